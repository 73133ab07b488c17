
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
 *
 * When nginx stops gracefully (QUIT: nginx -s quit, systemctl stop), the
 * sessions that changed since their last save are saved the same way,
 * however long they were idle, before the workers exit; not when a
 * reload's workers take over the same shared memory.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_idle.h"
#include "ngx_http_llama_session_io.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_models.h"
#include "ngx_http_llama_session_reprime.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_store.h"


typedef struct {
    ngx_http_llama_session_ctx_t    ctx;        /* first: the module ctx */
    ngx_http_llama_session_job_t    job;        /* its parts */
    ngx_http_llama_session_warm_t   warm;
    ngx_http_llama_session_route_t  route;
    ngx_uint_t                      failed;     /* back off */
    ngx_uint_t                      state;      /* the slot's, at the end */
    unsigned                        model_gone:1;
    unsigned                        stop:1;     /* nginx stops */
} ngx_http_llama_session_idle_t;


static ngx_msec_t ngx_http_llama_session_idle_step(
    ngx_http_llama_session_zone_t *zone);
static void ngx_http_llama_session_idle_tick(ngx_event_t *ev);
static ngx_uint_t ngx_http_llama_session_idle_scan(
    ngx_http_llama_session_zone_t *zone, ngx_msec_t save_idle,
    ngx_log_t *log);
static void ngx_http_llama_session_idle_stopping(void);
static void ngx_http_llama_session_stop_tick(ngx_event_t *ev);
static ngx_int_t ngx_http_llama_session_idle_start(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_ctx_t *probe,
    ngx_uint_t stop, ngx_log_t *log);
static void ngx_http_llama_session_idle_resume(ngx_http_request_t *r);
static void ngx_http_llama_session_idle_went(ngx_http_request_t *r,
    ngx_http_llama_session_idle_t *idle, ngx_int_t rc);
static void ngx_http_llama_session_idle_checked(ngx_http_request_t *r,
    ngx_http_llama_session_idle_t *idle);
static void ngx_http_llama_session_idle_saved(ngx_http_request_t *r,
    ngx_http_llama_session_idle_t *idle);
static void ngx_http_llama_session_idle_end(void *data);


/* this worker's saves at a graceful stop, for every zone */

static ngx_event_t       ngx_http_llama_session_stop_ev;
static ngx_connection_t  ngx_http_llama_session_stop_conn;  /* the debug
                                                   log's ident: fd -1 */
static ngx_msec_t        ngx_http_llama_session_stop_start;
static ngx_uint_t        ngx_http_llama_session_stop_late;  /* said once */


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

        /* this configuration's workers run: older ones are reloaded */
        zone->sh->live_cycle = zone->generation;

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
        /*
         * with store= the timer holds a worker that stops until its next
         * tick, which saves what changed (the files outlive nginx); else
         * there is nothing to save at a stop
         */
        zone->idle_ev.cancelable = (zone->store.len == 0);

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

    ngx_msec_t  step;

    if (ngx_terminate) {
        return;
    }

    if (ngx_exiting || ngx_quit) {
        ngx_http_llama_session_idle_stopping();
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
        (void) ngx_http_llama_session_store_sync_start(zone, ev->log, NULL,
                                                       NULL);
    }

    if (zone->idle_busy
        || (ngx_msec_int_t) (ngx_current_msec - zone->idle_next) < 0)
    {
        /* one at a time; after a failure, again in 1 s doubling to 60 s */
        return;
    }

    (void) ngx_http_llama_session_idle_scan(zone, zone->save_idle, ev->log);
}


/*
 * The first slot whose session changed since its last save and was idle
 * for save_idle gets its save job.  At a stop, once per slot: a session
 * that stays unsaved (a slot llama-server emptied) does not hold the
 * worker.  Returns 1 when one started.
 */

