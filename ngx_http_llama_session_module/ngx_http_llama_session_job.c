
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The slot job: what every caller (a client's request, the management
 * API, the idle saver, the router's switch) does to one slot, and the one
 * way it talks to llama-server, the slot calls of call.c: subrequests to
 * the slots location (llama_session_slots_uri), with its proxy_pass, TLS,
 * keepalive and proxy_set_header Authorization.
 *
 * Work that no client asked for (an idle save) runs in a request of the
 * module's own: a connection with no client behind it (its descriptor is
 * /dev/null's, nothing is ever read from it or written to it, as the
 * slot calls' replies are captured by call.c) and a main request in the
 * server and location of the zone's first "llama_session" (or
 * "llama_session_api") location.  Its pool's cleanup ends the job, however
 * the request ends.
 *
 * A job's states (ctx->job->state, set only by job_state(), which logs
 * each change at debug level) and what each may touch; identity (ctx's
 * own fields) is set before ACQUIRE and only read after it:
 *
 *   state     slot held   call in flight          may change
 *   BODY      no          none                    identity (body.c)
 *   ACQUIRE   no (queue)  none                    ticket, ctx's waiter
 *   ROUTER    yes         GET /models, /props,    ctx->route (router.c)
 *                         POST /models/(un)load
 *   PROPS     yes or no   GET /props, /v1/models  props_*, the zone's
 *                                                 fingerprint, job.fp
 *   CHECK     yes         GET /slots              slot_tokens, slot_task,
 *                                                 slots_checked, restarted
 *   PAUSE     yes         none (a timer)          polls, ctx->delay
 *   SAVE      yes         POST ?action=save       out_key's file (.tmp),
 *                                                 saved_*, save_failed
 *   LOAD      yes         POST ?action=restore    loaded_*, the slot
 *                         or erase                (unknown until it
 *                                                 answers)
 *   WARM      yes         restore, erase, prime,  ctx->warm (warm.c)
 *                         save of a base
 *   PROXY     yes         none: proxy_pass runs   ctx's r_* (reply.c)
 *   DONE      no          none                    nothing
 *   OLLAMA    no          GET /v1/models          ctx's ollama_reply
 *   REPRIME   yes         POST /apply-template,   ctx->job->reprime, the
 *                         /completion             slot (a prefix of the
 *                                                 session leaving)
 *
 * Every state may start a call (call, call_* and capture, call.c) and
 * end the job (released, quarantine).  The end of a job gives the slot
 * back with what it holds decided from its state (job_finish() in call.c
 * for a request, the idle saver's end for its own).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_cost.h"
#include "ngx_http_llama_session_gguf.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_metrics.h"
#include "ngx_http_llama_session_index.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_slots.h"
#include "ngx_http_llama_session_store.h"
#include "ngx_http_llama_session_turn.h"


static u_char *ngx_http_llama_session_job_log(ngx_log_t *log, u_char *buf,
    size_t len);
static ngx_connection_t *ngx_http_llama_session_job_connection(
    ngx_http_llama_session_zone_t *zone, ngx_log_t *log);
static void ngx_http_llama_session_job_drop(ngx_connection_t *c,
    ngx_http_llama_session_zone_t *zone);
static void ngx_http_llama_session_job_wake(ngx_event_t *ev);
static void ngx_http_llama_session_job_event(ngx_event_t *ev);


#if (NGX_DEBUG)

/* the job states' names, for the debug log only */

static char  *ngx_http_llama_session_state_names[] = {
    "body", "acquire", "router", "props", "check", "pause", "save", "load",
    "warm", "proxy", "done", "ollama", "bind", "reprime", "look",
    "turn"
};

#endif


/* every change of a job's state goes through here, for the debug log */

void
ngx_http_llama_session_job_state(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state)
{
    ngx_uint_t  seq;

    ngx_log_debug6(NGX_LOG_DEBUG_HTTP,
                   ctx->request ? ctx->request->connection->log
                                : ngx_cycle->log, 0,
                   "llama_session: job of \"%*s\" on slot %ui: %s -> %s%s",
                   ctx->key_len ? ctx->key_len : ctx->job->out_len,
                   ctx->key_len ? ctx->key : ctx->job->out_key, ctx->job->slot,
                   ngx_http_llama_session_state_names[ctx->job->state],
                   ngx_http_llama_session_state_names[state],
                   ctx->job->own ? " (the module's own request)" : "");

    ctx->job->state = state;

    if (ctx->job->acquired && !ctx->job->released
        && (state == NGX_HTTP_LLAMA_SESSION_ST_LOAD
            || state == NGX_HTTP_LLAMA_SESSION_ST_WARM
            || state == NGX_HTTP_LLAMA_SESSION_ST_PROXY))
    {
        /*
         * the slot's content changes: its last turn no longer tells it,
         * and its text goes; only the slot's holder touches turn_seq, no
         * lock is needed
         */

        seq = ctx->zone->sh->slots[ctx->job->slot].turn_seq;

        if (seq) {
            ctx->zone->sh->slots[ctx->job->slot].turn_seq = 0;
            ngx_http_llama_session_turn_drop(ctx->zone, ctx->job->slot, seq,
                                             ctx->request
                                             ? ctx->request->connection->log
                                             : ngx_cycle->log);
        }
    }
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

    ctx->job->slots_checked = 0;

    if (ctx->job->call_status == NGX_HTTP_BAD_REQUEST && ctx->zone->model.len) {
        /* router mode: the model is not running (it went, or failed) */
        return NGX_HTTP_LLAMA_SESSION_SLOTS_MODEL_GONE;
    }

    if (ctx->job->call_status == NGX_HTTP_NOT_IMPLEMENTED) {
        /* --no-slots: nothing can be looked at, nor vouched for */
        ctx->job->slot_tokens = -1;
        return NGX_HTTP_LLAMA_SESSION_SLOTS_NO_API;
    }

    if (ctx->job->call_status != NGX_HTTP_OK) {
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

    if (ngx_http_llama_session_slot_task(ctx->zone, ctx->job,
                                         ctx->job->slot_task))
    {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: llama-server restarted (slot %ui shows "
                      "task %i), the slot no longer holds \"%*s\" (zone "
                      "\"%V\")", ctx->job->slot, ctx->job->slot_task,
                      ctx->job->out_len ? ctx->job->out_len : 1,
                      ctx->job->out_len ? ctx->job->out_key : (u_char *) "-",
                      &ctx->zone->name);

        return NGX_HTTP_LLAMA_SESSION_SLOTS_RESTARTED;
    }

    ctx->job->slots_checked = 1;

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

    ctx->job->restarted = 1;
    ctx->job->save_pending = 0;
    ctx->job->out_len = 0;
}


/*
 * shared=on: the slot holds the session, but another owner saved a newer
 * state of it since (slot_newer()): no hit after all, the slot's state is
 * not saved, the session comes back from the newer file.
 */

void
ngx_http_llama_session_slot_stale(ngx_http_llama_session_ctx_t *ctx)
{
    /* kept, should the hit be one after all (files()) */
    ctx->job->stale_verify = ctx->verify;

    ctx->verify = 0;
    ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_NONE;
    ctx->job->stale = 1;
    ctx->job->save_pending = 0;
    ctx->job->out_len = 0;
}


/*
 * May the slot be saved?  Only after a GET /slots in the same hold of the
 * slot showed it idle, holding tokens, and llama-server not restarted:
 * else the state may be empty, or another session's.
 */

ngx_uint_t
ngx_http_llama_session_may_save(ngx_http_llama_session_ctx_t *ctx)
{
    return ctx->job->save_pending && ctx->job->slots_checked
        && ctx->job->slot_tokens > 0
           && !ctx->job->restarted;
}


/*
 * The end of a save, the same for a swap, an idle save and the API: the
 * reply must say the slot held tokens, and with store= the file must be
 * what llama-server says it wrote (it does not check its last fclose: a
 * full disk or NFS can answer 200 with a short file).  Then the file
 * takes its name and the session is recorded.  Else its previous file is
 * kept, untouched.  NGX_OK: saved.  With the zone's threads the commit's
 * file calls run in one: NGX_AGAIN, and the caller calls again when "wake"
 * is woken.
 */

ngx_int_t
ngx_http_llama_session_save_done(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t reason, u_char *key,
    size_t len, ngx_event_t *wake)
{
    off_t        bytes;
    double       ms;
    ngx_int_t    rc;
    ngx_uint_t   tokens;
    const char  *what;

    static const char  *reasons[] = {
        "swap", "idle save", "API", "save before an unload", "base"
    };

    what = reasons[reason];
    tokens = 0;
    bytes = 0;
    ms = 0;

    if (ctx->job->call_status == NGX_HTTP_OK
        && ngx_http_llama_session_parse_action(log, ctx, &tokens, &bytes, &ms)
           == NGX_OK)
    {
        if (tokens == 0) {
            ngx_log_error(NGX_LOG_ERR, log, 0,
                          "llama_session: %s: llama-server saved no tokens "
                          "of session \"%*s\" from slot %ui, nothing is "
                          "kept of it", what, len, key, ctx->job->slot);

        } else if ((rc = ngx_http_llama_session_store_commit(log, ctx, key,
                                                             len, bytes,
                                                             tokens, wake))
                   == NGX_AGAIN)
        {
            return NGX_AGAIN;

        } else if (rc == NGX_DECLINED) {
            /*
             * shared=on: another owner saved a newer state of the session
             * meanwhile; nothing of the slot's is to be kept, now or later
             */

            ngx_http_llama_session_slot_saved(ctx->zone, ctx->job, key,
                                              len);
            ngx_http_llama_session_stat(&ctx->zone->sh->stats.newer_saves);

            return NGX_DECLINED;

        } else if (rc == NGX_OK) {
            if (key == ctx->job->out_key) {
                ctx->job->saved_tokens = tokens;
                ctx->job->saved_bytes = bytes;
                ctx->job->save_ms = ms;

            } else {
                ctx->warm->base_tokens = tokens;
                ctx->warm->base_bytes = bytes;
                ctx->warm->base_ms = ms;
            }

            ngx_http_llama_session_store_saved(log, ctx, key, len, tokens,
                                            bytes);
            ngx_http_llama_session_save_stat(ctx->zone, reason, 1, bytes, ms);

            return NGX_OK;
        }
    }

    if (ctx->zone->store.len == 0 && ctx->job->call_status == NGX_HTTP_OK) {
        /* llama-server wrote over the file itself: it cannot be trusted */
        ngx_http_llama_session_file_saved(ctx->zone, ctx->job, key, len, 0,
                                          0, 0, 0);
    }

    if (ctx->job->store_silent) {
        /* its commit goes on in a thread (io.c), logged: nothing more */
        ngx_http_llama_session_save_stat(ctx->zone, reason, 0, 0, 0);
        return NGX_ERROR;
    }

    /* a full disk: room made, the save sent once more */

    rc = ngx_http_llama_session_store_room_after(log, ctx, key, len, wake);

    if (rc == NGX_AGAIN) {
        /* the look at the disk in a thread: back here after it */
        return NGX_AGAIN;
    }

    if (rc == NGX_OK) {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: the save of \"%*s\" failed on a full "
                      "disk (%i), sent again after the eviction", len, key,
                      ctx->job->call_status);

        /* call() makes no room again for it; call_done() clears the flag */
        ctx->job->call_retried = 1;

        if (ngx_http_llama_session_call(ctx->request, ctx,
                                        NGX_HTTP_LLAMA_SESSION_CALL_SAVE,
                                        key, len)
            == NGX_AGAIN)
        {
            return NGX_AGAIN;
        }

        ctx->job->call_retried = 0;

        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: the save of \"%*s\" could not be sent "
                      "again", len, key);
    }

    ngx_http_llama_session_store_drop_tmp(log, ctx, key, len);

    if (ngx_http_llama_session_media_refused(log, ctx, key, len) == NGX_OK) {
        ctx->job->media_refused = 1;
        return NGX_ERROR;
    }

    ngx_http_llama_session_stat(&ctx->zone->sh->stats.save_errors);
    ngx_http_llama_session_save_stat(ctx->zone, reason, 0, 0, 0);

    ngx_log_error(NGX_LOG_ERR, log, 0,
                  "llama_session: %s: saving session \"%*s\" from slot %ui "
                  "failed (%i: \"%*s\"), its previous file is kept and its "
                  "latest turns are lost", what,
                  len, key, ctx->job->slot, ctx->job->call_status,
                  ctx->job->call_reply
                  ? ngx_min(ctx->job->call_reply->last
                            - ctx->job->call_reply->pos, 200)
                  : 0,
                  ctx->job->call_reply ? ctx->job->call_reply->pos
                      : (u_char *) "");

    return NGX_ERROR;
}


