
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * models=: the functions of ngx_http_llama_session_models.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_MODELS_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_MODELS_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_uint_t ngx_http_llama_session_model_valid(u_char *model, size_t len);
u_char *ngx_http_llama_session_model_arg(u_char *dst, u_char *model,
    size_t len);
ngx_uint_t ngx_http_llama_session_models_size(
    ngx_http_llama_session_zone_t *zone);
ngx_uint_t ngx_http_llama_session_models_adopt(
    ngx_http_llama_session_zone_t *zone);
ngx_http_llama_session_zone_t *ngx_http_llama_session_models_find(
    ngx_http_llama_session_zone_t *lead, u_char *model, size_t len);
ngx_http_llama_session_zone_t *ngx_http_llama_session_models_take(
    ngx_http_llama_session_zone_t *lead, u_char *model, size_t len,
    ngx_log_t *log);
void ngx_http_llama_session_models_load(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log);


#endif /* _NGX_HTTP_LLAMA_SESSION_MODELS_H_INCLUDED_ */
