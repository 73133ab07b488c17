
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Anthropic's Messages API on any number of slots: the functions of
 * ngx_http_llama_session_anthropic.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_ANTHROPIC_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_ANTHROPIC_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_anthropic_request(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_buf_t *ngx_http_llama_session_anthropic_prime(ngx_http_request_t *r,
    ngx_buf_t *b, ngx_uint_t slot);
char *ngx_http_llama_session_anthropic_error_type(ngx_uint_t status);


#endif /* _NGX_HTTP_LLAMA_SESSION_ANTHROPIC_H_INCLUDED_ */