/*
 * A save llama-server refused because the slot holds media it cannot
 * serialise (501 "Cannot serialize media chunk", builds before v0.4.0's
 * placeholders, or another kind of media): no error, the conversation
 * goes on; its previous file, if any, stays (a prefix of it).  Said once
 * per session at info, counted; the zone keeps such a session in its
 * slot while another can go (choose_locked()).  NGX_OK: it was that.
 */

ngx_int_t
ngx_http_llama_session_media_refused(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len)
{
    uint32_t                        hash;
    ngx_buf_t                      *b;
    ngx_uint_t                      i, said;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *zone;

    b = ctx->job->call_reply;

    if (ctx->job->call_status != NGX_HTTP_NOT_IMPLEMENTED || b == NULL
        || ngx_strlcasestrn(b->pos, b->last, (u_char *) "media", 5 - 1)
           == NULL)
    {
        return NGX_DECLINED;
    }

    zone = ctx->zone;
    sh = zone->sh;
    hash = ngx_crc32_short(key, len);
    said = 0;

    (void) ngx_atomic_fetch_add(&sh->stats.media_unsaved, 1);

    ngx_shmtx_lock(&zone->shpool->mutex);

    sh->media_refused = 1;
    ngx_memcpy(sh->media_refused_fp, ctx->job->fp,
               NGX_HTTP_LLAMA_SESSION_FP_LEN);

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_MEDIA_SAID; i++) {
        if (sh->media_said[i] == hash) {
            said = 1;
            break;
        }
    }

    if (!said) {
        sh->media_said[sh->media_said_next++
                       % NGX_HTTP_LLAMA_SESSION_MEDIA_SAID] = hash;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (!said) {
        ngx_log_error(NGX_LOG_INFO, log, 0,
                      "llama_session: llama-server cannot save slot %ui: "
                      "session \"%*s\" holds media it does not serialise "
                      "(%*s); it stays in its slot while another can go, "
                      "else its history is prefilled again when it returns",
                      ctx->job->slot, len, key,
                      ngx_min(b->last - b->pos, 200), b->pos);
    }

    return NGX_OK;
}


