
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The slot scheduler: what each slot of a zone holds, which slot job holds
 * it, who waits for it (one FIFO per zone), and which slot a session
 * takes.  It is given a zone, a slot job (job.c's: the slot it holds, its
 * place in the queue, what the slot held when granted) and what the job
 * asks (ngx_http_llama_session_ask_t: its session's key, tenant, system
 * prompt), never the request; it answers with verdicts.  Every access is
 * under the zone's mutex; nothing here does I/O but /proc/PID/stat.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_ram.h"
#include "ngx_http_llama_session_sched.h"


static ngx_int_t ngx_http_llama_session_acquire_many(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job,
    ngx_http_llama_session_ask_t *ask);
static ngx_int_t ngx_http_llama_session_choose_locked(
    ngx_http_llama_session_sh_t *sh, ngx_http_llama_session_ask_t *ask,
    ngx_uint_t spare);
static ngx_uint_t ngx_http_llama_session_wanted_locked(
    ngx_http_llama_session_sh_t *sh, ngx_http_llama_session_slot_t *slot);
static ngx_uint_t ngx_http_llama_session_waited_locked(
    ngx_http_llama_session_sh_t *sh, u_char *key, size_t len);
static ngx_int_t ngx_http_llama_session_slot_of_locked(
    ngx_http_llama_session_sh_t *sh, u_char *key, size_t len);
static void ngx_http_llama_session_granted_locked(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job,
    ngx_http_llama_session_ask_t *ask, ngx_http_llama_session_slot_t *slot,
    ngx_uint_t hit);
static ngx_int_t ngx_http_llama_session_enqueue_locked(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job,
    ngx_http_llama_session_ask_t *ask);
static ngx_uint_t ngx_http_llama_session_count_batch(
    ngx_http_llama_session_sh_t *sh, ngx_http_llama_session_slot_t *slot);
static void ngx_http_llama_session_reap_locked(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_slot_t *slot,
    ngx_log_t *log);
static ngx_uint_t ngx_http_llama_session_take_locked(
    ngx_http_llama_session_job_t *job, ngx_http_llama_session_slot_t *slot);
static void ngx_http_llama_session_behind_save(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job,
    ngx_http_llama_session_ask_t *ask);
static void ngx_http_llama_session_unqueue_locked(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_job_t *job);
static void ngx_http_llama_session_prune(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_slot_t *slot, ngx_log_t *log);
static uint64_t ngx_http_llama_session_proc_start(ngx_pid_t pid);


/* how long a free slot may see no grant before the queue is checked */
#define NGX_HTTP_LLAMA_SESSION_STALL     200

/* how long a slot is held before its owner is checked, and how often */
#define NGX_HTTP_LLAMA_SESSION_OWNER_CHECK  1000


/* when this process started (/proc/PID/stat), with its pid its identity */
static uint64_t  ngx_http_llama_session_self_start;


/* this worker's slot jobs that wait for a slot, woken on a local release */

static ngx_queue_t  ngx_http_llama_session_waiting = {
    &ngx_http_llama_session_waiting, &ngx_http_llama_session_waiting
};



/*
 * Takes the slot for the request or queues it.  NGX_OK: the request holds
 * the slot, and job->out_key, ask->action tell what the slot held;
 * NGX_AGAIN: queued, poll again; NGX_DECLINED: the queue is full.
 *
 * Order: the oldest waiter goes first.  When a session was swapped in, its
 * requests that were already waiting then may go before the next swap.
 * A poll costs the same whatever the queue's length; only a queue that
 * stalls (a free slot, nobody taking it) is walked, to drop the waiters
 * of dead workers wherever they stand.
 */

