
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The shared-memory zone: what each slot holds, who holds it, who waits
 * for it (one FIFO per zone), and which sessions have a saved file.
 * Every access is under the zone's mutex; nothing here does I/O.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_shm.h"


static ngx_http_llama_session_node_t *ngx_http_llama_session_lookup(
    ngx_http_llama_session_sh_t *sh, u_char *name, size_t len,
    uint32_t hash);
static void ngx_http_llama_session_rbtree_insert(ngx_rbtree_node_t *temp,
    ngx_rbtree_node_t *node, ngx_rbtree_node_t *sentinel);
static void ngx_http_llama_session_prune(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_slot_t *slot, ngx_log_t *log);
static void ngx_http_llama_session_unqueue_locked(
    ngx_http_llama_session_ctx_t *ctx);
static ngx_uint_t ngx_http_llama_session_count_batch(
    ngx_http_llama_session_sh_t *sh, ngx_http_llama_session_slot_t *slot);
static void ngx_http_llama_session_reap_locked(
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_slot_t *slot);
static void ngx_http_llama_session_take_locked(
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_slot_t *slot);
static ngx_uint_t ngx_http_llama_session_alive(ngx_pid_t pid, uint64_t start);
static ngx_int_t ngx_http_llama_session_acquire_many(
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_enqueue_locked(
    ngx_http_llama_session_ctx_t *ctx);
static void ngx_http_llama_session_granted_locked(
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_slot_t *slot,
    ngx_uint_t hit);
static ngx_int_t ngx_http_llama_session_choose_locked(
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t spare);
static ngx_uint_t ngx_http_llama_session_waited_locked(
    ngx_http_llama_session_sh_t *sh, u_char *key, size_t len);
static ngx_int_t ngx_http_llama_session_slot_of_locked(
    ngx_http_llama_session_sh_t *sh, u_char *key, size_t len);
static ngx_uint_t ngx_http_llama_session_wanted_locked(
    ngx_http_llama_session_sh_t *sh, ngx_http_llama_session_slot_t *slot);
static uint64_t ngx_http_llama_session_proc_start(ngx_pid_t pid);
static void ngx_http_llama_session_slot_forget(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_slot_t *slot,
    ngx_uint_t state);


/* how long a free slot may see no grant before the queue is checked */
#define NGX_HTTP_LLAMA_SESSION_STALL     200

/* how long a slot is held before its owner is checked, and how often */
#define NGX_HTTP_LLAMA_SESSION_OWNER_CHECK  1000


/* when this process started (/proc/PID/stat), with its pid its identity */
static uint64_t  ngx_http_llama_session_self_start;


/* requests of this worker that wait for a slot, woken on a local release */

static ngx_queue_t  ngx_http_llama_session_waiting = {
    &ngx_http_llama_session_waiting, &ngx_http_llama_session_waiting
};


ngx_int_t
ngx_http_llama_session_init_zone(ngx_shm_zone_t *shm_zone, void *data)
{
    ngx_http_llama_session_zone_t  *ozone = data;

    size_t                          len;
    ngx_uint_t                      i;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *zone;

    zone = shm_zone->data;

    if (ozone) {
        if (ozone->sh->magic != NGX_HTTP_LLAMA_SESSION_MAGIC
            || ozone->sh->version != NGX_HTTP_LLAMA_SESSION_VERSION)
        {
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "llama_session zone \"%V\" has layout version %uD, "
                          "this module needs %d: restart nginx instead of "
                          "reloading it", &shm_zone->shm.name,
                          ozone->sh->version, NGX_HTTP_LLAMA_SESSION_VERSION);
            return NGX_ERROR;
        }

        if (ozone->sh->waiters_max != zone->waiters_max) {
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "llama_session zone \"%V\" uses max_waiting=%ui "
                          "while previously it used %ui: restart nginx to "
                          "change it", &shm_zone->shm.name,
                          zone->waiters_max, ozone->sh->waiters_max);
            return NGX_ERROR;
        }

        if (ozone->nslots != zone->nslots) {
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "llama_session zone \"%V\" uses slots=%ui while "
                          "previously it used slots=%ui: restart nginx to "
                          "change it", &shm_zone->shm.name, zone->nslots,
                          ozone->nslots);
            return NGX_ERROR;
        }

        if (zone->models == NULL
            && (ozone->model.len != zone->model.len
                || ngx_strncmp(ozone->model.data, zone->model.data,
                               zone->model.len) != 0))
        {
            /* its slots' contents and fingerprint are the old model's */
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "llama_session zone \"%V\" drives model \"%V\" "
                          "while previously it drove \"%V\": restart nginx "
                          "to change it", &shm_zone->shm.name, &zone->model,
                          &ozone->model);
            return NGX_ERROR;
        }

        zone->sh = ozone->sh;
        zone->shpool = ozone->shpool;

        /* a reload: the old workers exit without their saves at stop */
        zone->generation = ++zone->sh->cycles;

        return NGX_OK;
    }

    zone->shpool = (ngx_slab_pool_t *) shm_zone->shm.addr;

    if (shm_zone->shm.exists) {
        zone->sh = zone->shpool->data;
        zone->generation = ++zone->sh->cycles;
        return NGX_OK;
    }


    sh = ngx_slab_calloc(zone->shpool, sizeof(ngx_http_llama_session_sh_t));
    if (sh == NULL) {
        return NGX_ERROR;
    }

    zone->sh = sh;
    zone->shpool->data = sh;

    sh->magic = NGX_HTTP_LLAMA_SESSION_MAGIC;
    sh->version = NGX_HTTP_LLAMA_SESSION_VERSION;
    sh->nslots = zone->nslots;
    sh->next_ticket = 1;
    sh->cycles = 1;
    zone->generation = 1;

    ngx_queue_init(&sh->waiters);
    ngx_queue_init(&sh->free_waiters);
    ngx_queue_init(&sh->lru);
    ngx_queue_init(&sh->nofile);
    ngx_rbtree_init(&sh->rbtree, &sh->sentinel,
                    ngx_http_llama_session_rbtree_insert);

    /*
     * waiting requests have storage of their own, reserved now: records
     * of sessions may fill the rest of the zone, they never take it
     */

    sh->waiters_max = zone->waiters_max;
    sh->waiter_pool = ngx_slab_calloc(zone->shpool, zone->waiters_max
                                      * sizeof(ngx_http_llama_session_waiter_t));
    if (sh->waiter_pool == NULL) {
        ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                      "llama_session zone \"%V\" is too small for "
                      "max_waiting=%ui", &shm_zone->shm.name,
                      zone->waiters_max);
        return NGX_ERROR;
    }

    for (i = 0; i < zone->waiters_max; i++) {
        ngx_queue_insert_tail(&sh->free_waiters, &sh->waiter_pool[i].queue);
    }

    /* after a start nobody can vouch for what the backend's slots hold */

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_SLOTS_MAX; i++) {
        sh->slots[i].state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        sh->slots[i].task = -1;
    }

    len = sizeof(" in llama_session zone \"\"") + shm_zone->shm.name.len;

    zone->shpool->log_ctx = ngx_slab_alloc(zone->shpool, len);
    if (zone->shpool->log_ctx == NULL) {
        return NGX_ERROR;
    }

    ngx_sprintf(zone->shpool->log_ctx, " in llama_session zone \"%V\"%Z",
                &shm_zone->shm.name);

    zone->shpool->log_nomem = 0;

    return NGX_OK;
}


/*
 * Takes the slot for the request or queues it.  NGX_OK: the request holds
 * the slot, and ctx->job.out_key, ctx->action tell what the slot held;
 * NGX_AGAIN: queued, poll again; NGX_DECLINED: the queue is full.
 *
 * Order: the oldest waiter goes first.  When a session was swapped in, its
 * requests that were already waiting then may go before the next swap.
 * A poll costs the same whatever the queue's length; only a queue that
 * stalls (a free slot, nobody taking it) is walked, to drop the waiters
 * of dead workers wherever they stand.
 */

