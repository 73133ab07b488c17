
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What the reply says of the prompt's cache: the functions of ngx_http_llama_session_reply.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_REPLY_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_REPLY_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_reply_init(ngx_conf_t *cf);


#endif /* _NGX_HTTP_LLAMA_SESSION_REPLY_H_INCLUDED_ */
