
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The slot scheduler: the functions of ngx_http_llama_session_sched.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_SCHED_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_SCHED_H_INCLUDED_


#include "ngx_http_llama_session.h"


/*
 * What a slot job asks of the scheduler for its session, and what the
 * grant of a slot tells of it (job.c makes one from the request's state)
 */

typedef struct {
    u_char                         *key;        /* the session */
    size_t                          key_len;
    u_char                         *base;       /* its system prompt's
                                                   digest, NULL: none */
    u_char                         *ns;         /* its tenant's, NULL: none */
    ngx_pool_t                     *pool;       /* a client's: for the
                                                   session's last prompt */
    ngx_uint_t                      action;     /* the job's, a hit's */

    /* a hit: the session's last prompt (miss.c) */
    ngx_http_llama_session_msg_t   *prev;
    ngx_uint_t                      nprev;
    ngx_uint_t                      prev_tokens;

    unsigned                        unnamed:1;  /* "default" */
    unsigned                        media:1;    /* an image in it */
    unsigned                        base_file:1; /* its base was restored */
    unsigned                        verify:1;   /* a hit to check first */
    unsigned                        hit_dirty:1; /* changed before the hit */
    unsigned                        ram:1;      /* in llama-server's RAM
                                                   cache (ram.c) */
} ngx_http_llama_session_ask_t;


void ngx_http_llama_session_process_init(void);
void ngx_http_llama_session_wait_local(ngx_http_llama_session_job_t *job);
void ngx_http_llama_session_wait_end(ngx_http_llama_session_job_t *job);
void ngx_http_llama_session_wake_local(void);
ngx_uint_t ngx_http_llama_session_alive(ngx_pid_t pid, uint64_t start);
uint64_t ngx_http_llama_session_self(void);
ngx_int_t ngx_http_llama_session_acquire(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_http_llama_session_ask_t *ask);
ngx_int_t ngx_http_llama_session_try_slot(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job);
ngx_uint_t ngx_http_llama_session_idle_wanted(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job);
ngx_int_t ngx_http_llama_session_try_idle(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_msec_t save_idle);
ngx_uint_t ngx_http_llama_session_base_claim(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job,
    u_char *base);
void ngx_http_llama_session_lend(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job);
void ngx_http_llama_session_slot_saved(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, u_char *key, size_t len);
ngx_uint_t ngx_http_llama_session_in_use(ngx_http_llama_session_zone_t *zone,
    u_char *key, size_t len);
void ngx_http_llama_session_dequeue(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job);
void ngx_http_llama_session_release(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_uint_t state);
void ngx_http_llama_session_slot_set(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_http_llama_session_ask_t *ask,
    ngx_uint_t state, u_char *key, size_t len, ngx_uint_t dirty);
void ngx_http_llama_session_slot_forget(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_slot_t *slot, ngx_uint_t state);
ngx_uint_t ngx_http_llama_session_fingerprint(
    ngx_http_llama_session_zone_t *zone, u_char *fp);
void ngx_http_llama_session_set_fingerprint(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job,
    u_char *fp, ngx_uint_t n_ctx, ngx_uint_t total_slots,
    ngx_str_t *model_path);
ngx_uint_t ngx_http_llama_session_slot_task(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job,
    ngx_int_t task);
void ngx_http_llama_session_slot_msgs(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t n, u_char *key, size_t len, ngx_http_llama_session_msg_t *msgs,
    ngx_uint_t nmsgs, uint64_t chain, ngx_uint_t prompt_tokens);
ngx_uint_t ngx_http_llama_session_slot_msgs_copy(
    ngx_http_llama_session_zone_t *zone, ngx_uint_t n, u_char *key,
    size_t len, ngx_http_llama_session_msg_t *out, ngx_uint_t max,
    ngx_uint_t *tokens, uint64_t *chain);
ngx_uint_t ngx_http_llama_session_restores_off(
    ngx_http_llama_session_zone_t *zone, u_char *fp);
ngx_uint_t ngx_http_llama_session_model_reset(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job,
    ngx_int_t hit_dirty, ngx_uint_t state);
ngx_uint_t ngx_http_llama_session_unloading_locked(
    ngx_http_llama_session_zone_t *zone);
ngx_uint_t ngx_http_llama_session_slots_usable(ngx_http_llama_session_sh_t *sh);
ngx_uint_t ngx_http_llama_session_slot_of_tenant(
    ngx_http_llama_session_zone_t *zone, ngx_uint_t n, u_char *ns);


#endif /* _NGX_HTTP_LLAMA_SESSION_SCHED_H_INCLUDED_ */
