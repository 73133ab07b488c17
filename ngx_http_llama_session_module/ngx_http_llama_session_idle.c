
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Idle save (save_idle= on the zone): the session in a slot that had no
 * request for that long, and changed since its last save, is saved, so a
 * reboot loses at most that much.  No client request is behind it: the
 * job runs in a request of the module's own (job.c), with the slot calls
 * of every other job, through the slots location: GET /slots and its
 * verdict, then POST /slots/N?action=save and the save's end (the file
 * checked and renamed into place).  Every worker has a timer; the shared
 * zone makes sure one of them does a given save.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_idle.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_models.h"
#include "ngx_http_llama_session_reprime.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_store.h"


typedef struct {
    ngx_http_llama_session_ctx_t    ctx;        /* first: the module ctx */
    ngx_uint_t                      failed;     /* back off */
    ngx_uint_t                      state;      /* the slot's, at the end */
    unsigned                        model_gone:1;
} ngx_http_llama_session_idle_t;


static ngx_msec_t ngx_http_llama_session_idle_step(
    ngx_http_llama_session_zone_t *zone);
static void ngx_http_llama_session_idle_tick(ngx_event_t *ev);
static ngx_int_t ngx_http_llama_session_idle_start(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_ctx_t *probe,
    ngx_log_t *log);
static void ngx_http_llama_session_idle_resume(ngx_http_request_t *r);
static void ngx_http_llama_session_idle_checked(ngx_http_request_t *r,
    ngx_http_llama_session_idle_t *idle);
static void ngx_http_llama_session_idle_saved(ngx_http_request_t *r,
    ngx_http_llama_session_idle_t *idle);
static void ngx_http_llama_session_idle_end(void *data);


ngx_int_t
ngx_http_llama_session_idle_init(ngx_cycle_t *cycle)
{
    ngx_uint_t                           i;
    ngx_msec_t                           step;
    ngx_http_llama_session_zone_t      **zp, *zone;
    ngx_http_llama_session_main_conf_t  *lmcf;

    /* only workers: not the cache manager nor the cache loader */

    if (ngx_process != NGX_PROCESS_WORKER
        && ngx_process != NGX_PROCESS_SINGLE)
    {
        return NGX_OK;
    }

    lmcf = ngx_http_cycle_get_module_main_conf(cycle,
                                               ngx_http_llama_session_module);
    if (lmcf == NULL) {
        return NGX_OK;
    }

    zp = lmcf->zones.elts;

    for (i = 0; i < lmcf->zones.nelts; i++) {
        zone = zp[i];

        if (zone->save_idle == 0 && !ngx_http_llama_session_by_router(zone)) {
            /* a router's model zone saves before an unload, see router.c */
            continue;
        }

        zone->idle_ev.handler = ngx_http_llama_session_idle_tick;
        zone->idle_ev.data = zone;

        /*
         * idle saves are logged where the swaps of the zone's first
         * location are (its error_log), else in the main error log
         */
        zone->idle_ev.log = (zone->log_conf && zone->log_conf->error_log)
                            ? zone->log_conf->error_log : cycle->log;
        zone->idle_ev.cancelable = 1;

        step = ngx_http_llama_session_idle_step(zone);

        ngx_add_timer(&zone->idle_ev, step + ngx_random() % step);
    }

    return NGX_OK;
}


/*
 * How often a worker looks: a quarter of save_idle, 50 ms to 1 s; a
 * router's model zone at least every 100 ms, as a switch waits for its
 * saves before the unload (a zone of models= without a model: every 1 s,
 * to take its binding).
 */

static ngx_msec_t
ngx_http_llama_session_idle_step(ngx_http_llama_session_zone_t *zone)
{
    ngx_msec_t  step;

    step = ngx_max(ngx_min(zone->save_idle / 4, 1000), 50);

    if (zone->models && !ngx_http_llama_session_models_adopt(zone)) {
        /* a zone of a set without a model yet: nothing to save */
        return 1000;
    }

    if (ngx_http_llama_session_by_router(zone)) {
        step = ngx_min(step, 100);
    }

    return step;
}




