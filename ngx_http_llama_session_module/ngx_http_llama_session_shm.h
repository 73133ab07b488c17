
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The shared-memory zone: the functions of ngx_http_llama_session_shm.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_SHM_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_SHM_H_INCLUDED_


#include "ngx_http_llama_session.h"


void ngx_http_llama_session_wait_local(ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_wait_end(ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_wake_local(void);
ngx_http_llama_session_zone_t *ngx_http_llama_session_find_zone(
    ngx_conf_t *cf, ngx_str_t *name);
ngx_int_t ngx_http_llama_session_init_zone(ngx_shm_zone_t *shm_zone,
    void *data);
ngx_int_t ngx_http_llama_session_acquire(ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_process_init(void);
ngx_int_t ngx_http_llama_session_try_slot(ngx_http_llama_session_ctx_t *ctx);
ngx_uint_t ngx_http_llama_session_base_claim(
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_try_idle(ngx_http_llama_session_ctx_t *ctx,
    ngx_msec_t save_idle);
void ngx_http_llama_session_slot_saved(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t slot, u_char *key, size_t len);
ngx_uint_t ngx_http_llama_session_in_use(ngx_http_llama_session_zone_t *zone,
    u_char *key, size_t len);
void ngx_http_llama_session_dequeue(ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_release(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state);
void ngx_http_llama_session_slot_set(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state, u_char *key, size_t len, ngx_uint_t dirty);
ngx_int_t ngx_http_llama_session_file_size(
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len, off_t *bytes,
    ngx_uint_t *tokens);
ngx_int_t ngx_http_llama_session_file_known(
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len);
void ngx_http_llama_session_file_saved(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len, ngx_uint_t saved, ngx_uint_t tokens,
    off_t bytes);
void ngx_http_llama_session_remember(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len, ngx_str_t *id);
ngx_uint_t ngx_http_llama_session_fingerprint(
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_set_fingerprint(
    ngx_http_llama_session_ctx_t *ctx, u_char *fp, ngx_uint_t n_ctx,
    ngx_uint_t total_slots, ngx_str_t *model_path);
void ngx_http_llama_session_slot_msgs(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t prompt_tokens);
ngx_uint_t ngx_http_llama_session_slot_msgs_copy(
    ngx_http_llama_session_zone_t *zone, ngx_uint_t n, u_char *key,
    size_t len, ngx_http_llama_session_msg_t *out, ngx_uint_t max,
    ngx_uint_t *tokens);
ngx_uint_t ngx_http_llama_session_restores_off(
    ngx_http_llama_session_zone_t *zone, u_char *fp);
ngx_uint_t ngx_http_llama_session_unloading_locked(
    ngx_http_llama_session_zone_t *zone);
ngx_uint_t ngx_http_llama_session_model_reset(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state);
ngx_int_t ngx_http_llama_session_switch_take(
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_switch_end(ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_victim_end(ngx_http_llama_session_ctx_t *ctx);
ngx_uint_t ngx_http_llama_session_victim_clean(
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_zone_t *zone);
ngx_uint_t ngx_http_llama_session_slot_task(ngx_http_llama_session_ctx_t *ctx,
    ngx_int_t task);
ngx_int_t ngx_http_llama_session_node_info(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, ngx_http_llama_session_node_t *copy);
ngx_uint_t ngx_http_llama_session_evict_pick(
    ngx_http_llama_session_zone_t *zone, u_char *keep, size_t keep_len,
    off_t need, ngx_http_llama_session_evicted_t *out, ngx_uint_t max);
ngx_http_llama_session_node_t *ngx_http_llama_session_node(
    ngx_http_llama_session_zone_t *zone, u_char *name, size_t len);
ngx_http_llama_session_node_t *ngx_http_llama_session_lookup_name(
    ngx_http_llama_session_zone_t *zone, u_char *name, size_t len);
ngx_uint_t ngx_http_llama_session_base_used(
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_node_base(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_node_t *node, ngx_uint_t is_base, ngx_uint_t uses);
void ngx_http_llama_session_node_file(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_node_t *node, ngx_uint_t saved, off_t bytes);
ngx_uint_t ngx_http_llama_session_slots_usable(ngx_http_llama_session_sh_t *sh);
ngx_uint_t ngx_http_llama_session_slot_of_tenant(
    ngx_http_llama_session_zone_t *zone, ngx_uint_t n, u_char *ns);
size_t ngx_http_llama_session_file_name(u_char *buf, u_char *key,
    size_t len, u_char *fp);
void ngx_http_llama_session_stat(ngx_http_llama_session_ctx_t *ctx,
    ngx_atomic_uint_t *counter);


#endif /* _NGX_HTTP_LLAMA_SESSION_SHM_H_INCLUDED_ */
