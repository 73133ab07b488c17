
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The slot job: what every caller (a client's request, the management
 * API, the idle saver, the router's switch) does to one slot, and the one
 * way it talks to llama-server, the slot calls of slots.c: subrequests to
 * the slots location (llama_session_slots_uri), with its proxy_pass, TLS,
 * keepalive and proxy_set_header Authorization.
 *
 * Work that no client asked for (an idle save) runs in a request of the
 * module's own: a connection with no client behind it (its descriptor is
 * /dev/null's, nothing is ever read from it or written to it, as the
 * slot calls' replies are captured by slots.c) and a main request in the
 * server and location of the zone's first "llama_session" (or
 * "llama_session_api") location.  Its pool's cleanup ends the job, however
 * the request ends.
 *
 * A job's states (ctx->state) and what each may touch:
 *
 *   state     slot held   call in flight          may change
 *   BODY      no          none                    identity (body.c)
 *   ACQUIRE   no (queue)  none                    ticket, waiter, local
 *   ROUTER    yes         GET /models, /props,    victim, switch_seq,
 *                         POST /models/(un)load   routed, model_reset
 *   PROPS     yes or no   GET /props, /v1/models  the zone's fingerprint
 *   CHECK     yes         GET /slots              slot_tokens, slot_task,
 *                                                 slots_checked, restarted
 *   PAUSE     yes         none (a timer)          delay, polls
 *   SAVE      yes         POST ?action=save       out_key's file (.tmp)
 *   LOAD      yes         POST ?action=restore    the slot: unknown until
 *                         or erase                it answers
 *   WARM      yes         restore, erase, prime,  base_*, warm_step
 *                         save of a base (warm.c)
 *   PROXY     yes         none: proxy_pass runs   reply scan (reply.c)
 *   DONE      no          none                    nothing
 *   OLLAMA    no          GET /v1/models          ollama.c's reply
 *
 * The end of a job gives the slot back with what it holds decided from
 * its state (ngx_http_llama_session_finish() for a request, the idle
 * saver's end for its own).
 */


#include "ngx_http_llama_session_module.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_metrics.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_slots.h"
#include "ngx_http_llama_session_store.h"


#define NGX_HTTP_LLAMA_SESSION_REPLY_MAX  (4 * 1024 * 1024)


static ngx_int_t ngx_http_llama_session_call_done(ngx_http_request_t *sr,
    void *data, ngx_int_t rc);
static ngx_int_t ngx_http_llama_session_capture_filter(ngx_http_request_t *r,
    ngx_chain_t *in);
static ngx_int_t ngx_http_llama_session_capture_append(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, u_char *data, size_t size);
static u_char *ngx_http_llama_session_job_log(ngx_log_t *log, u_char *buf,
    size_t len);
static void ngx_http_llama_session_job_wake(ngx_event_t *ev);
static void ngx_http_llama_session_job_event(ngx_event_t *ev);


static char  *ngx_http_llama_session_state_names[] = {
    "body", "acquire", "router", "props", "check", "pause", "save", "load",
    "warm", "proxy", "done", "ollama"
};


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
      ngx_null_string, ngx_null_string, NGX_HTTP_POST }
};


/* a slot call's name, for the log and the client's error */

ngx_str_t *
ngx_http_llama_session_call_name(ngx_uint_t call)
{
    return &ngx_http_llama_session_calls[call].name;
}


/* requests of this worker that wait for a slot, woken on a local release */

static ngx_queue_t  ngx_http_llama_session_waiting = {
    &ngx_http_llama_session_waiting, &ngx_http_llama_session_waiting
};


/* every change of a job's state goes through here, for the debug log */

void
ngx_http_llama_session_job_state(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state)
{
    ngx_log_debug6(NGX_LOG_DEBUG_HTTP,
                   ctx->request ? ctx->request->connection->log
                                : ngx_cycle->log, 0,
                   "llama_session: job of \"%*s\" on slot %ui: %s -> %s%s",
                   ctx->key_len ? ctx->key_len : ctx->out_len,
                   ctx->key_len ? ctx->key : ctx->out_key, ctx->slot,
                   ngx_http_llama_session_state_names[ctx->state],
                   ngx_http_llama_session_state_names[state],
                   ctx->own ? " (the module's own request)" : "");

    ctx->state = state;
}


