
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The management API, a content handler: the functions of ngx_http_llama_session_api.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_API_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_API_H_INCLUDED_


#include "ngx_http_llama_session.h"


char *ngx_http_llama_session_api(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);


#endif /* _NGX_HTTP_LLAMA_SESSION_API_H_INCLUDED_ */
