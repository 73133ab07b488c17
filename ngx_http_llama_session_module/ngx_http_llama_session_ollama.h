
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Ollama's API in front of llama-server: the functions of ngx_http_llama_session_ollama.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_OLLAMA_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_OLLAMA_H_INCLUDED_


#include "ngx_http_llama_session.h"


/* its requests: the dialect rows' kinds (dialect.c) */

#define NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT      1
#define NGX_HTTP_LLAMA_SESSION_OLLAMA_GENERATE  2
#define NGX_HTTP_LLAMA_SESSION_OLLAMA_EMBED     3


ngx_int_t ngx_http_llama_session_ollama_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_ollama_request(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_ollama_info(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_ollama_error(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t status, char *message);


#endif /* _NGX_HTTP_LLAMA_SESSION_OLLAMA_H_INCLUDED_ */