static ngx_uint_t
ngx_http_llama_session_idle_scan(ngx_http_llama_session_zone_t *zone,
    ngx_msec_t save_idle, ngx_log_t *log)
{
    ngx_uint_t                     n, stopping;
    ngx_http_llama_session_ctx_t   probe;
    ngx_http_llama_session_job_t   job;

    stopping = (ngx_exiting || ngx_quit);

    for (n = 0; n < ngx_http_llama_session_slots_usable(zone->sh); n++) {

        if (stopping && (zone->stop_tried & ((uint64_t) 1 << n))) {
            continue;
        }

        ngx_memzero(&probe, sizeof(ngx_http_llama_session_ctx_t));
        ngx_memzero(&job, sizeof(ngx_http_llama_session_job_t));

        probe.zone = zone;
        probe.job = &job;
        probe.job->log = log;
        probe.job->slot = n;
        probe.job->slot_tokens = -1;
        probe.job->slot_task = -1;

        if (ngx_http_llama_session_try_idle(zone, probe.job, save_idle)
            != NGX_OK)
        {
            continue;
        }

        if (stopping) {
            zone->stop_tried |= (uint64_t) 1 << n;
        }

        if (ngx_http_llama_session_idle_start(zone, &probe, stopping, log)
            != NGX_OK)
        {
            ngx_http_llama_session_release(zone, probe.job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
            ngx_http_llama_session_wake_local();

            zone->idle_backoff = ngx_min(ngx_max(zone->idle_backoff * 2,
                                                 1000), 60000);
            zone->idle_next = ngx_current_msec + zone->idle_backoff;

            if (stopping) {
                zone->stop_failed = 1;
            }

            return 0;
        }

        return 1;
    }

    return 0;
}


/*
 * The worker stops gracefully: the zones' timers give way to one of the
 * worker's own, which saves every changed session (one per zone at a
 * time) and holds the worker while a save or a request of this worker
 * runs, since a request that ends changes its session.
 */

static void
ngx_http_llama_session_idle_stopping(void)
{
    ngx_uint_t                           i;
    ngx_http_llama_session_zone_t      **zp;
    ngx_http_llama_session_main_conf_t  *lmcf;

    if (ngx_http_llama_session_stop_ev.handler) {
        return;
    }

    lmcf = ngx_http_cycle_get_module_main_conf(ngx_cycle,
                                               ngx_http_llama_session_module);
    zp = lmcf->zones.elts;

    for (i = 0; i < lmcf->zones.nelts; i++) {
        if (zp[i]->idle_ev.timer_set) {
            ngx_del_timer(&zp[i]->idle_ev);
        }
    }

    ngx_http_llama_session_stop_conn.fd = (ngx_socket_t) -1;

    ngx_http_llama_session_stop_ev.handler = ngx_http_llama_session_stop_tick;
    ngx_http_llama_session_stop_ev.data = &ngx_http_llama_session_stop_conn;
    ngx_http_llama_session_stop_ev.log = ngx_cycle->log;
    ngx_http_llama_session_stop_ev.cancelable = 0;
    ngx_http_llama_session_stop_start = ngx_current_msec;

    ngx_add_timer(&ngx_http_llama_session_stop_ev, 1);
}


static void
ngx_http_llama_session_stop_tick(ngx_event_t *ev)
{
    ngx_uint_t                           i, busy, late;
    ngx_core_conf_t                     *ccf;
    ngx_http_llama_session_zone_t      **zp, *zone;
    ngx_http_llama_session_main_conf_t  *lmcf;

    if (ngx_terminate) {
        return;
    }

    /*
     * worker_shutdown_timeout: no save starts after it (the one under way
     * ends: nginx closes the clients' connections, not the upstreams')
     */
    ccf = (ngx_core_conf_t *) ngx_get_conf(ngx_cycle->conf_ctx,
                                           ngx_core_module);
    late = (ccf->shutdown_timeout
            && ngx_current_msec - ngx_http_llama_session_stop_start
               >= ccf->shutdown_timeout);

    if (late && !ngx_http_llama_session_stop_late) {
        ngx_http_llama_session_stop_late = 1;

        ngx_log_error(NGX_LOG_NOTICE, ev->log, 0,
                      "llama_session: nginx stops: worker_shutdown_timeout "
                      "passed, no more sessions are saved");
    }

    lmcf = ngx_http_cycle_get_module_main_conf(ngx_cycle,
                                               ngx_http_llama_session_module);
    zp = lmcf->zones.elts;
    busy = 0;

    for (i = 0; i < lmcf->zones.nelts; i++) {
        zone = zp[i];

        if (zone->idle_ev.handler == NULL
            || zone->store.len == 0
            || zone->sh->live_cycle != zone->generation
            || (zone->models && !ngx_http_llama_session_models_adopt(zone)))
        {
            /* no idle saver; nothing outlives nginx; a reload; no model */
            continue;
        }

        if (!zone->idle_busy && !zone->stop_failed && !late) {
            (void) ngx_http_llama_session_idle_scan(zone, 1,
                                                    zone->idle_ev.log);
        }

        busy |= zone->idle_busy;
    }

    if (busy || ngx_event_no_timers_left() != NGX_OK) {
        ngx_add_timer(ev, 100);
    }
}


/*
 * The slot is the idle saver's: its job in a request of the module's own,
 * whose pool cleanup gives the slot back however the request ends.
 */

static ngx_int_t
ngx_http_llama_session_idle_start(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_ctx_t *probe, ngx_uint_t stop, ngx_log_t *log)
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
    idle->job = *probe->job;
    ctx->job = &idle->job;
    ctx->warm = &idle->warm;
    ctx->route = &idle->route;
    ctx->request = r;
    ctx->job->own = 1;

    /* the commit's thread (store_commit()) wakes it by the job's timer */
    ngx_memzero(&ctx->job->wait_ev, sizeof(ngx_event_t));
    ngx_http_llama_session_job_timer(ctx);
    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);

    idle->failed = 1;
    idle->state = NGX_HTTP_LLAMA_SESSION_SLOT_SESSION;
    idle->stop = stop;

    cln->handler = ngx_http_llama_session_idle_end;
    cln->data = idle;

    ngx_http_set_ctx(r, ctx, ngx_http_llama_session_module);

    r->write_event_handler = ngx_http_llama_session_idle_resume;

    zone->idle_busy = 1;

    ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: idle save of \"%*s\" from slot %ui starts",
                   ctx->job->out_len, ctx->job->out_key, ctx->job->slot);

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

    if (idle == NULL) {
        return;
    }

    if (idle->ctx.job->state == NGX_HTTP_LLAMA_SESSION_ST_TURN) {
        /* the slot's turn file, read in a thread (reprime.c) */

        if (ngx_http_llama_session_io_pending(idle->ctx.job->io,
                                              &idle->ctx.job->wait_ev))
        {
            return;
        }

        r->write_event_handler = ngx_http_llama_session_idle_resume;

        ngx_http_llama_session_idle_went(r, idle,
                                         ngx_http_llama_session_save(
                                             r, &idle->ctx));
        return;
    }

    if (!idle->ctx.job->call_done) {
        return;
    }

    r->write_event_handler = ngx_http_request_empty_handler;

    if (idle->ctx.job->call == NGX_HTTP_LLAMA_SESSION_CALL_GET) {
        ngx_http_llama_session_idle_checked(r, idle);
        return;
    }

    if (idle->ctx.job->state == NGX_HTTP_LLAMA_SESSION_ST_REPRIME) {
        r->write_event_handler = ngx_http_llama_session_idle_resume;

        ngx_http_llama_session_idle_went(r, idle,
                                         ngx_http_llama_session_reprime_next(
                                             r, &idle->ctx));
        return;
    }

    ngx_http_llama_session_idle_saved(r, idle);
}


