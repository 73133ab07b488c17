
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The request's way through the module, in the precontent phase: the functions of ngx_http_llama_session_handler.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_HANDLER_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_HANDLER_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_handler(ngx_http_request_t *r);
ngx_http_llama_session_ctx_t *ngx_http_llama_session_get_ctx(
    ngx_http_request_t *r);
ngx_http_llama_session_ctx_t *ngx_http_llama_session_create_ctx(
    ngx_http_request_t *r, ngx_http_llama_session_zone_t *zone);


#endif /* _NGX_HTTP_LLAMA_SESSION_HANDLER_H_INCLUDED_ */
