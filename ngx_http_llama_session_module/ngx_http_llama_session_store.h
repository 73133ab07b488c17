
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The store folder: the functions of ngx_http_llama_session_store.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_STORE_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_STORE_H_INCLUDED_


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_io.h"


/* does the file name key?  (store_remove_if(), in a thread of the store's) */
typedef ngx_uint_t (*ngx_http_llama_session_names_pt)(u_char *file,
    u_char *key, size_t len, ngx_log_t *log);


ngx_int_t ngx_http_llama_session_store_sync(
    ngx_http_llama_session_zone_t *zone, ngx_log_t *log);
ngx_int_t ngx_http_llama_session_store_sync_start(
    ngx_http_llama_session_zone_t *zone, ngx_log_t *log, ngx_event_t *wake,
    ngx_http_llama_session_io_t **iop);
void ngx_http_llama_session_store_sync_end(ngx_http_llama_session_io_t *io,
    ngx_log_t *log);
ngx_int_t ngx_http_llama_session_store_commit(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len, off_t size,
    ngx_uint_t tokens, ngx_event_t *wake);
void ngx_http_llama_session_store_drop_old(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_store_drop_tmp(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len);
ngx_int_t ngx_http_llama_session_store_room(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len,
    ngx_uint_t failed);
ngx_int_t ngx_http_llama_session_store_room_after(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len,
    ngx_event_t *wake);
void ngx_http_llama_session_store_evict(ngx_log_t *log,
    ngx_http_llama_session_zone_t *zone, u_char *keep, size_t keep_len);
ngx_int_t ngx_http_llama_session_store_check(
    ngx_http_llama_session_zone_t *zone, ngx_log_t *log);
ngx_int_t ngx_http_llama_session_store_index(
    ngx_http_llama_session_zone_t *zone, ngx_log_t *log);
ngx_int_t ngx_http_llama_session_store_meta(ngx_log_t *log,
    ngx_http_llama_session_zone_t *zone, u_char *name, size_t len,
    ngx_uint_t slot);
ngx_int_t ngx_http_llama_session_store_write(ngx_str_t *folder, u_char *name,
    ngx_str_t *tmp_suffix, u_char *text, size_t len, ngx_log_t *log);
ngx_int_t ngx_http_llama_session_store_put(
    ngx_http_llama_session_zone_t *zone, u_char *file, u_char *tmp,
    ngx_str_t *parts, ngx_uint_t n, ngx_uint_t access, ngx_atomic_t *done,
    ngx_atomic_uint_t seq, ngx_log_t *log);
void ngx_http_llama_session_store_remove(ngx_http_llama_session_zone_t *zone,
    u_char *file, u_char *file2, ngx_log_t *log);
void ngx_http_llama_session_store_remove_if(
    ngx_http_llama_session_zone_t *zone, u_char *file,
    ngx_http_llama_session_names_pt names, u_char *key, size_t len,
    ngx_log_t *log);
void ngx_http_llama_session_store_remove_after(
    ngx_http_llama_session_zone_t *zone, u_char *file, u_char *file2,
    ngx_atomic_t *done, ngx_atomic_uint_t seq, ngx_log_t *log);
ngx_int_t ngx_http_llama_session_store_look(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_store_looked(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_store_prev(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_store_delete(u_char *file);
void ngx_http_llama_session_store_saved(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len,
    ngx_uint_t tokens, off_t bytes);
ngx_int_t ngx_http_llama_session_store_fid(
    ngx_http_llama_session_zone_t *zone, u_char *fp, u_char *key, size_t len,
    ngx_http_llama_session_fid_t *fid, ngx_log_t *log);
ngx_uint_t ngx_http_llama_session_store_newer(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_store_used(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, ngx_uint_t touch, ngx_log_t *log);
ngx_uint_t ngx_http_llama_session_store_has_file(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len);
ngx_int_t ngx_http_llama_session_store_unlink(
    ngx_http_llama_session_zone_t *zone, u_char *name, size_t len,
    ngx_log_t *log);


#endif /* _NGX_HTTP_LLAMA_SESSION_STORE_H_INCLUDED_ */