/*
 * What GET /slots said of the job's slot, decided once for every caller.
 * Sets slot_tokens (-1: the slot never ran a task, what it holds is not
 * proven), slot_task and slots_checked, and logs a restart.
 */

ngx_uint_t
ngx_http_llama_session_slots_verdict(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t   rc;
    ngx_uint_t  processing;

    ctx->slots_checked = 0;

    if (ctx->call_status == NGX_HTTP_BAD_REQUEST && ctx->zone->model.len) {
        /* router mode: the model is not running (it went, or failed) */
        return NGX_HTTP_LLAMA_SESSION_SLOTS_MODEL_GONE;
    }

    if (ctx->call_status == NGX_HTTP_NOT_IMPLEMENTED) {
        /* --no-slots: nothing can be looked at, nor vouched for */
        ctx->slot_tokens = -1;
        return NGX_HTTP_LLAMA_SESSION_SLOTS_NO_API;
    }

    if (ctx->call_status != NGX_HTTP_OK) {
        return NGX_HTTP_LLAMA_SESSION_SLOTS_ERROR;
    }

    processing = 0;

    rc = ngx_http_llama_session_parse_slots(log, ctx, &processing);

    if (rc == NGX_DECLINED) {
        /* no such slot now: llama-server came back with fewer */
        return NGX_HTTP_LLAMA_SESSION_SLOTS_RESTARTED;
    }

    if (rc != NGX_OK) {
        return NGX_HTTP_LLAMA_SESSION_SLOTS_ERROR;
    }

    if (processing) {
        /* a task runs there (a client that left mid-stream, say) */
        return NGX_HTTP_LLAMA_SESSION_SLOTS_BUSY;
    }

    if (ngx_http_llama_session_slot_task(ctx, ctx->slot_task)) {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: llama-server restarted (slot %ui shows "
                      "task %i), the slot no longer holds \"%*s\" (zone "
                      "\"%V\")", ctx->slot, ctx->slot_task,
                      ctx->out_len ? ctx->out_len : 1,
                      ctx->out_len ? ctx->out_key : (u_char *) "-",
                      &ctx->zone->name);

        return NGX_HTTP_LLAMA_SESSION_SLOTS_RESTARTED;
    }

    ctx->slots_checked = 1;

    return NGX_HTTP_LLAMA_SESSION_SLOTS_IDLE;
}


/*
 * The slot no longer holds what the zone thought (llama-server restarted,
 * the router's model went): no hit after all, nothing to save, and the
 * session comes back from its file.
 */

void
ngx_http_llama_session_slot_lost(ngx_http_llama_session_ctx_t *ctx)
{
    if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_HIT) {
        ctx->verify = 0;
        ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_NONE;
        ctx->swapped = 1;
        ctx->swap_start = ngx_current_msec;
    }

    ctx->restarted = 1;
    ctx->save_pending = 0;
    ctx->out_len = 0;
}


/*
 * May the slot be saved?  Only after a GET /slots in the same hold of the
 * slot showed it idle, holding tokens, and llama-server not restarted:
 * else the state may be empty, or another session's.
 */

