
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * A session's save, re-primed first: the functions of ngx_http_llama_session_reprime.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_REPRIME_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_REPRIME_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_save(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_reprime_next(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);


#endif /* _NGX_HTTP_LLAMA_SESSION_REPRIME_H_INCLUDED_ */
