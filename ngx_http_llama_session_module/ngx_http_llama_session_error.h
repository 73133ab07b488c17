
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Errors to the client, one way for every file: the functions of ngx_http_llama_session_error.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_ERROR_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_ERROR_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_send_error(ngx_http_request_t *r,
    ngx_uint_t status, char *type, char *message, time_t retry_after);
ngx_int_t ngx_http_llama_session_send_json(ngx_http_request_t *r,
    ngx_uint_t status, ngx_buf_t *b);
ngx_int_t ngx_http_llama_session_backend_error(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, const char *what);
ngx_int_t ngx_http_llama_session_error(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t status, char *type,
    char *message, time_t retry_after);


#endif /* _NGX_HTTP_LLAMA_SESSION_ERROR_H_INCLUDED_ */