ngx_uint_t
ngx_http_llama_session_may_save(ngx_http_llama_session_ctx_t *ctx)
{
    return ctx->save_pending && ctx->slots_checked && ctx->slot_tokens > 0
           && !ctx->restarted;
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
    size_t                              blen;
    ngx_str_t                           uri, *args, *model;
    ngx_buf_t                          *b;
    ngx_chain_t                        *cl;
    ngx_table_elt_t                    *h;
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

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_PRIME) {
        p = ngx_sprintf(uri.data, ctx->anthropic ? "%V/v1/messages"
                                  : "%V/v1/chat/completions",
                        &llcf->slots_uri);

    } else if (c->path.len) {
        p = ngx_sprintf(uri.data, "%V%V", &llcf->slots_uri, &c->path);

    } else {
        p = ngx_sprintf(uri.data, "%V/slots/%ui", &llcf->slots_uri,
                        ctx->slot);
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
            model = &ctx->victim->model;
        }
    }

    ctx->call_uri = uri;

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

        blen = sizeof("{\"filename\":\"..bin\"}") - 1 + len
               + NGX_HTTP_LLAMA_SESSION_FP_LEN
               + sizeof(",\"model\":\"\"") + NGX_HTTP_LLAMA_SESSION_MODEL_SHOW;

        if (call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE && ctx->zone->store.len) {
            blen += sizeof(".tmp") - 1;
        }

        b = ngx_create_temp_buf(r->pool, blen);
        if (b == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        if (model
            && (call == NGX_HTTP_LLAMA_SESSION_CALL_ERASE
                || call == NGX_HTTP_LLAMA_SESSION_CALL_LOAD
                || call == NGX_HTTP_LLAMA_SESSION_CALL_UNLOAD))
        {
            /* the model's name has no character to escape (module.c) */
            b->last = ngx_sprintf(b->last, "{\"model\":\"%V\"}", model);

        } else if (call == NGX_HTTP_LLAMA_SESSION_CALL_ERASE) {
            b->last = ngx_cpymem(b->last, "{}", 2);

        } else if (call == NGX_HTTP_LLAMA_SESSION_CALL_PRIME) {
            /* warm.c made it */
            b = ctx->call_body;
            ctx->call_body = NULL;

        } else {
            /* the key has only [A-Za-z0-9_-] in it (and "@" in router mode) */

            b->last = ngx_sprintf(b->last,
                                  "{\"filename\":\"%*s.%*s.bin%s\"",
                                  len, key,
                                  (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN,
                                  ctx->fp,
                                  (call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE
                                   && ctx->zone->store.len)
                                  ? ".tmp" : "");

            if (model) {
                b->last = ngx_sprintf(b->last, ",\"model\":\"%V\"", model);
            }

            *b->last++ = '}';
        }

        b->last_buf = 1;
        b->last_in_chain = 1;

        cl = ngx_alloc_chain_link(r->pool);
        if (cl == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cl->buf = b;
        cl->next = NULL;

        rb->bufs = cl;
        sr->headers_in.content_length_n = b->last - b->pos;

        h = ngx_list_push(&sr->headers_in.headers);
        if (h == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        ngx_str_set(&h->key, "Content-Type");
        ngx_str_set(&h->value, "application/json");
        h->lowcase_key = (u_char *) "content-type";
        h->hash = ngx_hash_key(h->lowcase_key, h->key.len);
#if (nginx_version >= 1023000)
        h->next = NULL;
#endif

        sr->headers_in.content_type = h;
    }

    if (ctx->own) {
        /* the module's own request: so it shows in llama-server's log */

        h = ngx_list_push(&sr->headers_in.headers);
        if (h == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        ngx_str_set(&h->key, "User-Agent");
        ngx_str_set(&h->value, "nginx-llama-session (idle save)");
        h->lowcase_key = (u_char *) "user-agent";
        h->hash = ngx_hash_key(h->lowcase_key, h->key.len);
#if (nginx_version >= 1023000)
        h->next = NULL;
#endif

        sr->headers_in.user_agent = h;
    }

    /* the reply's buffer is kept from call to call */

    if (ctx->capture) {
        ctx->capture->pos = ctx->capture->start;
        ctx->capture->last = ctx->capture->start;
    }

    ctx->call = call;
    ctx->call_done = 0;
    ctx->call_timed_out = 0;
    ctx->call_inflight = 1;
    ctx->call_status = 0;
    ctx->call_reply = NULL;

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: slot call %V?%V", &uri, args);

    return NGX_AGAIN;
}


static ngx_int_t
ngx_http_llama_session_call_done(ngx_http_request_t *sr, void *data,
    ngx_int_t rc)
{
    ngx_http_llama_session_ctx_t *ctx = data;

    if (ctx->call_done) {
        return rc;
    }

    ctx->call_done = 1;
    ctx->call_inflight = 0;

    ctx->call_reply = (ctx->capture && ctx->capture->last > ctx->capture->pos)
                      ? ctx->capture : NULL;

    if (sr->upstream) {
        /* 0: no answer from the backend (refused, reset, timed out) */
        ctx->call_status = sr->upstream->headers_in.status_n;
        ctx->call_timed_out = (ctx->call_status == 0
                               && rc == NGX_HTTP_GATEWAY_TIME_OUT);

    } else {
        /* the location does not proxy: a misconfiguration */
        ctx->call_status = sr->headers_out.status ? sr->headers_out.status
                                                  : NGX_HTTP_NOT_FOUND;
        if (ctx->call_status < NGX_HTTP_BAD_REQUEST) {
            ctx->call_status = NGX_HTTP_NOT_FOUND;
        }

        ngx_log_error(NGX_LOG_ERR, sr->connection->log, 0,
                      "llama_session: \"%V\" is not proxied to llama-server, "
                      "check llama_session_slots_uri and its location",
                      &sr->uri);
    }

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, sr->connection->log, 0,
                   "llama_session: slot call done: %i, rc %i",
                   ctx->call_status, rc);

    return rc;
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

        if (ctx && ctx->state == NGX_HTTP_LLAMA_SESSION_ST_PROXY
            && ctx->acquired && !ctx->released)
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

    if (size == 0 || ctx->call_done) {
        return NGX_OK;
    }

    b = ctx->capture;

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

        if (ctx->capture) {
            b->last = ngx_cpymem(b->last, ctx->capture->pos,
                                 ctx->capture->last - ctx->capture->pos);
        }

        ctx->capture = b;
    }

    b->last = ngx_cpymem(b->last, data, size);

    return NGX_OK;
}


/*
 * The end of a save, the same for a swap, an idle save and the API: the
 * reply must say the slot held tokens, and with store= the file must be
 * what llama-server says it wrote (it does not check its last fclose: a
 * full disk or NFS can answer 200 with a short file).  Then the file
 * takes its name and the session is recorded.  Else its previous file is
 * kept, untouched.  NGX_OK: saved.
 */

ngx_int_t
ngx_http_llama_session_save_done(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t reason, u_char *key,
    size_t len)
{
    off_t        bytes;
    double       ms;
    ngx_uint_t   tokens;
    const char  *what;

    static const char  *reasons[] = {
        "swap", "idle save", "API", "save before an unload", "base"
    };

    what = reasons[reason];
    tokens = 0;
    bytes = 0;
    ms = 0;

    if (ctx->call_status == NGX_HTTP_OK
        && ngx_http_llama_session_parse_action(log, ctx, &tokens, &bytes, &ms)
           == NGX_OK)
    {
        if (tokens == 0) {
            ngx_log_error(NGX_LOG_ERR, log, 0,
                          "llama_session: %s: llama-server saved no tokens "
                          "of session \"%*s\" from slot %ui, nothing is "
                          "kept of it", what, len, key, ctx->slot);

        } else if (ngx_http_llama_session_store_commit(log, ctx, key, len,
                                                       bytes)
                   == NGX_OK)
        {
            if (key == ctx->out_key) {
                ctx->saved_tokens = tokens;
                ctx->saved_bytes = bytes;
                ctx->save_ms = ms;

            } else {
                ctx->base_tokens = tokens;
                ctx->base_bytes = bytes;
                ctx->base_ms = ms;
            }

            ngx_http_llama_session_store_saved(log, ctx, key, len, tokens,
                                            bytes);
            ngx_http_llama_session_save_stat(ctx->zone, reason, 1, bytes, ms);

            return NGX_OK;
        }
    }

    if (ctx->zone->store.len == 0 && ctx->call_status == NGX_HTTP_OK) {
        /* llama-server wrote over the file itself: it cannot be trusted */
        ngx_http_llama_session_file_saved(ctx, key, len, 0, 0, 0);
    }

    ngx_http_llama_session_store_drop_tmp(log, ctx, key, len);

    ngx_http_llama_session_stat(ctx, &ctx->zone->sh->stats.save_errors);
    ngx_http_llama_session_save_stat(ctx->zone, reason, 0, 0, 0);

    ngx_log_error(NGX_LOG_ERR, log, 0,
                  "llama_session: %s: saving session \"%*s\" from slot %ui "
                  "failed (%i: \"%*s\"), its previous file is kept and its "
                  "latest turns are lost", what,
                  len, key, ctx->slot, ctx->call_status,
                  ctx->call_reply
                  ? ngx_min(ctx->call_reply->last - ctx->call_reply->pos, 200)
                  : 0,
                  ctx->call_reply ? ctx->call_reply->pos : (u_char *) "");

    return NGX_ERROR;
}


/*
 * The fingerprint's two calls, for the request path and the API alike:
 * once GET /props answered, GET /v1/models; once that answered, the
 * fingerprint is set.  NGX_AGAIN: the next call is on its way; NGX_OK:
 * known; NGX_ERROR: the backend failed the call in ctx->call; else an
 * HTTP status to end with.
 */

ngx_int_t
ngx_http_llama_session_learn(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    if (ctx->call == NGX_HTTP_LLAMA_SESSION_CALL_PROPS) {

        if (ctx->call_status != NGX_HTTP_OK
            || ngx_http_llama_session_parse_props(r, ctx) != NGX_OK)
        {
            return NGX_ERROR;
        }

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_MODELS,
                                           NULL, 0);
    }

    if (ctx->call_status == 0
        || ngx_http_llama_session_parse_models(r, ctx) != NGX_OK)
    {
        return NGX_ERROR;
    }

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
 *   a restore or an erase             anything: unknown
 *   proxying                          this session, unless the backend
 *                                     failed or vanished: unknown
 */

void
ngx_http_llama_session_job_finish(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t           state;
    ngx_http_request_t  *r;

    if (!ctx->acquired || ctx->released) {
        return;
    }

    r = ctx->request;
    state = NGX_HTTP_LLAMA_SESSION_SLOT_SESSION;

    switch (ctx->state) {

    case NGX_HTTP_LLAMA_SESSION_ST_SAVE:

        if (ctx->zone->store.len == 0) {
            /* llama-server writes over the session's file itself */
            ngx_http_llama_session_file_saved(ctx, ctx->out_key, ctx->out_len,
                                              0, 0, 0);

        } else {
            ngx_http_llama_session_store_drop_tmp(r->connection->log, ctx,
                                                  ctx->out_key, ctx->out_len);
        }

        break;

    case NGX_HTTP_LLAMA_SESSION_ST_LOAD:
        state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        break;

    case NGX_HTTP_LLAMA_SESSION_ST_WARM:
        state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;

        if (ctx->warm_step == NGX_HTTP_LLAMA_SESSION_WARM_SAVE) {
            if (ctx->zone->store.len == 0) {
                ngx_http_llama_session_file_saved(ctx, ctx->base_key,
                                                  ctx->base_len, 0, 0, 0);

            } else {
                ngx_http_llama_session_store_drop_tmp(r->connection->log,
                                                      ctx, ctx->base_key,
                                                      ctx->base_len);
            }

        } else if (ctx->warm_step == NGX_HTTP_LLAMA_SESSION_WARM_PRIME) {
            /* llama-server may still run the prime, as any completion */
            ctx->quarantine = 1;
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
            ctx->quarantine = 1;
        }

        break;

    default:
        break;
    }

    ngx_log_debug5(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: session \"%*s\" releases slot %ui "
                   "at stage %ui (%ui)", ctx->key_len, ctx->key, ctx->slot,
                   ctx->state, state);

    if (ctx->state == NGX_HTTP_LLAMA_SESSION_ST_WARM) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: the request of session \"%*s\" ended "
                      "during the warm start's %V of slot %ui, whose content "
                      "is unknown now", ctx->key_len, ctx->key,
                      ngx_http_llama_session_call_name(ctx->call),
                      ctx->slot);

    } else if (state == NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN
               && ctx->state == NGX_HTTP_LLAMA_SESSION_ST_LOAD)
    {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: the request of session \"%*s\" ended "
                      "during a %s of slot %ui, whose content is unknown now",
                      ctx->key_len, ctx->key,
                      ctx->load_file ? "restore" : "erase", ctx->slot);
    }

    ngx_http_llama_session_release(ctx, state);
    ngx_http_llama_session_wake_local();
}


