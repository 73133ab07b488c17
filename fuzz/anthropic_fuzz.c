
/*
 * libFuzzer harness for Anthropic's translation (ngx_http_llama_session_
 * anthropic.c, #included here so its statics are at hand).  The first
 * byte chooses:
 *
 *   0..63     the rest is an Anthropic request body: it becomes llama-
 *             server's chat completion (ngx_http_llama_session_anthropic_
 *             chat()), and a warm start's prime of it (_prime());
 *   64..127   the rest is llama-server's SSE stream: its "data:" lines go
 *             through ngx_http_llama_session_anthropic_event() one by one,
 *             then the stream's end; the output must be Anthropic's
 *             events, "event: T\ndata: {"type":"T",...}\n\n" each, with
 *             message_start first, blocks opened and closed in turn (a
 *             delta only in the block open), message_stop or an error
 *             last;
 *   128..255  the rest is llama-server's whole reply, status 200 or 500,
 *             through ngx_http_llama_session_anthropic_whole(): one JSON
 *             object, a message or an error.
 *
 * Every input is read from a copy that ends right before an unmapped page.
 * See fuzz/run.sh.
 */


#include "ngx_http_llama_session_anthropic.c"

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


static void
fuzz_fail(const char *what)
{
    fprintf(stderr, "fuzz: %s\n", what);
    __builtin_trap();
}


/* the output as one string */

static u_char *
fuzz_join(ngx_chain_t *out, size_t *len)
{
    u_char       *p, *q;
    ngx_chain_t  *cl;

    *len = 0;

    for (cl = out; cl; cl = cl->next) {
        *len += cl->buf->last - cl->buf->pos;
    }

    p = malloc(*len + 1);
    if (p == NULL) {
        abort();
    }

    q = p;

    for (cl = out; cl; cl = cl->next) {
        q = ngx_cpymem(q, cl->buf->pos, cl->buf->last - cl->buf->pos);
    }

    *q = '\0';

    return p;
}


/* Anthropic's events, in their order */

static void
fuzz_check_stream(ngx_chain_t *out)
{
    u_char      *all, *p, *nl, *data, *end;
    cJSON       *json, *type, *index;
    size_t       len;
    ngx_int_t    open, next;
    ngx_uint_t   n, started, stopped;

    all = fuzz_join(out, &len);
    p = all;
    end = all + len;

    n = 0;
    started = 0;
    stopped = 0;
    open = -1;
    next = 0;

    while (p < end) {
        if (stopped) {
            fuzz_fail("an event after the stream's last");
        }

        if (ngx_strncmp(p, "event: ", 7) != 0) {
            fuzz_fail("not an event line");
        }

        nl = (u_char *) ngx_strchr(p, '\n');
        if (nl == NULL || ngx_strncmp(nl + 1, "data: ", 6) != 0) {
            fuzz_fail("an event without its data line");
        }

        data = nl + 7;
        nl = (u_char *) ngx_strchr(data, '\n');
        if (nl == NULL || nl[1] != '\n') {
            fuzz_fail("an event not ended by a blank line");
        }

        json = cJSON_ParseWithLength((char *) data, nl - data);
        type = cJSON_GetObjectItemCaseSensitive(json, "type");
        index = cJSON_GetObjectItemCaseSensitive(json, "index");

        if (!cJSON_IsString(type)
            || ngx_strncmp(p + 7, type->valuestring,
                           ngx_strlen(type->valuestring)) != 0)
        {
            fuzz_fail("an event's data is not of its type");
        }

        if (n == 0 && ngx_strcmp(type->valuestring, "message_start") != 0
            && ngx_strcmp(type->valuestring, "error") != 0)
        {
            fuzz_fail("the first event is neither message_start nor error");
        }

        if (ngx_strcmp(type->valuestring, "message_start") == 0) {
            if (started) {
                fuzz_fail("message_start twice");
            }

            started = 1;

        } else if (ngx_strcmp(type->valuestring, "content_block_start")
                   == 0)
        {
            if (open != -1 || !cJSON_IsNumber(index)
                || index->valueint != next)
            {
                fuzz_fail("a block started inside another, or out of turn");
            }

            open = next;

        } else if (ngx_strcmp(type->valuestring, "content_block_delta")
                   == 0)
        {
            if (open == -1 || !cJSON_IsNumber(index)
                || index->valueint != open)
            {
                fuzz_fail("a delta outside its block");
            }

        } else if (ngx_strcmp(type->valuestring, "content_block_stop") == 0)
        {
            if (open == -1 || !cJSON_IsNumber(index)
                || index->valueint != open)
            {
                fuzz_fail("a block stopped that is not open");
            }

            open = -1;
            next++;

        } else if (ngx_strcmp(type->valuestring, "message_delta") == 0) {
            if (open != -1) {
                fuzz_fail("message_delta inside a block");
            }

        } else if (ngx_strcmp(type->valuestring, "message_stop") == 0
                   || ngx_strcmp(type->valuestring, "error") == 0)
        {
            if (open != -1) {
                fuzz_fail("the stream ends inside a block");
            }

            stopped = 1;
        }

        cJSON_Delete(json);

        n++;
        p = nl + 2;
    }

    if (!stopped) {
        fuzz_fail("a stream without its last event");
    }

    free(all);
}