ngx_int_t
ngx_http_llama_session_acquire(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t                        grant, hit, member;
    ngx_queue_t                      *q;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_slot_t    *slot;
    ngx_http_llama_session_zone_t    *zone;
    ngx_http_llama_session_waiter_t  *w;

    zone = ctx->zone;
    sh = zone->sh;

    if (sh->nslots > 1) {
        return ngx_http_llama_session_acquire_many(ctx);
    }

    slot = &sh->slots[ctx->job.slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    ngx_http_llama_session_reap_locked(ctx, slot);

    hit = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
           && slot->key_len == ctx->key_len
           && ngx_memcmp(slot->key, ctx->key, ctx->key_len) == 0);

    grant = 0;
    member = 0;

    if (ngx_http_llama_session_unloading_locked(zone)) {
        /* router mode: the model is being unloaded; wait in the queue */

        if (!ctx->queued
            && ngx_http_llama_session_enqueue_locked(ctx) != NGX_OK)
        {
            return NGX_DECLINED;
        }

    } else if (!ctx->queued) {

        if (!slot->busy && ngx_queue_empty(&sh->waiters)) {
            grant = 1;

        } else if (ngx_http_llama_session_enqueue_locked(ctx) != NGX_OK) {
            return NGX_DECLINED;
        }

    } else if (!slot->busy) {

        if ((ngx_msec_int_t) (ngx_current_msec - slot->free_since)
            >= NGX_HTTP_LLAMA_SESSION_STALL)
        {
            /* nobody took the free slot for a while: who waits really? */
            ngx_http_llama_session_prune(zone, slot,
                                         ctx->request->connection->log);
            slot->free_since = ngx_current_msec;
        }

        member = (hit && ctx->job.ticket < slot->batch
                  && slot->batch_len == ctx->key_len
                  && ngx_memcmp(slot->batch_key, ctx->key, ctx->key_len)
                     == 0);

        if (member) {
            /* waited already when its session was swapped in */
            grant = 1;

        } else if (slot->batch_left == 0
                   || slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                   || slot->key_len != slot->batch_len
                   || ngx_memcmp(slot->key, slot->batch_key, slot->key_len)
                      != 0)
        {
            q = ngx_queue_head(&sh->waiters);
            w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

            grant = (w == ctx->waiter && w->ticket == ctx->job.ticket);
        }
    }

    if (!grant) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_AGAIN;
    }

    if (ctx->queued) {
        ngx_http_llama_session_unqueue_locked(ctx);
    }

    ngx_http_llama_session_take_locked(ctx, slot);
    ngx_http_llama_session_granted_locked(ctx, slot, hit);

    if (!hit) {
        /* requests of this session waiting now go before the next swap */
        slot->batch = sh->next_ticket;
        slot->batch_left = ngx_http_llama_session_count_batch(sh, slot);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return NGX_OK;
}


/*
 * Many slots.  A session that is in a slot runs there, its requests one at
 * a time in arrival order.  A session that is in no slot takes one when
 * it is the oldest of the waiters that need a swap (a swap never waits
 * behind a hit on another slot), by ngx_http_llama_session_choose_locked.
 * Every waiter is in the one queue of the zone; a poll walks the waiters
 * older than the request (bounded by max_waiting).
 */

static ngx_int_t
ngx_http_llama_session_acquire_many(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t                         s, e;
    ngx_uint_t                        i, stalled, usable;
    ngx_queue_t                      *q;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_slot_t    *slot;
    ngx_http_llama_session_zone_t    *zone;
    ngx_http_llama_session_waiter_t  *w, *me;

    zone = ctx->zone;
    sh = zone->sh;

    ngx_shmtx_lock(&zone->shpool->mutex);

    stalled = 0;
    usable = ngx_http_llama_session_slots_usable(sh);

    for (i = 0; i < sh->nslots; i++) {
        slot = &sh->slots[i];

        ngx_http_llama_session_reap_locked(ctx, slot);

        if (!slot->busy && i < usable
            && (ngx_msec_int_t) (ngx_current_msec - slot->free_since)
               >= NGX_HTTP_LLAMA_SESSION_STALL)
        {
            stalled = 1;
        }
    }

    if (!ctx->queued) {
        if (ngx_http_llama_session_enqueue_locked(ctx) != NGX_OK) {
            return NGX_DECLINED;
        }

    } else if (stalled) {
        /* a free slot nobody took for a while: who waits really? */
        ngx_http_llama_session_prune(zone, &sh->slots[0],
                                     ctx->request->connection->log);

        for (i = 0; i < sh->nslots; i++) {
            if (!sh->slots[i].busy) {
                sh->slots[i].free_since = ngx_current_msec;
            }
        }
    }

    me = ctx->waiter;

    if (me == NULL || me->ticket != ctx->job.ticket) {
        /* dropped as a dead worker's: this process is alive, queue again */
        ctx->queued = 0;
        ctx->waiter = NULL;
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_AGAIN;
    }

    if (ngx_http_llama_session_unloading_locked(zone)) {
        /* router mode: the model is being unloaded; wait in the queue */
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_AGAIN;
    }

    s = ngx_http_llama_session_slot_of_locked(sh, ctx->key, ctx->key_len);

    /* the older waiters: of the same session, or swaps that go first */

    for (q = ngx_queue_head(&sh->waiters);
         q != ngx_queue_sentinel(&sh->waiters);
         q = ngx_queue_next(q))
    {
        w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

        if (w == me) {
            break;
        }

        if ((w->key_len == ctx->key_len
             && ngx_memcmp(w->key, ctx->key, ctx->key_len) == 0
             && !ctx->default_session)
            || (s == NGX_ERROR
                && ngx_http_llama_session_slot_of_locked(sh, w->key,
                                                         w->key_len)
                   == NGX_ERROR))
        {
            ngx_shmtx_unlock(&zone->shpool->mutex);
            return NGX_AGAIN;
        }
    }

    if (s != NGX_ERROR) {
        e = sh->slots[s].busy ? NGX_ERROR : s;

        if (e == NGX_ERROR && ctx->default_session) {
            /*
             * requests without an id that look alike run at once, as
             * llama-server alone runs them: a second one takes a slot
             * that is empty, holds "default", or holds a session saved
             * and unchanged since
             */

            e = ngx_http_llama_session_choose_locked(ctx, 1);

            if (e != NGX_ERROR) {
                /* another slot of "default" is one, as good as the first */
                s = (sh->slots[e].state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                     && sh->slots[e].key_len == ctx->key_len
                     && ngx_memcmp(sh->slots[e].key, ctx->key, ctx->key_len)
                        == 0)
                    ? e : NGX_ERROR;
            }
        }

    } else {
        e = ngx_http_llama_session_choose_locked(ctx, 0);
    }

    if (e == NGX_ERROR) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_AGAIN;
    }

    ngx_http_llama_session_unqueue_locked(ctx);

    ctx->job.slot = e;
    slot = &sh->slots[e];

    ngx_http_llama_session_take_locked(ctx, slot);
    ngx_http_llama_session_granted_locked(ctx, slot, s != NGX_ERROR);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return NGX_OK;
}


/*
 * Which slot a session that is in none takes, among the free slots whose
 * session no request waits for: an empty slot, or one nobody can vouch
 * for, first; then one holding the unsaved "default" session (for a
 * request with an id); then one whose session is saved and unchanged
 * since (evicting it costs nothing); then the least recently used (its
 * session is saved first).  Among equals, a slot that starts with the
 * request's system prompt (a warm start without a restore), then the least
 * recently used.  A request without an id ("default") takes a slot of a
 * named session only when there is no other.  "spare": not a slot whose
 * session changed since its last save.  NGX_ERROR: none now.
 */

static ngx_int_t
ngx_http_llama_session_choose_locked(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t spare)
{
    ngx_int_t                       best;
    ngx_uint_t                      i, rank, best_rank, same, usable;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;

    sh = ctx->zone->sh;
    best = NGX_ERROR;
    best_rank = 0;
    usable = ngx_http_llama_session_slots_usable(sh);

    for (i = 0; i < usable; i++) {
        slot = &sh->slots[i];

        if (slot->busy) {
            continue;
        }

        if (slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION) {
            rank = 0;

        } else if (spare && slot->key_len == ctx->key_len
                   && ngx_memcmp(slot->key, ctx->key, ctx->key_len) == 0)
        {
            /*
             * "default" in another slot: the requests waiting for it are
             * this one and others like it
             */

            rank = 0;

        } else if (ngx_http_llama_session_waited_locked(sh, slot->key,
                                                        slot->key_len))
        {
            continue;

        } else if (!slot->saveable) {
            rank = 1;

        } else if (spare && slot->dirty) {
            /* a spare slot never costs a conversation its last turns */
            continue;

        } else {
            /*
             * a session with an image, on a llama-server that cannot save
             * one, is lost when it leaves: the last to go
             */

            rank = (slot->media && slot->dirty && sh->media_refused
                    && ngx_memcmp(sh->media_refused_fp, sh->fp,
                                  NGX_HTTP_LLAMA_SESSION_FP_LEN) == 0)
                   ? 4 : slot->dirty ? 3 : 2;

            if (ctx->default_session) {
                rank += 4;
            }
        }

        same = (ctx->base_len && slot->has_base
                && ngx_memcmp(slot->base, ctx->base_id,
                              NGX_HTTP_LLAMA_SESSION_DIGEST) == 0);

        /* rank, then the shared prefix, then the least recently used */

        rank = rank * 2 + !same;

        if (best == NGX_ERROR || rank < best_rank
            || (rank == best_rank
                && (ngx_msec_int_t) (slot->last_used
                                     - sh->slots[best].last_used) < 0))
        {
            best = i;
            best_rank = rank;
        }
    }

    return best;
}


