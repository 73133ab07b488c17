
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Routing across owners by where a session's state is and how loaded each
 * owner is: the functions of ngx_http_llama_session_balance.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_BALANCE_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_BALANCE_H_INCLUDED_


#include "ngx_http_llama_session.h"


char *ngx_http_llama_session_balance(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
ngx_int_t ngx_http_llama_session_balance_owner(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_t *zone);
ngx_int_t ngx_http_llama_session_balance_filter_init(ngx_conf_t *cf);
ngx_int_t ngx_http_llama_session_balance_mark(ngx_http_request_t *r);


#endif /* _NGX_HTTP_LLAMA_SESSION_BALANCE_H_INCLUDED_ */