/*
 * The end of a restore, the same for a session and a warm start's base:
 * the reply's figures kept (loaded_*), the bytes and time counted; or the
 * file forgotten (a missing, foreign or damaged file: llama-server left
 * the slot empty) and the failure logged.  NGX_OK: restored.
 */

ngx_int_t
ngx_http_llama_session_restore_done(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    off_t                           bytes;
    size_t                          n;
    double                          ms;
    ngx_uint_t                      tokens, level;
    ngx_buf_t                      *b;
    ngx_http_llama_session_node_t   node;

    tokens = 0;
    bytes = 0;
    ms = 0;

    if (ctx->job->call_status == NGX_HTTP_OK
        && ngx_http_llama_session_parse_action(log, ctx, &tokens, &bytes, &ms)
           == NGX_OK)
    {
        ctx->job->loaded_tokens = tokens;
        ctx->job->loaded_bytes = bytes;
        ctx->job->load_ms = ms;
        /* was the file re-primed before its save (reply.c's proof)? */
        n = ngx_http_llama_session_file_name(name, key, len, ctx->job->fp);
        ctx->job->loaded_primed =
            ngx_http_llama_session_node_info(ctx->zone, name, n, &node)
            == NGX_OK && node.saved && node.primed;

        (void) ngx_atomic_fetch_add(&ctx->zone->sh->metrics.bytes_restored,
                                    (ngx_atomic_uint_t) bytes);
        ngx_http_llama_session_observe(&ctx->zone->sh->metrics.restore, ms);

        /* the disk's speed, for when a restore pays (cost.c) */
        ngx_http_llama_session_cost_restore(ctx->zone, ctx->job->fp, bytes, ms);

        if (ctx->zone->shared && tokens) {
            /* another owner's file, maybe: indexed from now on */
            ngx_http_llama_session_file_saved(ctx->zone, ctx->job, key, len,
                                              key == ctx->base_key, 1,
                                              tokens, bytes);
        }

        return NGX_OK;
    }

    ngx_http_llama_session_file_saved(ctx->zone, ctx->job, key, len, 0, 0,
                                      0, 0);

    /* a 400 for a file the zone never knew is no error: it may not exist */

    if (ctx->job->call_status != NGX_HTTP_BAD_REQUEST
        || ngx_http_llama_session_file_known(ctx->zone, ctx->job->fp, key,
                                             len)
           != -1)
    {
        ngx_http_llama_session_stat(&ctx->zone->sh->stats.restore_errors);
    }

    level = ctx->zone->store.len ? NGX_LOG_WARN : NGX_LOG_INFO;
    b = ctx->job->call_reply;

    ngx_log_error(level, log, 0,
                  "llama_session: restoring %s \"%*s\" into slot %ui failed "
                  "(%i: \"%*s\"), it %s",
                  key == ctx->key ? "session" : "base", len, key,
                  ctx->job->slot, ctx->job->call_status,
                  b ? ngx_min(b->last - b->pos, 200) : 0,
                  b ? b->pos : (u_char *) "",
                  key == ctx->key ? "starts fresh" : "is made anew");

    return NGX_ERROR;
}


