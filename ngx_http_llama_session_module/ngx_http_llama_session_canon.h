
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What the module rewrites in a request body: the functions of ngx_http_llama_session_canon.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_CANON_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_CANON_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_canon(ngx_http_request_t *r,
    ngx_str_t *body, ngx_http_llama_session_span_t *system);


#endif /* _NGX_HTTP_LLAMA_SESSION_CANON_H_INCLUDED_ */
