
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * A scanner for request bodies: the functions of ngx_http_llama_session_json.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_JSON_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_JSON_H_INCLUDED_


#include "ngx_http_llama_session.h"


u_char *ngx_http_llama_session_json_skip(u_char *p, u_char *end);
ngx_uint_t ngx_http_llama_session_json_values(u_char *p, size_t len);
cJSON *ngx_http_llama_session_json_tree(u_char *p, size_t len);
ngx_uint_t ngx_http_llama_session_json_string_is(
    ngx_http_llama_session_span_t *span, ngx_str_t *s);
u_char *ngx_http_llama_session_json_object(u_char *p, u_char *end,
    ngx_str_t *names, ngx_http_llama_session_span_t *values, ngx_uint_t n);
ngx_int_t ngx_http_llama_session_json_next(u_char **pos, u_char *end,
    ngx_http_llama_session_span_t *elt);
ngx_int_t ngx_http_llama_session_json_body(u_char *p, u_char *end,
    ngx_str_t *names, ngx_http_llama_session_span_t *values, ngx_uint_t n);
ngx_uint_t ngx_http_llama_session_json_media(u_char *p, u_char *end);


#endif /* _NGX_HTTP_LLAMA_SESSION_JSON_H_INCLUDED_ */
