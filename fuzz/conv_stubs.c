
/*
 * What the files under fuzzing (ollama.c, anthropic.c, convert.c, turn.c)
 * call of nginx and of the module outside themselves: none of it is
 * reached by the harnesses, which call the code under test directly.
 */


#include "fuzz_ngx.h"

#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_error.h"


ngx_http_output_header_filter_pt  ngx_http_top_header_filter;
volatile ngx_str_t                ngx_cached_http_log_iso8601 =
    ngx_string("2026-11-30T12:00:00+00:00");





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
    ctx->job->state = state;
}


ngx_int_t
ngx_http_llama_session_error(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t status, char *type,
    char *message, time_t retry_after)
{
    fuzz_unexpected("ngx_http_llama_session_error");
    return NGX_ERROR;
}

