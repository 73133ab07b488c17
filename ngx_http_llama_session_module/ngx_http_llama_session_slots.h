
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What llama-server's replies to the slot calls say: the functions of ngx_http_llama_session_slots.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_SLOTS_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_SLOTS_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_parse_slots(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t *processing);
ngx_int_t ngx_http_llama_session_parse_action(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t *tokens, off_t *bytes,
    double *ms);
ngx_int_t ngx_http_llama_session_parse_props(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_parse_models(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_uint_t ngx_http_llama_session_backend_failed(ngx_int_t status);


#endif /* _NGX_HTTP_LLAMA_SESSION_SLOTS_H_INCLUDED_ */
