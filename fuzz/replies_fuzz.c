
/*
 * libFuzzer harness for the slot replies (ngx_http_llama_session_slots.c
 * and the capture of ngx_http_llama_session_call.c, #included here so
 * their statics are at hand): any bytes as what a broken
 * or hostile backend answers to a slot call.  The reply goes through the
 * module's own capture (ngx_http_llama_session_capture_append(), in
 * chunks of a size taken from the first byte, then call_done()), must come
 * out whole, and is then read by every parser, from a copy that ends right
 * before an unmapped page so that a read past it faults even inside cJSON:
 *
 *   ngx_http_llama_session_parse_slots()   GET /slots, for slots 0, 1, 63
 *   ngx_http_llama_session_parse_action()  save, restore, erase
 *   ngx_http_llama_session_parse_props()   GET /props
 *   ngx_http_llama_session_parse_models()  GET /v1/models, status 200 and
 *                                          502, after the input's own
 *                                          /props or a real one
 *
 * What they give is formatted as the swap log line formats it, and the
 * fingerprint handed to ngx_http_llama_session_set_fingerprint() checked.
 * See fuzz/run.sh.
 */


#include "ngx_http_llama_session_slots.c"
#include "ngx_http_llama_session_call.c"

#include "fuzz_ngx.h"


static ngx_uint_t       fuzz_fingerprints;
static volatile u_char  fuzz_sink;


/* what llama-server answers to GET /props */

static char  fuzz_props[] =
    "{\"default_generation_settings\":{\"id\":0,\"id_task\":-1,"
    "\"n_ctx\":16384,\"speculative\":false,\"is_processing\":false,"
    "\"params\":{\"n_predict\":-1,\"seed\":4294967295,\"temperature\":0.8}},"
    "\"total_slots\":4,\"model_alias\":\"qwen2.5-7b\","
    "\"model_path\":\"/models/qwen2.5-7b-instruct-q4_k_m.gguf\","
    "\"modalities\":{\"vision\":false,\"audio\":false},"
    "\"endpoint_slots\":true,\"endpoint_props\":false,"
    "\"endpoint_metrics\":false,\"webui\":true,\"chat_template\":\"{{x}}\","
    "\"bos_token\":\"<|endoftext|>\",\"eos_token\":\"<|im_end|>\","
    "\"build_info\":\"b6550-80fb11ac\",\"is_sleeping\":false}";


/* sched.c, index.c: of them, only the fingerprint is on these paths */

void
ngx_http_llama_session_set_fingerprint(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, u_char *fp, ngx_uint_t n_ctx,
    ngx_uint_t total_slots, ngx_str_t *model_path)
{
    u_char      c;
    ngx_uint_t  i;

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_FP_LEN; i++) {
        c = fp[i];

        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
            __builtin_trap();
        }
    }

    if (model_path->len > NGX_HTTP_LLAMA_SESSION_PATH_SHOW
        || (model_path->len && model_path->data == NULL)
        || total_slots < 1 || total_slots > 1000000 || n_ctx > 1000000000000)
    {
        __builtin_trap();
    }

    /* every byte is read, as the shared zone's copy reads it */
    for (i = 0; i < model_path->len; i++) {
        fuzz_sink ^= model_path->data[i];
    }

    ngx_memcpy(job->fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);

    fuzz_fingerprints++;
}






void
ngx_http_llama_session_file_saved(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, u_char *key, size_t len,
    ngx_uint_t is_base, ngx_uint_t saved, ngx_uint_t tokens, off_t bytes)
{
    fuzz_unexpected("ngx_http_llama_session_file_saved");
}


void
ngx_http_llama_session_stat(ngx_atomic_uint_t *counter)
{
    fuzz_unexpected("ngx_http_llama_session_stat");
}





ngx_int_t
ngx_http_llama_session_store_room(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len,
    ngx_uint_t failed)
{
    fuzz_unexpected("ngx_http_llama_session_store_room");
    return NGX_OK;
}


void
ngx_http_llama_session_store_drop_tmp(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len)
{
    fuzz_unexpected("ngx_http_llama_session_store_drop_tmp");
}


void
ngx_http_llama_session_release(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_uint_t state)
{
    fuzz_unexpected("ngx_http_llama_session_release");
}


void
ngx_http_llama_session_wake_local(void)
{
    fuzz_unexpected("ngx_http_llama_session_wake_local");
}


