
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The request's way through the module, in the precontent phase (after all
 * of nginx's access control):
 *
 *   read the body -> find the session -> wait for the slot (FIFO, timers)
 *   -> if the slot holds another session: GET /slots, save it, restore ours
 *      (or erase) through subrequests -> let proxy_pass carry the request
 *   -> give the slot back when the request's pool goes (any end).
 *
 * The handler is re-entered by ngx_http_core_run_phases() after the body,
 * after each timer and after each subrequest; ctx->job->state says where it is.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_cost.h"
#include "ngx_http_llama_session_dialect.h"
#include "ngx_http_llama_session_error.h"
#include "ngx_http_llama_session_handler.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_metrics.h"
#include "ngx_http_llama_session_ollama.h"
#include "ngx_http_llama_session_pin.h"
#include "ngx_http_llama_session_ram.h"
#include "ngx_http_llama_session_reprime.h"
#include "ngx_http_llama_session_router.h"
#include "ngx_http_llama_session_index.h"
#include "ngx_http_llama_session_io.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_slots.h"
#include "ngx_http_llama_session_told.h"
#include "ngx_http_llama_session_store.h"
#include "ngx_http_llama_session_warm.h"


#define NGX_HTTP_LLAMA_SESSION_POLL_MIN    2
#define NGX_HTTP_LLAMA_SESSION_POLL_MAX    20

/*
 * while llama-server still runs the slot: GET /slots again after 25 ms,
 * doubling up to 1 s (each poll is a subrequest in the request's pool)
 */
#define NGX_HTTP_LLAMA_SESSION_BUSY_MIN    25
#define NGX_HTTP_LLAMA_SESSION_BUSY_MAX    1000


static ngx_int_t ngx_http_llama_session_start(ngx_http_request_t *r,
    ngx_http_llama_session_loc_conf_t *llcf);
