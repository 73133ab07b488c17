
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * When a restore pays: the functions of ngx_http_llama_session_cost.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_COST_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_COST_H_INCLUDED_


#include "ngx_http_llama_session.h"


void ngx_http_llama_session_cost_prefill(ngx_http_llama_session_zone_t *zone,
    u_char *fp, ngx_int_t tokens, double ms);
void ngx_http_llama_session_cost_generate(
    ngx_http_llama_session_zone_t *zone, u_char *fp, ngx_uint_t lost,
    ngx_int_t tokens, double ms);
void ngx_http_llama_session_cost_restore(ngx_http_llama_session_zone_t *zone,
    u_char *fp, off_t bytes, double ms);
ngx_uint_t ngx_http_llama_session_cost_reprefill(
    ngx_http_llama_session_ctx_t *ctx, off_t bytes, ngx_uint_t tokens,
    double *restore_ms, double *prefill_ms);


#endif /* _NGX_HTTP_LLAMA_SESSION_COST_H_INCLUDED_ */
