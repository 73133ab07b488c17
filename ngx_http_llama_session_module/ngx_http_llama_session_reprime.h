
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The prefix prime: a session's save re-primed first, a base's prime: the functions of ngx_http_llama_session_reprime.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_REPRIME_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_REPRIME_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_save(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_reprime_next(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_prefix_bodies(ngx_http_request_t *r,
    cJSON *body, cJSON *reply, cJSON *alt, ngx_buf_t **first,
    ngx_buf_t **second);
ngx_int_t ngx_http_llama_session_prefix_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_buf_t *first, ngx_buf_t *second);
ngx_int_t ngx_http_llama_session_prefix_next(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, char *what);
void ngx_http_llama_session_prefix_tokens(ngx_http_llama_session_ctx_t *ctx,
    ngx_int_t *cached, ngx_int_t *evaluated);


#endif /* _NGX_HTTP_LLAMA_SESSION_REPRIME_H_INCLUDED_ */
