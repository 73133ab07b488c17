
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Slot calls, the one transport to llama-server: subrequests to the
 * operator's internal location (llama_session_slots_uri), each with its
 * own method, JSON body and headers, so nothing of the client's request
 * (Content-Length, Authorization, body) leaks into them.  A body filter
 * captures their replies; for a client's request it also sees the last
 * buffer of the response, which gives the slot back (finish).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_index.h"
#include "ngx_http_llama_session_ram.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_store.h"


#define NGX_HTTP_LLAMA_SESSION_REPLY_MAX  (4 * 1024 * 1024)


static ngx_buf_t *ngx_http_llama_session_call_body(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t call, u_char *key,
    size_t len, ngx_str_t *model);
static ngx_table_elt_t *ngx_http_llama_session_call_header(
    ngx_http_request_t *sr, char *key, char *lowcase, char *value);
static ngx_int_t ngx_http_llama_session_call_done(ngx_http_request_t *sr,
    void *data, ngx_int_t rc);
static ngx_int_t ngx_http_llama_session_call_retry(ngx_http_request_t *sr,
    ngx_http_llama_session_ctx_t *ctx, ngx_int_t rc);
static ngx_int_t ngx_http_llama_session_capture_filter(ngx_http_request_t *r,
    ngx_chain_t *in);
static ngx_int_t ngx_http_llama_session_capture_append(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, u_char *data, size_t size);


static ngx_http_output_body_filter_pt  ngx_http_next_body_filter;


/*
 * The slot calls, by ngx_http_llama_session_call_e: the name the log
 * gives, the backend's path (none: "/slots/N", or the prime's endpoint),
 * the query, the query in router mode (a call that looks or saves never
 * loads a model: the router would unload another for it; a restore does,
 * as the request needs the model anyway), and the method.
 */

typedef struct {
    ngx_str_t                       name;
    ngx_str_t                       path;
    ngx_str_t                       query;
    ngx_str_t                       router_query;
    ngx_uint_t                      method;
} ngx_http_llama_session_call_t;


static ngx_http_llama_session_call_t  ngx_http_llama_session_calls[] = {

    { ngx_null_string, ngx_null_string, ngx_null_string, ngx_null_string,
      NGX_HTTP_GET },

    { ngx_string("GET /slots"), ngx_string("/slots"), ngx_null_string,
      ngx_null_string /* ?model= */, NGX_HTTP_GET },

    { ngx_string("save"), ngx_null_string, ngx_string("action=save"),
      ngx_string("action=save&autoload=false"), NGX_HTTP_POST },

    { ngx_string("restore"), ngx_null_string, ngx_string("action=restore"),
      ngx_string("action=restore"), NGX_HTTP_POST },

    { ngx_string("erase"), ngx_null_string, ngx_string("action=erase"),
      ngx_string("action=erase&autoload=false"), NGX_HTTP_POST },

    { ngx_string("GET /props"), ngx_string("/props"), ngx_null_string,
      ngx_null_string /* ?model= */, NGX_HTTP_GET },

    { ngx_string("GET /v1/models"), ngx_string("/v1/models"),
      ngx_null_string, ngx_null_string, NGX_HTTP_GET },

    { ngx_string("prime"), ngx_null_string, ngx_null_string,
      ngx_null_string, NGX_HTTP_POST },

    { ngx_string("GET /models"), ngx_string("/models"), ngx_null_string,
      ngx_null_string, NGX_HTTP_GET },

    { ngx_string("GET /props"), ngx_string("/props"), ngx_null_string,
      ngx_null_string, NGX_HTTP_GET },

    { ngx_string("POST /models/load"), ngx_string("/models/load"),
      ngx_null_string, ngx_null_string, NGX_HTTP_POST },

    { ngx_string("POST /models/unload"), ngx_string("/models/unload"),
      ngx_null_string, ngx_null_string, NGX_HTTP_POST },

    { ngx_string("POST /apply-template"), ngx_string("/apply-template"),
      ngx_null_string, ngx_null_string, NGX_HTTP_POST },

    { ngx_string("the re-prime's POST /completion"), ngx_string("/completion"),
      ngx_null_string, ngx_null_string, NGX_HTTP_POST },

    { ngx_string("POST /tokenize"), ngx_string("/tokenize"),
      ngx_null_string, ngx_null_string, NGX_HTTP_POST }
};