/*
 * A request of the module's own in the zone's first location, for a job
 * no client asked for; NULL when it cannot be made (logged).  The caller
 * sets its context and its pool cleanup, which ends the job, and resumes
 * in write_event_handler after each slot call, as a client's request.
 */

ngx_http_request_t *
ngx_http_llama_session_job_request(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    ngx_fd_t                    fd;
    ngx_log_t                  *clog;
    ngx_pool_t                 *pool;
    ngx_connection_t           *c;
    struct sockaddr_in         *sin;
    ngx_http_request_t         *r;
    ngx_http_log_ctx_t         *lctx;
    ngx_http_conf_ctx_t        *cctx;
    ngx_http_core_main_conf_t  *cmcf;

    cctx = zone->conf_ctx;

    if (cctx == NULL) {
        return NULL;
    }

    /* a descriptor the connection can close as any other */

    fd = ngx_open_file("/dev/null", NGX_FILE_RDWR, NGX_FILE_OPEN, 0);

    if (fd == NGX_INVALID_FILE) {
        ngx_log_error(NGX_LOG_ALERT, log, ngx_errno,
                      ngx_open_file_n " \"/dev/null\" failed");
        return NULL;
    }

    c = ngx_get_connection((ngx_socket_t) fd, log);
    if (c == NULL) {
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: no free connection for the module's "
                      "own request of zone \"%V\": raise worker_connections",
                      &zone->name);
        (void) ngx_close_file(fd);
        return NULL;
    }

    c->pool = ngx_create_pool(1024, log);
    if (c->pool == NULL) {
        goto failed;
    }

    clog = ngx_palloc(c->pool, sizeof(ngx_log_t));
    lctx = ngx_pcalloc(c->pool, sizeof(ngx_http_log_ctx_t));
    sin = ngx_pcalloc(c->pool, sizeof(struct sockaddr_in));

    if (clog == NULL || lctx == NULL || sin == NULL) {
        goto failed;
    }

    *clog = *log;
    clog->connection = ngx_atomic_fetch_add(ngx_connection_counter, 1);
    clog->data = lctx;
    clog->handler = ngx_http_llama_session_job_log;
    clog->action = NULL;

    c->number = clog->connection;
    c->log = clog;
    c->read->log = clog;
    c->write->log = clog;
    c->log_error = NGX_ERROR_INFO;

    /*
     * the upstream module arms the client connection's events (to see a
     * client leave, to write): these count as armed, never fire, and
     * nothing is ever read from the descriptor or written to it
     */
    c->read->active = 1;
    c->write->active = 1;
    c->write->ready = 1;
    c->read->handler = ngx_http_llama_session_job_event;
    c->write->handler = ngx_http_llama_session_job_event;
    c->tcp_nodelay = NGX_TCP_NODELAY_DISABLED;
    c->tcp_nopush = NGX_TCP_NOPUSH_DISABLED;

    c->recv = ngx_recv;
    c->send = ngx_send;
    c->recv_chain = ngx_recv_chain;
    c->send_chain = ngx_send_chain;

    /* the module itself, on this machine, for $remote_addr and the like */

    sin->sin_family = AF_INET;
    sin->sin_addr.s_addr = htonl(INADDR_LOOPBACK);

    c->sockaddr = (struct sockaddr *) sin;
    c->socklen = sizeof(struct sockaddr_in);
    c->local_sockaddr = (struct sockaddr *) sin;
    c->local_socklen = sizeof(struct sockaddr_in);
    ngx_str_set(&c->addr_text, "127.0.0.1");

    pool = ngx_create_pool(4096, clog);
    if (pool == NULL) {
        goto failed;
    }

    r = ngx_pcalloc(pool, sizeof(ngx_http_request_t));
    if (r == NULL) {
        ngx_destroy_pool(pool);
        goto failed;
    }

    r->pool = pool;
    r->connection = c;
    r->signature = NGX_HTTP_MODULE;
    r->main = r;
    r->count = 1;

    r->main_conf = cctx->main_conf;
    r->srv_conf = cctx->srv_conf;
    r->loc_conf = cctx->loc_conf;

    r->ctx = ngx_pcalloc(pool, sizeof(void *) * ngx_http_max_module);
    if (r->ctx == NULL) {
        goto failed_request;
    }

    cmcf = ngx_http_get_module_main_conf(r, ngx_http_core_module);

    r->variables = ngx_pcalloc(pool, cmcf->variables.nelts
                                     * sizeof(ngx_http_variable_value_t));
    if (r->variables == NULL) {
        goto failed_request;
    }

    if (ngx_list_init(&r->headers_in.headers, pool, 2,
                      sizeof(ngx_table_elt_t))
        != NGX_OK
        || ngx_list_init(&r->headers_out.headers, pool, 2,
                         sizeof(ngx_table_elt_t))
           != NGX_OK)
    {
        goto failed_request;
    }

