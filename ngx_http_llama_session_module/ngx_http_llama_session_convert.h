
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The APIs the module speaks in front of llama-server (Ollama's,
 * Anthropic's): a request translated into a chat completion, and its
 * reply translated back as it passes, with nginx's flow control.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_CONVERT_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_CONVERT_H_INCLUDED_


#include "ngx_http_llama_session.h"

#include <cjson/cJSON.h>


typedef struct ngx_http_llama_session_conv_s  ngx_http_llama_session_conv_t;

/*
 * An API's part: event() gets each SSE event's data of a stream (NULL
 * when the stream ended), whole() a whole reply (or an error's)
 */

typedef ngx_int_t (*ngx_http_llama_session_conv_pt)(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len);


struct ngx_http_llama_session_conv_s {
    char                           *api;        /* "Ollama": for the log */
    char                           *stream_type;
    ngx_http_llama_session_conv_pt  event;
    ngx_http_llama_session_conv_pt  whole;
    void                           *data;       /* the API's own state */

    ngx_uint_t                      stream;     /* the client asked one */
    ngx_uint_t                      status;

    /* usage and timings, wherever they come (conv_stats()) */
    ngx_uint_t                      prompt_tokens;
    ngx_int_t                       prompt_n;   /* evaluated, -1: unknown */
    ngx_int_t                       cached;     /* from the cache, -1 */
    ngx_uint_t                      completion_tokens;
    double                          prompt_ms;
    double                          predicted_ms;

    /* the body filter's flow control */
    ngx_buf_t                      *in;         /* what is not translated */
    ngx_chain_t                    *pending;    /* llama-server's, not
                                                   taken yet */
    ngx_uint_t                      last;       /* its last buffer came */
    ngx_buf_t                      *cur;        /* the output being filled */
    ngx_chain_t                    *free;
    ngx_chain_t                    *busy;
    ngx_uint_t                      nbufs;      /* output buffers made */
    ngx_chain_t                   **ll;         /* where output goes now */
};


ngx_int_t ngx_http_llama_session_conv_init(ngx_conf_t *cf);
ngx_http_llama_session_conv_t *ngx_http_llama_session_conv_create(
    ngx_http_request_t *r, ngx_http_llama_session_ctx_t *ctx, char *api);
ngx_int_t ngx_http_llama_session_conv_request(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, cJSON *out, char *uri);
cJSON *ngx_http_llama_session_conv_parse(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, char *what, char **error);
ngx_int_t ngx_http_llama_session_conv_dups(ngx_pool_t *pool, cJSON *item);
ngx_int_t ngx_http_llama_session_conv_emit(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, cJSON *json, ngx_uint_t nl);
ngx_int_t ngx_http_llama_session_conv_write(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len);
void ngx_http_llama_session_conv_stats(ngx_http_llama_session_conv_t *c,
    cJSON *reply);


#endif /* _NGX_HTTP_LLAMA_SESSION_CONVERT_H_INCLUDED_ */
