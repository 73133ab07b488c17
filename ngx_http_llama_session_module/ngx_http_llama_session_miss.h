
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Why a prompt missed the cache: the functions of ngx_http_llama_session_miss.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_MISS_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_MISS_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_msgs(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t *system,
    ngx_http_llama_session_span_t *messages);
ngx_uint_t ngx_http_llama_session_miss(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_int_t cached, ngx_int_t evaluated);
ngx_int_t ngx_http_llama_session_msgs_encode(u_char *dst, size_t size,
    ngx_http_llama_session_msg_t *msgs, ngx_uint_t n);
ngx_int_t ngx_http_llama_session_msgs_decode(ngx_pool_t *pool, u_char *text,
    size_t len, ngx_http_llama_session_msg_t **msgs, ngx_uint_t *n);


#endif /* _NGX_HTTP_LLAMA_SESSION_MISS_H_INCLUDED_ */
