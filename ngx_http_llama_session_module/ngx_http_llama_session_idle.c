
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Idle save (save_idle= on the zone): the session in a slot that had no
 * request for that long, and changed since its last save, is saved, so a
 * reboot loses at most that much.  No client request is behind it, so it
 * talks to llama-server over a small connection of its own (backend=):
 * GET /slots (is the slot idle, does it hold tokens, did the backend
 * restart), then POST /slots/N?action=save, then the file is renamed into
 * place as a request's save is.  Every worker has a timer; the shared zone
 * makes sure one of them does a given save.
 */


#include "ngx_http_llama_session_module.h"


#define NGX_HTTP_LLAMA_SESSION_IDLE_REPLY_MAX  (1024 * 1024)


typedef struct {
    ngx_http_llama_session_ctx_t    ctx;
    ngx_pool_t                     *pool;
    ngx_log_t                      *log;
    ngx_peer_connection_t           peer;
    ngx_buf_t                      *out;
    ngx_buf_t                      *in;
    ngx_uint_t                      step;
    ngx_uint_t                      failed;
} ngx_http_llama_session_idle_t;


static ngx_msec_t ngx_http_llama_session_idle_step(
    ngx_http_llama_session_zone_t *zone);
static void ngx_http_llama_session_idle_tick(ngx_event_t *ev);
static ngx_int_t ngx_http_llama_session_idle_send(
    ngx_http_llama_session_idle_t *job, ngx_uint_t call);
static void ngx_http_llama_session_idle_write(ngx_event_t *wev);
static void ngx_http_llama_session_idle_read(ngx_event_t *rev);
static ngx_uint_t ngx_http_llama_session_idle_complete(ngx_buf_t *b);
static u_char *ngx_http_llama_session_idle_chunks(u_char *p, u_char *last,
    ngx_uint_t decode);
static void ngx_http_llama_session_idle_reply(
    ngx_http_llama_session_idle_t *job);
