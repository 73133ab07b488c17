
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Idle save: the functions of ngx_http_llama_session_idle.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_IDLE_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_IDLE_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_idle_init(ngx_cycle_t *cycle);


#endif /* _NGX_HTTP_LLAMA_SESSION_IDLE_H_INCLUDED_ */
