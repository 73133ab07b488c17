
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Slot calls, the one transport to llama-server: the functions of ngx_http_llama_session_call.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_CALL_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_CALL_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_capture_init(ngx_conf_t *cf);
void ngx_http_llama_session_job_finish(ngx_http_llama_session_ctx_t *ctx);
ngx_uint_t ngx_http_llama_session_own_call(ngx_http_request_t *r);
ngx_str_t *ngx_http_llama_session_call_name(ngx_uint_t call);
ngx_int_t ngx_http_llama_session_call(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t call, u_char *key,
    size_t len);


#endif /* _NGX_HTTP_LLAMA_SESSION_CALL_H_INCLUDED_ */