/*
 * The fingerprint's two calls, for the request path and the API alike:
 * once GET /props answered, GET /v1/models; once that answered, the
 * fingerprint is set.  NGX_AGAIN: the next call is on its way; NGX_OK:
 * known; NGX_ERROR: the backend failed the call in ctx->job->call; else an
 * HTTP status to end with.
 */

ngx_int_t
ngx_http_llama_session_learn(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_PROPS) {

        if (ctx->job->call_status != NGX_HTTP_OK
            || ngx_http_llama_session_parse_props(r, ctx) != NGX_OK)
        {
            return NGX_ERROR;
        }

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_MODELS,
                                           NULL, 0);
    }

    if (ctx->job->call_status == 0
        || ngx_http_llama_session_parse_models(r, ctx) != NGX_OK)
    {
        return NGX_ERROR;
    }

    /* what a slot file can bring back on this model (gguf.c) */
    ngx_http_llama_session_memory_learn(r, ctx);

    return NGX_OK;
}


/*
 * A request of the module's own in the zone's first location, for a job
 * no client asked for; NULL when it cannot be made (logged).  The caller
 * sets its context and its pool cleanup, which ends the job, and resumes
 * in write_event_handler after each slot call, as a client's request.
 */

/*
 * The module's own connection: no client behind it; its log says whose
 * request it is (ngx_http_llama_session_job_log).
 */