static ngx_int_t ngx_http_llama_session_read(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t state);
static void ngx_http_llama_session_body_handler(ngx_http_request_t *r);
static ngx_int_t ngx_http_llama_session_wait(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_props(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_hit(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_files(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_checked(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_ram_next(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_saved(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_load(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_loaded(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_pinned(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_look(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t next);
static ngx_int_t ngx_http_llama_session_plan(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_proxy(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static void ngx_http_llama_session_cleanup(void *data);
static ngx_int_t ngx_http_llama_session_subrequest(ngx_http_request_t *r);
static void ngx_http_llama_session_drop_headers(ngx_http_request_t *r);




ngx_int_t
ngx_http_llama_session_handler(ngx_http_request_t *r)
{
    ngx_int_t                           rc;
    ngx_uint_t                          status;
    ngx_http_llama_session_ctx_t       *ctx;
    ngx_http_llama_session_loc_conf_t  *llcf;

    if (r != r->main) {
        return ngx_http_llama_session_subrequest(r);
    }

    ctx = ngx_http_llama_session_get_ctx(r);

    if (ctx == NULL) {
        llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

        if (!llcf->enable) {
            return NGX_DECLINED;
        }

        return ngx_http_llama_session_start(r, llcf);
    }

    switch (ctx->job->state) {

    case NGX_HTTP_LLAMA_SESSION_ST_BODY:
        return NGX_DONE;

    case NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE:
        if (ctx->job->wait_ev.timer_set || ctx->job->wait_ev.posted) {
            return NGX_AGAIN;
        }

        return ngx_http_llama_session_wait(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_ST_ROUTER:
        if (ctx->job->wait_ev.timer_set || ctx->job->wait_ev.posted
            || (ctx->job->call != NGX_HTTP_LLAMA_SESSION_CALL_NONE
                && !ctx->job->call_done))
        {
            return NGX_AGAIN;
        }

        rc = ngx_http_llama_session_routed(r, ctx);

        /* NGX_OK: the model is up, the swap goes on */
        return (rc == NGX_OK) ? ngx_http_llama_session_plan(r, ctx) : rc;

    case NGX_HTTP_LLAMA_SESSION_ST_PROPS:
        if (!ctx->job->call_done) {
            return NGX_AGAIN;
        }

        return ngx_http_llama_session_props(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_ST_TURN:
        if (ngx_http_llama_session_io_pending(ctx->job->io,
                                              &ctx->job->wait_ev))
        {
            return NGX_AGAIN;
        }

        /* the turn file read (reprime.c), or its bound passed */
        return ngx_http_llama_session_save(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_ST_LOOK:
        if (ngx_http_llama_session_io_pending(ctx->job->io,
                                              &ctx->job->wait_ev))
        {
            return NGX_AGAIN;
        }

        /* done, or its store_timeout= passed */
        ngx_http_llama_session_store_looked(r, ctx);

        return (ctx->job->look_next == NGX_HTTP_LLAMA_SESSION_ST_PROPS)
               ? ngx_http_llama_session_files(r, ctx)
               : ngx_http_llama_session_plan(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_ST_CHECK:
        if (!ctx->job->call_done) {
            return NGX_AGAIN;
        }

        return ngx_http_llama_session_checked(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_ST_PAUSE:
        if (ctx->job->wait_ev.timer_set || ctx->job->wait_ev.posted) {
            return NGX_AGAIN;
        }

        /* after a pause while the backend still ran the slot */
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_CHECK);

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_GET,
                                           NULL, 0);

    case NGX_HTTP_LLAMA_SESSION_ST_REPRIME:
        if (!ctx->job->call_done) {
            return NGX_AGAIN;
        }

        return ngx_http_llama_session_reprime_next(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_ST_SAVE:
        if (!ctx->job->call_done
            || ngx_http_llama_session_io_pending(ctx->job->io,
                                                 &ctx->job->wait_ev))
        {
            /* the save, then its commit in a thread (store_commit()) */
            return NGX_AGAIN;
        }

        return ngx_http_llama_session_saved(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_ST_LOAD:
        if (!ctx->job->call_done) {
            return NGX_AGAIN;
        }

        return ngx_http_llama_session_loaded(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_ST_WARM:
        if (!ctx->job->call_done
            || ngx_http_llama_session_io_pending(ctx->job->io,
                                                 &ctx->job->wait_ev))
        {
            /* a call, or the base's commit in a thread (store_commit()) */
            return NGX_AGAIN;
        }

        rc = ngx_http_llama_session_warm_done(r, ctx);

        /* NGX_OK: the warm start is over, the slot is ready */
        return (rc == NGX_OK) ? ngx_http_llama_session_proxy(r, ctx) : rc;

    case NGX_HTTP_LLAMA_SESSION_ST_PROXY:
        return NGX_DECLINED;

    case NGX_HTTP_LLAMA_SESSION_ST_BIND:
        rc = ngx_http_llama_session_route_bind(r, ctx);

        if (rc != NGX_OK) {
            return rc;
        }

        /* the model's zone: its slot next */
        ngx_http_llama_session_job_state(ctx,
                                         NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);

        return ngx_http_llama_session_wait(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_ST_OLLAMA:
        if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_NONE) {
            /* the body is in */
            return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_MODELS,
                                           NULL, 0);
        }

        if (!ctx->job->call_done) {
            return NGX_AGAIN;
        }

        return ngx_http_llama_session_ollama_info(r, ctx);

    default: /* NGX_HTTP_LLAMA_SESSION_ST_DONE */

        if (ctx->fail_status) {
            status = ctx->fail_status;
            ctx->fail_status = 0;

            return ngx_http_llama_session_error(r, ctx, status,
                                                ctx->fail_type,
                                                ctx->fail_message, 0);
        }

        return ctx->status ? ctx->status : NGX_DECLINED;
    }
}


/*
 * A subrequest in a location with llama_session: the module's own slot
 * calls pass; any other (SSI, mirror, addition, njs) that would run an
 * inference is refused, as it would bypass the slot's queue.
 */

static ngx_int_t
ngx_http_llama_session_subrequest(ngx_http_request_t *r)
{
    ngx_http_llama_session_ctx_t        ctx;
    ngx_http_llama_session_loc_conf_t  *llcf;

    if (ngx_http_llama_session_own_call(r)) {
        return NGX_DECLINED;
    }

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    if (!llcf->enable) {
        return NGX_DECLINED;
    }

    ngx_memzero(&ctx, sizeof(ngx_http_llama_session_ctx_t));

    /*
     * any POST: a subrequest's URI need not be the one proxy_pass sends
     * (a mirror to "location /m { proxy_pass .../v1/chat/completions; }")
     */

    if (r->method != NGX_HTTP_POST
        && !ngx_http_llama_session_uses_slot(r, &ctx) && !ctx.refuse)
    {
        ngx_http_llama_session_drop_headers(r);
        return NGX_DECLINED;
    }

    if (llcf->zone) {
        ngx_http_llama_session_stat(&llcf->zone->sh->stats.refused);
    }

    ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                  "llama_session: refused a subrequest to \"%V\": "
                  "inference goes through the slot's queue, only main "
                  "requests may take it", &r->uri);

    return NGX_HTTP_FORBIDDEN;
}


/*
 * Request headers that llama-server gives a meaning of its own never reach
 * it: X-Conversation-Id keys a replayable stream (any client could read or
 * cancel another's generation with it, and the generation would keep the
 * slot after its client left).  The list is copied without them; the
 * pointers of r->headers_in stay valid.
 */

static void
ngx_http_llama_session_drop_headers(ngx_http_request_t *r)
{
    ngx_uint_t        i, found;
    ngx_list_t        headers;
    ngx_list_part_t  *part;
    ngx_table_elt_t  *h, *nh;

    found = 0;

    for (part = &r->headers_in.headers.part; part; part = part->next) {
        h = part->elts;

        for (i = 0; i < part->nelts; i++) {
            if (h[i].key.len == sizeof("x-conversation-id") - 1
                && ngx_strncmp(h[i].lowcase_key, "x-conversation-id",
                               sizeof("x-conversation-id") - 1) == 0)
            {
                found = 1;
            }
        }
    }

    if (!found) {
        return;
    }

    if (ngx_list_init(&headers, r->pool, 20, sizeof(ngx_table_elt_t))
        != NGX_OK)
    {
        return;
    }

    for (part = &r->headers_in.headers.part; part; part = part->next) {
        h = part->elts;

        for (i = 0; i < part->nelts; i++) {
            if (h[i].key.len == sizeof("x-conversation-id") - 1
                && ngx_strncmp(h[i].lowcase_key, "x-conversation-id",
                               sizeof("x-conversation-id") - 1) == 0)
            {
                continue;
            }

            nh = ngx_list_push(&headers);
            if (nh == NULL) {
                return;
            }

            *nh = h[i];
        }
    }

    r->headers_in.headers = headers;
}


/* a request's context; its pool cleanup gives the slot back on any end */

ngx_http_llama_session_ctx_t *
ngx_http_llama_session_create_ctx(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone)
{
    ngx_pool_cleanup_t            *cln;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_ctx_t));
    if (ctx == NULL) {
        return NULL;
    }

    /* the parts its files own: the slot job, the warm start, the route */

    ctx->job = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_job_t));
    ctx->warm = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_warm_t));
    ctx->route = ngx_pcalloc(r->pool,
                             sizeof(ngx_http_llama_session_route_t));

    if (ctx->job == NULL || ctx->warm == NULL || ctx->route == NULL) {
        return NULL;
    }

    ctx->request = r;
    ctx->zone = zone;
    ctx->start = ngx_current_msec;
    ctx->cached = -1;           /* until the reply's end (reply.c) */
    ctx->job->log = r->connection->log;
    ctx->job->slot_tokens = -1;
    ctx->job->slot_task = -1;

    ngx_http_llama_session_job_timer(ctx);

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NULL;
    }

    cln->handler = ngx_http_llama_session_cleanup;
    cln->data = ctx;

    ngx_http_set_ctx(r, ctx, ngx_http_llama_session_module);

    return ctx;
}


static ngx_int_t
ngx_http_llama_session_start(ngx_http_request_t *r,
    ngx_http_llama_session_loc_conf_t *llcf)
{
    ngx_int_t                      rc;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = ngx_http_llama_session_create_ctx(r, llcf->zone);
    if (ctx == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ngx_http_set_ctx(r, ctx, ngx_http_llama_session_module);

    /* a client's: its use of a slot is the slot's last use */
    ctx->job->client = 1;

    /* the API it speaks, once: the core asks its row from here on */

    ctx->dialect = ngx_http_llama_session_dialect(r, llcf);

    if (llcf->ollama == 1) {
        /*
         * Ollama's API: its inference requests go the session's way; what
         * it answers itself ends the request (ctx is not touched after)
         */

        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_DONE);
        ctx->status = NGX_DONE;

        rc = ngx_http_llama_session_ollama_start(r, ctx);

        if (rc == NGX_DONE) {
            return NGX_DONE;
        }

        ctx->status = 0;

        if (rc == NGX_AGAIN) {
            /*
             * what llama-server serves: GET /v1/models, once the body is
             * read whole (a discard still running would take the
             * client's events into the slot call)
             */

            return ngx_http_llama_session_read(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_ST_OLLAMA);
        }

        if (rc != NGX_DECLINED) {
            return rc;
        }
    }

    if (llcf->zone == NULL) {
        /*
         * identity only (an edge node): the key for "hash
         * $llama_session_key consistent", the request forwarded as it
         * came, headers and body; the owner node refuses what it refuses
         */

        ctx->identity = 1;

        if (!ngx_http_llama_session_uses_slot(r, ctx)) {
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_DONE);
            ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_BYPASS;
            return NGX_DECLINED;
        }

    } else if (!ngx_http_llama_session_uses_slot(r, ctx)) {

        ngx_http_llama_session_drop_headers(r);

        if (ctx->refuse) {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "llama_session: refused a client's call to "
                          "\"%V\": %s", &r->uri, ctx->refuse_why);

            ngx_http_llama_session_stat(&ctx->zone->sh->stats.refused);

            ngx_http_llama_session_job_state(ctx,
                NGX_HTTP_LLAMA_SESSION_ST_DONE);

            if (ngx_http_discard_request_body(r) != NGX_OK) {
                ctx->status = NGX_HTTP_FORBIDDEN;
                return NGX_HTTP_FORBIDDEN;
            }

            return ngx_http_llama_session_error(r, ctx, NGX_HTTP_FORBIDDEN,
                                                "permission_error",
                                                "this endpoint is not "
                                                "available", 0);
        }

        ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_BYPASS;
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_PROXY);
        ngx_http_llama_session_stat(&ctx->zone->sh->stats.bypass);
        return NGX_DECLINED;
    }

    return ngx_http_llama_session_read(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_ST_BODY);
}


/* reads the body whole, in the given state; the body handler goes on */

static ngx_int_t
ngx_http_llama_session_read(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t state)
{
    ngx_int_t  rc;

    ctx->job->state = state;

    rc = ngx_http_read_client_request_body(r,
                                         ngx_http_llama_session_body_handler);

    if (rc >= NGX_HTTP_SPECIAL_RESPONSE) {
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_DONE);
        return rc;
    }

    ngx_http_finalize_request(r, NGX_DONE);

    return NGX_DONE;
}


static void
ngx_http_llama_session_body_handler(ngx_http_request_t *r)
{
    ngx_int_t                           rc;
    ngx_http_llama_session_ctx_t       *ctx;
    ngx_http_llama_session_loc_conf_t  *llcf;

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx->job->state == NGX_HTTP_LLAMA_SESSION_ST_BODY) {

        rc = ngx_http_llama_session_identify(r, ctx);

        if (ctx->identity) {
            /* an edge node: its owner node needs the request as it came */
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_DONE);

            if (rc == NGX_ERROR
                || ngx_http_llama_session_told_mark(r) != NGX_OK)
            {
                ctx->status = NGX_HTTP_INTERNAL_SERVER_ERROR;
            }

            r->preserve_body = 1;
            r->write_event_handler = ngx_http_core_run_phases;
            ngx_http_core_run_phases(r);
            return;
        }

        /* after identity, which may take the id from such a header */
        ngx_http_llama_session_drop_headers(r);

        if (rc == NGX_ABORT) {
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_DONE);
            ctx->fail_status = NGX_HTTP_BAD_REQUEST;
            ctx->fail_type = "invalid_request_error";
            ctx->fail_message = "the session id is too long";

        } else if (rc == NGX_DECLINED) {
            /* router mode: no zone of the location drives the model */
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_DONE);
            ctx->fail_status = NGX_HTTP_BAD_REQUEST;
            ctx->fail_type = "invalid_request_error";
            ctx->fail_message = "the request's model is not one this "
                                "server keeps sessions for";

        } else if (rc != NGX_OK) {
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_DONE);
            ctx->status = NGX_HTTP_INTERNAL_SERVER_ERROR;

        } else if (ctx->dialect->request
                   && (rc = ctx->dialect->request(r, ctx)) != NGX_OK)
        {
            /* the dialect's translation into a chat request failed */

            if (rc == NGX_DONE) {
                /* its error was sent */
                return;
            }

            ngx_http_llama_session_job_state(ctx,
                NGX_HTTP_LLAMA_SESSION_ST_DONE);
            ctx->status = NGX_HTTP_INTERNAL_SERVER_ERROR;

        } else {
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);

            /* a body in a file waits there, not in memory */
            ngx_http_llama_session_body_release(r, ctx);

            if (ctx->probe) {
                ngx_http_llama_session_stat(&ctx->zone->sh->stats.probes);
            }

            /* the wait is counted from here, after the body */
            llcf = ngx_http_get_module_loc_conf(r,
                                                ngx_http_llama_session_module);

            ctx->start = ngx_current_msec;
            ctx->deadline = ctx->start + llcf->wait_timeout;

            if (ctx->bind) {
                /* models=: the router's list says whether it has it */
                ngx_http_llama_session_job_state(ctx,
                                              NGX_HTTP_LLAMA_SESSION_ST_BIND);
            }
        }
    }

    r->preserve_body = 1;

    r->write_event_handler = ngx_http_core_run_phases;
    ngx_http_core_run_phases(r);
}


