
/*
 * libFuzzer harness for Ollama's translation (ngx_http_llama_session_ollama.c,
 * #included here so its statics are at hand).  The first byte chooses:
 *
 *   0..63     the rest is an Ollama request body: chat, generate and raw
 *             generate become llama-server's requests
 *             (ngx_http_llama_session_ollama_chat(), _messages(),
 *             _options()), printed as the module prints them;
 *   64..127   the rest is llama-server's SSE stream: its "data:" lines go
 *             through ngx_http_llama_session_ollama_event() one by one, as
 *             a chat's or a generate's, then the last line is made;
 *   128..255  the rest is llama-server's whole reply, status 200 or 500,
 *             through ngx_http_llama_session_ollama_whole() as a chat's,
 *             a generate's or an embed's.
 *
 * Every input is read from a copy that ends right before an unmapped page.
 * See fuzz/run.sh.
 */


#include "ngx_http_llama_session_ollama.c"

#include "fuzz_ngx.h"


static void
fuzz_print(cJSON *json)
{
    char  *text;

    if (json == NULL) {
        return;
    }

    text = cJSON_PrintUnformatted(json);
    if (text) {
        cJSON_free(text);
    }

    cJSON_Delete(json);
}


/* every emitted line must be one JSON object */

static void
fuzz_check(ngx_chain_t *out)
{
    cJSON  *json;

    for ( /* void */ ; out; out = out->next) {
        json = cJSON_ParseWithLength((char *) out->buf->pos,
                                     out->buf->last - out->buf->pos);
        if (!cJSON_IsObject(json)) {
            fprintf(stderr, "fuzz: an emitted line is not an object\n");
            __builtin_trap();
        }

        cJSON_Delete(json);
    }
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    u_char                           *copy, *line, *end, *last;
    cJSON                            *in, *messages;
    ngx_uint_t                        mode, g, stream;
    ngx_chain_t                      *out;
    ngx_connection_t                  c;
    ngx_http_request_t                r;
    ngx_http_llama_session_conv_t     conv;
    ngx_http_llama_session_ollama_t   o;

    static ngx_uint_t  kinds[] = {
        NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT,
        NGX_HTTP_LLAMA_SESSION_OLLAMA_GENERATE,
        NGX_HTTP_LLAMA_SESSION_OLLAMA_EMBED
    };

    if (size < 1) {
        return 0;
    }

    mode = data[0];
    copy = fuzz_guarded(data + 1, size - 1);
    last = copy + size - 1;

    fuzz_request(&r, &c);

    ngx_memzero(&o, sizeof(ngx_http_llama_session_ollama_t));
    ngx_memzero(&conv, sizeof(ngx_http_llama_session_conv_t));
    ngx_str_set(&o.model, "qwen3:8b");
    conv.api = "Ollama";
    conv.prompt_n = -1;
    conv.cached = -1;
    conv.data = &o;
    o.conv = &conv;

    out = NULL;
    conv.ll = &out;

    if (mode < 64) {
        in = cJSON_ParseWithLength((char *) copy, size - 1);

        if (cJSON_IsObject(in)) {
            for (g = 0; g < 3; g++) {
                fuzz_print(ngx_http_llama_session_ollama_chat(in, g, &stream));
            }

            messages = cJSON_GetObjectItemCaseSensitive(in, "messages");
            fuzz_print(ngx_http_llama_session_ollama_messages(messages));
        }

        cJSON_Delete(in);

    } else if (mode < 128) {
        o.kind = kinds[mode % 2];
        conv.stream = 1;
        conv.status = NGX_HTTP_OK;

        for (line = copy; line < last; line = end + 1) {
            end = ngx_strlchr(line, last, '\n');
            if (end == NULL) {
                end = last;
            }

            if (end - line > 5 && ngx_strncmp(line, "data:", 5) == 0) {
                if (ngx_http_llama_session_ollama_event(&r, &conv, line + 5,
                                                        end - line - 5)
                    != NGX_OK)
                {
                    break;
                }
            }
        }

        /* the stream's end */
        (void) ngx_http_llama_session_ollama_event(&r, &conv, NULL, 0);

    } else {
        o.kind = kinds[mode % 3];
        conv.status = (mode & 8) ? NGX_HTTP_INTERNAL_SERVER_ERROR
                                 : NGX_HTTP_OK;

        (void) ngx_http_llama_session_ollama_whole(&r, &conv, copy,
                                                   last - copy);
    }

    fuzz_check(out);

    if (o.tool_calls) {
        cJSON_Delete(o.tool_calls);
    }

    fuzz_pool_reset();

    return 0;
}