/*
 * May a waiting request want the slot: one of its session, or one that
 * needs a swap?  With one slot, any waiting request.
 */

static ngx_uint_t
ngx_http_llama_session_wanted_locked(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_slot_t *slot)
{
    ngx_queue_t                      *q;
    ngx_http_llama_session_waiter_t  *w;

    if (sh->nslots == 1) {
        return !ngx_queue_empty(&sh->waiters);
    }

    for (q = ngx_queue_head(&sh->waiters);
         q != ngx_queue_sentinel(&sh->waiters);
         q = ngx_queue_next(q))
    {
        w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

        if ((slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
             && w->key_len == slot->key_len
             && ngx_memcmp(w->key, slot->key, w->key_len) == 0)
            || ngx_http_llama_session_slot_of_locked(sh, w->key, w->key_len)
               == NGX_ERROR)
        {
            return 1;
        }
    }

    return 0;
}


/* does a request wait for the session? */

static ngx_uint_t
ngx_http_llama_session_waited_locked(ngx_http_llama_session_sh_t *sh,
    u_char *key, size_t len)
{
    ngx_queue_t                      *q;
    ngx_http_llama_session_waiter_t  *w;

    for (q = ngx_queue_head(&sh->waiters);
         q != ngx_queue_sentinel(&sh->waiters);
         q = ngx_queue_next(q))
    {
        w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

        if (w->key_len == len && ngx_memcmp(w->key, key, len) == 0) {
            return 1;
        }
    }

    return 0;
}


/* the slot that holds the session, or is swapping it in; NGX_ERROR: none */

static ngx_int_t
ngx_http_llama_session_slot_of_locked(ngx_http_llama_session_sh_t *sh,
    u_char *key, size_t len)
{
    ngx_uint_t                      i, usable;
    ngx_http_llama_session_slot_t  *slot;

    usable = ngx_http_llama_session_slots_usable(sh);

    for (i = 0; i < usable; i++) {
        slot = &sh->slots[i];

        if (slot->busy && slot->batch_len == len
            && ngx_memcmp(slot->batch_key, key, len) == 0)
        {
            return i;
        }
    }

    for (i = 0; i < usable; i++) {
        slot = &sh->slots[i];

        if (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
            && slot->key_len == len && ngx_memcmp(slot->key, key, len) == 0)
        {
            return i;
        }
    }

    return NGX_ERROR;
}


/*
 * What the grant of the slot means: a hit (the request will change the
 * session in the slot; a slot idle for a while is checked first), or a
 * swap, whose session coming in is recorded, so that its other requests
 * wait for this slot.
 */

static void
ngx_http_llama_session_granted_locked(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_slot_t *slot, ngx_uint_t hit)
{
    ngx_http_llama_session_sh_t  *sh;

    sh = ctx->zone->sh;

    if (hit) {
        ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_HIT;
        ctx->job.save_pending = 0;
        ctx->verify = ((ngx_msec_int_t) (ngx_current_msec - slot->last_used)
                       >= NGX_HTTP_LLAMA_SESSION_VERIFY);
        ctx->hit_dirty = slot->dirty;
        slot->dirty = 1;

        if (slot->msgs && ctx->request && ctx->api == NULL && !ctx->job.own) {
            /* the session's last prompt, to explain a miss (miss.c) */
            ctx->prev = ngx_palloc(ctx->request->pool, slot->nmsgs
                                   * sizeof(ngx_http_llama_session_msg_t));
            if (ctx->prev) {
                ngx_memcpy(ctx->prev, slot->msgs, slot->nmsgs
                           * sizeof(ngx_http_llama_session_msg_t));
                ctx->nprev = slot->nmsgs;
                ctx->prev_tokens = slot->prompt_tokens;
            }
        }
        sh->stats.hits++;

    } else {
        ctx->job.slot_tokens = (slot->state
                                == NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY)
                           ? 0 : -1;
        slot->batch_len = (u_short) ctx->key_len;
        ngx_memcpy(slot->batch_key, ctx->key, ctx->key_len);
    }

    sh->stats.requests++;
}


/*
 * The request takes its place at the end of the queue, in the storage
 * reserved for waiters.  NGX_DECLINED: max_waiting requests wait already;
 * the lock is released then.
 */

static ngx_int_t
ngx_http_llama_session_enqueue_locked(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_queue_t                      *q;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_zone_t    *zone;
    ngx_http_llama_session_waiter_t  *w;

    zone = ctx->zone;
    sh = zone->sh;

    if (ngx_queue_empty(&sh->free_waiters)) {
        sh->stats.queue_full++;
        ngx_shmtx_unlock(&zone->shpool->mutex);

        ngx_log_error(NGX_LOG_WARN, ctx->request->connection->log, 0,
                      "llama_session zone \"%V\" has %ui requests waiting "
                      "already, its max_waiting",
                      &zone->name, zone->waiters_max);
        return NGX_DECLINED;
    }

    q = ngx_queue_head(&sh->free_waiters);
    ngx_queue_remove(q);

    w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

    w->ticket = sh->next_ticket++;
    w->pid = ngx_pid;
    w->start = ngx_http_llama_session_self_start;
    w->key_len = (u_short) ctx->key_len;
    ngx_memcpy(w->key, ctx->key, ctx->key_len);

    ngx_queue_insert_tail(&sh->waiters, &w->queue);
    sh->nwaiters++;

    ctx->waiter = w;
    ctx->job.ticket = w->ticket;
    ctx->queued = 1;

    return NGX_OK;
}


/* the waiters of the session swapped in that came before the swap */

static ngx_uint_t
ngx_http_llama_session_count_batch(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_slot_t *slot)
{
    ngx_uint_t                        n;
    ngx_queue_t                      *q;
    ngx_http_llama_session_waiter_t  *w;

    n = 0;

    for (q = ngx_queue_head(&sh->waiters);
         q != ngx_queue_sentinel(&sh->waiters);
         q = ngx_queue_next(q))
    {
        w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

        if (w->ticket < slot->batch && w->key_len == slot->batch_len
            && ngx_memcmp(w->key, slot->batch_key, w->key_len) == 0)
        {
            n++;
        }
    }

    return n;
}


/*
 * Takes the slot only if it is free and nobody waits (the management
 * API): NGX_OK or NGX_BUSY.
 */

ngx_int_t
ngx_http_llama_session_try_slot(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    sh = zone->sh;
    slot = &sh->slots[ctx->job.slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    ngx_http_llama_session_reap_locked(ctx, slot);

    if (slot->busy || ngx_http_llama_session_wanted_locked(sh, slot)) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_BUSY;
    }

    ngx_http_llama_session_take_locked(ctx, slot);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return NGX_OK;
}


/*
 * A slot whose owner died: free, and nobody can vouch for it.  The owner
 * is looked at once it held the slot for a while, and then at most once
 * a second: a pid and the start time of its process, so a pid that came
 * back for another process is no owner.
 */

