
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The shared-memory zone: what each slot holds, who holds it, who waits
 * for it (one FIFO per zone), and which sessions have a saved file.
 * Every access is under the zone's mutex; nothing here does I/O.
 */


#include "ngx_http_llama_session_module.h"


static ngx_http_llama_session_node_t *ngx_http_llama_session_lookup(
    ngx_http_llama_session_sh_t *sh, u_char *key, size_t len,
    uint32_t hash);
static ngx_http_llama_session_node_t *ngx_http_llama_session_node(
    ngx_http_llama_session_zone_t *zone, u_char *key, size_t len);
static void ngx_http_llama_session_prune(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log);
static void ngx_http_llama_session_unqueue_locked(
    ngx_http_llama_session_zone_t *zone, ngx_atomic_uint_t ticket);
static ngx_uint_t ngx_http_llama_session_alive(ngx_pid_t pid);


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

        if (ozone->nslots != zone->nslots) {
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "llama_session zone \"%V\" uses slots=%ui while "
                          "previously it used slots=%ui: restart nginx to "
                          "change it", &shm_zone->shm.name, zone->nslots,
                          ozone->nslots);
            return NGX_ERROR;
        }

        zone->sh = ozone->sh;
        zone->shpool = ozone->shpool;

        return NGX_OK;
    }

    zone->shpool = (ngx_slab_pool_t *) shm_zone->shm.addr;

    if (shm_zone->shm.exists) {
        zone->sh = zone->shpool->data;
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

    ngx_queue_init(&sh->waiters);
    ngx_queue_init(&sh->lru);
    ngx_rbtree_init(&sh->rbtree, &sh->sentinel, ngx_rbtree_insert_value);

    /* after a start nobody can vouch for what the backend's slots hold */

    for (i = 0; i < zone->nslots; i++) {
        sh->slots[i].state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
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
 * the slot, and ctx->out_key, ctx->action tell what the slot held;
 * NGX_AGAIN: queued, poll again; NGX_ERROR: no memory for the queue.
 *
 * Order: the oldest waiter goes first.  When a session was swapped in, its
 * requests that were already waiting then may go before the next swap.
 */

ngx_int_t
ngx_http_llama_session_acquire(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t                        grant, hit, batch;
    ngx_queue_t                      *q;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_slot_t    *slot;
    ngx_http_llama_session_zone_t    *zone;
    ngx_http_llama_session_waiter_t  *w, *head;

    zone = ctx->zone;
    sh = zone->sh;
    slot = &sh->slots[ctx->slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->busy && !ngx_http_llama_session_alive(slot->owner)) {
        ngx_log_error(NGX_LOG_ALERT, ctx->request->connection->log, 0,
                      "llama_session: worker %P died holding slot %ui, "
                      "its content is unknown now", slot->owner, ctx->slot);
        slot->busy = 0;
        slot->owner = 0;
        slot->state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
    }

    hit = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
           && slot->key_len == ctx->key_len
           && ngx_memcmp(slot->key, ctx->key, ctx->key_len) == 0);

    grant = 0;

    if (!ctx->queued) {

        if (!slot->busy && ngx_queue_empty(&sh->waiters)) {
            grant = 1;

        } else {
            w = ngx_slab_alloc_locked(zone->shpool,
                                      sizeof(ngx_http_llama_session_waiter_t));
            if (w == NULL) {
                ngx_shmtx_unlock(&zone->shpool->mutex);
                ngx_log_error(NGX_LOG_CRIT, ctx->request->connection->log, 0,
                              "llama_session zone \"%V\" has no room for "
                              "another waiting request", &zone->name);
                return NGX_ERROR;
            }

            w->ticket = sh->next_ticket++;
            w->pid = ngx_pid;
            w->key_len = (u_short) ctx->key_len;
            ngx_memcpy(w->key, ctx->key, ctx->key_len);

            ngx_queue_insert_tail(&sh->waiters, &w->queue);
            sh->nwaiters++;

            ctx->ticket = w->ticket;
            ctx->queued = 1;
        }

    } else if (!slot->busy) {

        ngx_http_llama_session_prune(zone, ctx->request->connection->log);

        if (hit && ctx->ticket < slot->batch) {
            /* waited already when its session was swapped in */
            grant = 1;

        } else {
            head = NULL;
            batch = 0;

            for (q = ngx_queue_head(&sh->waiters);
                 q != ngx_queue_sentinel(&sh->waiters);
                 q = ngx_queue_next(q))
            {
                w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

                if (head == NULL) {
                    head = w;
                }

                if (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                    && w->ticket < slot->batch
                    && w->key_len == slot->key_len
                    && ngx_memcmp(w->key, slot->key, w->key_len) == 0)
                {
                    batch = 1;
                    break;
                }
            }

            if (!batch && (head == NULL || head->ticket == ctx->ticket)) {
                grant = 1;
            }
        }
    }

    if (!grant) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_AGAIN;
    }

    if (ctx->queued) {
        ngx_http_llama_session_unqueue_locked(zone, ctx->ticket);
        ctx->queued = 0;
    }

    slot->busy = 1;
    slot->owner = ngx_pid;

    ctx->acquired = 1;

    ngx_memcpy(ctx->out_key, slot->key, slot->key_len);
    ctx->out_len = slot->key_len;

    if (hit) {
        ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_HIT;

    } else {
        /* requests of this session waiting now go before the next swap */
        slot->batch = sh->next_ticket;

        ctx->save_pending = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
                             && slot->dirty && slot->saveable);
        ctx->slot_tokens = (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY)
                           ? 0 : -1;

        if (slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION) {
            ctx->out_len = 0;
        }
    }

    sh->stats.requests++;

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return NGX_OK;
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
    ngx_http_llama_session_unqueue_locked(zone, ctx->ticket);
    ngx_shmtx_unlock(&zone->shpool->mutex);

    ctx->queued = 0;
}