/* takes the slot, or waits for it in arrival order */

static ngx_int_t
ngx_http_llama_session_wait(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t   rc;
    ngx_msec_t  now, delay;

    if (ctx->zone->sh->nslots == 0
        || (ctx->zone->sh->total_slots == 0 && ctx->zone->model.len == 0))
    {
        /*
         * the backend's slot count first (GET /props): slots=auto takes
         * it, and a zone with more slots than llama-server has uses only
         * those it has
         */

        ctx->learn_slots = 1;
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_PROPS);

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_PROPS,
                                           NULL, 0);
    }

    if (!ctx->job->queued && ctx->zone->sh->nslots > 1
        && ctx->dialect->unpinned)
    {
        /*
         * llama-server's Anthropic and transcription conversions drop
         * "id_slot" (a transcription is a form, not JSON): the request
         * could run on any slot, on another session's cache; the module's
         * own translation of /v1/messages (llama_session_anthropic on)
         * pins it
         */

        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: zone \"%V\" has %ui slots and "
                      "llama-server cannot pin \"%V\" to one (it drops "
                      "id_slot): refused", &ctx->zone->name,
                      ctx->zone->sh->nslots, &r->uri);

        return ngx_http_llama_session_error(r, ctx,
                                  NGX_HTTP_NOT_IMPLEMENTED,
                                  "not_implemented_error",
                                  "llama-server cannot run this endpoint on "
                                  "a chosen slot; with several slots, use "
                                  "/v1/chat/completions, or "
                                  "\"llama_session_anthropic on\" for "
                                  "Anthropic clients", 0);
    }

    rc = ngx_http_llama_session_job_acquire(ctx);

    now = ngx_current_msec;

    if (rc == NGX_OK) {
        ctx->waiting = 0;
        ctx->wait_ms = now - ctx->start;

        ngx_http_llama_session_observe(&ctx->zone->sh->metrics.wait,
                                       (double) ctx->wait_ms);

        ngx_http_llama_session_wait_end(ctx->job);

        return ngx_http_llama_session_plan(r, ctx);
    }

    if (rc == NGX_DECLINED) {
        return ngx_http_llama_session_error(r, ctx,
                                  NGX_HTTP_SERVICE_UNAVAILABLE,
                                  "unavailable_error",
                                  "too many requests wait for the model, "
                                  "retry later", 1);
    }

    if ((ngx_msec_int_t) (now - ctx->deadline) >= 0) {

        ngx_http_llama_session_dequeue(ctx->zone, ctx->job);

        ngx_http_llama_session_wait_end(ctx->job);

        ctx->wait_ms = now - ctx->start;

        ngx_http_llama_session_stat(&ctx->zone->sh->stats.wait_timeouts);

        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: session \"%*s\" waited %M ms for slot "
                      "%ui of zone \"%V\" in vain", ctx->key_len, ctx->key,
                      ctx->wait_ms,
                      ctx->job->slot, &ctx->zone->name);

        return ngx_http_llama_session_error(r, ctx,
                                  NGX_HTTP_SERVICE_UNAVAILABLE,
                                  "unavailable_error",
                                  "the model is busy with other sessions, "
                                  "retry later", 1);
    }

    /* poll: quickly at first, then every NGX_HTTP_LLAMA_SESSION_POLL_MAX */

    if (!ctx->waiting) {
        ctx->waiting = 1;
        ctx->delay = NGX_HTTP_LLAMA_SESSION_POLL_MIN;

        ngx_http_llama_session_wait_local(ctx->job);

        ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "llama_session: session \"%*s\" waits, ticket %uA",
                       ctx->key_len, ctx->key, ctx->job->ticket);

    } else if (ctx->delay < NGX_HTTP_LLAMA_SESSION_POLL_MAX) {
        ctx->delay *= 2;
    }

    delay = ngx_min(ctx->delay, ctx->deadline - now);

    return ngx_http_llama_session_sleep(r, ctx, delay);
}


