
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The hot tier, llama-server's RAM prompt cache: the functions of
 * ngx_http_llama_session_ram.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_RAM_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_RAM_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_uint_t ngx_http_llama_session_ram_holds_locked(
    ngx_http_llama_session_zone_t *zone, u_char *key, size_t len);
void ngx_http_llama_session_ram_reset_locked(
    ngx_http_llama_session_zone_t *zone);
ngx_uint_t ngx_http_llama_session_ram_swap(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_uint_t ngx_http_llama_session_ram_take(
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t unsaved);
ngx_uint_t ngx_http_llama_session_ram_fresh(
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_ram_leave(ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_ram_reply(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_int_t cached,
    ngx_int_t evaluated, ngx_int_t predicted);
void ngx_http_llama_session_ram_tiers(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log);


#endif /* _NGX_HTTP_LLAMA_SESSION_RAM_H_INCLUDED_ */