ngx_int_t
ngx_http_llama_session_acquire(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_http_llama_session_ask_t *ask)
{
    ngx_uint_t                        grant, hit, member, free, lent;
    ngx_queue_t                      *q;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_slot_t    *slot;
    ngx_http_llama_session_waiter_t  *w;

    sh = zone->sh;

    if (sh->nslots > 1) {
        return ngx_http_llama_session_acquire_many(zone, job, ask);
    }

    slot = &sh->slots[job->slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    ngx_http_llama_session_reap_locked(zone, slot, job->log);

    hit = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
           && slot->key_len == ask->key_len
           && ngx_memcmp(slot->key, ask->key, ask->key_len) == 0);

    grant = 0;
    member = 0;

    /* a slot lent by its idle save is free to a request of its session */
    free = (!slot->busy || (slot->lent && hit));

    if (ngx_http_llama_session_unloading_locked(zone)) {
        /* router mode: the model is being unloaded; wait in the queue */

        if (!job->queued
            && ngx_http_llama_session_enqueue_locked(zone, job, ask) != NGX_OK)
        {
            return NGX_DECLINED;
        }

    } else if (!job->queued) {

        if (free && ngx_queue_empty(&sh->waiters)) {
            grant = 1;

        } else if (ngx_http_llama_session_enqueue_locked(zone, job, ask)
                   != NGX_OK)
        {
            return NGX_DECLINED;
        }

    } else if (free) {

        if (!slot->busy
            && (ngx_msec_int_t) (ngx_current_msec - slot->free_since)
               >= NGX_HTTP_LLAMA_SESSION_STALL)
        {
            /* nobody took the free slot for a while: who waits really? */
            ngx_http_llama_session_prune(zone, slot,
                                         job->log);
            slot->free_since = ngx_current_msec;
        }

        member = (hit && job->ticket < slot->batch
                  && slot->batch_len == ask->key_len
                  && ngx_memcmp(slot->batch_key, ask->key, ask->key_len)
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

            grant = (w == job->waiter && w->ticket == job->ticket);
        }
    }

    if (!grant) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_AGAIN;
    }

    if (job->queued) {
        ngx_http_llama_session_unqueue_locked(zone, job);
    }

    lent = ngx_http_llama_session_take_locked(job, slot);
    ngx_http_llama_session_granted_locked(zone, job, ask, slot, hit);

    if (!hit) {
        /* requests of this session waiting now go before the next swap */
        slot->batch = sh->next_ticket;
        slot->batch_left = ngx_http_llama_session_count_batch(sh, slot);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (lent) {
        ngx_http_llama_session_behind_save(zone, job, ask);
    }

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
ngx_http_llama_session_acquire_many(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_http_llama_session_ask_t *ask)
{
    ngx_int_t                         s, e;
    ngx_uint_t                        i, stalled, usable, lent;
    ngx_queue_t                      *q;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_slot_t    *slot;
    ngx_http_llama_session_waiter_t  *w, *me;

    sh = zone->sh;

    ngx_shmtx_lock(&zone->shpool->mutex);

    stalled = 0;
    usable = ngx_http_llama_session_slots_usable(sh);

    for (i = 0; i < sh->nslots; i++) {
        slot = &sh->slots[i];

        ngx_http_llama_session_reap_locked(zone, slot, job->log);

        if (!slot->busy && i < usable
            && (ngx_msec_int_t) (ngx_current_msec - slot->free_since)
               >= NGX_HTTP_LLAMA_SESSION_STALL)
        {
            stalled = 1;
        }
    }

    if (!job->queued) {
        if (ngx_http_llama_session_enqueue_locked(zone, job, ask) != NGX_OK) {
            return NGX_DECLINED;
        }

    } else if (stalled) {
        /* a free slot nobody took for a while: who waits really? */
        ngx_http_llama_session_prune(zone, &sh->slots[0],
                                     job->log);

        for (i = 0; i < sh->nslots; i++) {
            if (!sh->slots[i].busy) {
                sh->slots[i].free_since = ngx_current_msec;
            }
        }
    }

    me = job->waiter;

    if (me == NULL || me->ticket != job->ticket) {
        /* dropped as a dead worker's: this process is alive, queue again */
        job->queued = 0;
        job->waiter = NULL;
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_AGAIN;
    }

    if (ngx_http_llama_session_unloading_locked(zone)) {
        /* router mode: the model is being unloaded; wait in the queue */
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_AGAIN;
    }

    s = ngx_http_llama_session_slot_of_locked(sh, ask->key, ask->key_len);

    /* the older waiters: of the same session, or swaps that go first */

    for (q = ngx_queue_head(&sh->waiters);
         q != ngx_queue_sentinel(&sh->waiters);
         q = ngx_queue_next(q))
    {
        w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

        if (w == me) {
            break;
        }

        if ((w->key_len == ask->key_len
             && ngx_memcmp(w->key, ask->key, ask->key_len) == 0
             && !ask->unnamed)
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
        /* a slot lent by its idle save is free to a request of its session */
        e = (sh->slots[s].busy && !sh->slots[s].lent) ? NGX_ERROR : s;

        if (e == NGX_ERROR && ask->unnamed) {
            /*
             * requests without an id that look alike run at once, as
             * llama-server alone runs them: a second one takes a slot
             * that is empty, holds "default", or holds a session saved
             * and unchanged since
             */

            e = ngx_http_llama_session_choose_locked(sh, ask, 1);

            if (e != NGX_ERROR) {
                /* another slot of "default" is one, as good as the first */
                s = (sh->slots[e].state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                     && sh->slots[e].key_len == ask->key_len
                     && ngx_memcmp(sh->slots[e].key, ask->key, ask->key_len)
                        == 0)
                    ? e : NGX_ERROR;
            }
        }

    } else {
        ask->ram = ngx_http_llama_session_ram_holds_locked(zone, ask->key,
                                                           ask->key_len);
        e = ngx_http_llama_session_choose_locked(sh, ask, 0);
    }

    if (e == NGX_ERROR) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_AGAIN;
    }

    ngx_http_llama_session_unqueue_locked(zone, job);

    job->slot = e;
    slot = &sh->slots[e];

    lent = ngx_http_llama_session_take_locked(job, slot);
    ngx_http_llama_session_granted_locked(zone, job, ask, slot, s != NGX_ERROR);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (lent) {
        ngx_http_llama_session_behind_save(zone, job, ask);
    }

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
ngx_http_llama_session_choose_locked(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_ask_t *ask, ngx_uint_t spare)
{
    ngx_int_t                       best;
    ngx_uint_t                      i, rank, best_rank, same, usable;
    ngx_http_llama_session_slot_t  *slot;

    best = NGX_ERROR;
    best_rank = 0;
    usable = ngx_http_llama_session_slots_usable(sh);

    for (i = 0; i < usable; i++) {
        slot = &sh->slots[i];

        if (slot->busy) {
            continue;
        }

        if (slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION) {
            /*
             * a session in llama-server's RAM cache comes out of it only
             * into a slot that holds another (ram.c): an empty one last
             */
            rank = ask->ram ? 5 : 0;

        } else if (spare && slot->key_len == ask->key_len
                   && ngx_memcmp(slot->key, ask->key, ask->key_len) == 0)
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

            if (ask->unnamed) {
                rank += 4;
            }
        }

        same = (ask->base && slot->has_base
                && ngx_memcmp(slot->base, ask->base,
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
ngx_http_llama_session_granted_locked(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_http_llama_session_ask_t *ask,
    ngx_http_llama_session_slot_t *slot, ngx_uint_t hit)
{
    ngx_http_llama_session_sh_t  *sh;

    sh = zone->sh;

    if (hit) {
        ask->action = NGX_HTTP_LLAMA_SESSION_ACTION_HIT;
        job->save_pending = 0;
        ask->verify = ((ngx_msec_int_t) (ngx_current_msec - slot->last_used)
                       >= NGX_HTTP_LLAMA_SESSION_VERIFY);
        ask->hit_dirty = slot->dirty;
        slot->dirty = 1;

        if (slot->msgs && ask->pool) {
            /* the session's last prompt, to explain a miss (miss.c) */
            ask->prev = ngx_palloc(ask->pool, slot->nmsgs
                                   * sizeof(ngx_http_llama_session_msg_t));
            if (ask->prev) {
                ngx_memcpy(ask->prev, slot->msgs, slot->nmsgs
                           * sizeof(ngx_http_llama_session_msg_t));
                ask->nprev = slot->nmsgs;
                ask->prev_tokens = slot->prompt_tokens;
            }
        }
        sh->stats.hits++;

    } else {
        job->slot_tokens = (slot->state
                                == NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY)
                           ? 0 : -1;
        job->slot_recent = ((ngx_msec_int_t) (ngx_current_msec
                                              - slot->last_used)
                            < NGX_HTTP_LLAMA_SESSION_VERIFY);
        slot->batch_len = (u_short) ask->key_len;
        ngx_memcpy(slot->batch_key, ask->key, ask->key_len);
    }

    sh->stats.requests++;
}


/*
 * The request takes its place at the end of the queue, in the storage
 * reserved for waiters.  NGX_DECLINED: max_waiting requests wait already;
 * the lock is released then.
 */

static ngx_int_t
ngx_http_llama_session_enqueue_locked(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_http_llama_session_ask_t *ask)
{
    ngx_queue_t                      *q;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_waiter_t  *w;

    sh = zone->sh;

    if (ngx_queue_empty(&sh->free_waiters)) {
        sh->stats.queue_full++;
        ngx_shmtx_unlock(&zone->shpool->mutex);

        ngx_log_error(NGX_LOG_WARN, job->log, 0,
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
    w->key_len = (u_short) ask->key_len;
    ngx_memcpy(w->key, ask->key, ask->key_len);

    ngx_queue_insert_tail(&sh->waiters, &w->queue);
    sh->nwaiters++;

    job->waiter = w;
    job->ticket = w->ticket;
    job->queued = 1;

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
ngx_http_llama_session_try_slot(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job)
{
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;
    slot = &sh->slots[job->slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    ngx_http_llama_session_reap_locked(zone, slot, job->log);

    if (slot->busy || ngx_http_llama_session_wanted_locked(sh, slot)) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_BUSY;
    }

    (void) ngx_http_llama_session_take_locked(job, slot);

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
ngx_http_llama_session_reap_locked(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_slot_t *slot, ngx_log_t *log)
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

    ngx_log_error(NGX_LOG_ALERT, log, 0,
                  "llama_session: worker %P died holding slot %ui, its "
                  "content is unknown now", slot->owner,
                  (ngx_uint_t) (slot - zone->sh->slots));

    slot->busy = 0;
    slot->lent = 0;
    slot->owner = 0;
    slot->owner_start = 0;
    slot->free_since = ngx_current_msec;

    ngx_http_llama_session_slot_forget(zone, slot,
                                      NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
}


/* the slot holds no session the module can name: empty or unknown */

void
ngx_http_llama_session_slot_forget(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_slot_t *slot, ngx_uint_t state)
{
    if (slot->msgs) {
        ngx_slab_free_locked(zone->shpool, slot->msgs);
        slot->msgs = NULL;
    }

    slot->nmsgs = 0;
    slot->prompt_tokens = 0;
    slot->chain = 0;
    slot->held = 0;
    slot->state = (u_char) state;
    slot->key_len = 0;
    slot->crc = 0;
    slot->has_ns = 0;
    slot->dirty = 0;
    slot->saveable = 0;
    slot->has_base = 0;
    slot->media = 0;
    slot->draft_lost = 0;
}


/*
 * The slot is this process's now; the context learns what it holds.
 * Returns 1 when it was lent: its idle save's call is still on its way.
 */

static ngx_uint_t
ngx_http_llama_session_take_locked(ngx_http_llama_session_job_t *job,
    ngx_http_llama_session_slot_t *slot)
{
    ngx_uint_t  lent;

    lent = (slot->busy && slot->lent);

    slot->lent = 0;
    job->taken = ++slot->taken;

    slot->busy = 1;
    slot->owner = ngx_pid;
    slot->owner_start = ngx_http_llama_session_self_start;
    slot->taken_at = ngx_current_msec;
    slot->checked_at = ngx_current_msec;

    job->acquired = 1;
    job->released = 0;
    job->slot_state = slot->state;
    job->quiet_until = slot->quiet_until;
    job->save_pending = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                         && slot->dirty && slot->saveable);

    job->out_len = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION)
                   ? slot->key_len : 0;
    ngx_memcpy(job->out_key, slot->key, job->out_len);

    job->slot_has_base = (slot->state
                               == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                          && slot->has_base);
    ngx_memcpy(job->slot_base, slot->base, NGX_HTTP_LLAMA_SESSION_DIGEST);

    return lent;
}


/*
 * An idle save's job whose save call is on its way: llama-server runs
 * that save before any request sent after it, so a request of the session
 * may take the slot now and go behind the save in llama-server's queue,
 * instead of waiting for its reply here.  Not before a router's unload,
 * which waits for the slot.  The job keeps its calls; the slot is the
 * request's once it takes it (release() and slot_saved() then leave it).
 */

void
ngx_http_llama_session_lend(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job)
{
    ngx_http_llama_session_slot_t  *slot;

    slot = &zone->sh->slots[job->slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->taken == job->taken && slot->busy
        && !ngx_http_llama_session_unloading_locked(zone))
    {
        slot->lent = 1;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    ngx_http_llama_session_wake_local();
}


static void
ngx_http_llama_session_behind_save(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_http_llama_session_ask_t *ask)
{
    (void) ngx_atomic_fetch_add(&zone->sh->stats.idle_lent, 1);

    ngx_log_error(NGX_LOG_INFO, job->log, 0,
                  "llama_session: \"%*s\" takes slot %ui of zone \"%V\" "
                  "while its idle save is on its way: its turn goes behind "
                  "the save in llama-server", ask->key_len, ask->key,
                  job->slot, &zone->name);
}


/*
 * An idle save's job, before each call that waits for llama-server's batch
 * in flight (its re-prime's completion, the save): does a request of the
 * session it saves wait for the slot?  Then the save gives way (idle.c),
 * but not before a router's unload, which must save.
 */

ngx_uint_t
ngx_http_llama_session_idle_wanted(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job)
{
    ngx_uint_t  wanted;

    ngx_shmtx_lock(&zone->shpool->mutex);

    wanted = !ngx_http_llama_session_unloading_locked(zone)
             && ngx_http_llama_session_waited_locked(zone->sh, job->out_key,
                                                     job->out_len);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return wanted;
}


/*
 * For the idle save: takes the slot if its session changed since its last
 * save and had no request for save_idle, and nobody waits.
 */

ngx_int_t
ngx_http_llama_session_try_idle(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_msec_t save_idle)
{
    ngx_uint_t                      urgent;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;
    slot = &sh->slots[job->slot];

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

    (void) ngx_http_llama_session_take_locked(job, slot);
    ngx_memcpy(job->fp, sh->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return NGX_OK;
}


/*
 * May the request's slot save the request's base now?  Not while another
 * slot saves it: both would write its one temporary file.  The claim ends
 * with the slot's release.
 */

ngx_uint_t
ngx_http_llama_session_base_claim(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, u_char *base)
{
    ngx_uint_t                      i, free;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;
    free = 1;

    ngx_shmtx_lock(&zone->shpool->mutex);

    for (i = 0; i < sh->nslots; i++) {
        slot = &sh->slots[i];

        if (i != job->slot && slot->busy && slot->saving_base
            && ngx_memcmp(slot->saving, base,
                          NGX_HTTP_LLAMA_SESSION_DIGEST) == 0)
        {
            free = 0;
            break;
        }
    }

    if (free) {
        slot = &sh->slots[job->slot];
        slot->saving_base = 1;
        ngx_memcpy(slot->saving, base, NGX_HTTP_LLAMA_SESSION_DIGEST);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return free;
}


/*
 * A save of the job's slot's session succeeded: it is clean until used
 * again, unless a request of the session took the slot since (lent).
 */

void
ngx_http_llama_session_slot_saved(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, u_char *key, size_t len)
{
    ngx_http_llama_session_slot_t  *slot;

    slot = &zone->sh->slots[job->slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->taken == job->taken
        && slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
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
ngx_http_llama_session_dequeue(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job)
{

    if (!job->queued) {
        return;
    }

    ngx_shmtx_lock(&zone->shpool->mutex);
    ngx_http_llama_session_unqueue_locked(zone, job);
    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/* the request leaves the queue, granted or not */

static void
ngx_http_llama_session_unqueue_locked(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job)
{
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_slot_t    *slot;
    ngx_http_llama_session_waiter_t  *w;

    sh = zone->sh;
    w = job->waiter;

    job->queued = 0;
    job->waiter = NULL;

    if (w == NULL || w->ticket != job->ticket || w->pid != ngx_pid) {
        /* dropped already (taken for a dead worker's) */
        return;
    }

    slot = &sh->slots[job->slot];

    if (job->ticket < slot->batch && slot->batch_left
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
ngx_http_llama_session_slot_set(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_http_llama_session_ask_t *ask,
    ngx_uint_t state, u_char *key, size_t len, ngx_uint_t dirty)
{
    ngx_http_llama_session_slot_t  *slot;

    slot = &zone->sh->slots[job->slot];

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
            slot->chain = 0;
        }

        if (slot->key_len != len || ngx_memcmp(slot->key, key, len) != 0) {
            /* its reply tells (ram.c) */
            slot->held = 0;
        }

        if (ask->ns) {
            slot->has_ns = 1;
            ngx_memcpy(slot->ns, ask->ns, NGX_HTTP_LLAMA_SESSION_DIGEST);

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

        if (ask->action == NGX_HTTP_LLAMA_SESSION_ACTION_RESTORE
            || ask->action == NGX_HTTP_LLAMA_SESSION_ACTION_WARM)
        {
            slot->draft_lost = job->speculative
                               && (ask->action
                                   == NGX_HTTP_LLAMA_SESSION_ACTION_RESTORE
                                   || slot->draft_lost
                                   || ask->base_file);

        } else if (ask->action == NGX_HTTP_LLAMA_SESSION_ACTION_FRESH) {
            slot->draft_lost = 0;
        }

        /* a conversation's image stays in its history */
        slot->media = (slot->key_len == len
                       && ngx_memcmp(slot->key, key, len) == 0
                       && slot->media) || ask->media;

        ngx_memcpy(slot->key, key, len);
        slot->key_len = (u_short) len;
        slot->saveable = !ask->unnamed;
        slot->crc = slot->saveable ? ngx_crc32_long(key, len) : 0;
        slot->dirty = (u_char) dirty;

        /* the slot's content starts with this base's system prompt */
        slot->has_base = (ask->base != NULL);

        if (ask->base) {
            ngx_memcpy(slot->base, ask->base, NGX_HTTP_LLAMA_SESSION_DIGEST);
        }

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
ngx_http_llama_session_release(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_uint_t state)
{
    ngx_msec_t                      held;
    ngx_http_llama_session_slot_t  *slot;

    if (!job->acquired || job->released) {
        return;
    }

    job->released = 1;

    slot = &zone->sh->slots[job->slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->taken != job->taken) {
        /* lent, and taken since by a request of its session: it is that's */
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return;
    }

    slot->lent = 0;

    if (slot->busy && slot->owner == ngx_pid) {
        slot->busy = 0;
        slot->owner = 0;
        slot->owner_start = 0;
        slot->free_since = ngx_current_msec;
    }

    if (job->quarantine) {
        slot->quiet_until = ngx_current_msec
                            + NGX_HTTP_LLAMA_SESSION_QUARANTINE;
    }

    if (state == NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN) {
        ngx_http_llama_session_slot_forget(zone, slot, state);
    }

    slot->saving_base = 0;

    if (job->client) {
        /* a request's use (not an idle save's, nor the API's) */
        slot->last_used = ngx_current_msec;
        slot->used_at = ngx_time();

        /* how long a turn holds a slot, for the balancer's queue */
        held = ngx_current_msec - slot->taken_at;
        zone->sh->turn_ms = zone->sh->turn_ms
                            ? (7 * zone->sh->turn_ms + held) / 8 : held;
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


/* copies the zone's fingerprint into fp; 0: not known yet */

ngx_uint_t
ngx_http_llama_session_fingerprint(ngx_http_llama_session_zone_t *zone,
    u_char *fp)
{
    ngx_uint_t                      known;

    ngx_shmtx_lock(&zone->shpool->mutex);

    known = zone->sh->fp_known;
    ngx_memcpy(fp, zone->sh->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return known;
}


void
ngx_http_llama_session_set_fingerprint(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, u_char *fp, ngx_uint_t n_ctx,
    ngx_uint_t total_slots, ngx_str_t *model_path)
{
    ngx_uint_t                      i;
    ngx_http_llama_session_sh_t    *sh;

    sh = zone->sh;

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (sh->fp_known
        && ngx_memcmp(sh->fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN) != 0)
    {
        ngx_log_error(NGX_LOG_WARN, job->log, 0,
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

        ngx_log_error(NGX_LOG_WARN, job->log, 0,
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
        ngx_log_error(NGX_LOG_NOTICE, job->log, 0,
                      "llama_session: llama-server has %ui slots, zone "
                      "\"%V\" uses its slots=%ui of them", total_slots,
                      &zone->name, sh->nslots);
    }

    sh->total_slots = total_slots;

    if (sh->nslots == 0 && total_slots) {
        /* slots=auto: the zone drives the slots the backend has */

        sh->nslots = ngx_min(total_slots, NGX_HTTP_LLAMA_SESSION_SLOTS_MAX);

        ngx_log_error(NGX_LOG_NOTICE, job->log, 0,
                      "llama_session zone \"%V\" drives the %ui slots of "
                      "its backend (slots=auto)", &zone->name, sh->nslots);
    }
    sh->model_path_len = (u_short) ngx_min(model_path->len,
                                           NGX_HTTP_LLAMA_SESSION_PATH_SHOW);
    ngx_memcpy(sh->model_path, model_path->data, sh->model_path_len);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    ngx_memcpy(job->fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);

    /* the first contact, and after a restart: which tiers (ram.c) */
    ngx_http_llama_session_ram_tiers(zone, job->log);
}


/*
 * GET /slots showed the slot's task id.  Task ids only grow while
 * llama-server runs; a smaller one (or none) where the zone saw one means
 * it restarted, and the session the zone thinks is there is gone.
 * Returns 1 then.
 */

ngx_uint_t
ngx_http_llama_session_slot_task(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_int_t task)
{
    ngx_uint_t                      restarted, resumed;
    ngx_http_llama_session_slot_t  *slot;

    slot = &zone->sh->slots[job->slot];
    resumed = 0;

    ngx_shmtx_lock(&zone->shpool->mutex);

    restarted = (slot->task >= 0 && task < slot->task);

    slot->task = task;

    if (restarted) {
        ngx_http_llama_session_slot_forget(zone, slot,
                                          NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
        zone->sh->stats.restarts++;

        /*
         * restores that brought nothing stopped saves and restores: a new
         * llama-server may run otherwise (--swa-full), they are tried again
         */
        resumed = zone->sh->restores_off;
        zone->sh->restores_off = 0;
        zone->sh->ineffective_run = 0;

        /* and its RAM cache is empty */
        ngx_http_llama_session_ram_reset_locked(zone);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (resumed) {
        ngx_log_error(NGX_LOG_NOTICE, job->log, 0,
                      "llama_session: llama-server of zone \"%V\" "
                      "restarted: the zone saves and restores again",
                      &zone->name);
    }

    return restarted;
}


/*
 * The request's prompt becomes the slot's last one, with the tokens its
 * reply counted, for the next request's comparison (miss.c), and the chain
 * of all its messages, for the session's .json (ext.c).
 */

void
ngx_http_llama_session_slot_msgs(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t n, u_char *key, size_t len, ngx_http_llama_session_msg_t *msgs,
    ngx_uint_t nmsgs, uint64_t chain, ngx_uint_t prompt_tokens)
{
    size_t                          size;
    ngx_http_llama_session_slot_t  *slot;

    slot = &zone->sh->slots[n];
    size = nmsgs * sizeof(ngx_http_llama_session_msg_t);

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (!slot->busy || slot->owner != ngx_pid
        || slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
        || slot->key_len != len
        || ngx_memcmp(slot->key, key, len) != 0)
    {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return;
    }

    if (slot->msgs && slot->nmsgs != nmsgs) {
        ngx_slab_free_locked(zone->shpool, slot->msgs);
        slot->msgs = NULL;
    }

    if (slot->msgs == NULL && size) {
        /* a full zone keeps no prompt: the next miss is not explained */
        slot->msgs = ngx_slab_alloc_locked(zone->shpool, size);
    }

    if (slot->msgs) {
        ngx_memcpy(slot->msgs, msgs, size);
    }

    slot->nmsgs = slot->msgs ? nmsgs : 0;
    slot->prompt_tokens = prompt_tokens;
    slot->chain = chain;

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * A copy of the slot's last prompt (its messages' digests) and its chain,
 * when the slot holds that session: how many; 0: none.
 */

ngx_uint_t
ngx_http_llama_session_slot_msgs_copy(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t n, u_char *key, size_t len, ngx_http_llama_session_msg_t *out,
    ngx_uint_t max, ngx_uint_t *tokens, uint64_t *chain)
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
        *chain = slot->chain;
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

ngx_uint_t
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


/* this process's start, with its pid its identity (router.c's switch) */

uint64_t
ngx_http_llama_session_self(void)
{
    return ngx_http_llama_session_self_start;
}


/* at a process's start: who it is, for the owner of a slot or a wait */

void
ngx_http_llama_session_process_init(void)
{
    ngx_http_llama_session_self_start =
                              ngx_http_llama_session_proc_start(ngx_getpid());
}


/* this worker's slot jobs that wait for a slot, woken on a release */

void
ngx_http_llama_session_wait_local(ngx_http_llama_session_job_t *job)
{
    if (job->local.next == NULL) {
        ngx_queue_insert_tail(&ngx_http_llama_session_waiting, &job->local);
    }
}


void
ngx_http_llama_session_wait_end(ngx_http_llama_session_job_t *job)
{
    if (job->local.next) {
        ngx_queue_remove(&job->local);
        job->local.next = NULL;
    }
}


void
ngx_http_llama_session_wake_local(void)
{
    ngx_queue_t                   *q;
    ngx_http_llama_session_job_t  *job;

    for (q = ngx_queue_head(&ngx_http_llama_session_waiting);
         q != ngx_queue_sentinel(&ngx_http_llama_session_waiting);
         q = ngx_queue_next(q))
    {
        job = ngx_queue_data(q, ngx_http_llama_session_job_t, local);

        if (!job->wait_ev.posted) {
            ngx_post_event(&job->wait_ev, &ngx_posted_events);
        }
    }
}


/*
 * The zone's model is not running (or sleeps): its slots are empty (or
 * unknown) whatever the zone thought.  Every slot no request holds, and
 * the job's own (job of this zone, or NULL), is set so; returns how many
 * held a session changed since its last save (lost).  hit_dirty: whether
 * the job's session changed before its hit took the slot, -1: no hit.
 */

ngx_uint_t
ngx_http_llama_session_model_reset(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, ngx_int_t hit_dirty, ngx_uint_t state)
{
    ngx_uint_t                      i, lost, own;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;
    lost = 0;

    ngx_shmtx_lock(&zone->shpool->mutex);

    for (i = 0; i < sh->nslots; i++) {
        slot = &sh->slots[i];

        own = (job && job->acquired && !job->released && job->slot == i);

        if (slot->busy && !own) {
            continue;
        }

        /* a hit marks its slot changed when it takes it: not yet */

        if (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
            && slot->saveable
            && ((own && hit_dirty != -1) ? (ngx_uint_t) hit_dirty
                                         : slot->dirty))
        {
            lost++;
        }

        ngx_http_llama_session_slot_forget(zone, slot, state);
        slot->task = -1;
    }

    /* the model's process went, its RAM cache with it */
    ngx_http_llama_session_ram_reset_locked(zone);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return lost;
}