/*
 * A look at the store before a decision that needs it (store_look(), in a
 * thread); the request goes on in plan() or files() ("next": the state it
 * came from, ACQUIRE or PROPS) once it is done or its bound passed
 */

static ngx_int_t
ngx_http_llama_session_look(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t next)
{
    ngx_int_t  rc;

    rc = ngx_http_llama_session_store_look(r, ctx);

    if (rc == NGX_AGAIN) {
        ctx->job->look_next = next;
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_LOOK);

        r->read_event_handler = ngx_http_test_reading;
        r->write_event_handler = ngx_http_core_run_phases;
    }

    return rc;
}


/* the request holds the slot: decide what the swap needs */

static ngx_int_t
ngx_http_llama_session_plan(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t  rc;

    if (ctx->zone->model.len && !ctx->route->routed) {
        /* router mode: the model is up first, see router.c */
        return ngx_http_llama_session_route(r, ctx);
    }

    if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_HIT
        && ctx->zone->shared)
    {
        /* has another owner saved it since? the store says, in a thread */
        rc = ngx_http_llama_session_look(r, ctx,
                                         NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
        if (rc != NGX_DECLINED) {
            return rc;
        }
    }

    if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_HIT
        && ngx_http_llama_session_store_newer(r, ctx))
    {
        /*
         * shared=on: another owner served the session since this slot
         * took it in (the front sent it elsewhere a while) and saved it:
         * its file is newer than the slot, it is restored
         */

        ngx_http_llama_session_slot_stale(ctx);
        ngx_http_llama_session_stat(&ctx->zone->sh->stats.newer_hits);

    } else if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_HIT) {
        return ngx_http_llama_session_hit(r, ctx);
    }

    ctx->swap_start = ngx_current_msec;
    ctx->swapped = 1;

    /*
     * file names carry the backend's configuration: learn it after a
     * start, and whenever the slot's content is unknown (the backend may
     * have restarted with another one)
     */

    if (!ngx_http_llama_session_fingerprint(ctx->zone, ctx->job->fp)
        || ctx->job->slot_state == NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN)
    {
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_PROPS);
        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_PROPS,
                                           NULL, 0);
    }

    return ngx_http_llama_session_files(r, ctx);
}


