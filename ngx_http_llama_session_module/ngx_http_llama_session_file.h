
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Opening files another user controls: the functions of
 * ngx_http_llama_session_file.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_FILE_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_FILE_H_INCLUDED_


#include "ngx_http_llama_session.h"


/* how a file is opened (file.c) */
#define NGX_HTTP_LLAMA_SESSION_FILE_READ    0  /* a store file, to read */
#define NGX_HTTP_LLAMA_SESSION_FILE_CREATE  1  /* a new store file */
#define NGX_HTTP_LLAMA_SESSION_FILE_MODEL   2  /* a path /props names */


ngx_fd_t ngx_http_llama_session_file_open(u_char *path, ngx_uint_t how,
    ngx_uint_t access, ngx_log_t *log);


#endif /* _NGX_HTTP_LLAMA_SESSION_FILE_H_INCLUDED_ */