static ngx_connection_t *
ngx_http_llama_session_job_connection(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    ngx_fd_t             fd;
    ngx_log_t           *clog;
    ngx_connection_t    *c;
    struct sockaddr_in  *sin;
    ngx_http_log_ctx_t  *lctx;

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

    return c;

failed:

    ngx_http_llama_session_job_drop(c, zone);

    return NULL;
}


/* a connection of the module's own that no request took */

static void
ngx_http_llama_session_job_drop(ngx_connection_t *c,
    ngx_http_llama_session_zone_t *zone)
{
    ngx_log_error(NGX_LOG_ERR, c->log, 0,
                  "llama_session: the module's own request of zone \"%V\" "
                  "could not be made", &zone->name);

    c->read->active = 0;
    c->write->active = 0;

    if (c->pool) {
        ngx_destroy_pool(c->pool);
        c->pool = NULL;
    }

    ngx_close_connection(c);
}


ngx_http_request_t *
ngx_http_llama_session_job_request(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    ngx_pool_t                 *pool;
    ngx_connection_t           *c;
    ngx_http_request_t         *r;
    ngx_http_log_ctx_t         *lctx;
    ngx_http_conf_ctx_t        *cctx;
    ngx_http_core_main_conf_t  *cmcf;

    cctx = zone->conf_ctx;

    if (cctx == NULL) {
        return NULL;
    }

    c = ngx_http_llama_session_job_connection(zone, log);
    if (c == NULL) {
        return NULL;
    }

    lctx = c->log->data;

    pool = ngx_create_pool(4096, c->log);
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

    ngx_http_llama_session_job_drop(c, zone);

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
                         "of zone \"%V\"", ctx->job->slot, &ctx->zone->name);
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

    ngx_add_timer(&ctx->job->wait_ev, delay ? delay : 1);

    return NGX_AGAIN;
}


