
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * A conversation without an id, known by the messages it extends: the
 * functions of ngx_http_llama_session_ext.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_EXT_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_EXT_H_INCLUDED_


#include "ngx_http_llama_session.h"

#include <cjson/cJSON.h>


/* the digest of no message (a prefix's digest: ext_step() of each) */
#define NGX_HTTP_LLAMA_SESSION_EXT_D0  0x636861696e73ULL


uint64_t ngx_http_llama_session_ext_step(uint64_t prev,
    ngx_http_llama_session_msg_t *m);
ngx_int_t ngx_http_llama_session_extension(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_ext_record(ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_ext_reply(ngx_http_llama_session_ctx_t *ctx,
    cJSON *message);
uint64_t ngx_http_llama_session_ext_saved(u_char *ns, u_char *sys,
    u_char *model, size_t model_len, u_char *msgs, size_t len);
uint64_t ngx_http_llama_session_ext_parse(u_char *hex, size_t len);
void ngx_http_llama_session_ext_index(ngx_http_llama_session_zone_t *zone,
    uint64_t chain, u_char *key, size_t len, u_char *id, size_t id_len,
    u_char *idk, u_char *ns);


#endif /* _NGX_HTTP_LLAMA_SESSION_EXT_H_INCLUDED_ */