#if (nginx_version >= 1013002)
    if (ngx_list_init(&r->headers_out.trailers, pool, 1,
                      sizeof(ngx_table_elt_t))
        != NGX_OK)
    {
        goto failed_request;
    }
#endif

    r->headers_in.content_length_n = 0;
    r->headers_in.keep_alive_n = -1;
    r->headers_out.content_length_n = -1;
    r->headers_out.last_modified_time = -1;

    r->method = NGX_HTTP_GET;
    ngx_str_set(&r->method_name, "GET");
    ngx_str_set(&r->http_protocol, "HTTP/1.1");
    r->http_version = NGX_HTTP_VERSION_11;
    ngx_str_set(&r->uri, "/");
    ngx_str_set(&r->request_line, "(llama_session's own request)");

    r->start_sec = ngx_time();
    r->start_msec = ngx_current_msec;

    r->uri_changes = NGX_HTTP_MAX_URI_CHANGES + 1;
    r->subrequests = NGX_HTTP_MAX_SUBREQUESTS + 1;
    r->http_state = NGX_HTTP_PROCESS_REQUEST_STATE;

    /* no access log line: the slot calls are the work, not this request */
    r->logged = 1;

    r->read_event_handler = ngx_http_block_reading;
    r->write_event_handler = ngx_http_request_empty_handler;

    lctx->connection = c;
    lctx->request = r;
    lctx->current_request = r;

    c->data = r;
    c->requests++;

