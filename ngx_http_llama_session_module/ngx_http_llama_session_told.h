
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What owners on other hosts tell an edge that balances them: the
 * functions of ngx_http_llama_session_told.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_TOLD_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_TOLD_H_INCLUDED_


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_balance.h"


ngx_int_t ngx_http_llama_session_told_filter_init(ngx_conf_t *cf);
ngx_int_t ngx_http_llama_session_told_mark(ngx_http_request_t *r);
ngx_int_t ngx_http_llama_session_told_init_process(ngx_cycle_t *cycle);


#endif /* _NGX_HTTP_LLAMA_SESSION_TOLD_H_INCLUDED_ */
