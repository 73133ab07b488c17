
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The file index: the functions of ngx_http_llama_session_index.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_INDEX_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_INDEX_H_INCLUDED_


#include "ngx_http_llama_session.h"


/* what the API shows of a session's file (remember()) */

typedef struct {
    ngx_str_t                      *id;         /* as the client gave it */
    ngx_str_t                      *model;
    u_char                         *sys;        /* its system prompt's
                                                   digest, NULL: none */
    u_char                         *idk;        /* the id's, NULL: none */
    u_char                         *ns;         /* its tenant's, NULL */
} ngx_http_llama_session_record_t;


void ngx_http_llama_session_index_init(ngx_http_llama_session_sh_t *sh);
size_t ngx_http_llama_session_file_name(u_char *buf, u_char *key,
    size_t len, u_char *fp);
ngx_int_t ngx_http_llama_session_file_known(
    ngx_http_llama_session_zone_t *zone, u_char *fp, u_char *key, size_t len);
ngx_int_t ngx_http_llama_session_file_size(
    ngx_http_llama_session_zone_t *zone, u_char *fp, u_char *key, size_t len,
    off_t *bytes, ngx_uint_t *tokens);
void ngx_http_llama_session_file_saved(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, u_char *key, size_t len,
    ngx_uint_t is_base, ngx_uint_t saved, ngx_uint_t tokens, off_t bytes);
void ngx_http_llama_session_file_seen(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len, ngx_http_llama_session_fid_t *fid);
ngx_uint_t ngx_http_llama_session_file_newer(
    ngx_http_llama_session_zone_t *zone, u_char *fp, u_char *key, size_t len,
    ngx_http_llama_session_fid_t *fid);
void ngx_http_llama_session_file_meta(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, ngx_http_llama_session_fid_t *fid);
ngx_uint_t ngx_http_llama_session_file_kept(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_evicted_t *e,
    ngx_http_llama_session_fid_t *fid, ngx_http_llama_session_fid_t *bin,
    time_t since);
void ngx_http_llama_session_remember(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len, ngx_http_llama_session_record_t *rec);
ngx_uint_t ngx_http_llama_session_base_used(
    ngx_http_llama_session_zone_t *zone, u_char *fp, u_char *key, size_t len);
ngx_int_t ngx_http_llama_session_node_info(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, ngx_http_llama_session_node_t *copy);
ngx_uint_t ngx_http_llama_session_evict_pick(
    ngx_http_llama_session_zone_t *zone, u_char *keep, size_t keep_len,
    off_t need, ngx_http_llama_session_evicted_t *out, ngx_uint_t max);
ngx_http_llama_session_node_t *ngx_http_llama_session_node(
    ngx_http_llama_session_zone_t *zone, u_char *name, size_t len);
ngx_http_llama_session_node_t *ngx_http_llama_session_lookup_name(
    ngx_http_llama_session_zone_t *zone, u_char *name, size_t len);
void ngx_http_llama_session_node_base(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_node_t *node, ngx_uint_t is_base, ngx_uint_t uses);
void ngx_http_llama_session_node_file(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_node_t *node, ngx_uint_t saved, off_t bytes);


#endif /* _NGX_HTTP_LLAMA_SESSION_INDEX_H_INCLUDED_ */