static void
ngx_http_llama_session_reap_locked(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_slot_t *slot)
{
    if (!slot->busy) {
        return;
    }

    if (slot->owner != ngx_pid
        && ((ngx_msec_int_t) (ngx_current_msec - slot->taken_at)
            < NGX_HTTP_LLAMA_SESSION_OWNER_CHECK
            || (ngx_msec_int_t) (ngx_current_msec - slot->checked_at)
               < NGX_HTTP_LLAMA_SESSION_OWNER_CHECK))
    {
        return;
    }

    slot->checked_at = ngx_current_msec;

    if (ngx_http_llama_session_alive(slot->owner, slot->owner_start)) {
        return;
    }

    ngx_log_error(NGX_LOG_ALERT, ctx->request ? ctx->request->connection->log
                                              : ngx_cycle->log, 0,
                  "llama_session: worker %P died holding slot %ui, its "
                  "content is unknown now", slot->owner,
                  (ngx_uint_t) (slot - ctx->zone->sh->slots));

    slot->busy = 0;
    slot->owner = 0;
    slot->owner_start = 0;
    slot->free_since = ngx_current_msec;

    ngx_http_llama_session_slot_forget(ctx->zone, slot,
                                      NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
}


/* the slot holds no session the module can name: empty or unknown */

static void
ngx_http_llama_session_slot_forget(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_slot_t *slot, ngx_uint_t state)
{
    if (slot->msgs) {
        ngx_slab_free_locked(zone->shpool, slot->msgs);
        slot->msgs = NULL;
    }

    slot->nmsgs = 0;
    slot->prompt_tokens = 0;
    slot->state = (u_char) state;
    slot->key_len = 0;
    slot->has_ns = 0;
    slot->dirty = 0;
    slot->saveable = 0;
    slot->has_base = 0;
    slot->media = 0;
    slot->draft_lost = 0;
}


/* the slot is this process's now; the context learns what it holds */

static void
ngx_http_llama_session_take_locked(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_slot_t *slot)
{
    slot->busy = 1;
    slot->owner = ngx_pid;
    slot->owner_start = ngx_http_llama_session_self_start;
    slot->taken_at = ngx_current_msec;
    slot->checked_at = ngx_current_msec;

    ctx->job.acquired = 1;
    ctx->job.released = 0;
    ctx->job.slot_state = slot->state;
    ctx->job.quiet_until = slot->quiet_until;
    ctx->job.save_pending = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                         && slot->dirty && slot->saveable);

    ctx->job.out_len = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION)
                   ? slot->key_len : 0;
    ngx_memcpy(ctx->job.out_key, slot->key, ctx->job.out_len);

    ctx->warm.slot_has_base = (slot->state
                               == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                          && slot->has_base);
    ngx_memcpy(ctx->warm.slot_base, slot->base, NGX_HTTP_LLAMA_SESSION_DIGEST);
}


/*
 * For the idle save: takes the slot if its session changed since its last
 * save and had no request for save_idle, and nobody waits.
 */