static ngx_int_t
ngx_http_llama_session_props(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t  rc;

    rc = ngx_http_llama_session_learn(r, ctx);

    if (rc == NGX_ERROR) {
        return ngx_http_llama_session_backend_error(r, ctx,
                (char *)
                    ngx_http_llama_session_call_name(ctx->job->call)->data);
    }

    if (rc != NGX_OK) {
        return rc;
    }

    ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;

    if (ctx->learn_slots) {
        ctx->learn_slots = 0;
        ngx_http_llama_session_job_state(ctx,
           NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);

        if (ctx->zone->sh->nslots == 0 || ctx->zone->sh->total_slots == 0) {
            return ngx_http_llama_session_backend_error(r, ctx,
                                                        "GET /props");
        }

        return ngx_http_llama_session_wait(r, ctx);
    }

    if (ctx->job->slot >= ngx_http_llama_session_slots_usable(ctx->zone->sh)) {
        /*
         * llama-server came back with fewer slots than this request's:
         * it would run the request on another slot (it wraps the id)
         */

        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: llama-server no longer has slot %ui "
                      "of zone \"%V\", session \"%*s\" is not sent there",
                      ctx->job->slot, &ctx->zone->name, ctx->key_len, ctx->key);

        ngx_http_llama_session_release(ctx->zone, ctx->job,
                                       NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
        ngx_http_llama_session_wake_local();

        return ngx_http_llama_session_error(r, ctx,
                                  NGX_HTTP_SERVICE_UNAVAILABLE,
                                  "unavailable_error",
                                  "the model server has fewer slots now, "
                                  "retry", 1);
    }

    return ngx_http_llama_session_files(r, ctx);
}


/* the slot holds the session: proxied, after a check if it idled a while */

static ngx_int_t
ngx_http_llama_session_hit(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    if (!ctx->verify) {
        return ngx_http_llama_session_proxy(r, ctx);
    }

    /* the slot was idle a while: has llama-server restarted? */

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_CHECK);
    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_GET,
                                       NULL, 0);
}


/* which files the swap involves, then what the slot holds */

static ngx_int_t
ngx_http_llama_session_files(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    off_t       bytes;
    ngx_int_t   rc;
    ngx_uint_t  tokens;

    /* the session's file and its .json, in a thread */

    rc = ngx_http_llama_session_look(r, ctx, NGX_HTTP_LLAMA_SESSION_ST_PROPS);
    if (rc != NGX_DECLINED) {
        return rc;
    }

    if (!ctx->default_session) {
        ngx_http_llama_session_job_remember(ctx, ctx->key, ctx->key_len,
                                        &ctx->id);
        ctx->job->load_file = ngx_http_llama_session_store_has_file(r, ctx,
                                                      ctx->key, ctx->key_len);
    }

    if (ngx_http_llama_session_restores_off(ctx->zone, ctx->job->fp)) {
        /* restores bring nothing on this backend: neither save nor load */
        ctx->job->load_file = 0;
        ctx->job->save_pending = 0;
    }

    /*
     * a completion pinned to the slot may move what it holds to RAM (the
     * proxy, ram_leave, or a slot call that replaces it, call.c)
     */
    ctx->job->ram_leaving = (ctx->zone->ram
                             && ctx->job->slot_state
                                == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                             && ctx->job->out_len);

    if (ngx_http_llama_session_ram_swap(r, ctx)) {

        if (ctx->job->slot_recent
            && (ngx_msec_int_t) (ctx->job->quiet_until - ngx_current_msec)
               <= 0
            && ngx_http_llama_session_ram_take(ctx, 1))
        {
            /*
             * out of llama-server's RAM cache: the slot ran a request of
             * the module within a second and none runs there now (as for
             * a hit, no GET /slots, one batch wait less), and RAM keeps
             * the session that leaves it
             */
            ctx->job->save_pending = 0;
            return ngx_http_llama_session_proxy(r, ctx);
        }

        /* once GET /slots vouches (checked), saved first if need be */
        ctx->job->ram = 1;
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_CHECK);

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_GET,
                                           NULL, 0);
    }

    if (ctx->job->load_file
        && ngx_http_llama_session_file_size(ctx->zone, ctx->job->fp,
                                            ctx->key, ctx->key_len,
                                            &bytes, &tokens) == NGX_OK
        && ngx_http_llama_session_cost_reprefill(ctx, bytes, tokens,
                                                 &ctx->job->est_restore_ms,
                                                 &ctx->job->est_prefill_ms))
    {
        /* its file would take longer to read than its prompt to prefill */
        ctx->job->load_file = 0;
        ctx->job->reprefill = 1;
    }

    if (ctx->job->stale && !ctx->job->load_file) {
        /*
         * shared=on: the newer file is not to be restored after all (its
         * restore costs more, or it went): the slot's older state is a
         * prefix of the conversation, better than nothing; a hit again
         */

        ctx->job->stale = 0;
        ctx->job->reprefill = 0;
        ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_HIT;
        ctx->verify = ctx->job->stale_verify;
        ctx->swapped = 0;

        return ngx_http_llama_session_hit(r, ctx);
    }

    if (ctx->job->reprefill) {
        ngx_http_llama_session_stat(&ctx->zone->sh->stats.reprefills);
    }

    if (ctx->job->restarted) {
        /* the slot was checked already: llama-server restarted */
        return ngx_http_llama_session_load(r, ctx);
    }

    if (!ctx->job->save_pending && !ctx->job->load_file
        && ctx->job->slot_tokens == 0)
    {
        /* a known empty slot and nothing of its own to bring in */
        return ngx_http_llama_session_load(r, ctx);
    }

    /*
     * ask the backend first: the slot must be idle before a slot action
     * (llama-server parks actions on busy slots), and a save is only worth
     * it when the slot really holds tokens
     */

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_CHECK);

    return ngx_http_llama_session_call(r, ctx, NGX_HTTP_LLAMA_SESSION_CALL_GET,
                                       NULL, 0);
}


