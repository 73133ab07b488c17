
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Warm starts: the functions of ngx_http_llama_session_warm.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_WARM_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_WARM_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_warm(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_warm_done(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);


#endif /* _NGX_HTTP_LLAMA_SESSION_WARM_H_INCLUDED_ */