/* a step of the save through the request path (save(), reprime_next()) */

static void
ngx_http_llama_session_idle_went(ngx_http_request_t *r,
    ngx_http_llama_session_idle_t *idle, ngx_int_t rc)
{
    if (rc == NGX_AGAIN) {
        return;
    }

    if (rc == NGX_DONE) {
        /* gave way to a request of the session: no failure */
        idle->failed = 0;
    }

    ngx_http_llama_session_job_close(r);
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
                      "save", &ctx->zone->model, ctx->job->out_len,
                          ctx->job->out_key);

        idle->state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        idle->model_gone = 1;
        idle->failed = 0;
        break;

    case NGX_HTTP_LLAMA_SESSION_SLOTS_NO_API:
        /* --no-slots: nothing is saved until a request changes it */
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: idle save: GET /slots answered 501, "
                      "\"%*s\" is not saved: start llama-server with --slots",
                      ctx->job->out_len, ctx->job->out_key);

        ngx_http_llama_session_slot_saved(ctx->zone, ctx->job,
                                          ctx->job->out_key,
                                          ctx->job->out_len);
        idle->failed = 0;
        break;

    case NGX_HTTP_LLAMA_SESSION_SLOTS_ERROR:
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: idle save: GET /slots through \"%V\" "
                      "answered %i, \"%*s\" is not saved",
                      &ctx->job->call_uri, ctx->job->call_status,
                          ctx->job->out_len,
                      ctx->job->out_key);
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

        if (rc == NGX_DONE) {
            /* gave way to a request of the session: no failure */
            idle->failed = 0;
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
    ngx_int_t                      rc;
    ngx_uint_t                     reason;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = &idle->ctx;

    if (ctx->job->call_status == 0) {
        /* llama-server may have died in the middle, or not answered */
        idle->state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
    }

    /* a save at stop counts as an idle save: the counters go with nginx */
    reason = ctx->zone->sh->unloading ? NGX_HTTP_LLAMA_SESSION_SAVE_UNLOAD
                                      : NGX_HTTP_LLAMA_SESSION_SAVE_IDLE;

    rc = ngx_http_llama_session_save_done(r->connection->log, ctx, reason,
                                          ctx->job->out_key,
                                          ctx->job->out_len,
                                          &ctx->job->wait_ev);

    if (rc == NGX_AGAIN) {
        /* the commit's file calls run in a thread: back here after them */
        r->write_event_handler = ngx_http_llama_session_idle_resume;
        return;
    }

    if (rc == NGX_DECLINED) {
        /* shared=on: another owner's newer state stays, no failure */
        idle->failed = 0;

    } else if (rc == NGX_OK) {
        idle->failed = 0;

        ngx_http_llama_session_stat(&ctx->zone->sh->stats.idle_saves);

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: %s of \"%*s\" from slot %ui of "
                      "zone \"%V\": %ui tokens, %O bytes in %.1f ms",
                      idle->stop ? "save at stop" : "idle save",
                      ctx->job->out_len, ctx->job->out_key, ctx->job->slot,
                      &ctx->zone->name, ctx->job->saved_tokens,
                          ctx->job->saved_bytes,
                      ctx->job->save_ms);
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

    if (ctx->job->wait_ev.timer_set) {
        ngx_del_timer(&ctx->job->wait_ev);
    }

    if (ctx->job->wait_ev.posted) {
        ngx_delete_posted_event(&ctx->job->wait_ev);
    }

    if (ctx->job->io) {
        /* its commit still runs in a thread: it cleans up after itself */
        ngx_http_llama_session_io_leave(ctx->job->io,
                                        ctx->request->connection->log, NULL);
        ctx->job->io = NULL;
        ctx->job->store_silent = 1;
    }

    if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE) {
        /* committed (renamed) or not: no temporary file stays */
        ngx_http_llama_session_store_drop_tmp(ctx->request->connection->log,
                                              ctx, ctx->job->out_key,
                                              ctx->job->out_len);
    }

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_DONE);
    ngx_http_llama_session_release(ctx->zone, ctx->job, idle->state);

    if (idle->model_gone) {
        /* its slots are empty: the model is loaded again when needed */
        (void) ngx_http_llama_session_model_reset(zone, NULL, -1,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY);
        ngx_http_llama_session_stat(&zone->sh->stats.model_lost);
    }

    ngx_http_llama_session_wake_local();

    zone->idle_busy = 0;

    if (idle->failed && idle->stop && !zone->stop_failed) {
        /* llama-server fails: the other sessions are not tried */
        zone->stop_failed = 1;

        ngx_log_error(NGX_LOG_WARN, ctx->request->connection->log, 0,
                      "llama_session: nginx stops: a save failed, the other "
                      "sessions of zone \"%V\" that changed since their "
                      "last save are not saved", &zone->name);
    }

    if (idle->failed) {
        zone->idle_backoff = ngx_min(ngx_max(zone->idle_backoff * 2, 1000),
                                     60000);
        zone->idle_next = ngx_current_msec + zone->idle_backoff;

    } else {
        zone->idle_backoff = 0;
    }
}