/* a slot call's name, for the log and the client's error */

ngx_str_t *
ngx_http_llama_session_call_name(ngx_uint_t call)
{
    return &ngx_http_llama_session_calls[call].name;
}


ngx_int_t
ngx_http_llama_session_capture_init(ngx_conf_t *cf)
{
    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_llama_session_capture_filter;

    return NGX_OK;
}


/*
 * Starts a slot call; the handler is run again when it is done.
 * key: the session to save or restore (the file is "<key>.bin").
 */

ngx_int_t
ngx_http_llama_session_call(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t call, u_char *key,
    size_t len)
{
    u_char                             *p;
    ngx_str_t                           uri, *args, *model;
    ngx_buf_t                          *b;
    ngx_chain_t                        *cl;
    ngx_http_request_t                 *sr;
    ngx_http_core_main_conf_t          *cmcf;
    ngx_http_post_subrequest_t         *ps;
    ngx_http_request_body_t            *rb;
    ngx_http_llama_session_call_t      *c;
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    uri.len = llcf->slots_uri.len + sizeof("/v1/chat/completions") - 1
              + NGX_INT_T_LEN;
    uri.data = ngx_pnalloc(r->pool, uri.len);
    if (uri.data == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    c = &ngx_http_llama_session_calls[call];

    if (ctx->job->ram_leaving) {
        /* what the slot holds goes into RAM, or is replaced (ram.c) */

        if (call == NGX_HTTP_LLAMA_SESSION_CALL_PRIME) {
            ngx_http_llama_session_ram_leave(ctx);

        } else if (call == NGX_HTTP_LLAMA_SESSION_CALL_RESTORE
                   || call == NGX_HTTP_LLAMA_SESSION_CALL_ERASE)
        {
            ctx->job->ram_leaving = 0;
        }
    }

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_PRIME) {
        p = ngx_sprintf(uri.data, "%V%s", &llcf->slots_uri,
                        ctx->dialect->prime);

    } else if (c->path.len) {
        p = ngx_sprintf(uri.data, "%V%V", &llcf->slots_uri, &c->path);

    } else {
        p = ngx_sprintf(uri.data, "%V/slots/%ui", &llcf->slots_uri,
                        ctx->job->slot);
    }

    uri.len = p - uri.data;
    args = &c->query;

    /* router mode: every call names the zone's model */

    model = ctx->zone->model.len ? &ctx->zone->model : NULL;

    if (model) {
        args = (call == NGX_HTTP_LLAMA_SESSION_CALL_GET
                || call == NGX_HTTP_LLAMA_SESSION_CALL_PROPS)
               ? &ctx->zone->model_arg : &c->router_query;

        if (call == NGX_HTTP_LLAMA_SESSION_CALL_UNLOAD) {
            model = &ctx->route->victim->model;
        }
    }

    ctx->job->call_uri = uri;

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_RESTORE && ctx->job->speculative
        && !ctx->job->erased)
    {
        /*
         * a draft model: llama-server restores the target's context
         * alone, and a draft context longer than the restored one fails
         * every later request (500, "failed to process speculative
         * batch"); the slot is erased first, then the restore is sent
         * (call_done())
         */

        ctx->job->call_then = 1;
        c = &ngx_http_llama_session_calls[NGX_HTTP_LLAMA_SESSION_CALL_ERASE];
        uri.len = ngx_sprintf(uri.data, "%V/slots/%ui", &llcf->slots_uri,
                              ctx->job->slot) - uri.data;
        args = model ? &c->router_query : &c->query;
        ctx->job->call_uri = uri;
        call = NGX_HTTP_LLAMA_SESSION_CALL_ERASE;
    }

    ctx->job->erased = 0;

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE && !ctx->job->call_retried) {
        /* the file it writes and min_free must fit on the store's disk */
        ctx->job->room = 0;
        (void) ngx_http_llama_session_store_room(r->connection->log, ctx,
                                                 key, len, 0);
    }

    ps = ngx_palloc(r->pool, sizeof(ngx_http_post_subrequest_t));
    if (ps == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ps->handler = ngx_http_llama_session_call_done;
    ps->data = ctx;

    if (ngx_http_subrequest(r, &uri, args->len ? args : NULL, &sr, ps,
                            NGX_HTTP_SUBREQUEST_WAITED)
        != NGX_OK)
    {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    /* its own method, headers and body */

    cmcf = ngx_http_get_module_main_conf(r, ngx_http_core_module);

    sr->variables = ngx_pcalloc(r->pool, cmcf->variables.nelts
                                         * sizeof(ngx_http_variable_value_t));
    if (sr->variables == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ngx_memzero(&sr->headers_in, sizeof(ngx_http_headers_in_t));

    if (ngx_list_init(&sr->headers_in.headers, r->pool, 2,
                      sizeof(ngx_table_elt_t))
        != NGX_OK)
    {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    sr->headers_in.server = r->headers_in.server;
    sr->headers_in.content_length_n = -1;
    sr->headers_in.keep_alive_n = -1;

    rb = ngx_pcalloc(r->pool, sizeof(ngx_http_request_body_t));
    if (rb == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    sr->request_body = rb;

    if (c->method == NGX_HTTP_GET) {
        sr->method = NGX_HTTP_GET;
        ngx_str_set(&sr->method_name, "GET");

    } else {
        sr->method = NGX_HTTP_POST;
        ngx_str_set(&sr->method_name, "POST");

        b = ngx_http_llama_session_call_body(r, ctx, call, key, len, model);
        if (b == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        /* sent as it is again if the call is retried (call_retry()) */
        ctx->job->call_sent = b;
        ctx->job->call_sent_pos = b->pos;

        cl = ngx_alloc_chain_link(r->pool);
        if (cl == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cl->buf = b;
        cl->next = NULL;

        rb->bufs = cl;
        sr->headers_in.content_length_n = b->last - b->pos;

        sr->headers_in.content_type = ngx_http_llama_session_call_header(sr,
                                   "Content-Type", "content-type",
                                   "application/json");
        if (sr->headers_in.content_type == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
    }

    if (ctx->job->own) {
        /* the module's own request: so it shows in llama-server's log */

        sr->headers_in.user_agent = ngx_http_llama_session_call_header(sr,
                                   "User-Agent", "user-agent",
                                   "nginx-llama-session (idle save)");
        if (sr->headers_in.user_agent == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
    }

    /* the reply's buffer is kept from call to call */

    if (ctx->job->capture) {
        ctx->job->capture->pos = ctx->job->capture->start;
        ctx->job->capture->last = ctx->job->capture->start;
    }

    ctx->job->call = call;
    ctx->job->call_key = key;
    ctx->job->call_key_len = len;
    ctx->job->call_sr = sr;
    ctx->job->call_done = 0;
    ctx->job->call_timed_out = 0;
    ctx->job->call_inflight = 1;
    ctx->job->call_status = 0;
    ctx->job->call_reply = NULL;

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: slot call %V?%V", &uri, args);

    return NGX_AGAIN;
}


/*
 * A POST call's JSON body: the file of the session to save or restore
 * (key: only [A-Za-z0-9_-], and "@" in router mode), the model in router
 * mode (its name has no character to escape, see module.c), or the
 * one made for the call: a prime's (warm.c), a re-prime's (reprime.c).
 */

static ngx_buf_t *
ngx_http_llama_session_call_body(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t call, u_char *key,
    size_t len, ngx_str_t *model)
{
    size_t      blen;
    ngx_buf_t  *b;

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_PRIME
        || call == NGX_HTTP_LLAMA_SESSION_CALL_APPLY
        || call == NGX_HTTP_LLAMA_SESSION_CALL_COMPLETE
        || call == NGX_HTTP_LLAMA_SESSION_CALL_TOKENIZE)
    {
        b = ctx->job->call_body;
        ctx->job->call_body = NULL;

        if (b) {
            b->last_buf = 1;
            b->last_in_chain = 1;
        }

        return b;
    }

    blen = sizeof("{\"filename\":\"..bin.12345678.tmp\"}") - 1 + len
           + NGX_HTTP_LLAMA_SESSION_FP_LEN
           + sizeof(",\"model\":\"\"") + NGX_HTTP_LLAMA_SESSION_MODEL_SHOW;

    b = ngx_create_temp_buf(r->pool, blen);
    if (b == NULL) {
        return NULL;
    }

    if (model
        && (call == NGX_HTTP_LLAMA_SESSION_CALL_ERASE
            || call == NGX_HTTP_LLAMA_SESSION_CALL_LOAD
            || call == NGX_HTTP_LLAMA_SESSION_CALL_UNLOAD))
    {
        b->last = ngx_sprintf(b->last, "{\"model\":\"%V\"}", model);

    } else if (call == NGX_HTTP_LLAMA_SESSION_CALL_ERASE) {
        b->last = ngx_cpymem(b->last, "{}", 2);

    } else {
        /* a save to a temporary file, renamed once checked (store.c) */

        b->last = ngx_sprintf(b->last, "{\"filename\":\"%*s.%*s.bin\"",
                              len, key,
                              (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN,
                              ctx->job->fp);

        if (call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE && ctx->zone->store.len)
        {
            b->last--;
            b->last = ngx_sprintf(b->last, "%V\"", &ctx->zone->tmp);
        }

        if (model) {
            b->last = ngx_sprintf(b->last, ",\"model\":\"%V\"", model);
        }

        *b->last++ = '}';
    }

    b->last_buf = 1;
    b->last_in_chain = 1;

    return b;
}


/* a request header of a slot call's own */

static ngx_table_elt_t *
ngx_http_llama_session_call_header(ngx_http_request_t *sr, char *key,
    char *lowcase, char *value)
{
    ngx_table_elt_t  *h;

    h = ngx_list_push(&sr->headers_in.headers);
    if (h == NULL) {
        return NULL;
    }

    h->key.data = (u_char *) key;
    h->key.len = ngx_strlen(key);
    h->value.data = (u_char *) value;
    h->value.len = ngx_strlen(value);
    h->lowcase_key = (u_char *) lowcase;
    h->hash = ngx_hash_key(h->lowcase_key, h->key.len);
#if (nginx_version >= 1023000)
    h->next = NULL;
#endif

    return h;
}


static ngx_int_t
ngx_http_llama_session_call_done(ngx_http_request_t *sr, void *data,
    ngx_int_t rc)
{
    ngx_http_llama_session_ctx_t *ctx = data;

    if (ctx->job->call_done || sr != ctx->job->call_sr) {
        /* finalized again, or a call that was sent again (call_retry()) */
        return rc;
    }

    if (ngx_http_llama_session_call_retry(sr, ctx, rc) == NGX_OK) {
        /* this one ends without an error page; the next is on its way */
        return NGX_OK;
    }

    /* the next call may be sent again once */
    ctx->job->call_retried = 0;

    if (ctx->job->call_then && !sr->connection->error) {
        /* the erase before a restore on a draft model's slot: the restore */

        ctx->job->call_then = 0;
        ctx->job->erased = 1;

        if (sr->upstream == NULL || sr->upstream->headers_in.status_n
                                    != NGX_HTTP_OK)
        {
            ngx_log_error(NGX_LOG_WARN, sr->connection->log, 0,
                          "llama_session: the erase of slot %ui before a "
                          "restore failed, the restore is sent all the same",
                          ctx->job->slot);
        }

        if (ngx_http_llama_session_call(sr->parent, ctx,
                                        NGX_HTTP_LLAMA_SESSION_CALL_RESTORE,
                                        ctx->job->call_key,
                                        ctx->job->call_key_len)
            == NGX_AGAIN)
        {
            return NGX_OK;
        }

        ctx->job->call_sr = sr;
    }

    ctx->job->call_then = 0;
    ctx->job->call_done = 1;
    ctx->job->call_inflight = 0;

    ctx->job->call_reply = (ctx->job->capture && ctx->job->capture->last
                           > ctx->job->capture->pos)
                      ? ctx->job->capture : NULL;

    if (sr->upstream) {
        /* 0: no answer from the backend (refused, reset, timed out) */
        ctx->job->call_status = sr->upstream->headers_in.status_n;
        ctx->job->call_timed_out = (ctx->job->call_status == 0
                               && rc == NGX_HTTP_GATEWAY_TIME_OUT);

    } else {
        /* the location does not proxy: a misconfiguration */
        ctx->job->call_status = sr->headers_out.status ? sr->headers_out.status
                                                  : NGX_HTTP_NOT_FOUND;
        if (ctx->job->call_status < NGX_HTTP_BAD_REQUEST) {
            ctx->job->call_status = NGX_HTTP_NOT_FOUND;
        }

        ngx_log_error(NGX_LOG_ERR, sr->connection->log, 0,
                      "llama_session: \"%V\" is not proxied to llama-server, "
                      "check llama_session_slots_uri and its location",
                      &sr->uri);
    }

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, sr->connection->log, 0,
                   "llama_session: slot call done: %i, rc %i",
                   ctx->job->call_status, rc);

    return rc;
}


/*
 * A slot call sent once more, as the same call (NGX_OK: it is on its way):
 *
 *   - llama-server closes a kept-alive connection after 5 s idle
 *     (cpp-httplib's keep-alive timeout); a call sent on it at that moment
 *     gets no byte back, and nginx does not send a POST again
 *     (proxy_next_upstream's non_idempotent).  The module's slot calls are
 *     safe to send again: a connection from the keepalive cache that closed
 *     before any byte of a reply is tried once more;
 *   - a restore that llama-server failed (400) in a shared store: it opens
 *     the file twice, for its token count and then for the state, and
 *     another owner's save of the session committed in between fails it
 *     ("token count ... exceeded capacity") with a whole file in place.
 *
 * Once per call.  A call that got a reply otherwise, timed out, or whose
 * client left stands as it is.  (A save that llama-server failed on a
 * full disk is sent again after a look at the disk in a thread, by its
 * waiter: save_done(), store_room_after().)
 */

static ngx_int_t
ngx_http_llama_session_call_retry(ngx_http_request_t *sr,
    ngx_http_llama_session_ctx_t *ctx, ngx_int_t rc)
{
    ngx_int_t             retried;
    ngx_uint_t            call;
    ngx_buf_t            *body;
    ngx_http_upstream_t  *u;

    u = sr->upstream;
    call = ctx->job->call;


    if (u == NULL || ctx->job->call_retried || sr->connection->error) {
        return NGX_DECLINED;
    }

    if (rc == NGX_HTTP_BAD_GATEWAY && u->headers_in.status_n == 0
        && u->peer.cached
        && (u->state == NULL || u->state->bytes_received == 0))
    {
        ngx_log_error(NGX_LOG_WARN, sr->connection->log, 0,
                      "llama_session: the backend closed a kept-alive "
                      "connection before it answered the slot call %V, sent "
                      "again (keep the upstream's keepalive_timeout below "
                      "llama-server's 5 s)",
                      ngx_http_llama_session_call_name(call));

    } else if (call == NGX_HTTP_LLAMA_SESSION_CALL_RESTORE
               && ctx->zone->shared
               && u->headers_in.status_n == NGX_HTTP_BAD_REQUEST)
    {
        ngx_log_error(NGX_LOG_WARN, sr->connection->log, 0,
                      "llama_session: restoring \"%*s\" failed (400), sent "
                      "again: another owner may have saved it while "
                      "llama-server read its file",
                      ctx->job->call_key_len, ctx->job->call_key);

    } else {
        return NGX_DECLINED;
    }

    body = ctx->job->call_sent;

    if (body && (call == NGX_HTTP_LLAMA_SESSION_CALL_PRIME
                 || call == NGX_HTTP_LLAMA_SESSION_CALL_APPLY
                 || call == NGX_HTTP_LLAMA_SESSION_CALL_COMPLETE
                 || call == NGX_HTTP_LLAMA_SESSION_CALL_TOKENIZE))
    {
        /* a body made for the call: the same bytes again */
        body->pos = ctx->job->call_sent_pos;
        ctx->job->call_body = body;
    }

    ctx->job->call_retried = 1;

    retried = ngx_http_llama_session_call(sr->parent, ctx, call,
                                          ctx->job->call_key,
                                          ctx->job->call_key_len);

    if (retried != NGX_AGAIN) {
        ngx_log_error(NGX_LOG_ERR, sr->connection->log, 0,
                      "llama_session: the slot call %V could not be sent "
                      "again", ngx_http_llama_session_call_name(call));

        /* this call's failure stands */
        ctx->job->call = call;
        ctx->job->call_sr = sr;
        ctx->job->call_inflight = 1;
        return NGX_DECLINED;
    }

    return NGX_OK;
}


/*
 * Keeps the reply of the module's own slot calls instead of sending it
 * anywhere.  They are known by their post-subrequest handler, which an
 * internal redirect (error_page in the slots location) does not change,
 * unlike the request's module context.  For the main request, the end of
 * the response gives the slot back.
 */

static ngx_int_t
ngx_http_llama_session_capture_filter(ngx_http_request_t *r, ngx_chain_t *in)
{
    off_t                          size;
    ssize_t                        n;
    u_char                        *p;
    ngx_buf_t                     *b;
    ngx_chain_t                   *cl;
    ngx_http_llama_session_ctx_t  *ctx;

    if (r == r->main) {
        ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

        if (ctx && ctx->job->state == NGX_HTTP_LLAMA_SESSION_ST_PROXY
            && ctx->job->acquired && !ctx->job->released)
        {
            for (cl = in; cl; cl = cl->next) {
                if (cl->buf->last_buf) {
                    ngx_http_llama_session_job_finish(ctx);
                    break;
                }
            }
        }

        return ngx_http_next_body_filter(r, in);
    }

    if (!ngx_http_llama_session_own_call(r)) {
        return ngx_http_next_body_filter(r, in);
    }

    ctx = r->post_subrequest->data;

    for (cl = in; cl; cl = cl->next) {
        b = cl->buf;

        if (ngx_buf_in_memory(b)) {
            if (ngx_http_llama_session_capture_append(r, ctx, b->pos,
                                                      b->last - b->pos)
                != NGX_OK)
            {
                return NGX_ERROR;
            }

            b->pos = b->last;

        } else if (b->in_file) {
            size = b->file_last - b->file_pos;

            if (size > NGX_HTTP_LLAMA_SESSION_REPLY_MAX) {
                size = NGX_HTTP_LLAMA_SESSION_REPLY_MAX;
            }

            p = ngx_pnalloc(r->pool, size);
            if (p == NULL) {
                return NGX_ERROR;
            }

            n = ngx_read_file(b->file, p, size, b->file_pos);

            if (n == NGX_ERROR) {
                return NGX_ERROR;
            }

            if (ngx_http_llama_session_capture_append(r, ctx, p, n)
                != NGX_OK)
            {
                return NGX_ERROR;
            }

            b->file_pos = b->file_last;
        }
    }

    return NGX_OK;
}


/* is this subrequest one of the module's slot calls? */

ngx_uint_t
ngx_http_llama_session_own_call(ngx_http_request_t *r)
{
    return r != r->main && r->post_subrequest
           && r->post_subrequest->handler
              == ngx_http_llama_session_call_done;
}


static ngx_int_t
ngx_http_llama_session_capture_append(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, u_char *data, size_t size)
{
    size_t      want;
    ngx_buf_t  *b;

    if (size == 0 || ctx->job->call_done) {
        return NGX_OK;
    }

    b = ctx->job->capture;

    if (b == NULL || (size_t) (b->end - b->last) < size) {

        want = b ? (size_t) (b->last - b->pos) + size : size;

        if (want > NGX_HTTP_LLAMA_SESSION_REPLY_MAX) {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "llama_session: a slot call's reply is larger "
                          "than %d bytes, the rest is dropped",
                          NGX_HTTP_LLAMA_SESSION_REPLY_MAX);
            return NGX_OK;
        }

        want = ngx_max(want * 2, 4096);

        /* in the main request's pool: it outlives the subrequest */

        b = ngx_create_temp_buf(r->main->pool, want);
        if (b == NULL) {
            return NGX_ERROR;
        }

        if (ctx->job->capture) {
            b->last = ngx_cpymem(b->last, ctx->job->capture->pos,
                                 ctx->job->capture->last
                                     - ctx->job->capture->pos);
        }

        ctx->job->capture = b;
    }

    b->last = ngx_cpymem(b->last, data, size);

    return NGX_OK;
}


/*
 * Gives the slot back, once: when the response ends (the last buffer
 * passes the body filter) or when the request goes, whatever ended it.
 * What the slot holds then is decided from the stage the request reached,
 * never from the flags of a slot call that its end may have cleared:
 *
 *   waiting, GET /props, GET /slots   untouched: as the zone says
 *   a save in flight                  the slot still holds the session
 *                                     leaving; its temporary file goes
 *   its re-prime                      the same (a prefix of it), that
 *                                     llama-server may still extend
 *   a restore or an erase             anything: unknown
 *   proxying                          this session, unless the backend
 *                                     failed or vanished: unknown
 */

void
ngx_http_llama_session_job_finish(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t           state;
    ngx_http_request_t  *r;

    if (!ctx->job->acquired || ctx->job->released) {
        return;
    }

    r = ctx->request;
    state = NGX_HTTP_LLAMA_SESSION_SLOT_SESSION;

    switch (ctx->job->state) {

    case NGX_HTTP_LLAMA_SESSION_ST_SAVE:

        if (ctx->zone->store.len == 0) {
            /* llama-server writes over the session's file itself */
            ngx_http_llama_session_file_saved(ctx->zone, ctx->job,
                                              ctx->job->out_key,
                                              ctx->job->out_len, 0, 0, 0, 0);

        } else {
            ngx_http_llama_session_store_drop_tmp(r->connection->log, ctx,
                                                  ctx->job->out_key,
                                                      ctx->job->out_len);
        }

        break;

    case NGX_HTTP_LLAMA_SESSION_ST_REPRIME:

        if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_COMPLETE
            && !ctx->job->call_done)
        {
            ctx->job->quarantine = 1;
        }

        break;

    case NGX_HTTP_LLAMA_SESSION_ST_LOAD:
        state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        break;

    case NGX_HTTP_LLAMA_SESSION_ST_WARM:
        state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;

        if (ctx->warm->warm_step == NGX_HTTP_LLAMA_SESSION_WARM_SAVE) {
            if (ctx->zone->store.len == 0) {
                ngx_http_llama_session_file_saved(ctx->zone, ctx->job,
                                                  ctx->base_key,
                                                  ctx->base_len, 1, 0, 0, 0);

            } else {
                ngx_http_llama_session_store_drop_tmp(r->connection->log,
                                                      ctx, ctx->base_key,
                                                      ctx->base_len);
            }

        } else if (ctx->warm->warm_step == NGX_HTTP_LLAMA_SESSION_WARM_PRIME) {
            /* llama-server may still run the prime, as any completion */
            ctx->job->quarantine = 1;
        }

        break;

    case NGX_HTTP_LLAMA_SESSION_ST_PROXY:

        if (r->upstream
            && (r->upstream->headers_in.status_n == 0
                || r->upstream->headers_in.status_n
                   >= NGX_HTTP_INTERNAL_SERVER_ERROR))
        {
            state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        }

        if (r->upstream && r->upstream->headers_in.status_n == 0) {
            /*
             * no reply yet: llama-server may run the request later, on
             * whatever the slot holds by then (another session's)
             */
            ctx->job->quarantine = 1;
        }

        break;

    default:
        break;
    }

    ngx_log_debug5(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: session \"%*s\" releases slot %ui "
                   "at stage %ui (%ui)", ctx->key_len, ctx->key, ctx->job->slot,
                   ctx->job->state, state);

    if (ctx->job->state == NGX_HTTP_LLAMA_SESSION_ST_WARM) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: the request of session \"%*s\" ended "
                      "during the warm start's %V of slot %ui, whose content "
                      "is unknown now", ctx->key_len, ctx->key,
                      ngx_http_llama_session_call_name(ctx->job->call),
                      ctx->job->slot);

    } else if (state == NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN
               && ctx->job->state == NGX_HTTP_LLAMA_SESSION_ST_LOAD)
    {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: the request of session \"%*s\" ended "
                      "during a %s of slot %ui, whose content is unknown now",
                      ctx->key_len, ctx->key,
                      ctx->job->load_file ? "restore" : "erase",
                      ctx->job->slot);
    }

    ngx_http_llama_session_release(ctx->zone, ctx->job, state);
    ngx_http_llama_session_wake_local();
}
