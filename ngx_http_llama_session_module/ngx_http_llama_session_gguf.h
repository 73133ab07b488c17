
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What the model's file says of its memory: the functions of ngx_http_llama_session_gguf.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_GGUF_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_GGUF_H_INCLUDED_


#include "ngx_http_llama_session.h"


char *ngx_http_llama_session_memory_name(ngx_uint_t kind);
ngx_uint_t ngx_http_llama_session_memory_kind(
    ngx_http_llama_session_zone_t *zone, u_char *fp);
ngx_int_t ngx_http_llama_session_gguf_memory(ngx_log_t *log, u_char *path,
    ngx_http_llama_session_memory_t *mem);
void ngx_http_llama_session_memory_learn(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);


#endif /* _NGX_HTTP_LLAMA_SESSION_GGUF_H_INCLUDED_ */