ngx_int_t
ngx_http_llama_session_try_idle(ngx_http_llama_session_ctx_t *ctx,
    ngx_msec_t save_idle)
{
    ngx_uint_t                      urgent;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    sh = zone->sh;
    slot = &sh->slots[ctx->job.slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    /* router mode: the model is about to be unloaded, save it now */
    urgent = ngx_http_llama_session_unloading_locked(zone);

    if (slot->busy
        || (!urgent && ngx_http_llama_session_wanted_locked(sh, slot))
        || slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
        || !slot->dirty || !slot->saveable || !sh->fp_known
        || (sh->restores_off
            && ngx_memcmp(sh->restores_off_fp, sh->fp,
                          NGX_HTTP_LLAMA_SESSION_FP_LEN) == 0)
        || (!urgent
            && (save_idle == 0
                || (ngx_msec_int_t) (ngx_current_msec - slot->last_used)
                   < (ngx_msec_int_t) save_idle)))
    {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_DECLINED;
    }

    ngx_http_llama_session_take_locked(ctx, slot);
    ngx_memcpy(ctx->job.fp, sh->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return NGX_OK;
}


/*
 * May the request's slot save the request's base now?  Not while another
 * slot saves it: both would write its one temporary file.  The claim ends
 * with the slot's release.
 */

ngx_uint_t
ngx_http_llama_session_base_claim(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t                      i, free;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    sh = zone->sh;
    free = 1;

    ngx_shmtx_lock(&zone->shpool->mutex);

    for (i = 0; i < sh->nslots; i++) {
        slot = &sh->slots[i];

        if (i != ctx->job.slot && slot->busy && slot->saving_base
            && ngx_memcmp(slot->saving, ctx->base_id,
                          NGX_HTTP_LLAMA_SESSION_DIGEST) == 0)
        {
            free = 0;
            break;
        }
    }

    if (free) {
        slot = &sh->slots[ctx->job.slot];
        slot->saving_base = 1;
        ngx_memcpy(slot->saving, ctx->base_id, NGX_HTTP_LLAMA_SESSION_DIGEST);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return free;
}


/*
 * A session started from the base (its file restored, or the slot's
 * content cut back to it): counted, so that eviction keeps it before the
 * bases nobody used.  Returns the count before, 0: the first use.
 */

ngx_uint_t
ngx_http_llama_session_base_used(ngx_http_llama_session_ctx_t *ctx)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_uint_t                      uses;
    ngx_http_llama_session_node_t  *node;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    uses = 1;

    n = ngx_http_llama_session_file_name(name, ctx->base_key, ctx->base_len,
                                         ctx->job.fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_node(zone, name, n);

    if (node) {
        uses = node->base_uses;
        ngx_http_llama_session_node_base(zone->sh, node, 1, uses + 1);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return uses;
}


/* a save of the slot's session succeeded: it is clean until used again */

void
ngx_http_llama_session_slot_saved(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t n, u_char *key, size_t len)
{
    ngx_http_llama_session_slot_t  *slot;

    slot = &zone->sh->slots[n];

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
        && slot->key_len == len && ngx_memcmp(slot->key, key, len) == 0)
    {
        slot->dirty = 0;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/* is the session in a slot, or waited for? */

ngx_uint_t
ngx_http_llama_session_in_use(ngx_http_llama_session_zone_t *zone,
    u_char *key, size_t len)
{
    ngx_uint_t                        i, used;
    ngx_queue_t                      *q;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_slot_t    *slot;
    ngx_http_llama_session_waiter_t  *w;

    sh = zone->sh;
    used = 0;

    ngx_shmtx_lock(&zone->shpool->mutex);

    for (i = 0; i < sh->nslots; i++) {
        slot = &sh->slots[i];

        if (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
            && slot->key_len == len && ngx_memcmp(slot->key, key, len) == 0)
        {
            used = 1;
        }
    }

    for (q = ngx_queue_head(&sh->waiters);
         !used && q != ngx_queue_sentinel(&sh->waiters);
         q = ngx_queue_next(q))
    {
        w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

        if (w->key_len == len && ngx_memcmp(w->key, key, len) == 0) {
            used = 1;
        }
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return used;
}


void
ngx_http_llama_session_dequeue(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_zone_t  *zone;

    if (!ctx->queued) {
        return;
    }

    zone = ctx->zone;

    ngx_shmtx_lock(&zone->shpool->mutex);
    ngx_http_llama_session_unqueue_locked(ctx);
    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/* the request leaves the queue, granted or not */

static void
ngx_http_llama_session_unqueue_locked(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_slot_t    *slot;
    ngx_http_llama_session_waiter_t  *w;

    sh = ctx->zone->sh;
    w = ctx->waiter;

    ctx->queued = 0;
    ctx->waiter = NULL;

    if (w == NULL || w->ticket != ctx->job.ticket || w->pid != ngx_pid) {
        /* dropped already (taken for a dead worker's) */
        return;
    }

    slot = &sh->slots[ctx->job.slot];

    if (ctx->job.ticket < slot->batch && slot->batch_left
        && w->key_len == slot->batch_len
        && ngx_memcmp(w->key, slot->batch_key, w->key_len) == 0)
    {
        slot->batch_left--;
    }

    ngx_queue_remove(&w->queue);
    w->ticket = 0;
    ngx_queue_insert_head(&sh->free_waiters, &w->queue);
    sh->nwaiters--;
}


/* sets what the slot holds while the request holds it */

void
ngx_http_llama_session_slot_set(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state, u_char *key, size_t len, ngx_uint_t dirty)
{
    ngx_http_llama_session_slot_t  *slot;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    slot = &zone->sh->slots[ctx->job.slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    slot->state = (u_char) state;

    if (state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION) {

        if (slot->msgs
            && (slot->key_len != len || ngx_memcmp(slot->key, key, len) != 0))
        {
            /* the prompt of the session that left */
            ngx_slab_free_locked(zone->shpool, slot->msgs);
            slot->msgs = NULL;
            slot->nmsgs = 0;
            slot->prompt_tokens = 0;
        }

        if (ctx->has_nsk) {
            slot->has_ns = 1;
            ngx_memcpy(slot->ns, ctx->nsk, NGX_HTTP_LLAMA_SESSION_DIGEST);

        } else if (slot->key_len != len
                   || ngx_memcmp(slot->key, key, len) != 0)
        {
            /* another session, of no known tenant (not from a request) */
            slot->has_ns = 0;
        }

        /*
         * the draft's context: lost by a restore (llama-server restores
         * the target's alone), whole again after an empty slot's prefill
         */

        if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_RESTORE
            || ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_WARM)
        {
            slot->draft_lost = ctx->job.speculative
                               && (ctx->action
                                   == NGX_HTTP_LLAMA_SESSION_ACTION_RESTORE
                                   || slot->draft_lost
                                   || ctx->warm.base_file);

        } else if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_FRESH) {
            slot->draft_lost = 0;
        }

        /* a conversation's image stays in its history */
        slot->media = (slot->key_len == len
                       && ngx_memcmp(slot->key, key, len) == 0
                       && slot->media) || ctx->media;

        ngx_memcpy(slot->key, key, len);
        slot->key_len = (u_short) len;
        slot->saveable = !ctx->default_session;
        slot->dirty = (u_char) dirty;

        /* the slot's content starts with this base's system prompt */
        slot->has_base = (ctx->base_len != 0);
        ngx_memcpy(slot->base, ctx->base_id, NGX_HTTP_LLAMA_SESSION_DIGEST);

    } else {
        ngx_http_llama_session_slot_forget(zone, slot, state);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * Gives the slot back.  state: NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN when the
 * request cannot vouch for the slot any more, anything else keeps it.
 */

void
ngx_http_llama_session_release(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state)
{
    ngx_http_llama_session_slot_t  *slot;
    ngx_http_llama_session_zone_t  *zone;

    if (!ctx->job.acquired || ctx->job.released) {
        return;
    }

    ctx->job.released = 1;

    zone = ctx->zone;
    slot = &zone->sh->slots[ctx->job.slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->busy && slot->owner == ngx_pid) {
        slot->busy = 0;
        slot->owner = 0;
        slot->owner_start = 0;
        slot->free_since = ngx_current_msec;
    }

    if (ctx->job.quarantine) {
        slot->quiet_until = ngx_current_msec
                            + NGX_HTTP_LLAMA_SESSION_QUARANTINE;
    }

    if (state == NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN) {
        ngx_http_llama_session_slot_forget(zone, slot, state);
    }

    slot->saving_base = 0;

    if (ctx->request && ctx->api == NULL && !ctx->job.own) {
        /* a request's use (not an idle save's, nor the API's) */
        slot->last_used = ngx_current_msec;
        slot->used_at = ngx_time();
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/* does the slot hold a session of the tenant whose digest ns is? */

ngx_uint_t
ngx_http_llama_session_slot_of_tenant(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t n, u_char *ns)
{
    ngx_uint_t                      mine;
    ngx_http_llama_session_slot_t  *slot;

    slot = &zone->sh->slots[n];

    ngx_shmtx_lock(&zone->shpool->mutex);

    mine = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
            && slot->has_ns
            && ngx_memcmp(slot->ns, ns, NGX_HTTP_LLAMA_SESSION_DIGEST) == 0);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return mine;
}


/*
 * The slots a session may be sent to: the zone's, but never one that
 * llama-server does not have (its GET /props said fewer; 0: not known yet).
 */

ngx_uint_t
ngx_http_llama_session_slots_usable(ngx_http_llama_session_sh_t *sh)
{
    if (sh->total_slots && sh->total_slots < sh->nslots) {
        return sh->total_slots;
    }

    return sh->nslots;
}


/* "<key>.<fp>": the name of a session's state for one configuration */

size_t
ngx_http_llama_session_file_name(u_char *buf, u_char *key, size_t len,
    u_char *fp)
{
    u_char  *p;

    p = ngx_cpymem(buf, key, len);
    *p++ = '.';
    p = ngx_cpymem(p, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);

    return p - buf;
}


/*
 * Is there a saved file for the key?  1: yes, 0: no, -1: the zone does not
 * know (nothing recorded since start for it).
 */

ngx_int_t
ngx_http_llama_session_file_known(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_int_t                       rc;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_node_t  *node;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    sh = zone->sh;

    n = ngx_http_llama_session_file_name(name, key, len, ctx->job.fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_lookup(sh, name, n, ngx_crc32_short(name, n));

    rc = node ? node->saved : -1;

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return rc;
}


/* the bytes and tokens of the session's file; NGX_DECLINED: not known */

ngx_int_t
ngx_http_llama_session_file_size(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len, off_t *bytes, ngx_uint_t *tokens)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_int_t                       rc;
    ngx_http_llama_session_node_t  *node;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;

    n = ngx_http_llama_session_file_name(name, key, len, ctx->job.fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_lookup(zone->sh, name, n,
                                         ngx_crc32_short(name, n));

    rc = NGX_DECLINED;

    if (node && node->saved && node->bytes > 0 && node->tokens > 0) {
        *bytes = node->bytes;
        *tokens = node->tokens;
        rc = NGX_OK;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return rc;
}


void
ngx_http_llama_session_file_saved(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len, ngx_uint_t saved, ngx_uint_t tokens, off_t bytes)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_http_llama_session_node_t  *node;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;

    n = ngx_http_llama_session_file_name(name, key, len, ctx->job.fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_node(zone, name, n);

    if (node) {
        if (saved && key == ctx->base_key) {
            ngx_http_llama_session_node_base(zone->sh, node, 1,
                                             node->base_uses);
        }

        ngx_http_llama_session_node_file(zone->sh, node, saved, bytes);

        if (saved) {
            node->tokens = tokens;
            node->saved_at = ngx_time();
        }

    } else {
        ngx_log_error(NGX_LOG_CRIT, ctx->request
                                    ? ctx->request->connection->log
                                    : ngx_cycle->log, 0,
                      "llama_session zone \"%V\" has no room to record "
                      "session \"%*s\"", &zone->name, n, name);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * records a session (the request's, or its base: id "base"), with its id
 * and model for the API; a record in use goes to the front of its queue
 */

void
ngx_http_llama_session_remember(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len, ngx_str_t *id)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_http_llama_session_node_t  *node;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;

    n = ngx_http_llama_session_file_name(name, key, len, ctx->job.fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_node(zone, name, n);

    if (node) {
        node->id_len = (u_char) ngx_min(id->len,
                                        NGX_HTTP_LLAMA_SESSION_ID_SHOW);
        ngx_memcpy(node->id, id->data, node->id_len);

        node->has_sys = (ctx->sys_len != 0);
        ngx_memcpy(node->sys, ctx->sys, NGX_HTTP_LLAMA_SESSION_DIGEST);

        if (key == ctx->key) {
            node->has_idk = 1;
            ngx_memcpy(node->idk, ctx->idk, NGX_HTTP_LLAMA_SESSION_DIGEST);
        }

        if (ctx->has_nsk) {
            /* the session's tenant, and its base's: the same */
            node->has_ns = 1;
            ngx_memcpy(node->ns, ctx->nsk, NGX_HTTP_LLAMA_SESSION_DIGEST);
        }

        node->model_len = (u_char) ngx_min(ctx->model.len,
                                           NGX_HTTP_LLAMA_SESSION_MODEL_SHOW);
        ngx_memcpy(node->model, ctx->model.data, node->model_len);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/* copies the zone's fingerprint into the request; 0: not known yet */

ngx_uint_t
ngx_http_llama_session_fingerprint(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t                      known;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;

    ngx_shmtx_lock(&zone->shpool->mutex);

    known = zone->sh->fp_known;
    ngx_memcpy(ctx->job.fp, zone->sh->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return known;
}


void
ngx_http_llama_session_set_fingerprint(ngx_http_llama_session_ctx_t *ctx,
    u_char *fp, ngx_uint_t n_ctx, ngx_uint_t total_slots,
    ngx_str_t *model_path)
{
    ngx_uint_t                      i;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    sh = zone->sh;

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (sh->fp_known
        && ngx_memcmp(sh->fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN) != 0)
    {
        ngx_log_error(NGX_LOG_WARN, ctx->request->connection->log, 0,
                      "llama_session: the backend of zone \"%V\" has a new "
                      "configuration (%*s, was %*s): files saved with the "
                      "old one are stale and never restored", &zone->name,
                      (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN, fp,
                      (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN, sh->fp);
    }

    ngx_memcpy(sh->fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);
    sh->fp_known = 1;
    sh->n_ctx = n_ctx;

    if (sh->nslots && total_slots < sh->nslots
        && total_slots != sh->total_slots)
    {
        /*
         * llama-server wraps a slot id it does not have (id % n_slots):
         * a session sent to one would run on another's slot.  Only the
         * slots it has are used; the others' contents are forgotten.
         */

        ngx_log_error(NGX_LOG_WARN, ctx->request->connection->log, 0,
                      "llama_session: llama-server has %ui slots, zone "
                      "\"%V\" has slots=%ui: the zone uses slots 0 to %ui "
                      "only; give llama-server -np %ui, or set slots=%ui "
                      "(or slots=auto)", total_slots, &zone->name,
                      sh->nslots, total_slots - 1, sh->nslots, total_slots);

        for (i = total_slots; i < sh->nslots; i++) {
            if (!sh->slots[i].busy) {
                ngx_http_llama_session_slot_forget(zone, &sh->slots[i],
                                          NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
            }
        }

    } else if (sh->nslots && total_slots > sh->nslots
               && total_slots != sh->total_slots)
    {
        ngx_log_error(NGX_LOG_NOTICE, ctx->request->connection->log, 0,
                      "llama_session: llama-server has %ui slots, zone "
                      "\"%V\" uses its slots=%ui of them", total_slots,
                      &zone->name, sh->nslots);
    }

    sh->total_slots = total_slots;

    if (sh->nslots == 0 && total_slots) {
        /* slots=auto: the zone drives the slots the backend has */

        sh->nslots = ngx_min(total_slots, NGX_HTTP_LLAMA_SESSION_SLOTS_MAX);

        ngx_log_error(NGX_LOG_NOTICE, ctx->request->connection->log, 0,
                      "llama_session zone \"%V\" drives the %ui slots of "
                      "its backend (slots=auto)", &zone->name, sh->nslots);
    }
    sh->model_path_len = (u_short) ngx_min(model_path->len,
                                           NGX_HTTP_LLAMA_SESSION_PATH_SHOW);
    ngx_memcpy(sh->model_path, model_path->data, sh->model_path_len);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    ngx_memcpy(ctx->job.fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);
}


/*
 * GET /slots showed the slot's task id.  Task ids only grow while
 * llama-server runs; a smaller one (or none) where the zone saw one means
 * it restarted, and the session the zone thinks is there is gone.
 * Returns 1 then.
 */

ngx_uint_t
ngx_http_llama_session_slot_task(ngx_http_llama_session_ctx_t *ctx,
    ngx_int_t task)
{
    ngx_uint_t                      restarted;
    ngx_http_llama_session_slot_t  *slot;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    slot = &zone->sh->slots[ctx->job.slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    restarted = (slot->task >= 0 && task < slot->task);

    slot->task = task;

    if (restarted) {
        ngx_http_llama_session_slot_forget(zone, slot,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
        zone->sh->stats.restarts++;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return restarted;
}


/*
 * The request's prompt becomes the slot's last one, with the tokens its
 * reply counted, for the next request's comparison (miss.c).
 */

void
ngx_http_llama_session_slot_msgs(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t prompt_tokens)
{
    size_t                          size;
    ngx_http_llama_session_slot_t  *slot;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    slot = &zone->sh->slots[ctx->job.slot];
    size = ctx->nmsgs * sizeof(ngx_http_llama_session_msg_t);

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (!slot->busy || slot->owner != ngx_pid
        || slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
        || slot->key_len != ctx->key_len
        || ngx_memcmp(slot->key, ctx->key, ctx->key_len) != 0)
    {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return;
    }

    if (slot->msgs && slot->nmsgs != ctx->nmsgs) {
        ngx_slab_free_locked(zone->shpool, slot->msgs);
        slot->msgs = NULL;
    }

    if (slot->msgs == NULL && size) {
        /* a full zone keeps no prompt: the next miss is not explained */
        slot->msgs = ngx_slab_alloc_locked(zone->shpool, size);
    }

    if (slot->msgs) {
        ngx_memcpy(slot->msgs, ctx->msgs, size);
    }

    slot->nmsgs = slot->msgs ? ctx->nmsgs : 0;
    slot->prompt_tokens = prompt_tokens;

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * A copy of the slot's last prompt (its messages' digests), when the slot
 * holds that session: how many; 0: none.
 */

ngx_uint_t
ngx_http_llama_session_slot_msgs_copy(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t n, u_char *key, size_t len, ngx_http_llama_session_msg_t *out,
    ngx_uint_t max, ngx_uint_t *tokens)
{
    ngx_uint_t                      count;
    ngx_http_llama_session_slot_t  *slot;

    slot = &zone->sh->slots[n];
    count = 0;

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->msgs && slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
        && slot->key_len == len && ngx_memcmp(slot->key, key, len) == 0)
    {
        count = ngx_min(slot->nmsgs, max);
        ngx_memcpy(out, slot->msgs,
                   count * sizeof(ngx_http_llama_session_msg_t));
        *tokens = slot->prompt_tokens;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return count;
}


/* did ineffective restores stop saves and restores for this backend? */

ngx_uint_t
ngx_http_llama_session_restores_off(ngx_http_llama_session_zone_t *zone,
    u_char *fp)
{
    return zone->sh->restores_off
           && ngx_memcmp(zone->sh->restores_off_fp, fp,
                         NGX_HTTP_LLAMA_SESSION_FP_LEN) == 0;
}


/*
 * Router mode.  Is a request unloading the zone's model (its sessions
 * being saved, or the router told to unload it)?  No slot of the zone is
 * granted then.  A flag of a dead worker is dropped.  Under the zone's
 * lock.
 */

ngx_uint_t
ngx_http_llama_session_unloading_locked(ngx_http_llama_session_zone_t *zone)
{
    ngx_http_llama_session_sh_t  *sh;

    sh = zone->sh;

    if (sh->unloading == 0) {
        return 0;
    }

    if (sh->unloading == ngx_pid
        || ngx_http_llama_session_alive(sh->unloading, sh->unloading_start))
    {
        return 1;
    }

    sh->unloading = 0;
    sh->unloading_start = 0;

    return 0;
}


/*
 * The zone's model is not running (or sleeps): its slots are empty (or
 * unknown) whatever the zone thought.  Every slot no request holds, and
 * the request's own, is set so; returns how many held a session changed
 * since its last save (lost).
 */

ngx_uint_t
ngx_http_llama_session_model_reset(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t state)
{
    ngx_uint_t                      i, lost, own;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;
    lost = 0;

    ngx_shmtx_lock(&zone->shpool->mutex);

    for (i = 0; i < sh->nslots; i++) {
        slot = &sh->slots[i];

        own = (ctx && ctx->zone == zone && ctx->job.acquired
               && !ctx->job.released
               && ctx->job.slot == i);

        if (slot->busy && !own) {
            continue;
        }

        /* a hit marks its slot changed when it takes it: not yet */

        if (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
            && slot->saveable
            && ((own && ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_HIT)
                ? ctx->hit_dirty : slot->dirty))
        {
            lost++;
        }

        ngx_http_llama_session_slot_forget(zone, slot, state);
        slot->task = -1;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return lost;
}


/*
 * One model switch at a time in a router's group of zones: the turn is
 * kept in the group's first zone.  NGX_OK: the request has it;
 * NGX_AGAIN: another request's switch runs.
 */

ngx_int_t
ngx_http_llama_session_switch_take(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t                       rc;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *lead;

    if (ctx->route.switching) {
        return NGX_OK;
    }

    lead = ctx->zone->group;
    sh = lead->sh;

    ngx_shmtx_lock(&lead->shpool->mutex);

    if (sh->switch_pid
        && ngx_http_llama_session_alive(sh->switch_pid, sh->switch_start))
    {
        rc = NGX_AGAIN;

    } else {
        if (sh->switch_pid) {
            ngx_log_error(NGX_LOG_ALERT, ctx->request->connection->log, 0,
                          "llama_session: worker %P died switching the "
                          "router's models", sh->switch_pid);
        }

        sh->switch_pid = ngx_pid;
        sh->switch_start = ngx_http_llama_session_self_start;
        sh->switch_seq = ++sh->switch_next;

        ctx->route.switch_seq = sh->switch_seq;
        ctx->route.switching = 1;

        rc = NGX_OK;
    }

    ngx_shmtx_unlock(&lead->shpool->mutex);

    return rc;
}


/* the victim of the switch is gone (or the switch ends): its zone goes on */

void
ngx_http_llama_session_victim_end(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *victim;

    victim = ctx->route.victim;

    if (victim == NULL) {
        return;
    }

    ctx->route.victim = NULL;
    ctx->route.unload_sent = 0;
    sh = victim->sh;

    ngx_shmtx_lock(&victim->shpool->mutex);

    if (sh->unloading == ngx_pid && sh->unloading_seq
        == ctx->route.switch_seq) {
        sh->unloading = 0;
        sh->unloading_start = 0;
    }

    ngx_shmtx_unlock(&victim->shpool->mutex);
}


/* the switch ends: the group's turn and the victim's flag are given back */

void
ngx_http_llama_session_switch_end(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *lead;

    ngx_http_llama_session_victim_end(ctx);

    if (!ctx->route.switching) {
        return;
    }

    ctx->route.switching = 0;

    lead = ctx->zone->group;
    sh = lead->sh;

    ngx_shmtx_lock(&lead->shpool->mutex);

    if (sh->switch_pid == ngx_pid && sh->switch_seq == ctx->route.switch_seq) {
        sh->switch_pid = 0;
        sh->switch_start = 0;
    }

    ngx_shmtx_unlock(&lead->shpool->mutex);
}


/*
 * The victim of a switch: flags it as unloading (its slots are granted to
 * nobody, its idle saver saves what changed now), and tells whether it is
 * ready to go: no slot held, nothing changed since its last save.
 */

ngx_uint_t
ngx_http_llama_session_victim_clean(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_zone_t *zone)
{
    ngx_uint_t                      i, clean;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (!(sh->unloading == ngx_pid && sh->unloading_seq
          == ctx->route.switch_seq)) {
        sh->unloading = ngx_pid;
        sh->unloading_start = ngx_http_llama_session_self_start;
        sh->unloading_seq = ctx->route.switch_seq;
    }

    clean = 1;

    for (i = 0; i < sh->nslots; i++) {
        slot = &sh->slots[i];

        if (slot->busy
            || (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                && slot->dirty && slot->saveable))
        {
            clean = 0;
            break;
        }
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return clean;
}


/* a record by its name, under the lock; NULL: none */

ngx_http_llama_session_node_t *
ngx_http_llama_session_lookup_name(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len)
{
    return ngx_http_llama_session_lookup(zone->sh, name, len,
                                         ngx_crc32_short(name, len));
}


/* a copy of a record, for the API; NGX_DECLINED: none */

ngx_int_t
ngx_http_llama_session_node_info(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, ngx_http_llama_session_node_t *copy)
{
    ngx_http_llama_session_node_t  *node;

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_lookup(zone->sh, name, len,
                                         ngx_crc32_short(name, len));
    if (node) {
        *copy = *node;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return node ? NGX_OK : NGX_DECLINED;
}


/*
 * The least recently used files to delete while the zone has more than
 * max_files or max_size, or until they add up to "need" bytes (min_free),
 * never a session in a slot nor "keep" (the one coming in): they are
 * forgotten here, and deleted by the caller after the lock
 * (ngx_http_llama_session_store_evict).  Returns how many.
 */

ngx_uint_t
ngx_http_llama_session_evict_pick(ngx_http_llama_session_zone_t *zone,
    u_char *keep, size_t keep_len, off_t need,
    ngx_http_llama_session_evicted_t *out, ngx_uint_t max)
{
    off_t                           freed;
    size_t                          klen;
    ngx_uint_t                      i, n, used, pass;
    ngx_queue_t                    *q, *prev;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_node_t  *node;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;
    n = 0;
    freed = 0;

    ngx_shmtx_lock(&zone->shpool->mutex);

    /*
     * bases no session ever started from go first (each new conversation
     * of a system prompt of its own leaves one: a title request's, say),
     * then the least recently used of all; the first pass is made only
     * when there are such bases (it may walk every record, under the lock)
     */

    for (pass = (sh->bases_unused == 0); pass < 2; pass++) {

        for (q = ngx_queue_last(&sh->lru);
             q != ngx_queue_sentinel(&sh->lru)
             && n < max
             && (freed < need
                 || (zone->max_files && sh->files > zone->max_files)
                 || (zone->max_size && sh->bytes > zone->max_size));
             q = prev)
        {
            prev = ngx_queue_prev(q);

            node = ngx_queue_data(q, ngx_http_llama_session_node_t, lru);

            if (!node->saved
                || (pass == 0 && !(node->is_base && node->base_uses == 0)))
            {
                continue;
            }

            klen = node->name_len - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN;

            if (klen == keep_len && ngx_memcmp(node->name, keep, klen) == 0) {
                continue;
            }

            used = 0;

            for (i = 0; i < sh->nslots; i++) {
                slot = &sh->slots[i];

                if (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                    && slot->key_len == klen
                    && ngx_memcmp(slot->key, node->name, klen) == 0)
                {
                    used = 1;
                    break;
                }
            }

            if (used) {
                continue;
            }

            ngx_memcpy(out[n].name, node->name, node->name_len);
            out[n].len = node->name_len;
            out[n].bytes = node->bytes;
            freed += node->bytes;
            n++;

            ngx_http_llama_session_node_file(sh, node, 0, 0);
            sh->stats.evictions++;
        }
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return n;
}


void
ngx_http_llama_session_stat(ngx_http_llama_session_ctx_t *ctx,
    ngx_atomic_uint_t *counter)
{
    (void) ngx_atomic_fetch_add(counter, 1);
}


/*
 * marks a record as a base's or not, with the sessions that started from
 * it, in the zone's totals of bases (and of saved bases no session used,
 * which eviction takes first)
 */

#define ngx_http_llama_session_unused_base(node)                             \
    ((node)->saved && (node)->is_base && (node)->base_uses == 0)

void
ngx_http_llama_session_node_base(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_node_t *node, ngx_uint_t is_base, ngx_uint_t uses)
{
    if (ngx_http_llama_session_unused_base(node)) {
        sh->bases_unused--;
    }

    if (node->saved && node->is_base != (u_char) is_base) {
        if (is_base) {
            sh->base_files++;
            sh->base_bytes += node->bytes;

        } else {
            sh->base_files--;
            sh->base_bytes -= node->bytes;
        }
    }

    node->is_base = (u_char) is_base;
    node->base_uses = (u_short) ngx_min(uses, 65535);

    if (ngx_http_llama_session_unused_base(node)) {
        sh->bases_unused++;
    }
}


/*
 * Marks a record as having a file or not, keeps the zone's totals, and
 * keeps it in the queue of its kind (most recently used first).
 */

void
ngx_http_llama_session_node_file(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_node_t *node, ngx_uint_t saved, off_t bytes)
{
    if (ngx_http_llama_session_unused_base(node)) {
        sh->bases_unused--;
    }

    if (node->saved) {
        sh->files--;
        sh->bytes -= node->bytes;

        if (node->is_base) {
            sh->base_files--;
            sh->base_bytes -= node->bytes;
        }
    }

    node->saved = (u_char) saved;
    node->bytes = saved ? bytes : 0;

    ngx_queue_remove(&node->lru);

    if (saved) {
        sh->files++;
        sh->bytes += bytes;

        if (node->is_base) {
            sh->base_files++;
            sh->base_bytes += bytes;

            if (node->base_uses == 0) {
                sh->bases_unused++;
            }
        }

        node->seq = ++sh->seq;
        ngx_queue_insert_head(&sh->lru, &node->lru);

    } else {
        ngx_queue_insert_head(&sh->nofile, &node->lru);
    }
}


static ngx_http_llama_session_node_t *
ngx_http_llama_session_lookup(ngx_http_llama_session_sh_t *sh, u_char *name,
    size_t len, uint32_t hash)
{
    ngx_int_t                       rc;
    ngx_rbtree_node_t              *node, *sentinel;
    ngx_http_llama_session_node_t  *sn;

    node = sh->rbtree.root;
    sentinel = sh->rbtree.sentinel;

    while (node != sentinel) {

        if (hash < node->key) {
            node = node->left;
            continue;
        }

        if (hash > node->key) {
            node = node->right;
            continue;
        }

        sn = (ngx_http_llama_session_node_t *) node;

        rc = ngx_memn2cmp(name, sn->name, len, sn->name_len);

        if (rc == 0) {
            return sn;
        }

        node = (rc < 0) ? node->left : node->right;
    }

    return NULL;
}


/* inserts in the order the lookup walks: crc32, then the name */

static void
ngx_http_llama_session_rbtree_insert(ngx_rbtree_node_t *temp,
    ngx_rbtree_node_t *node, ngx_rbtree_node_t *sentinel)
{
    ngx_rbtree_node_t              **p;
    ngx_http_llama_session_node_t   *sn, *snt;

    for ( ;; ) {

        if (node->key < temp->key) {
            p = &temp->left;

        } else if (node->key > temp->key) {
            p = &temp->right;

        } else { /* node->key == temp->key */

            sn = (ngx_http_llama_session_node_t *) node;
            snt = (ngx_http_llama_session_node_t *) temp;

            p = (ngx_memn2cmp(sn->name, snt->name, sn->name_len,
                              snt->name_len) < 0)
                ? &temp->left : &temp->right;
        }

        if (*p == sentinel) {
            break;
        }

        temp = *p;
    }

    *p = node;
    node->parent = temp;
    node->left = sentinel;
    node->right = sentinel;
    ngx_rbt_red(node);
}


/*
 * Finds or adds a record, and makes it the most recently used of its
 * kind.  When the zone is full, the least recently used record without
 * a file is forgotten, else the oldest with one, and its file is deleted
 * (an eviction): the folder never holds files the zone does not count.
 */

ngx_http_llama_session_node_t *
ngx_http_llama_session_node(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len)
{
    uint32_t                        hash;
    ngx_uint_t                      tries;
    ngx_queue_t                    *q, *queue;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_node_t  *sn;

    sh = zone->sh;
    hash = ngx_crc32_short(name, len);

    sn = ngx_http_llama_session_lookup(sh, name, len, hash);

    if (sn) {
        sn->used_at = ngx_time();
        ngx_queue_remove(&sn->lru);
        ngx_queue_insert_head(sn->saved ? &sh->lru : &sh->nofile, &sn->lru);
        return sn;
    }

    for (tries = 0; tries < 8; tries++) {

        sn = ngx_slab_calloc_locked(zone->shpool,
                                    sizeof(ngx_http_llama_session_node_t));
        if (sn) {
            break;
        }

        queue = ngx_queue_empty(&sh->nofile) ? &sh->lru : &sh->nofile;

        if (ngx_queue_empty(queue)) {
            return NULL;
        }

        q = ngx_queue_last(queue);

        sn = ngx_queue_data(q, ngx_http_llama_session_node_t, lru);

        if (sn->saved && zone->store.len) {
            /*
             * the index cannot hold every file: the least recently used
             * file goes with its record (renamed aside, cut and unlinked
             * in steps when large), so that the folder holds what the
             * zone counts, and max_files and max_size still bound it
             */

            if (!sh->evicting_full) {
                sh->evicting_full = 1;
                ngx_log_error(NGX_LOG_WARN, ngx_cycle->log, 0,
                              "llama_session zone \"%V\" is full of "
                              "records: the least recently used files are "
                              "deleted before max_files or max_size is "
                              "reached; make the zone larger", &zone->name);
            }

            /* the store's handler (store.c), set by module.c */
            (void) zone->unlink(zone, sn->name, sn->name_len, ngx_cycle->log);
            sh->stats.evictions++;

        } else {
            sh->stats.forgotten++;
        }

        ngx_http_llama_session_node_file(sh, sn, 0, 0);
        ngx_queue_remove(&sn->lru);
        ngx_rbtree_delete(&sh->rbtree, &sn->node);
        ngx_slab_free_locked(zone->shpool, sn);
        sh->nsessions--;
        sn = NULL;
    }

    if (sn == NULL) {
        return NULL;
    }

    sn->node.key = hash;
    sn->name_len = (u_char) len;
    ngx_memcpy(sn->name, name, len);
    sn->used_at = ngx_time();

    ngx_rbtree_insert(&sh->rbtree, &sn->node);
    ngx_queue_insert_head(&sh->nofile, &sn->lru);
    sh->nsessions++;

    return sn;
}


/*
 * Drops the waiters of dead workers, wherever they stand in the queue,
 * and counts again who of the swapped-in session still waits.
 */

static void
ngx_http_llama_session_prune(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_slot_t *slot, ngx_log_t *log)
{
    ngx_pid_t                         dead, alive;
    ngx_queue_t                      *q, *next;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_waiter_t  *w;

    sh = zone->sh;
    dead = 0;
    alive = ngx_pid;

    for (q = ngx_queue_head(&sh->waiters);
         q != ngx_queue_sentinel(&sh->waiters);
         q = next)
    {
        next = ngx_queue_next(q);

        w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

        /* the waiters of one worker come in runs: ask once per run */

        if (w->pid == alive
            || (w->pid != dead
                && ngx_http_llama_session_alive(w->pid, w->start)))
        {
            alive = w->pid;
            continue;
        }

        dead = w->pid;

        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: dropping a waiter of dead worker %P "
                      "from zone \"%V\"", w->pid, &zone->name);

        ngx_queue_remove(q);
        w->ticket = 0;
        ngx_queue_insert_head(&sh->free_waiters, q);
        sh->nwaiters--;
    }

    slot->batch_left = ngx_http_llama_session_count_batch(sh, slot);
}


/* is the process (pid, start) still there? */

static ngx_uint_t
ngx_http_llama_session_alive(ngx_pid_t pid, uint64_t start)
{
    uint64_t  now;

    if (pid == 0) {
        return 1;
    }

    if (pid == ngx_pid) {
        return start == ngx_http_llama_session_self_start;
    }

    if (kill(pid, 0) == -1 && ngx_errno == NGX_ESRCH) {
        return 0;
    }

    if (start == 0) {
        return 1;
    }

    now = ngx_http_llama_session_proc_start(pid);

    return now == 0 || now == start;
}


/*
 * When a process started, in clock ticks since boot: field 22 of
 * /proc/PID/stat, counted after the command's closing parenthesis.
 * 0 when it cannot be read.
 */

static uint64_t
ngx_http_llama_session_proc_start(ngx_pid_t pid)
{
    u_char      *p, *last, file[64], buf[1024];
    ssize_t      n;
    uint64_t     v;
    ngx_fd_t     fd;
    ngx_uint_t   field;

    ngx_sprintf(file, "/proc/%P/stat%Z", pid);

    fd = ngx_open_file(file, NGX_FILE_RDONLY, NGX_FILE_OPEN, 0);
    if (fd == NGX_INVALID_FILE) {
        return 0;
    }

    n = ngx_read_fd(fd, buf, sizeof(buf));
    ngx_close_file(fd);

    if (n <= 0) {
        return 0;
    }

    last = buf + n;

    for (p = last; p > buf && p[-1] != ')'; p--) { /* void */ }

    if (p == buf) {
        return 0;
    }

    for (field = 2; field < 22 && p < last; p++) {
        if (*p == ' ') {
            field++;
        }
    }

    while (p < last && *p == ' ') {
        p++;
    }

    v = 0;

    while (p < last && *p >= '0' && *p <= '9') {
        v = v * 10 + (*p++ - '0');
    }

    return v;
}


/* at a process's start: who it is, for the owner of a slot or a wait */

void
ngx_http_llama_session_process_init(void)
{
    ngx_http_llama_session_self_start =
                              ngx_http_llama_session_proc_start(ngx_getpid());
}


/* a zone declared before, by name; logs the error when there is none */

ngx_http_llama_session_zone_t *
ngx_http_llama_session_find_zone(ngx_conf_t *cf, ngx_str_t *name)
{
    ngx_uint_t                           i;
    ngx_http_llama_session_zone_t      **zp;
    ngx_http_llama_session_main_conf_t  *lmcf;

    lmcf = ngx_http_conf_get_module_main_conf(cf,
                                              ngx_http_llama_session_module);

    zp = lmcf->zones.elts;

    for (i = 0; i < lmcf->zones.nelts; i++) {
        if (zp[i]->name.len == name->len
            && ngx_strncmp(zp[i]->name.data, name->data, name->len) == 0)
        {
            /* a zone of a set ("r.2"): the set */
            return zp[i]->models ? zp[i]->models : zp[i];
        }

        if (zp[i]->models_index == 1
            && zp[i]->models_name.len == name->len
            && ngx_strncmp(zp[i]->models_name.data, name->data, name->len)
               == 0)
        {
            /* models=: the first of its zones leads them */
            return zp[i];
        }
    }

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "unknown llama_session zone \"%V\": declare it with "
                       "\"llama_session_zone zone=%V:size\" before use",
                       name, name);

    return NULL;
}


/* this worker's requests that wait for a slot, woken on a release */

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