/* a job's timer and the wake-up on a local release */

void
ngx_http_llama_session_job_timer(ngx_http_llama_session_ctx_t *ctx)
{
    ctx->job->wait_ev.handler = ngx_http_llama_session_job_wake;
    ctx->job->wait_ev.data = ctx->request;
    ctx->job->wait_ev.log = ctx->request->connection->log;
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


/*
 * The scheduler and the file index take keys and values, never the
 * request (sched.c, index.c): what the request's job asks of them
 */

static void
ngx_http_llama_session_job_ask(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_ask_t *ask)
{
    ngx_memzero(ask, sizeof(ngx_http_llama_session_ask_t));

    ask->key = ctx->key;
    ask->key_len = ctx->key_len;
    ask->base = ctx->base_len ? ctx->base_id : NULL;
    ask->ns = ctx->has_nsk ? ctx->nsk : NULL;
    ask->pool = ctx->job->client ? ctx->request->pool : NULL;
    ask->action = ctx->action;
    ask->unnamed = ctx->default_session;
    ask->media = ctx->media;
    ask->base_file = ctx->warm->base_file;
}


/* takes the slot or waits: sched.c's acquire(), and a hit's verdict */

ngx_int_t
ngx_http_llama_session_job_acquire(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t                     rc;
    ngx_http_llama_session_ask_t  ask;

    ngx_http_llama_session_job_ask(ctx, &ask);

    rc = ngx_http_llama_session_acquire(ctx->zone, ctx->job, &ask);

    if (rc == NGX_OK && ask.action == NGX_HTTP_LLAMA_SESSION_ACTION_HIT) {
        ctx->action = ask.action;
        ctx->verify = ask.verify;
        ctx->hit_dirty = ask.hit_dirty;
        ctx->prev = ask.prev;
        ctx->nprev = ask.nprev;
        ctx->prev_tokens = ask.prev_tokens;
    }

    return rc;
}


/* what the slot holds now, with the request's tenant and system prompt */

void
ngx_http_llama_session_job_slot_set(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state, u_char *key, size_t len, ngx_uint_t dirty)
{
    ngx_http_llama_session_ask_t  ask;

    ngx_http_llama_session_job_ask(ctx, &ask);

    ngx_http_llama_session_slot_set(ctx->zone, ctx->job, &ask, state, key,
                                    len, dirty);
}


/* records the request's session, or its base, for the API (index.c) */

void
ngx_http_llama_session_job_remember(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len, ngx_str_t *id)
{
    ngx_http_llama_session_record_t  rec;

    rec.id = id;
    rec.model = &ctx->model;
    rec.sys = ctx->sys_len ? ctx->sys : NULL;
    rec.idk = (key == ctx->key) ? ctx->idk : NULL;
    rec.ns = ctx->has_nsk ? ctx->nsk : NULL;

    ngx_http_llama_session_remember(ctx->zone, ctx->job->fp, key, len, &rec);
}
