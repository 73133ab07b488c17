
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The API dialects, chosen once per request: the functions of
 * ngx_http_llama_session_dialect.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_DIALECT_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_DIALECT_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_http_llama_session_dialect_t *ngx_http_llama_session_dialect(
    ngx_http_request_t *r, ngx_http_llama_session_loc_conf_t *llcf);
ngx_str_t *ngx_http_llama_session_dialect_endpoints(void);


#endif /* _NGX_HTTP_LLAMA_SESSION_DIALECT_H_INCLUDED_ */