static void
fuzz_props_reply(ngx_http_llama_session_ctx_t *ctx, ngx_buf_t *b, u_char *p,
    size_t size)
{
    ngx_memzero(b, sizeof(ngx_buf_t));
    b->start = p;
    b->pos = p;
    b->last = p + size;
    b->end = b->last;
    b->temporary = 1;

    ctx->job->call_reply = size ? b : NULL;
}


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    u_char                          *copy, line[NGX_MAX_ERROR_STR], *p;
    off_t                            bytes;
    double                           ms;
    size_t                           chunk, k;
    ngx_int_t                        rc;
    ngx_buf_t                        reply, props;
    ngx_uint_t                       i, processing, tokens;
    ngx_connection_t                 c;
    ngx_http_request_t               r, sr;
    ngx_http_upstream_t              u;
    ngx_http_llama_session_ctx_t     ctx;
    ngx_http_llama_session_job_t     job;
    ngx_http_llama_session_zone_t    zone;
    ngx_http_post_subrequest_t       ps;

    static ngx_uint_t  slots[] = { 0, 1, 63 };

    ngx_memzero(&zone, sizeof(ngx_http_llama_session_zone_t));
    ngx_str_set(&zone.name, "llama");
    zone.nslots = 4;

    fuzz_request(&r, &c);

    ngx_memzero(&ctx, sizeof(ngx_http_llama_session_ctx_t));
    ngx_memzero(&job, sizeof(ngx_http_llama_session_job_t));
    ctx.request = &r;
    ctx.zone = &zone;
    ctx.job = &job;
    ctx.job->slot_tokens = -1;
    ctx.job->slot_task = -1;
    ctx.job->call = NGX_HTTP_LLAMA_SESSION_CALL_GET;
    ctx.job->call_inflight = 1;

    /* the reply as the capture filter collects it, in chunks */

    ps.handler = ngx_http_llama_session_call_done;
    ps.data = &ctx;

    ngx_memzero(&sr, sizeof(ngx_http_request_t));
    sr.main = &r;
    sr.parent = &r;
    sr.pool = fuzz_pool;
    sr.connection = &c;
    sr.post_subrequest = &ps;

    /* the call in flight is this subrequest (call.c's call_done() asks) */
    ctx.job->call_sr = &sr;

    if (!ngx_http_llama_session_own_call(&sr)) {
        __builtin_trap();
    }

    chunk = size ? ((size_t) data[0] << 4) + 1 : 1;

    for (k = 0; k < size; k += chunk) {
        if (ngx_http_llama_session_capture_append(&sr, &ctx,
                                                  (u_char *) data + k,
                                                  ngx_min(chunk, size - k))
            != NGX_OK)
        {
            __builtin_trap();
        }
    }

    ngx_memzero(&u, sizeof(ngx_http_upstream_t));
    u.headers_in.status_n = NGX_HTTP_OK;
    sr.upstream = &u;

    (void) ngx_http_llama_session_call_done(&sr, &ctx, NGX_OK);

    if (size == 0 ? ctx.job->call_reply != NULL
        : (ctx.job->call_reply == NULL
           || (size_t) (ctx.job->call_reply->last - ctx.job->call_reply->pos)
              != size
           || ngx_memcmp(ctx.job->call_reply->pos, data, size) != 0
           || ctx.job->call_status != NGX_HTTP_OK || ctx.job->call_inflight))
    {
        fprintf(stderr, "fuzz: the captured reply is not the reply\n");
        __builtin_trap();
    }

    /* then the parsers, on a copy of it that nothing can be read past */

    copy = fuzz_guarded(data, size);
    fuzz_props_reply(&ctx, &reply, copy, size);

    for (i = 0; i < sizeof(slots) / sizeof(ngx_uint_t); i++) {
        ctx.job->slot = slots[i];
        ctx.job->slot_tokens = -1;
        ctx.job->slot_task = -1;
        processing = 2;

        rc = ngx_http_llama_session_parse_slots(fuzz_log, &ctx, &processing);

        if (rc == NGX_OK && processing > 1) {
            __builtin_trap();
        }
    }

    rc = ngx_http_llama_session_parse_action(fuzz_log, &ctx, &tokens, &bytes,
                                             &ms);

    if (rc == NGX_OK) {
        if (tokens >= 1000000000000000 || bytes < 0) {
            __builtin_trap();
        }

        /* as the swap's log line has them */

        p = ngx_slprintf(line, line + sizeof(line), "\"%*s\" saved %ui "
                         "tokens, %O bytes in %.1f ms", (size_t) 7,
                         "default", tokens, bytes, ms);

        if (p > line + sizeof(line)) {
            __builtin_trap();
        }
    }

    /* GET /props, then GET /v1/models with it or with a real /props */

    ctx.job->call_status = NGX_HTTP_OK;
    ngx_str_null(&ctx.job->props_text);

    rc = ngx_http_llama_session_parse_props(&r, &ctx);

    if (rc == NGX_OK) {
        if (ctx.job->props_text.len == 0 || ctx.job->props_text.len > 1024
            || ctx.job->props_model.len > NGX_HTTP_LLAMA_SESSION_PATH_SHOW
            || ctx.job->props_slots < 1 || ctx.job->props_slots > 1000000)
        {
            __builtin_trap();
        }

    } else {
        fuzz_props_reply(&ctx, &props, (u_char *) fuzz_props,
                         sizeof(fuzz_props) - 1);

        if (ngx_http_llama_session_parse_props(&r, &ctx) != NGX_OK) {
            __builtin_trap();
        }

        fuzz_props_reply(&ctx, &reply, copy, size);
    }

    fuzz_fingerprints = 0;

    if (ngx_http_llama_session_parse_models(&r, &ctx) != NGX_OK
        || fuzz_fingerprints != 1)
    {
        __builtin_trap();
    }

    ctx.job->call_status = NGX_HTTP_BAD_GATEWAY;

    if (ngx_http_llama_session_parse_models(&r, &ctx) != NGX_OK
        || fuzz_fingerprints != 2)
    {
        __builtin_trap();
    }

    fuzz_pool_reset();

    return 0;
}