static void ngx_http_llama_session_idle_done(
    ngx_http_llama_session_idle_t *job, ngx_uint_t state);


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

        if (zone->save_idle == 0 && zone->model.len == 0) {
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
 * saves before the unload.
 */

static ngx_msec_t
ngx_http_llama_session_idle_step(ngx_http_llama_session_zone_t *zone)
{
    ngx_msec_t  step;

    step = ngx_max(ngx_min(zone->save_idle / 4, 1000), 50);

    if (zone->model.len) {
        step = ngx_min(step, 100);
    }

    return step;
}


static void
ngx_http_llama_session_idle_tick(ngx_event_t *ev)
{
    ngx_http_llama_session_zone_t *zone = ev->data;

    ngx_uint_t                      n;
    ngx_msec_t                      step;
    ngx_pool_t                     *pool;
    ngx_http_llama_session_idle_t  *job;

    if (ngx_exiting || ngx_terminate || ngx_quit) {
        return;
    }

    step = ngx_http_llama_session_idle_step(zone);
    ngx_add_timer(ev, step);

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

    pool = NULL;

    for (n = 0; n < ngx_http_llama_session_slots_usable(zone->sh); n++) {

        if (pool == NULL) {
            pool = ngx_create_pool(4096, ev->log);
            if (pool == NULL) {
                return;
            }
        }

        job = ngx_pcalloc(pool, sizeof(ngx_http_llama_session_idle_t));
        if (job == NULL) {
            ngx_destroy_pool(pool);
            return;
        }

        job->pool = pool;
        job->log = ev->log;
        job->failed = 1;
        job->ctx.zone = zone;
        job->ctx.slot = n;
        job->ctx.slot_tokens = -1;
        job->ctx.slot_task = -1;

        if (ngx_http_llama_session_try_idle(&job->ctx, zone->save_idle)
            != NGX_OK)
        {
            continue;
        }

        ngx_log_debug2(NGX_LOG_DEBUG_HTTP, ev->log, 0,
                       "llama_session: idle save of \"%*s\" starts",
                       job->ctx.out_len, job->ctx.out_key);

        zone->idle_busy = 1;

        if (ngx_http_llama_session_idle_send(job,
                                             NGX_HTTP_LLAMA_SESSION_CALL_GET)
            != NGX_OK)
        {
            ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
        }

        return;
    }

    if (pool) {
        ngx_destroy_pool(pool);
    }
}


/* one request on a connection of its own: Connection: close */

static ngx_int_t
ngx_http_llama_session_idle_send(ngx_http_llama_session_idle_t *job,
    ngx_uint_t call)
{
    u_char                         *p, body[NGX_HTTP_LLAMA_SESSION_NAME_MAX
                                            + NGX_HTTP_LLAMA_SESSION_MODEL_SHOW
                                            + 64];
    size_t                          blen;
    ngx_int_t                       rc;
    ngx_connection_t               *c;
    ngx_http_llama_session_ctx_t   *ctx;
    ngx_http_llama_session_zone_t  *zone;

    ctx = &job->ctx;
    zone = ctx->zone;

    ctx->call = call;
    ctx->call_status = 0;
    ctx->call_reply = NULL;

    blen = 0;

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE) {
        p = ngx_sprintf(body, "{\"filename\":\"%*s.%*s.bin%s\"",
                        ctx->out_len, ctx->out_key,
                        (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN, ctx->fp,
                        zone->store.len ? ".tmp" : "");

        if (zone->model.len) {
            /* router mode: the model's slot, never loading the model */
            p = ngx_sprintf(p, ",\"model\":\"%V\"", &zone->model);
        }

        *p++ = '}';
        blen = p - body;
    }

    job->out = ngx_create_temp_buf(job->pool, 512 + zone->backend_name.len
                                              + zone->api_key.len
                                              + zone->model_arg.len + blen);
    if (job->out == NULL) {
        return NGX_ERROR;
    }

    p = job->out->last;

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_GET) {
        p = ngx_sprintf(p, "GET /slots%s%V HTTP/1.1" CRLF,
                        zone->model.len ? "?" : "", &zone->model_arg);

    } else {
        p = ngx_sprintf(p, "POST /slots/%ui?action=save%s HTTP/1.1" CRLF
                        "Content-Type: application/json" CRLF
                        "Content-Length: %uz" CRLF, ctx->slot,
                        zone->model.len ? "&autoload=false" : "", blen);
    }

    p = ngx_sprintf(p, "Host: %V" CRLF "Connection: close" CRLF
                    "User-Agent: nginx-llama-session" CRLF,
                    &zone->backend_name);

    if (zone->api_key.len) {
        p = ngx_sprintf(p, "Authorization: Bearer %V" CRLF, &zone->api_key);
    }

    p = ngx_cpymem(p, CRLF, 2);
    p = ngx_cpymem(p, body, blen);

    job->out->last = p;

    job->in = ngx_create_temp_buf(job->pool, 16384);
    if (job->in == NULL) {
        return NGX_ERROR;
    }

    ngx_memzero(&job->peer, sizeof(ngx_peer_connection_t));

    job->peer.sockaddr = zone->backend->sockaddr;
    job->peer.socklen = zone->backend->socklen;
    job->peer.name = &zone->backend->name;
    job->peer.get = ngx_event_get_peer;
    job->peer.log = job->log;
    job->peer.log_error = NGX_ERROR_ERR;

    rc = ngx_event_connect_peer(&job->peer);

    if (rc == NGX_ERROR || rc == NGX_BUSY || rc == NGX_DECLINED) {
        ngx_log_error(NGX_LOG_ERR, job->log, 0,
                      "llama_session: idle save cannot connect to \"%V\"",
                      &zone->backend_name);
        if (job->peer.connection) {
            ngx_close_connection(job->peer.connection);
            job->peer.connection = NULL;
        }
        return NGX_ERROR;
    }

    c = job->peer.connection;
    c->data = job;
    c->pool = job->pool;
    c->log = job->log;
    c->read->log = job->log;
    c->write->log = job->log;

    c->write->handler = ngx_http_llama_session_idle_write;
    c->read->handler = ngx_http_llama_session_idle_read;

    if (rc == NGX_AGAIN) {
        ngx_add_timer(c->write, 5000);
        return NGX_OK;
    }

    ngx_http_llama_session_idle_write(c->write);

    return NGX_OK;
}