static void
ngx_http_llama_session_unqueue_locked(ngx_http_llama_session_zone_t *zone,
    ngx_atomic_uint_t ticket)
{
    ngx_queue_t                      *q;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_waiter_t  *w;

    sh = zone->sh;

    for (q = ngx_queue_head(&sh->waiters);
         q != ngx_queue_sentinel(&sh->waiters);
         q = ngx_queue_next(q))
    {
        w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

        if (w->ticket == ticket) {
            ngx_queue_remove(q);
            ngx_slab_free_locked(zone->shpool, w);
            sh->nwaiters--;
            return;
        }
    }
}


/* sets what the slot holds while the request holds it */

void
ngx_http_llama_session_slot_set(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t state, u_char *key, size_t len, ngx_uint_t dirty)
{
    ngx_http_llama_session_slot_t  *slot;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    slot = &zone->sh->slots[ctx->slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    slot->state = (u_char) state;

    if (state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION) {
        ngx_memcpy(slot->key, key, len);
        slot->key_len = (u_short) len;
        slot->saveable = !ctx->default_session;
        slot->dirty = (u_char) dirty;

    } else {
        slot->key_len = 0;
        slot->saveable = 0;
        slot->dirty = 0;
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

    if (!ctx->acquired || ctx->released) {
        return;
    }

    ctx->released = 1;

    zone = ctx->zone;
    slot = &zone->sh->slots[ctx->slot];

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->busy && slot->owner == ngx_pid) {
        slot->busy = 0;
        slot->owner = 0;
    }

    if (state == NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN) {
        slot->state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        slot->key_len = 0;
        slot->dirty = 0;
        slot->saveable = 0;
    }

    slot->last_used = ngx_current_msec;

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * Is there a saved file for the key?  1: yes, 0: no, -1: the zone does not
 * know (no store= folder to look into and nothing recorded since start).
 */

ngx_int_t
ngx_http_llama_session_file_known(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len)
{
    ngx_int_t                       rc;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_node_t  *node;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    sh = zone->sh;

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_lookup(sh, key, len,
                                         ngx_crc32_short(key, len));

    if (node) {
        rc = node->saved;
        node->used_at = ngx_time();
        ngx_queue_remove(&node->lru);
        ngx_queue_insert_head(&sh->lru, &node->lru);

    } else {
        rc = -1;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return rc;
}


void
ngx_http_llama_session_file_saved(ngx_http_llama_session_ctx_t *ctx,
    u_char *key, size_t len, ngx_uint_t saved, ngx_uint_t tokens, off_t bytes)
{
    ngx_http_llama_session_node_t  *node;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_node(zone, key, len);

    if (node) {
        node->saved = (u_char) saved;

        if (saved) {
            node->tokens = tokens;
            node->bytes = bytes;
            node->saved_at = ngx_time();
        }

    } else {
        ngx_log_error(NGX_LOG_CRIT, ctx->request->connection->log, 0,
                      "llama_session zone \"%V\" has no room to record "
                      "session \"%*s\"", &zone->name, len, key);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


void
ngx_http_llama_session_stat(ngx_http_llama_session_ctx_t *ctx,
    ngx_atomic_uint_t *counter)
{
    (void) ngx_atomic_fetch_add(counter, 1);
}


static ngx_http_llama_session_node_t *
ngx_http_llama_session_lookup(ngx_http_llama_session_sh_t *sh, u_char *key,
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

        rc = ngx_memn2cmp(key, sn->key, len, sn->key_len);

        if (rc == 0) {
            return sn;
        }

        node = (rc < 0) ? node->left : node->right;
    }

    return NULL;
}


/* finds or adds the key's node, evicting the least recently used record */

static ngx_http_llama_session_node_t *
ngx_http_llama_session_node(ngx_http_llama_session_zone_t *zone, u_char *key,
    size_t len)
{
    uint32_t                        hash;
    ngx_uint_t                      tries;
    ngx_queue_t                    *q;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_node_t  *sn;

    sh = zone->sh;
    hash = ngx_crc32_short(key, len);

    sn = ngx_http_llama_session_lookup(sh, key, len, hash);

    if (sn) {
        sn->used_at = ngx_time();
        ngx_queue_remove(&sn->lru);
        ngx_queue_insert_head(&sh->lru, &sn->lru);
        return sn;
    }

    for (tries = 0; tries < 3; tries++) {

        sn = ngx_slab_calloc_locked(zone->shpool,
                                    sizeof(ngx_http_llama_session_node_t));
        if (sn) {
            break;
        }

        if (ngx_queue_empty(&sh->lru)) {
            return NULL;
        }

        /* forget the oldest record; its file, if any, stays */

        q = ngx_queue_last(&sh->lru);
        ngx_queue_remove(q);

        sn = ngx_queue_data(q, ngx_http_llama_session_node_t, lru);
        ngx_rbtree_delete(&sh->rbtree, &sn->node);
        ngx_slab_free_locked(zone->shpool, sn);
        sh->nsessions--;
        sn = NULL;
    }

    if (sn == NULL) {
        return NULL;
    }

    sn->node.key = hash;
    sn->key_len = (u_short) len;
    ngx_memcpy(sn->key, key, len);
    sn->used_at = ngx_time();

    ngx_rbtree_insert(&sh->rbtree, &sn->node);
    ngx_queue_insert_head(&sh->lru, &sn->lru);
    sh->nsessions++;

    return sn;
}


/* drops waiters whose worker died */

static void
ngx_http_llama_session_prune(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    ngx_queue_t                      *q, *next;
    ngx_http_llama_session_sh_t      *sh;
    ngx_http_llama_session_waiter_t  *w;

    sh = zone->sh;

    for (q = ngx_queue_head(&sh->waiters);
         q != ngx_queue_sentinel(&sh->waiters);
         q = next)
    {
        next = ngx_queue_next(q);

        w = ngx_queue_data(q, ngx_http_llama_session_waiter_t, queue);

        if (w->pid == ngx_pid || ngx_http_llama_session_alive(w->pid)) {
            /* only the head can block the others */
            break;
        }

        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: dropping a waiter of dead worker %P",
                      w->pid);

        ngx_queue_remove(q);
        ngx_slab_free_locked(zone->shpool, w);
        sh->nwaiters--;
    }
}


static ngx_uint_t
ngx_http_llama_session_alive(ngx_pid_t pid)
{
    if (pid == ngx_pid || pid == 0) {
        return 1;
    }

    if (kill(pid, 0) == -1 && ngx_errno == NGX_ESRCH) {
        return 0;
    }

    return 1;
}