static ngx_int_t
ngx_http_llama_session_checked(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t  processing;
    ngx_msec_t  delay;

    processing = 0;

    switch (ngx_http_llama_session_slots_verdict(r->connection->log, ctx)) {

    case NGX_HTTP_LLAMA_SESSION_SLOTS_MODEL_GONE:

        if (!ctx->route->rerouted) {
            /* router mode: the model went since the router's look: again */
            ctx->route->rerouted = 1;
            ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;
            ctx->route->routed = 0;
            return ngx_http_llama_session_route(r, ctx);
        }

        return ngx_http_llama_session_backend_error(r, ctx, "GET /slots");

    case NGX_HTTP_LLAMA_SESSION_SLOTS_ERROR:
        return ngx_http_llama_session_backend_error(r, ctx, "GET /slots");

    case NGX_HTTP_LLAMA_SESSION_SLOTS_NO_API:

        /*
         * --no-slots: the module cannot look, so it assumes the slot holds
         * tokens, and saves nothing: what is there may be empty, or a
         * restarted llama-server's other state
         */

        if (ctx->job->save_pending) {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "llama_session: GET /slots answered %i, the module "
                          "cannot check the slot and does not save "
                          "\"%*s\": start llama-server with --slots",
                          ctx->job->call_status, ctx->job->out_len,
                              ctx->job->out_key);
        }

        ctx->job->save_pending = 0;
        break;

    case NGX_HTTP_LLAMA_SESSION_SLOTS_RESTARTED:

        /* its configuration again, the session from its file */

        ngx_http_llama_session_slot_lost(ctx);

        ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_PROPS);

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_PROPS,
                                           NULL, 0);

    case NGX_HTTP_LLAMA_SESSION_SLOTS_BUSY:
        processing = 1;
        break;

    default: /* NGX_HTTP_LLAMA_SESSION_SLOTS_IDLE */
        break;
    }

    ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;

    if (ctx->verify && !processing) {
        /* the hit is one */
        return ngx_http_llama_session_proxy(r, ctx);
    }

    if (processing) {
        /*
         * the backend still runs a request on the slot that the module
         * already let go (a client that left mid-stream): wait for it
         */

        if ((ngx_msec_int_t) (ngx_current_msec - ctx->deadline) >= 0) {
            ngx_http_llama_session_release(ctx->zone, ctx->job,
                                           NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
            ngx_http_llama_session_wake_local();

            return ngx_http_llama_session_error(r, ctx,
                                  NGX_HTTP_SERVICE_UNAVAILABLE,
                                  "unavailable_error",
                                  "the model's slot is still busy, "
                                  "retry later", 1);
        }

        ctx->job->polls++;
        ctx->delay = (ctx->job->polls == 1) ? NGX_HTTP_LLAMA_SESSION_BUSY_MIN
                     : ngx_min(ctx->delay * 2, NGX_HTTP_LLAMA_SESSION_BUSY_MAX);

        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_PAUSE);

        return ngx_http_llama_session_sleep(r, ctx,
                                      ngx_min(ctx->delay,
                                              (ngx_msec_t) (ctx->deadline
                                                         - ngx_current_msec)));
    }

    if ((ngx_msec_int_t) (ctx->job->quiet_until - ngx_current_msec) > 0) {
        /*
         * a request whose client left may still start in llama-server:
         * look again once it would have started or been cancelled
         */

        ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "llama_session: slot quiet for %M ms",
                       ctx->job->quiet_until - ngx_current_msec);

        delay = ctx->job->quiet_until - ngx_current_msec;
        ctx->job->quiet_until = 0;
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_PAUSE);

        return ngx_http_llama_session_sleep(r, ctx, delay);
    }

    if (ctx->job->ram) {
        ctx->job->ram = 0;

        if (ctx->job->slot_tokens > 0
            && ngx_http_llama_session_ram_take(ctx, 0))
        {
            /*
             * the slot holds another session, idle: the pinned completion
             * moves it to RAM and this one out, no restore (ram.c); an
             * empty slot after all looks up nothing: the files
             */
            return ngx_http_llama_session_ram_next(r, ctx);
        }
    }

    if (!ctx->job->load_file && ngx_http_llama_session_ram_fresh(ctx)) {
        /*
         * a session without a file: the request runs on the slot as it
         * is, and llama-server moves what it holds to RAM (ram.c)
         */
        ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_FRESH;
        return ngx_http_llama_session_ram_next(r, ctx);
    }

    if (ngx_http_llama_session_may_save(ctx)) {
        /* re-primed first when its last turn is known (reprime.c) */
        return ngx_http_llama_session_save(r, ctx);
    }

    ctx->job->save_pending = 0;

    return ngx_http_llama_session_load(r, ctx);
}


/*
 * The session that leaves goes into RAM with the pinned completion: first
 * saved when RAM may not keep it (ram.c), its save checked; a save that
 * fails leaves it to RAM, as its turns were before.
 */

static ngx_int_t
ngx_http_llama_session_ram_next(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    if (ngx_http_llama_session_may_save(ctx)) {
        return ngx_http_llama_session_save(r, ctx);
    }

    ctx->job->save_pending = 0;

    return ngx_http_llama_session_proxy(r, ctx);
}


