
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * llama-server's router mode: the functions of ngx_http_llama_session_router.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_ROUTER_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_ROUTER_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_route_bind(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_route(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_routed(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_route_end(ngx_http_llama_session_ctx_t *ctx);


#endif /* _NGX_HTTP_LLAMA_SESSION_ROUTER_H_INCLUDED_ */