#if (NGX_STAT_STUB)
    /* ngx_http_close_connection() counts it out */
    (void) ngx_atomic_fetch_add(ngx_stat_active, 1);
#endif

    return r;

failed_request:

    ngx_destroy_pool(pool);

failed:

    ngx_log_error(NGX_LOG_ERR, log, 0,
                  "llama_session: the module's own request of zone \"%V\" "
                  "could not be made", &zone->name);

    c->read->active = 0;
    c->write->active = 0;

    if (c->pool) {
        ngx_destroy_pool(c->pool);
    }

    ngx_close_connection(c);

    return NULL;
}


/* runs the slot calls the module's own request has started */

void
ngx_http_llama_session_job_run(ngx_http_request_t *r)
{
    ngx_http_run_posted_requests(r->connection);
}


/*
 * The end of the module's own request: its pool's cleanup runs (and ends
 * the job), then the connection goes, as nginx closes a request.
 */

void
ngx_http_llama_session_job_close(ngx_http_request_t *r)
{
    ngx_connection_t  *c;

    c = r->connection;

    /* counted armed for the upstream module, never added to the events */
    c->read->active = 0;
    c->write->active = 0;

    ngx_http_free_request(r, 0);
    ngx_http_close_connection(c);
}


/* the events of the module's own connection never fire */