static void
fuzz_check_whole(ngx_chain_t *out)
{
    u_char  *all;
    cJSON   *json;
    size_t   len;

    all = fuzz_join(out, &len);
    json = cJSON_ParseWithLength((char *) all, len);

    if (!cJSON_IsObject(json)
        || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(json, "type")))
    {
        fuzz_fail("a whole reply is not an object with a type");
    }

    cJSON_Delete(json);
    free(all);
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    u_char                              *copy, *line, *end, *last;
    cJSON                               *in;
    ngx_buf_t                            b;
    ngx_uint_t                           mode;
    ngx_chain_t                         *out;
    ngx_connection_t                     c;
    ngx_http_request_t                   r;
    ngx_http_llama_session_conv_t        conv;
    ngx_http_llama_session_anthropic_t   a;

    if (size < 1) {
        return 0;
    }

    mode = data[0];
    copy = fuzz_guarded(data + 1, size - 1);
    last = copy + size - 1;

    fuzz_request(&r, &c);

    ngx_memzero(&a, sizeof(ngx_http_llama_session_anthropic_t));
    ngx_memzero(&conv, sizeof(ngx_http_llama_session_conv_t));
    conv.api = "Anthropic";
    conv.prompt_n = -1;
    conv.cached = -1;
    conv.data = &a;
    a.tool = -1;

    out = NULL;
    conv.ll = &out;

    if (mode < 64) {
        in = cJSON_ParseWithLength((char *) copy, size - 1);

        if (cJSON_IsObject(in)) {
            fuzz_print(ngx_http_llama_session_anthropic_chat(in));
        }

        cJSON_Delete(in);

        ngx_memzero(&b, sizeof(ngx_buf_t));
        b.pos = copy;
        b.last = last;
        (void) ngx_http_llama_session_anthropic_prime(&r, &b, mode);

    } else if (mode < 128) {
        conv.stream = 1;
        conv.status = NGX_HTTP_OK;

        for (line = copy; line < last; line = end + 1) {
            end = ngx_strlchr(line, last, '\n');
            if (end == NULL) {
                end = last;
            }

            if (end - line > 5 && ngx_strncmp(line, "data:", 5) == 0) {
                if (ngx_http_llama_session_anthropic_event(&r, &conv,
                                                           line + 5,
                                                           end - line - 5)
                    != NGX_OK)
                {
                    fuzz_pool_reset();
                    return 0;
                }
            }
        }

        if (ngx_http_llama_session_anthropic_event(&r, &conv, NULL, 0)
            == NGX_OK)
        {
            fuzz_check_stream(out);
        }

    } else {
        conv.status = (mode & 8) ? NGX_HTTP_INTERNAL_SERVER_ERROR
                                 : NGX_HTTP_OK;

        if (ngx_http_llama_session_anthropic_whole(&r, &conv, copy,
                                                   last - copy)
            == NGX_OK)
        {
            fuzz_check_whole(out);
        }
    }

    fuzz_pool_reset();

    return 0;
}
