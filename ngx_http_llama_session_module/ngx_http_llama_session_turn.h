
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The turn a slot ran last, kept for its re-prime: the functions of ngx_http_llama_session_turn.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_TURN_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_TURN_H_INCLUDED_


#include "ngx_http_llama_session.h"


u_char *ngx_http_llama_session_turn_path(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t slot, u_char *buf);
void ngx_http_llama_session_turn_drop(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t slot, ngx_uint_t seq, ngx_log_t *log);
void ngx_http_llama_session_turn_forget(ngx_http_llama_session_zone_t *zone,
    u_char *key, size_t len, ngx_log_t *log);
void ngx_http_llama_session_turn_clean(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log);
void ngx_http_llama_session_turn_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_turn_data(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_buf_t *b);
void ngx_http_llama_session_turn_end(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);


#endif /* _NGX_HTTP_LLAMA_SESSION_TURN_H_INCLUDED_ */
