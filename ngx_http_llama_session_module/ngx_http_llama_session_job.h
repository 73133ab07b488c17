
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The slot job: the functions of ngx_http_llama_session_job.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_JOB_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_JOB_H_INCLUDED_


#include "ngx_http_llama_session.h"


void ngx_http_llama_session_job_state(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state);
ngx_uint_t ngx_http_llama_session_slots_verdict(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_slot_stale(ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_slot_lost(ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_restore_done(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len);
ngx_uint_t ngx_http_llama_session_may_save(
    ngx_http_llama_session_ctx_t *ctx);
ngx_http_request_t *ngx_http_llama_session_job_request(
    ngx_http_llama_session_zone_t *zone, ngx_log_t *log);
void ngx_http_llama_session_job_run(ngx_http_request_t *r);
void ngx_http_llama_session_job_close(ngx_http_request_t *r);
ngx_int_t ngx_http_llama_session_sleep(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_msec_t delay);
void ngx_http_llama_session_job_timer(ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_media_refused(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len);
ngx_int_t ngx_http_llama_session_save_done(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t reason, u_char *key,
    size_t len, ngx_event_t *wake);
ngx_int_t ngx_http_llama_session_learn(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_job_acquire(
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_job_slot_set(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state, u_char *key, size_t len, ngx_uint_t dirty);
void ngx_http_llama_session_job_remember(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len, ngx_str_t *id);


#endif /* _NGX_HTTP_LLAMA_SESSION_JOB_H_INCLUDED_ */
