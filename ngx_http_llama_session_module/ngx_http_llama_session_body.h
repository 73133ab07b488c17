
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Which requests use a slot, and which session a request belongs to: the functions of ngx_http_llama_session_body.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_BODY_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_BODY_H_INCLUDED_


#include "ngx_http_llama_session.h"


ngx_int_t ngx_http_llama_session_identify(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_read_body(ngx_http_request_t *r, size_t max,
    ngx_str_t *body);
ngx_uint_t ngx_http_llama_session_uses_slot(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_ns_digest(ngx_http_request_t *r,
    ngx_str_t *ns, u_char *out);
void ngx_http_llama_session_body_release(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
ngx_int_t ngx_http_llama_session_body_spans(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *body);
ngx_int_t ngx_http_llama_session_make_key(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *ns);
void ngx_http_llama_session_key_prefix(ngx_http_llama_session_ctx_t *ctx);
void ngx_http_llama_session_sha256_free(void);
ngx_uint_t ngx_http_llama_session_uri_ends(ngx_http_request_t *r,
    char *suffix);
ngx_uint_t ngx_http_llama_session_path_ends(ngx_http_request_t *r,
    ngx_str_t *suffix);
ngx_uint_t ngx_http_llama_session_is_endpoint(ngx_http_request_t *r,
    ngx_array_t *endpoints);


#endif /* _NGX_HTTP_LLAMA_SESSION_BODY_H_INCLUDED_ */