static void
ngx_http_llama_session_idle_write(ngx_event_t *wev)
{
    ssize_t                         n;
    ngx_connection_t               *c;
    ngx_http_llama_session_idle_t  *job;

    c = wev->data;
    job = c->data;

    if (wev->timedout) {
        ngx_log_error(NGX_LOG_ERR, job->log, NGX_ETIMEDOUT,
                      "llama_session: idle save: \"%V\" timed out",
                      &job->ctx.zone->backend_name);
        ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
        return;
    }

    if (wev->timer_set) {
        ngx_del_timer(wev);
    }

    while (job->out->pos < job->out->last) {
        n = c->send(c, job->out->pos, job->out->last - job->out->pos);

        if (n == NGX_AGAIN) {
            ngx_add_timer(wev, 5000);

            if (ngx_handle_write_event(wev, 0) != NGX_OK) {
                ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
            }

            return;
        }

        if (n == NGX_ERROR || n == 0) {
            ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
            return;
        }

        job->out->pos += n;
    }

    wev->handler = ngx_http_empty_handler;

    /* a save of a large state takes its time */

    ngx_add_timer(c->read, job->ctx.call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE
                           ? 600000 : 10000);

    if (c->read->ready) {
        ngx_http_llama_session_idle_read(c->read);
    }
}


static void
ngx_http_llama_session_idle_read(ngx_event_t *rev)
{
    size_t                          size;
    ssize_t                         n;
    ngx_buf_t                      *b;
    ngx_connection_t               *c;
    ngx_http_llama_session_idle_t  *job;

    c = rev->data;
    job = c->data;

    if (rev->timedout) {
        ngx_log_error(NGX_LOG_ERR, job->log, NGX_ETIMEDOUT,
                      "llama_session: idle save: \"%V\" timed out",
                      &job->ctx.zone->backend_name);
        ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
        return;
    }

    for ( ;; ) {
        b = job->in;

        if (b->last == b->end) {
            size = 2 * (b->end - b->start);

            if (size > NGX_HTTP_LLAMA_SESSION_IDLE_REPLY_MAX) {
                break;
            }

            b = ngx_create_temp_buf(job->pool, size);
            if (b == NULL) {
                ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
                return;
            }

            b->last = ngx_cpymem(b->last, job->in->pos,
                                 job->in->last - job->in->pos);
            job->in = b;
        }

        n = c->recv(c, b->last, b->end - b->last);

        if (n == NGX_AGAIN) {
            if (ngx_handle_read_event(rev, 0) != NGX_OK) {
                ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
            }

            return;
        }

        if (n == NGX_ERROR) {
            ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
            return;
        }

        if (n == 0) {
            break;
        }

        b->last += n;

        if (ngx_http_llama_session_idle_complete(b)) {
            break;
        }
    }

    ngx_close_connection(c);
    job->peer.connection = NULL;

    ngx_http_llama_session_idle_reply(job);
}


/* has the reply come whole?  By its Content-Length, else at the close */

static ngx_uint_t
ngx_http_llama_session_idle_complete(ngx_buf_t *b)
{
    u_char     *end, *p;
    ngx_int_t   len;

    end = ngx_strlcasestrn(b->pos, b->last, (u_char *) CRLF CRLF, 4 - 1);
    if (end == NULL) {
        return 0;
    }

    if (ngx_strlcasestrn(b->pos, end,
                         (u_char *) CRLF "transfer-encoding: chunked",
                         sizeof(CRLF "transfer-encoding: chunked") - 2))
    {
        /* llama-server's router passes its children's replies chunked */
        return ngx_http_llama_session_idle_chunks(end + 4, b->last, 0)
               != NULL;
    }

    p = ngx_strlcasestrn(b->pos, end, (u_char *) CRLF "content-length:",
                         sizeof(CRLF "content-length:") - 2);
    if (p == NULL) {
        return 0;
    }

    p += sizeof(CRLF "content-length:") - 1;

    while (p < end && *p == ' ') {
        p++;
    }

    len = 0;

    while (p < end && *p >= '0' && *p <= '9') {
        len = len * 10 + (*p++ - '0');

        if (len > NGX_HTTP_LLAMA_SESSION_IDLE_REPLY_MAX) {
            return 1;
        }
    }

    return b->last - (end + 4) >= len;
}