static void
ngx_http_llama_session_idle_tick(ngx_event_t *ev)
{
    ngx_http_llama_session_zone_t *zone = ev->data;

    ngx_uint_t                     n;
    ngx_msec_t                     step;
    ngx_http_llama_session_ctx_t   probe;

    if (ngx_exiting || ngx_terminate || ngx_quit) {
        return;
    }

    step = ngx_http_llama_session_idle_step(zone);
    ngx_add_timer(ev, step);

    if (zone->models && !ngx_http_llama_session_models_adopt(zone)) {
        /* models=: no model given to this zone yet, nothing of its own */
        return;
    }

    if (zone->store.len
        && (ngx_msec_int_t) (ngx_current_msec - zone->reaped) >= 300000)
    {
        /* every 5 minutes: the folder again, and its leftovers reaped */
        zone->reaped = ngx_current_msec;
        (void) ngx_http_llama_session_store_sync(zone, ev->log);
    }

    if (zone->idle_busy
        || (ngx_msec_int_t) (ngx_current_msec - zone->idle_next) < 0)
    {
        /* one at a time; after a failure, again in 1 s doubling to 60 s */
        return;
    }

    for (n = 0; n < ngx_http_llama_session_slots_usable(zone->sh); n++) {

        ngx_memzero(&probe, sizeof(ngx_http_llama_session_ctx_t));

        probe.zone = zone;
        probe.job.slot = n;
        probe.job.slot_tokens = -1;
        probe.job.slot_task = -1;

        if (ngx_http_llama_session_try_idle(&probe, zone->save_idle)
            != NGX_OK)
        {
            continue;
        }

        if (ngx_http_llama_session_idle_start(zone, &probe, ev->log)
            != NGX_OK)
        {
            ngx_http_llama_session_release(&probe,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
            ngx_http_llama_session_wake_local();

            zone->idle_backoff = ngx_min(ngx_max(zone->idle_backoff * 2,
                                                 1000), 60000);
            zone->idle_next = ngx_current_msec + zone->idle_backoff;
        }

        return;
    }
}


/*
 * The slot is the idle saver's: its job in a request of the module's own,
 * whose pool cleanup gives the slot back however the request ends.
 */

static ngx_int_t
ngx_http_llama_session_idle_start(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_ctx_t *probe, ngx_log_t *log)
{
    ngx_int_t                       rc;
    ngx_pool_cleanup_t             *cln;
    ngx_http_request_t             *r;
    ngx_http_llama_session_ctx_t   *ctx;
    ngx_http_llama_session_idle_t  *idle;

    r = ngx_http_llama_session_job_request(zone, log);
    if (r == NULL) {
        return NGX_ERROR;
    }

    idle = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_idle_t));
    cln = ngx_pool_cleanup_add(r->pool, 0);

    if (idle == NULL || cln == NULL) {
        ngx_http_llama_session_job_close(r);
        return NGX_ERROR;
    }

    /* from here on, the request's end is the job's */

    ctx = &idle->ctx;
    *ctx = *probe;
    ctx->request = r;
    ctx->job.own = 1;
    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);

    idle->failed = 1;
    idle->state = NGX_HTTP_LLAMA_SESSION_SLOT_SESSION;

    cln->handler = ngx_http_llama_session_idle_end;
    cln->data = idle;

    ngx_http_set_ctx(r, ctx, ngx_http_llama_session_module);

    r->write_event_handler = ngx_http_llama_session_idle_resume;

    zone->idle_busy = 1;

    ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: idle save of \"%*s\" from slot %ui starts",
                   ctx->job.out_len, ctx->job.out_key, ctx->job.slot);

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_CHECK);

    rc = ngx_http_llama_session_call(r, ctx, NGX_HTTP_LLAMA_SESSION_CALL_GET,
                                     NULL, 0);

    if (rc != NGX_AGAIN) {
        ngx_http_llama_session_job_close(r);
        return NGX_OK;
    }

    ngx_http_llama_session_job_run(r);

    return NGX_OK;
}


/* a slot call of the job is done */

static void
ngx_http_llama_session_idle_resume(ngx_http_request_t *r)
{
    ngx_http_llama_session_idle_t  *idle;

    idle = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (idle == NULL || !idle->ctx.job.call_done) {
        return;
    }

    r->write_event_handler = ngx_http_request_empty_handler;

    if (idle->ctx.job.call == NGX_HTTP_LLAMA_SESSION_CALL_GET) {
        ngx_http_llama_session_idle_checked(r, idle);
        return;
    }

    if (idle->ctx.job.state == NGX_HTTP_LLAMA_SESSION_ST_REPRIME) {
        r->write_event_handler = ngx_http_llama_session_idle_resume;

        if (ngx_http_llama_session_reprime_next(r, &idle->ctx) != NGX_AGAIN) {
            ngx_http_llama_session_job_close(r);
        }

        return;
    }

    ngx_http_llama_session_idle_saved(r, idle);
}


/* GET /slots answered: save, or leave the slot as it is */

