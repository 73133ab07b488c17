
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The shared-memory zone: the functions of ngx_http_llama_session_shm.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_SHM_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_SHM_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_http_llama_session_zone_t *ngx_http_llama_session_find_zone(
    ngx_conf_t *cf, ngx_str_t *name);
ngx_int_t ngx_http_llama_session_init_zone(ngx_shm_zone_t *shm_zone,
    void *data);
void ngx_http_llama_session_stat(ngx_atomic_uint_t *counter);


#endif /* _NGX_HTTP_LLAMA_SESSION_SHM_H_INCLUDED_ */