/*
 * A chunked body from p: NULL while it is not whole; else its end.  With
 * decode, the chunks' data is moved together in place (it only shrinks)
 * and the end of the data is returned.
 */

static u_char *
ngx_http_llama_session_idle_chunks(u_char *p, u_char *last, ngx_uint_t decode)
{
    u_char  *out;
    size_t   size;

    out = p;

    for ( ;; ) {
        size = 0;

        while (p < last && ((*p >= '0' && *p <= '9')
                            || (*p >= 'a' && *p <= 'f')
                            || (*p >= 'A' && *p <= 'F')))
        {
            if (size > NGX_HTTP_LLAMA_SESSION_IDLE_REPLY_MAX) {
                return NULL;
            }

            size = size * 16 + ((*p <= '9') ? (size_t) (*p - '0')
                                : (size_t) ((*p | 0x20) - 'a' + 10));
            p++;
        }

        /* chunk extensions up to the line's end */

        while (p < last && *p != LF) {
            p++;
        }

        if (p == last) {
            return NULL;
        }

        p++;

        if (size == 0) {
            return decode ? out : p;
        }

        if ((size_t) (last - p) < size + 2) {
            return NULL;
        }

        if (decode) {
            ngx_memmove(out, p, size);
            out += size;
        }

        p += size + 2;
    }
}


/* the whole reply is in: status line, headers, JSON body */