static ngx_int_t
ngx_http_llama_session_saved(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t  rc;

    if (ctx->job->call_status == 0) {
        /* llama-server may have died in the middle: its file stays whole */
        ngx_http_llama_session_store_drop_tmp(r->connection->log, ctx,
                                              ctx->job->out_key,
                                              ctx->job->out_len);
        return ngx_http_llama_session_backend_error(r, ctx, "save");
    }

    rc = ngx_http_llama_session_save_done(r->connection->log, ctx,
                                          NGX_HTTP_LLAMA_SESSION_SAVE_SWAP,
                                          ctx->job->out_key,
                                          ctx->job->out_len,
                                          &ctx->job->wait_ev);
    if (rc == NGX_AGAIN) {
        /* the commit's file calls run in a thread (store_commit()) */
        r->read_event_handler = ngx_http_test_reading;
        r->write_event_handler = ngx_http_core_run_phases;
        return NGX_AGAIN;
    }

    if (rc != NGX_OK) {
        /*
         * the session's previous file, if any, stays as it was; shared=on,
         * NGX_DECLINED: another owner's newer one (job->superseded)
         */
        ctx->job->save_pending = 0;
        ctx->job->save_failed = (rc != NGX_DECLINED);
    }

    if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_RAM
        || ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_FRESH)
    {
        /* the slot stays as it is: the completion moves it to RAM */
        return ngx_http_llama_session_proxy(r, ctx);
    }

    return ngx_http_llama_session_load(r, ctx);
}


static ngx_int_t
ngx_http_llama_session_load(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t  rc;

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_LOAD);

    if (ctx->job->load_file) {
        return ngx_http_llama_session_call(r, ctx,
                                          NGX_HTTP_LLAMA_SESSION_CALL_RESTORE,
                                          ctx->key, ctx->key_len);
    }

    rc = ngx_http_llama_session_warm(r, ctx);

    if (rc == NGX_OK) {
        /* warm from the slot itself: ready */
        return ngx_http_llama_session_proxy(r, ctx);
    }

    if (rc != NGX_DECLINED) {
        return rc;
    }

    if (ctx->job->slot_tokens == 0) {
        ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_FRESH;
        return ngx_http_llama_session_proxy(r, ctx);
    }

    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_ERASE,
                                       NULL, 0);
}


static ngx_int_t
ngx_http_llama_session_loaded(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    off_t       bytes;
    double      ms;
    ngx_uint_t  tokens, call;

    call = ctx->job->call;

    /* 501: llama-server without --slot-save-path */

    if (ngx_http_llama_session_backend_failed(ctx->job->call_status)
        || ctx->job->call_status == NGX_HTTP_NOT_IMPLEMENTED)
    {
        return ngx_http_llama_session_backend_error(r, ctx,
                          (char *) ngx_http_llama_session_call_name(call)->data);
    }

    ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_FRESH;

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_RESTORE) {

        /*
         * a failed restore leaves the slot empty in llama-server (missing,
         * foreign or damaged file): the request goes on with a fresh slot
         */

        if (ngx_http_llama_session_restore_done(r->connection->log, ctx,
                                                ctx->key, ctx->key_len)
            == NGX_OK)
        {
            ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_RESTORE;

            ngx_http_llama_session_stat(&ctx->zone->sh->stats.restores);

            /* the session's last prompt, to explain a miss (miss.c) */
            (void) ngx_http_llama_session_store_prev(r, ctx);
        }

        return ngx_http_llama_session_proxy(r, ctx);
    }

    if (ctx->job->call_status != NGX_HTTP_OK
        || ngx_http_llama_session_parse_action(r->connection->log, ctx,
                                               &tokens, &bytes, &ms)
           != NGX_OK)
    {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: erasing slot %ui failed (%i), the "
                      "request goes on", ctx->job->slot, ctx->job->call_status);
    }

    return ngx_http_llama_session_proxy(r, ctx);
}


/* the slot is ready: record it and let proxy_pass carry the request */

