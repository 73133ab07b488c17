
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * $llama_session_id, $llama_session_key, $llama_session_slot, $llama_session_action, $llama_session_wait_ms, $llama_session_swap_ms, $llama_session_cached_tokens: the functions of ngx_http_llama_session_var.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_VAR_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_VAR_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_add_variables(ngx_conf_t *cf);


#endif /* _NGX_HTTP_LLAMA_SESSION_VAR_H_INCLUDED_ */