static void
ngx_http_llama_session_job_event(ngx_event_t *ev)
{
    ngx_log_debug0(NGX_LOG_DEBUG_HTTP, ev->log, 0,
                   "llama_session: an event of the module's own connection");
}


/* ", while saving ..." in the error log lines of the module's request */

static u_char *
ngx_http_llama_session_job_log(ngx_log_t *log, u_char *buf, size_t len)
{
    u_char                        *p;
    ngx_http_request_t            *r, *sr;
    ngx_http_log_ctx_t            *lctx;
    ngx_http_llama_session_ctx_t  *ctx;

    p = buf;

    if (log->action) {
        p = ngx_snprintf(p, len, " while %s", log->action);
        len -= p - buf;
        buf = p;
    }

    lctx = log->data;
    r = lctx->request;

    if (r == NULL) {
        return p;
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx) {
        p = ngx_snprintf(buf, len, ", the module's own request for slot %ui "
                         "of zone \"%V\"", ctx->slot, &ctx->zone->name);
        len -= p - buf;
        buf = p;
    }

    sr = lctx->current_request;

    if (sr && sr != r) {
        p = ngx_snprintf(buf, len, ", subrequest: \"%V\"", &sr->uri);
    }

    return p;
}


/* a client's request sleeps; a client that leaves ends it (499) */