static ngx_int_t
ngx_http_llama_session_proxy(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char                       *p, *last, out[256], in[256];
    size_t                        out_len;
    ngx_uint_t                    held;
    ngx_http_llama_session_sh_t  *sh;

    sh = ctx->zone->sh;

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_PROXY);
    ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;

    if (ctx->job->ram_leaving) {
        /* the session that leaves is still in the slot: to RAM? (ram.c) */
        ngx_http_llama_session_ram_leave(ctx);
    }

    if (!ctx->swapped) {
        /* a hit: the zone marked the slot changed already */
        return ngx_http_llama_session_pinned(r, ctx);
    }

    /* what left, for the log line */
    held = sh->slots[ctx->job->slot].held;

    /* whatever runs now leaves the slot holding this session's tokens */

    ngx_http_llama_session_job_slot_set(ctx,
                                        NGX_HTTP_LLAMA_SESSION_SLOT_SESSION,
                                    ctx->key, ctx->key_len, 1);

    ctx->swap_ms = ngx_current_msec - ctx->swap_start;

    ngx_http_llama_session_stat(&sh->stats.swaps);
    ngx_http_llama_session_observe(&sh->metrics.swap, (double) ctx->swap_ms);

    if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_FRESH) {
        ngx_http_llama_session_stat(&sh->stats.fresh);

    } else if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_WARM) {
        ngx_http_llama_session_stat(&sh->stats.warm);
    }

    p = out;
    last = out + sizeof(out);

    if (ctx->job->stale) {
        p = ngx_slprintf(p, last, "its own older state (another owner "
                         "saved a newer one since)");

    } else if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_RAM) {
        p = ngx_slprintf(p, last, "\"%*s\" to llama-server's RAM cache, "
                         "%ui tokens", ctx->job->out_len, ctx->job->out_key,
                         held);

        if (ctx->job->save_pending) {
            p = ngx_slprintf(p, last, ", saved first (%ui tokens, %O bytes "
                             "in %.1f ms: RAM had no room to keep it)",
                             ctx->job->saved_tokens, ctx->job->saved_bytes,
                             ctx->job->save_ms);
        }

    } else if (ctx->job->out_len == 0) {
        p = ngx_slprintf(p, last, "nothing known");

    } else if (ctx->job->save_pending) {
        p = ngx_slprintf(p, last, "\"%*s\" saved %ui tokens, %O bytes in "
                         "%.1f ms", ctx->job->out_len, ctx->job->out_key,
                         ctx->job->saved_tokens, ctx->job->saved_bytes,
                             ctx->job->save_ms);

    } else {
        p = ngx_slprintf(p, last, "\"%*s\" not saved (%s)",
                         ctx->job->out_len, ctx->job->out_key,
                         ctx->job->media_refused
                         ? "llama-server cannot save its media"
                         : ctx->job->superseded
                         ? "another owner saved a newer state, it stays"
                         : ctx->job->save_failed ? "the save failed"
                         : (ctx->job->out_len == sizeof("default") - 1
                            && ngx_strncmp(ctx->job->out_key, "default",
                                           ctx->job->out_len) == 0)
                           ? "default" : "unchanged or empty");
    }

    out_len = p - out;

    p = in;
    last = in + sizeof(in);

    p = ngx_slprintf(p, last, "\"%*s\" ", ctx->key_len, ctx->key);

    if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_RAM) {
        p = ngx_slprintf(p, last, "from llama-server's RAM cache, %ui "
                         "tokens, no slot action", ctx->job->ram_tokens);

    } else if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_RESTORE) {
        p = ngx_slprintf(p, last, "restored %ui tokens, %O bytes in %.1f ms",
                         ctx->job->loaded_tokens, ctx->job->loaded_bytes,
                             ctx->job->load_ms);

    } else if (ctx->action != NGX_HTTP_LLAMA_SESSION_ACTION_WARM) {
        p = ngx_slprintf(p, last, "fresh");

        if (ctx->job->reprefill) {
            p = ngx_slprintf(p, last, " (re-prefilled: its file would take "
                             "~%.0f ms to restore, its prompt ~%.0f ms to "
                             "prefill)", ctx->job->est_restore_ms,
                             ctx->job->est_prefill_ms);
        }

    } else if (ctx->warm->trimmed) {
        p = ngx_slprintf(p, last, "warm from the slot's system prompt "
                         "(base \"%*s\"), 0 bytes read",
                         ctx->base_len, ctx->base_key);

    } else if (ctx->warm->history) {
        p = ngx_slprintf(p, last, "warm from the slot, its history kept "
                         "(llama_session_warm history)");

    } else {
        p = ngx_slprintf(p, last, "warm from base \"%*s\", %ui tokens, %O "
                         "bytes read in %.1f ms", ctx->base_len, ctx->base_key,
                         ctx->job->loaded_tokens, ctx->job->loaded_bytes,
                             ctx->job->load_ms);
    }

    if (ctx->warm->base_built) {
        p = ngx_slprintf(p, last, ", base \"%*s\" primed (%i tokens from "
                         "the slot's cache) and saved: %ui tokens, %O bytes "
                         "in %.1f ms", ctx->base_len, ctx->base_key,
                         ctx->warm->base_cached, ctx->warm->base_tokens,
                             ctx->warm->base_bytes,
                         ctx->warm->base_ms);
    }

    ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                  "llama_session: swap on slot %ui of zone \"%V\": out %*s, "
                  "in %*s, %M ms in all", ctx->job->slot, &ctx->zone->name,
                  out_len, out, p - in, in, ctx->swap_ms);

    return ngx_http_llama_session_pinned(r, ctx);
}


/*
 * With several slots the request goes to the slot it holds, by "id_slot"
 * in its body; one that cannot be pinned could run on any slot: never.
 * The slot is labelled with the session already, which is what it holds.
 */

static ngx_int_t
ngx_http_llama_session_pinned(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t  rc;

    if (ctx->zone->sh->nslots < 2) {
        return NGX_DECLINED;
    }

    rc = ngx_http_llama_session_pin(r, ctx);

    if (rc == NGX_OK) {
        return NGX_DECLINED;
    }

    if (rc == NGX_ERROR) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                  "llama_session: the body is no JSON object, it cannot be "
                  "pinned to slot %ui", ctx->job->slot);

    return ngx_http_llama_session_error(r, ctx, NGX_HTTP_BAD_REQUEST,
                                        "invalid_request_error",
                                        "the body must be a JSON object", 0);
}


/*
 * The context survives internal redirects, which wipe r->ctx, through its
 * pool cleanup (as the realip module does), so no request acquires twice.
 */

ngx_http_llama_session_ctx_t *
ngx_http_llama_session_get_ctx(ngx_http_request_t *r)
{
    ngx_pool_cleanup_t            *cln;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = ngx_http_get_module_ctx(r->main, ngx_http_llama_session_module);

    if (ctx || !(r->main->internal || r->main->filter_finalize)) {
        return ctx;
    }

    for (cln = r->main->pool->cleanup; cln; cln = cln->next) {
        if (cln->handler == ngx_http_llama_session_cleanup) {
            ctx = cln->data;
            ngx_http_set_ctx(r->main, ctx, ngx_http_llama_session_module);
            return ctx;
        }
    }

    return NULL;
}


static void
ngx_http_llama_session_cleanup(void *data)
{
    ngx_http_llama_session_ctx_t *ctx = data;

    ngx_http_request_t  *r;

    r = ctx->request;

    if (ctx->job->wait_ev.timer_set) {
        ngx_del_timer(&ctx->job->wait_ev);
    }

    if (ctx->job->wait_ev.posted) {
        ngx_delete_posted_event(&ctx->job->wait_ev);
    }

    if (ctx->job->io) {
        /* a store call in its thread: cleaned up when it ends */
        ngx_http_llama_session_io_leave(ctx->job->io, r->connection->log,
                                        NULL);
        ctx->job->io = NULL;
    }

    ngx_http_llama_session_wait_end(ctx->job);

    ngx_http_llama_session_dequeue(ctx->zone, ctx->job);

    ngx_http_llama_session_route_end(ctx);
    ngx_http_llama_session_job_finish(ctx);

    if (ctx->job->old_len) {
        ngx_http_llama_session_store_drop_old(r->connection->log, ctx);
    }
}
