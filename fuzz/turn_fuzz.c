
/*
 * libFuzzer harness for what the re-prime reads (ngx_http_llama_session_
 * turn.c and ngx_http_llama_session_gguf.c, #included here so their
 * statics are at hand).  The first byte chooses:
 *
 *   0..127    the rest is llama-server's reply to a chat turn, in chunks
 *             of a size taken from the second byte: a stream (even first
 *             byte: its lines go through ngx_http_llama_session_turn_data()
 *             as they come) or a whole reply (odd), then the assistant's
 *             message is made as turn_end() makes it, printed, and must be
 *             JSON again;
 *   128..255  the rest is a model file: it is written to a temporary file
 *             and its header read by ngx_http_llama_session_gguf_memory(),
 *             whose answer must be one of the kinds.
 *
 * See fuzz/run.sh.
 */


#include "ngx_http_llama_session_turn.c"
#include "ngx_http_llama_session_gguf.c"

#include "fuzz_ngx.h"


/*
 * what turn.c and gguf.c call of nginx and of the module, outside these
 * and fuzz/conv_stubs.c
 */

ngx_uint_t  ngx_test_config;


ngx_uint_t
ngx_http_llama_session_restores_off(ngx_http_llama_session_zone_t *zone,
    u_char *fp)
{
    fuzz_unexpected("ngx_http_llama_session_restores_off");
    return 0;
}


void
ngx_http_llama_session_ext_reply(ngx_http_llama_session_ctx_t *ctx,
    cJSON *message)
{
    fuzz_unexpected("ngx_http_llama_session_ext_reply");
}


void
ngx_shmtx_lock(ngx_shmtx_t *mtx)
{
}


void
ngx_shmtx_unlock(ngx_shmtx_t *mtx)
{
}


static void
fuzz_reply(const u_char *data, size_t size)
{
    char                           *text;
    cJSON                          *json, *message;
    size_t                          chunk, n;
    ngx_buf_t                       b;
    ngx_connection_t                c;
    ngx_http_request_t              r;
    ngx_http_llama_session_ctx_t    ctx;
    ngx_http_llama_session_job_t    job;
    ngx_http_llama_session_turn_t  *t;

    if (size < 2) {
        return;
    }

    fuzz_request(&r, &c);
    ngx_memzero(&ctx, sizeof(ngx_http_llama_session_ctx_t));
    ngx_memzero(&job, sizeof(ngx_http_llama_session_job_t));
    ctx.job = &job;

    t = ngx_pcalloc(r.pool, sizeof(ngx_http_llama_session_turn_t));
    if (t == NULL) {
        return;
    }

    t->stream = !(data[0] & 1);
    chunk = (size_t) data[1] * 37 + 1;
    ctx.turn = t;

    data += 2;
    size -= 2;

    /* the reply's buffers, as proxy_pass hands them to the filter */

    while (size && !t->failed) {
        n = ngx_min(chunk, size);

        ngx_memzero(&b, sizeof(ngx_buf_t));
        b.pos = fuzz_guarded(data, n);
        b.last = b.pos + n;
        b.temporary = 1;

        ngx_http_llama_session_turn_data(&r, &ctx, &b);

        data += n;
        size -= n;
    }

    if (t->failed) {
        return;
    }

    if (!t->stream) {
        /* as turn_end() reads a whole reply */
        ngx_http_llama_session_turn_whole(&r, t);
    }

    message = ngx_http_llama_session_turn_message(t);
    if (message == NULL) {
        return;
    }

    text = cJSON_PrintUnformatted(message);
    cJSON_Delete(message);

    if (text == NULL) {
        return;
    }

    /* what goes into the turn file must be JSON again */

    json = cJSON_Parse(text);

    if (json == NULL
        || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(json, "role")))
    {
        __builtin_trap();
    }

    cJSON_Delete(json);
    cJSON_free(text);
}


static void
fuzz_gguf(const u_char *data, size_t size)
{
    int                               fd;
    char                              path[] = "/tmp/fuzz-gguf-XXXXXX";
    ngx_int_t                         rc;
    ngx_http_llama_session_memory_t   mem;

    fd = mkstemp(path);
    if (fd == -1) {
        return;
    }

    if (write(fd, data, size) != (ssize_t) size) {
        close(fd);
        unlink(path);
        return;
    }

    close(fd);

    rc = ngx_http_llama_session_gguf_memory(fuzz_log, (u_char *) path, &mem);

    unlink(path);

    if (rc == NGX_OK
        && (mem.kind > NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT
            || mem.arch[NGX_HTTP_LLAMA_SESSION_ARCH_MAX - 1] != '\0'
            || ngx_strlen(mem.arch) == 0
            || (mem.kind == NGX_HTTP_LLAMA_SESSION_MEMORY_SWA
                && mem.window == 0)))
    {
        __builtin_trap();
    }
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) {
        return 0;
    }

    if (data[0] < 128) {
        fuzz_reply(data, size);

    } else {
        fuzz_gguf(data + 1, size - 1);
    }

    fuzz_pool_reset();

    return 0;
}
