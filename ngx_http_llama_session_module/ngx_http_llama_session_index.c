
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The file index: the zone's records of the sessions that have a file in
 * the store (a tree by file name, an LRU queue, the bytes they take), for
 * eviction, the cost model and the API.  Given a zone, keys, the backend's
 * fingerprint and values, never the request.  Under the zone's mutex;
 * nothing here does I/O.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_index.h"


static ngx_http_llama_session_node_t *ngx_http_llama_session_lookup(
    ngx_http_llama_session_sh_t *sh, u_char *name, size_t len,
    uint32_t hash);
static void ngx_http_llama_session_rbtree_insert(ngx_rbtree_node_t *temp,
    ngx_rbtree_node_t *node, ngx_rbtree_node_t *sentinel);



/*
 * A session started from the base (its file restored, or the slot's
 * content cut back to it): counted, so that eviction keeps it before the
 * bases nobody used.  Returns the count before, 0: the first use.
 */

ngx_uint_t
ngx_http_llama_session_base_used(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_uint_t                      uses;
    ngx_http_llama_session_node_t  *node;

    uses = 1;

    n = ngx_http_llama_session_file_name(name, key, len, fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_node(zone, name, n);

    if (node) {
        uses = node->base_uses;
        ngx_http_llama_session_node_base(zone->sh, node, 1, uses + 1);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return uses;
}


/* the file index in a new zone */

void
ngx_http_llama_session_index_init(ngx_http_llama_session_sh_t *sh)
{
    ngx_queue_init(&sh->lru);
    ngx_queue_init(&sh->nofile);
    ngx_rbtree_init(&sh->rbtree, &sh->sentinel,
                    ngx_http_llama_session_rbtree_insert);
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
ngx_http_llama_session_file_known(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_int_t                       rc;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_node_t  *node;

    sh = zone->sh;

    n = ngx_http_llama_session_file_name(name, key, len, fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_lookup(sh, name, n, ngx_crc32_short(name, n));

    rc = node ? node->saved : -1;

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return rc;
}


/* the bytes and tokens of the session's file; NGX_DECLINED: not known */

ngx_int_t
ngx_http_llama_session_file_size(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len, off_t *bytes, ngx_uint_t *tokens)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_int_t                       rc;
    ngx_http_llama_session_node_t  *node;

    n = ngx_http_llama_session_file_name(name, key, len, fp);

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
ngx_http_llama_session_file_saved(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_job_t *job, u_char *key, size_t len,
    ngx_uint_t is_base, ngx_uint_t saved, ngx_uint_t tokens, off_t bytes)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_http_llama_session_node_t  *node;

    n = ngx_http_llama_session_file_name(name, key, len, job->fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_node(zone, name, n);

    if (node) {
        if (saved && is_base) {
            ngx_http_llama_session_node_base(zone->sh, node, 1,
                                             node->base_uses);
        }

        ngx_http_llama_session_node_file(zone->sh, node, saved, bytes);

        if (saved) {
            node->tokens = tokens;
            node->saved_at = ngx_time();

            /* another owner's file, indexed here, is not known to be */
            node->primed = (key == job->out_key && job->primed);
        }

    } else {
        ngx_log_error(NGX_LOG_CRIT, job->log, 0,
                      "llama_session zone \"%V\" has no room to record "
                      "session \"%*s\"", &zone->name, n, name);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * shared=on: the store file the slot's state of the session came from or
 * went to (fid->uniq 0: there was none); NULL: the store could not be
 * read, nothing is known (no order is kept for the session then)
 */

void
ngx_http_llama_session_file_seen(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len, ngx_http_llama_session_fid_t *fid)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_http_llama_session_node_t  *node;

    n = ngx_http_llama_session_file_name(name, key, len, fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_lookup(zone->sh, name, n,
                                         ngx_crc32_short(name, n));
    if (node) {
        node->has_seen = (fid != NULL);

        if (fid) {
            node->seen = *fid;
        }
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * shared=on: is the file in the store now (fid) another than the one the
 * slot's state came from or went to?  Then another owner saved the
 * session since, and its state is newer than the slot's.  0 when the
 * zone knows nothing of it.
 */

ngx_uint_t
ngx_http_llama_session_file_newer(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len, ngx_http_llama_session_fid_t *fid)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_uint_t                      newer;
    ngx_http_llama_session_node_t  *node;

    n = ngx_http_llama_session_file_name(name, key, len, fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_lookup(zone->sh, name, n,
                                         ngx_crc32_short(name, n));

    newer = node && node->has_seen
            && (node->seen.uniq != fid->uniq || node->seen.size != fid->size
                || node->seen.mtime != fid->mtime);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return newer;
}


/*
 * shared=on: the session's .json as this zone left it (written by its
 * save, or its time set when the zone took the session in)
 */

void
ngx_http_llama_session_file_meta(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, ngx_http_llama_session_fid_t *fid)
{
    ngx_http_llama_session_node_t  *node;

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_lookup(zone->sh, name, len,
                                         ngx_crc32_short(name, len));
    if (node) {
        node->has_meta = 1;
        node->meta = *fid;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * shared=on: a file eviction picked, whose .json is now "fid" and .bin
 * "bin" (NULL: none): did another owner use the session since this zone
 * did (a .json other than the zone left it, or for a file the zone only
 * found in the folder, one changed after "since"; or a .bin other than
 * the zone saw, renamed in after "since", whatever its .json says)?  Then
 * the file stays, counted again and most recently used, and 1 is
 * returned; 0: it may go.
 */

ngx_uint_t
ngx_http_llama_session_file_kept(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_evicted_t *e, ngx_http_llama_session_fid_t *fid,
    ngx_http_llama_session_fid_t *bin, time_t since)
{
    ngx_uint_t                      kept;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_node_t  *node;

    sh = zone->sh;
    kept = 0;

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_lookup(sh, e->name, e->len,
                                         ngx_crc32_short(e->name, e->len));

    if (node && !node->saved
        && bin && bin->mtime >= since
        && !(node->has_seen && node->seen.uniq == bin->uniq
             && node->seen.size == bin->size
             && node->seen.mtime == bin->mtime))
    {
        /*
         * another owner's file, renamed in lately (its .json may not be
         * written yet, or its write failed): kept for the grace period
         */
        kept = 1;

        node->used_at = ngx_time();
        ngx_http_llama_session_node_file(sh, node, 1, e->bytes);

        sh->stats.evictions--;

    } else if (node && !node->saved && fid
               && (node->has_meta
                   ? (node->meta.uniq != fid->uniq
                      || node->meta.mtime != fid->mtime
                      || node->meta.size != fid->size)
                   : fid->mtime >= since))
    {
        kept = 1;

        node->has_meta = 1;
        node->meta = *fid;
        node->used_at = ngx_time();

        /* at the front of the queue of files */
        ngx_http_llama_session_node_file(sh, node, 1, e->bytes);

        sh->stats.evictions--;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return kept;
}


/*
 * records a session (the request's, or its base: id "base"), with its id
 * and model for the API; a record in use goes to the front of its queue
 */

void
ngx_http_llama_session_remember(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len, ngx_http_llama_session_record_t *rec)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_http_llama_session_node_t  *node;

    n = ngx_http_llama_session_file_name(name, key, len, fp);

    ngx_shmtx_lock(&zone->shpool->mutex);

    node = ngx_http_llama_session_node(zone, name, n);

    if (node) {
        node->id_len = (u_char) ngx_min(rec->id->len,
                                        NGX_HTTP_LLAMA_SESSION_ID_SHOW);
        ngx_memcpy(node->id, rec->id->data, node->id_len);

        node->has_sys = (rec->sys != NULL);

        if (rec->sys) {
            ngx_memcpy(node->sys, rec->sys, NGX_HTTP_LLAMA_SESSION_DIGEST);
        }

        if (rec->idk) {
            node->has_idk = 1;
            ngx_memcpy(node->idk, rec->idk, NGX_HTTP_LLAMA_SESSION_DIGEST);
        }

        if (rec->ns) {
            /* the session's tenant, and its base's: the same */
            node->has_ns = 1;
            ngx_memcpy(node->ns, rec->ns, NGX_HTTP_LLAMA_SESSION_DIGEST);
        }

        node->model_len = (u_char) ngx_min(rec->model->len,
                                           NGX_HTTP_LLAMA_SESSION_MODEL_SHOW);
        ngx_memcpy(node->model, rec->model->data, node->model_len);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
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
 * In a shared store the file stays (other owners may count it; min_free
 * bounds the folder), and the next scan may index it again.
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

        if (sn->saved && zone->store.len && !zone->shared) {
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