ngx_int_t
ngx_http_llama_session_sleep(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_msec_t delay)
{
    r->read_event_handler = ngx_http_test_reading;
    r->write_event_handler = ngx_http_core_run_phases;

    ngx_add_timer(&ctx->wait_ev, delay ? delay : 1);

    return NGX_AGAIN;
}


/* a job's timer and the wake-up on a local release */

void
ngx_http_llama_session_job_timer(ngx_http_llama_session_ctx_t *ctx)
{
    ctx->wait_ev.handler = ngx_http_llama_session_job_wake;
    ctx->wait_ev.data = ctx->request;
    ctx->wait_ev.log = ctx->request->connection->log;
}


static void
ngx_http_llama_session_job_wake(ngx_event_t *ev)
{
    ngx_connection_t    *c;
    ngx_http_request_t  *r;

    r = ev->data;
    c = r->connection;

    if (ev->timer_set) {
        ngx_del_timer(ev);
    }

    if (ev->posted) {
        ngx_delete_posted_event(ev);
    }

    ngx_http_set_log_request(c->log, r);

    r->write_event_handler(r);

    ngx_http_run_posted_requests(c);
}


void
ngx_http_llama_session_wait_local(ngx_http_llama_session_ctx_t *ctx)
{
    if (ctx->local.next == NULL) {
        ngx_queue_insert_tail(&ngx_http_llama_session_waiting, &ctx->local);
    }
}


void
ngx_http_llama_session_wait_end(ngx_http_llama_session_ctx_t *ctx)
{
    if (ctx->local.next) {
        ngx_queue_remove(&ctx->local);
        ctx->local.next = NULL;
    }
}


void
ngx_http_llama_session_wake_local(void)
{
    ngx_queue_t                   *q;
    ngx_http_llama_session_ctx_t  *ctx;

    for (q = ngx_queue_head(&ngx_http_llama_session_waiting);
         q != ngx_queue_sentinel(&ngx_http_llama_session_waiting);
         q = ngx_queue_next(q))
    {
        ctx = ngx_queue_data(q, ngx_http_llama_session_ctx_t, local);

        if (!ctx->wait_ev.posted) {
            ngx_post_event(&ctx->wait_ev, &ngx_posted_events);
        }
    }
}
