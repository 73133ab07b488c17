
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Pinning: the functions of ngx_http_llama_session_pin.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_PIN_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_PIN_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_pin(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);


#endif /* _NGX_HTTP_LLAMA_SESSION_PIN_H_INCLUDED_ */
