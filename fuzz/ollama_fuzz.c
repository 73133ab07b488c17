
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


ngx_http_output_header_filter_pt  ngx_http_top_header_filter;
volatile ngx_str_t                ngx_cached_http_log_iso8601 =
    ngx_string("2026-11-30T12:00:00+00:00");


/* what ollama.c calls of nginx and of the module, outside the translation */

ngx_uint_t
ngx_http_llama_session_uri_ends(ngx_http_request_t *r, char *suffix)
{
    fuzz_unexpected("ngx_http_llama_session_uri_ends");
    return 0;
}


ngx_int_t
ngx_http_llama_session_read_body(ngx_http_request_t *r, size_t max,
    ngx_str_t *body)
{
    fuzz_unexpected("ngx_http_llama_session_read_body");
    return NGX_ERROR;
}


void
ngx_http_finalize_request(ngx_http_request_t *r, ngx_int_t rc)
{
    fuzz_unexpected("ngx_http_finalize_request");
}


ngx_int_t
ngx_http_send_header(ngx_http_request_t *r)
{
    fuzz_unexpected("ngx_http_send_header");
    return NGX_ERROR;
}


ngx_int_t
ngx_http_output_filter(ngx_http_request_t *r, ngx_chain_t *in)
{
    fuzz_unexpected("ngx_http_output_filter");
    return NGX_ERROR;
}


ngx_int_t
ngx_http_discard_request_body(ngx_http_request_t *r)
{
    fuzz_unexpected("ngx_http_discard_request_body");
    return NGX_ERROR;
}


ngx_pool_cleanup_t *
ngx_pool_cleanup_add(ngx_pool_t *p, size_t size)
{
    fuzz_unexpected("ngx_pool_cleanup_add");
    return NULL;
}


void
ngx_http_weak_etag(ngx_http_request_t *r)
{
    fuzz_unexpected("ngx_http_weak_etag");
}


void
ngx_http_llama_session_job_state(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state)
{
    ctx->job.state = state;
}


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
    ngx_chain_t                      *out, **ll;
    ngx_connection_t                  c;
    ngx_http_request_t                r;
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
    ngx_str_set(&o.model, "qwen3:8b");
    o.prompt_n = -1;
    o.cached = -1;

    out = NULL;
    ll = &out;

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
        o.stream = 1;
        o.status = NGX_HTTP_OK;

        for (line = copy; line < last; line = end + 1) {
            end = ngx_strlchr(line, last, '\n');
            if (end == NULL) {
                end = last;
            }

            if (end - line > 5 && ngx_strncmp(line, "data:", 5) == 0) {
                if (ngx_http_llama_session_ollama_event(&r, &o, line + 5,
                                                        end - line - 5, &ll)
                    != NGX_OK)
                {
                    break;
                }
            }
        }

        (void) ngx_http_llama_session_ollama_emit(&r, &o,
                          ngx_http_llama_session_ollama_object(&r, &o, 1), 1,
                          &ll);

    } else {
        o.kind = kinds[mode % 3];
        o.status = (mode & 8) ? NGX_HTTP_INTERNAL_SERVER_ERROR : NGX_HTTP_OK;
        o.in = ngx_calloc_buf(r.pool);
        o.in->pos = copy;
        o.in->last = last;

        (void) ngx_http_llama_session_ollama_whole(&r, &o, &ll);
    }

    fuzz_check(out);

    if (o.tool_calls) {
        cJSON_Delete(o.tool_calls);
    }

    fuzz_pool_reset();

    return 0;
}