static void
ngx_http_llama_session_idle_reply(ngx_http_llama_session_idle_t *job)
{
    u_char                         *p, *body;
    ngx_int_t                       status;
    ngx_uint_t                      processing, reason;
    ngx_buf_t                      *b;
    ngx_http_llama_session_ctx_t   *ctx;

    ctx = &job->ctx;
    b = job->in;

    status = 0;

    if (b->last - b->pos > 12 && ngx_strncmp(b->pos, "HTTP/1.", 7) == 0) {
        status = ngx_atoi(b->pos + 9, 3);
    }

    body = ngx_strlcasestrn(b->pos, b->last, (u_char *) CRLF CRLF, 4 - 1);

    if (status == NGX_ERROR || status == 0 || body == NULL) {
        ngx_log_error(NGX_LOG_ERR, job->log, 0,
                      "llama_session: idle save: no valid reply from \"%V\"",
                      &ctx->zone->backend_name);
        ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
        return;
    }

    p = body + 4;

    if (ngx_strlcasestrn(b->pos, body,
                         (u_char *) CRLF "transfer-encoding: chunked",
                         sizeof(CRLF "transfer-encoding: chunked") - 2))
    {
        b->last = ngx_http_llama_session_idle_chunks(p, b->last, 1);

        if (b->last == NULL) {
            ngx_log_error(NGX_LOG_ERR, job->log, 0,
                          "llama_session: idle save: a chunked reply from "
                          "\"%V\" ended early", &ctx->zone->backend_name);
            ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
            return;
        }
    }

    ctx->call_status = status;
    ctx->call_reply = ngx_calloc_buf(job->pool);
    if (ctx->call_reply == NULL) {
        ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
        return;
    }

    ctx->call_reply->pos = p;
    ctx->call_reply->last = b->last;

    if (ctx->call == NGX_HTTP_LLAMA_SESSION_CALL_GET) {

        processing = 0;

        if (status != NGX_HTTP_OK
            || ngx_http_llama_session_parse_slots(job->log, ctx, &processing)
               != NGX_OK)
        {
            if (status == NGX_HTTP_BAD_REQUEST && ctx->zone->model.len) {
                /*
                 * router mode: the model is not running (unloaded or
                 * failed behind the module's back), its slots are empty
                 */
                ngx_log_error(NGX_LOG_WARN, job->log, 0,
                              "llama_session: idle save: the router's model "
                              "\"%V\" is not running, \"%*s\" lost its "
                              "turns since its last save",
                              &ctx->zone->model, ctx->out_len, ctx->out_key);

                ngx_http_llama_session_release(ctx,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
                (void) ngx_http_llama_session_model_reset(ctx->zone, NULL,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY);
                ngx_http_llama_session_stat(ctx,
                                          &ctx->zone->sh->stats.model_lost);
                job->failed = 0;

            } else if (status == NGX_HTTP_NOT_IMPLEMENTED) {
                /* --no-slots: nothing is saved until a request changes it */
                ngx_log_error(NGX_LOG_WARN, job->log, 0,
                              "llama_session: idle save: GET /slots answered "
                              "501, \"%*s\" is not saved: start llama-server "
                              "with --slots", ctx->out_len, ctx->out_key);

                ngx_http_llama_session_slot_saved(ctx->zone, ctx->slot,
                                                  ctx->out_key, ctx->out_len);
                job->failed = 0;

            } else {
                ngx_log_error(NGX_LOG_ERR, job->log, 0,
                              "llama_session: idle save: GET /slots answered "
                              "%i", status);
            }

            ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
            return;
        }

        job->failed = 0;

        if (ngx_http_llama_session_slot_task(ctx, ctx->slot_task)) {
            ngx_log_error(NGX_LOG_WARN, job->log, 0,
                          "llama_session: llama-server restarted (slot %ui "
                          "shows task %i), the slot no longer holds \"%*s\"",
                          ctx->slot, ctx->slot_task, ctx->out_len,
                          ctx->out_key);
            ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
            return;
        }

        ctx->slots_checked = 1;

        if (processing || !ngx_http_llama_session_may_save(ctx)) {
            /* still running for a client that left, or nothing to save */
            ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
            return;
        }

        job->failed = 1;

        if (ngx_http_llama_session_idle_send(job,
                                             NGX_HTTP_LLAMA_SESSION_CALL_SAVE)
            != NGX_OK)
        {
            ngx_http_llama_session_idle_done(job,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
        }

        return;
    }

    /* the save, with the checks and the commit of every other save */

    reason = ctx->zone->sh->unloading ? NGX_HTTP_LLAMA_SESSION_SAVE_UNLOAD
                                      : NGX_HTTP_LLAMA_SESSION_SAVE_IDLE;

    if (ngx_http_llama_session_save_done(job->log, ctx, reason,
                                         ctx->out_key, ctx->out_len)
        == NGX_OK)
    {
        job->failed = 0;

        ngx_http_llama_session_stat(ctx, &ctx->zone->sh->stats.idle_saves);

        ngx_log_error(NGX_LOG_INFO, job->log, 0,
                      "llama_session: idle save of \"%*s\" from slot %ui of "
                      "zone \"%V\": %ui tokens, %O bytes in %.1f ms",
                      ctx->out_len, ctx->out_key, ctx->slot,
                      &ctx->zone->name, ctx->saved_tokens, ctx->saved_bytes,
                      ctx->save_ms);
    }

    ngx_http_llama_session_idle_done(job, NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
}


static void
ngx_http_llama_session_idle_done(ngx_http_llama_session_idle_t *job,
    ngx_uint_t state)
{
    ngx_http_llama_session_zone_t  *zone;

    if (job->peer.connection) {
        ngx_close_connection(job->peer.connection);
        job->peer.connection = NULL;
    }

    if (job->ctx.call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE) {
        /* committed (renamed) or not: no temporary file stays */
        ngx_http_llama_session_store_drop_tmp(job->log, &job->ctx,
                                              job->ctx.out_key,
                                              job->ctx.out_len);
    }

    ngx_http_llama_session_release(&job->ctx, state);
    ngx_http_llama_session_wake_local();

    zone = job->ctx.zone;
    zone->idle_busy = 0;

    if (job->failed) {
        zone->idle_backoff = ngx_min(ngx_max(zone->idle_backoff * 2, 1000),
                                     60000);
        zone->idle_next = ngx_current_msec + zone->idle_backoff;

    } else {
        zone->idle_backoff = 0;
    }

    ngx_destroy_pool(job->pool);
}