static void
ngx_http_llama_session_idle_checked(ngx_http_request_t *r,
    ngx_http_llama_session_idle_t *idle)
{
    ngx_int_t                      rc;
    ngx_log_t                     *log;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = &idle->ctx;
    log = r->connection->log;

    switch (ngx_http_llama_session_slots_verdict(log, ctx)) {

    case NGX_HTTP_LLAMA_SESSION_SLOTS_MODEL_GONE:
        /* router mode: unloaded or failed behind the module's back */
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: idle save: the router's model \"%V\" "
                      "is not running, \"%*s\" lost its turns since its last "
                      "save", &ctx->zone->model, ctx->job.out_len,
                          ctx->job.out_key);

        idle->state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        idle->model_gone = 1;
        idle->failed = 0;
        break;

    case NGX_HTTP_LLAMA_SESSION_SLOTS_NO_API:
        /* --no-slots: nothing is saved until a request changes it */
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: idle save: GET /slots answered 501, "
                      "\"%*s\" is not saved: start llama-server with --slots",
                      ctx->job.out_len, ctx->job.out_key);

        ngx_http_llama_session_slot_saved(ctx->zone, ctx->job.slot,
                                          ctx->job.out_key,
                                          ctx->job.out_len);
        idle->failed = 0;
        break;

    case NGX_HTTP_LLAMA_SESSION_SLOTS_ERROR:
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: idle save: GET /slots through \"%V\" "
                      "answered %i, \"%*s\" is not saved",
                      &ctx->job.call_uri, ctx->job.call_status,
                          ctx->job.out_len,
                      ctx->job.out_key);
        break;

    case NGX_HTTP_LLAMA_SESSION_SLOTS_RESTARTED:
        ngx_http_llama_session_slot_lost(ctx);
        idle->state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        idle->failed = 0;
        break;

    case NGX_HTTP_LLAMA_SESSION_SLOTS_BUSY:
        /* still running for a client that left: later */
        idle->failed = 0;
        break;

    default: /* NGX_HTTP_LLAMA_SESSION_SLOTS_IDLE */

        idle->failed = 0;

        if (!ngx_http_llama_session_may_save(ctx)) {
            break;
        }

        idle->failed = 1;

        r->write_event_handler = ngx_http_llama_session_idle_resume;

        /* re-primed first when its last turn is known (reprime.c) */
        rc = ngx_http_llama_session_save(r, ctx);

        if (rc == NGX_AGAIN) {
            return;
        }

        break;
    }

    ngx_http_llama_session_job_close(r);
}


/* the save answered: the checks and the commit of every other save */

static void
ngx_http_llama_session_idle_saved(ngx_http_request_t *r,
    ngx_http_llama_session_idle_t *idle)
{
    ngx_uint_t                     reason;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = &idle->ctx;

    if (ctx->job.call_status == 0) {
        /* llama-server may have died in the middle, or not answered */
        idle->state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
    }

    reason = ctx->zone->sh->unloading ? NGX_HTTP_LLAMA_SESSION_SAVE_UNLOAD
                                      : NGX_HTTP_LLAMA_SESSION_SAVE_IDLE;

    if (ngx_http_llama_session_save_done(r->connection->log, ctx, reason,
                                         ctx->job.out_key, ctx->job.out_len)
        == NGX_OK)
    {
        idle->failed = 0;

        ngx_http_llama_session_stat(ctx, &ctx->zone->sh->stats.idle_saves);

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: idle save of \"%*s\" from slot %ui of "
                      "zone \"%V\": %ui tokens, %O bytes in %.1f ms",
                      ctx->job.out_len, ctx->job.out_key, ctx->job.slot,
                      &ctx->zone->name, ctx->job.saved_tokens,
                          ctx->job.saved_bytes,
                      ctx->job.save_ms);
    }

    ngx_http_llama_session_job_close(r);
}


/* the module's request goes, whatever ended it: the slot goes back */

static void
ngx_http_llama_session_idle_end(void *data)
{
    ngx_http_llama_session_idle_t *idle = data;

    ngx_http_llama_session_ctx_t   *ctx;
    ngx_http_llama_session_zone_t  *zone;

    ctx = &idle->ctx;
    zone = ctx->zone;

    if (ctx->job.call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE) {
        /* committed (renamed) or not: no temporary file stays */
        ngx_http_llama_session_store_drop_tmp(ctx->request->connection->log,
                                              ctx, ctx->job.out_key,
                                              ctx->job.out_len);
    }

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_DONE);
    ngx_http_llama_session_release(ctx, idle->state);

    if (idle->model_gone) {
        /* its slots are empty: the model is loaded again when needed */
        (void) ngx_http_llama_session_model_reset(zone, NULL,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY);
        ngx_http_llama_session_stat(ctx, &zone->sh->stats.model_lost);
    }

    ngx_http_llama_session_wake_local();

    zone->idle_busy = 0;

    if (idle->failed) {
        zone->idle_backoff = ngx_min(ngx_max(zone->idle_backoff * 2, 1000),
                                     60000);
        zone->idle_next = ngx_current_msec + zone->idle_backoff;

    } else {
        zone->idle_backoff = 0;
    }
}
