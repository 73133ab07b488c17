
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Metrics in the Prometheus text format (llama_session_metrics [zone
 * ...];), a content handler.  Every figure is kept in the zone's shared
 * memory, so any worker answers for all of them and a reload keeps them.
 * Names follow Prometheus' rules (base units, "_total" for counters) and
 * nginx modules' habit of a common prefix: nginx_llama_session_*.  Labels:
 * zone, and model (router mode), slot, outcome, reason, result where they
 * apply; never a session's id.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_gguf.h"
#include "ngx_http_llama_session_metrics.h"
#include "ngx_http_llama_session_models.h"
#include "ngx_http_llama_session_shm.h"


#define NGX_HTTP_LLAMA_SESSION_METRICS_BUF  16384


typedef struct {
    ngx_http_request_t             *request;
    ngx_chain_t                    *first;
    ngx_chain_t                    *last;
    ngx_str_t                       labels;     /* the zone's */
} ngx_http_llama_session_out_t;


/* the families, in the order printed; each zone's samples under each */

typedef enum {
    NGX_HTTP_LLAMA_SESSION_M_REQUESTS = 0,
    NGX_HTTP_LLAMA_SESSION_M_SWAPS,
    NGX_HTTP_LLAMA_SESSION_M_SAVES,
    NGX_HTTP_LLAMA_SESSION_M_RESTORES,
    NGX_HTTP_LLAMA_SESSION_M_EFFECTS,
    NGX_HTTP_LLAMA_SESSION_M_DISABLED,
    NGX_HTTP_LLAMA_SESSION_M_EVICTIONS,
    NGX_HTTP_LLAMA_SESSION_M_SAVED_BYTES,
    NGX_HTTP_LLAMA_SESSION_M_RESTORED_BYTES,
    NGX_HTTP_LLAMA_SESSION_M_TOKENS,
    NGX_HTTP_LLAMA_SESSION_M_PREFILL_SAVED,
    NGX_HTTP_LLAMA_SESSION_M_WAIT,
    NGX_HTTP_LLAMA_SESSION_M_SWAP,
    NGX_HTTP_LLAMA_SESSION_M_SAVE,
    NGX_HTTP_LLAMA_SESSION_M_RESTORE,
    NGX_HTTP_LLAMA_SESSION_M_WAITING,
    NGX_HTTP_LLAMA_SESSION_M_SLOTS,
    NGX_HTTP_LLAMA_SESSION_M_SLOTS_BUSY,
    NGX_HTTP_LLAMA_SESSION_M_SLOT_BUSY,
    NGX_HTTP_LLAMA_SESSION_M_SESSIONS,
    NGX_HTTP_LLAMA_SESSION_M_CHAINS,
    NGX_HTTP_LLAMA_SESSION_M_FILES,
    NGX_HTTP_LLAMA_SESSION_M_BYTES,
    NGX_HTTP_LLAMA_SESSION_M_BASE_FILES,
    NGX_HTTP_LLAMA_SESSION_M_BASE_BYTES,
    NGX_HTTP_LLAMA_SESSION_M_SHM_USED,
    NGX_HTTP_LLAMA_SESSION_M_SHM_SIZE,
    NGX_HTTP_LLAMA_SESSION_M_FORGOTTEN,
    NGX_HTTP_LLAMA_SESSION_M_RESTARTS,
    NGX_HTTP_LLAMA_SESSION_M_UNLOADS,
    NGX_HTTP_LLAMA_SESSION_M_LOST,
    NGX_HTTP_LLAMA_SESSION_M_REPRIMES,
    NGX_HTTP_LLAMA_SESSION_M_REPRIME_TOKENS,
    NGX_HTTP_LLAMA_SESSION_M_MEMORY,
    NGX_HTTP_LLAMA_SESSION_M_REPREFILLS,
    NGX_HTTP_LLAMA_SESSION_M_MEDIA_UNSAVED,
    NGX_HTTP_LLAMA_SESSION_M_SHARED_NEWER,
    NGX_HTTP_LLAMA_SESSION_M_RAM,
    NGX_HTTP_LLAMA_SESSION_M_STORE_TIMEOUTS,
    NGX_HTTP_LLAMA_SESSION_M_FAMILIES
} ngx_http_llama_session_family_e;


typedef struct {
    const char                     *name;
    const char                     *type;
    const char                     *help;
} ngx_http_llama_session_family_t;


static ngx_http_llama_session_family_t  ngx_http_llama_session_families[] = {
    { "requests_total", "counter",
      "Requests of sessions by how their slot was had." },
    { "swaps_total", "counter",
      "Swaps of the session in a slot." },
    { "saves_total", "counter",
      "Saves of a slot to a file, by reason and result." },
    { "restores_total", "counter",
      "Restores of a session's file into a slot by result: ok or failed." },
    { "restore_effects_total", "counter",
      "Of the ok restores, those whose reply showed they helped (effective) "
      "or not (ineffective)." },
    { "restores_disabled", "gauge",
      "1 when ineffective restores stopped saves and restores for the "
      "backend's configuration." },
    { "evictions_total", "counter",
      "Files deleted to keep the store within max_files and max_size, or "
      "min_free free on its disk." },
    { "saved_bytes_total", "counter",
      "Bytes of the files saved." },
    { "restored_bytes_total", "counter",
      "Bytes of the files restored." },
    { "prompt_tokens_total", "counter",
      "Prompt tokens of the replies, from the cache or evaluated." },
    { "prefill_saved_seconds_total", "counter",
      "Prefill time the cached prompt tokens saved, at each reply's "
      "prompt speed (an estimate)." },
    { "wait_seconds", "histogram",
      "Time requests waited for their slot." },
    { "swap_seconds", "histogram",
      "Time a swap took: the save, the restore or erase, the calls around "
      "them." },
    { "save_seconds", "histogram",
      "Time llama-server took to save a slot." },
    { "restore_seconds", "histogram",
      "Time llama-server took to restore a slot." },
    { "waiting_requests", "gauge",
      "Requests waiting for a slot now." },
    { "slots", "gauge",
      "Slots of the zone." },
    { "slots_busy", "gauge",
      "Slots a request holds now." },
    { "slot_busy", "gauge",
      "1 while a request holds the slot." },
    { "sessions", "gauge",
      "Sessions the zone knows." },
    { "id_chains", "gauge",
      "Requests and replies kept to know conversations without an id by." },
    { "store_files", "gauge",
      "Session files in the store folder." },
    { "store_bytes", "gauge",
      "Bytes of the session files in the store folder." },
    { "store_base_files", "gauge",
      "Of the store's files, warm starts' bases." },
    { "store_base_bytes", "gauge",
      "Bytes of the bases in the store folder." },
    { "shm_used_bytes", "gauge",
      "Shared memory of the zone in use." },
    { "shm_size_bytes", "gauge",
      "Shared memory of the zone." },
    { "sessions_forgotten_total", "counter",
      "Session records dropped to make room in a full zone (files stay)." },
    { "backend_restarts_total", "counter",
      "llama-server restarts seen in GET /slots." },
    { "model_unloads_total", "counter",
      "Router mode: the zone's model unloaded by the module for another, "
      "after its sessions were saved." },
    { "model_lost_sessions_total", "counter",
      "Router mode: sessions whose latest turns went with a model unloaded "
      "or asleep behind the module's back." },
    { "reprimes_total", "counter",
      "Re-primes before a save (the slot made to hold what the next turn "
      "shares), by result." },
    { "reprime_tokens_total", "counter",
      "Tokens the re-primes evaluated." },
    { "model_memory", "gauge",
      "The model's memory, from its file: full, swa, hybrid, recurrent or "
      "unknown (1 for the kind)." },
    { "reprefills_total", "counter",
      "Sessions re-prefilled instead of restored: their file would have "
      "taken longer to read than their prompt to prefill." },
    { "media_unsaved_total", "counter",
      "Saves llama-server refused because the slot holds an image or audio "
      "it cannot serialise (501): the session stays in its slot while it "
      "can, else it is prefilled again." },
    { "shared_newer_total", "counter",
      "shared=on: another owner had saved the session since this zone's "
      "slot took it in: a save not kept (at=\"save\"), a hit restored "
      "from the newer file instead (at=\"hit\")." },
    { "ram_total", "counter",
      "ram=: llama-server's RAM cache as the zone models it: swaps that "
      "found the session there (event=\"hit\") or not (\"miss\"), sessions "
      "that went in (\"stored\"), that it evicted (\"evicted\"), of them "
      "with turns their file lacked (\"lost\")." },
    { "store_timeouts_total", "counter",
      "Requests that went on without the store: a file call on it did not "
      "answer within the zone's store_timeout= (a store that stopped "
      "answering)." }
};


/*
 * The families of counters, a sample a field of the zone's stats or
 * metrics, in the order printed
 */

typedef struct {
    ngx_uint_t                      family;
    const char                     *labels;     /* after the zone's */
    size_t                          offset;     /* in the zone's sh */
} ngx_http_llama_session_counter_t;


static ngx_http_llama_session_counter_t  ngx_http_llama_session_counts[] = {
    { NGX_HTTP_LLAMA_SESSION_M_REQUESTS, ",outcome=\"hit\"",
      offsetof(ngx_http_llama_session_sh_t, stats.hits) },
    { NGX_HTTP_LLAMA_SESSION_M_REQUESTS, ",outcome=\"restore\"",
      offsetof(ngx_http_llama_session_sh_t, stats.restores) },
    { NGX_HTTP_LLAMA_SESSION_M_REQUESTS, ",outcome=\"warm\"",
      offsetof(ngx_http_llama_session_sh_t, stats.warm) },
    { NGX_HTTP_LLAMA_SESSION_M_REQUESTS, ",outcome=\"fresh\"",
      offsetof(ngx_http_llama_session_sh_t, stats.fresh) },
    { NGX_HTTP_LLAMA_SESSION_M_REQUESTS, ",outcome=\"bypass\"",
      offsetof(ngx_http_llama_session_sh_t, stats.bypass) },
    { NGX_HTTP_LLAMA_SESSION_M_REQUESTS, ",outcome=\"wait_timeout\"",
      offsetof(ngx_http_llama_session_sh_t, stats.wait_timeouts) },
    { NGX_HTTP_LLAMA_SESSION_M_REQUESTS, ",outcome=\"queue_full\"",
      offsetof(ngx_http_llama_session_sh_t, stats.queue_full) },
    { NGX_HTTP_LLAMA_SESSION_M_REQUESTS, ",outcome=\"backend_error\"",
      offsetof(ngx_http_llama_session_sh_t, stats.backend_errors) },
    { NGX_HTTP_LLAMA_SESSION_M_REQUESTS, ",outcome=\"refused\"",
      offsetof(ngx_http_llama_session_sh_t, stats.refused) },
    { NGX_HTTP_LLAMA_SESSION_M_SWAPS, "",
      offsetof(ngx_http_llama_session_sh_t, stats.swaps) },
    { NGX_HTTP_LLAMA_SESSION_M_RESTORES, ",result=\"ok\"",
      offsetof(ngx_http_llama_session_sh_t, stats.restores) },
    { NGX_HTTP_LLAMA_SESSION_M_RESTORES, ",result=\"failed\"",
      offsetof(ngx_http_llama_session_sh_t, stats.restore_errors) },
    { NGX_HTTP_LLAMA_SESSION_M_EFFECTS, ",effect=\"effective\"",
      offsetof(ngx_http_llama_session_sh_t, stats.effective) },
    { NGX_HTTP_LLAMA_SESSION_M_EFFECTS, ",effect=\"ineffective\"",
      offsetof(ngx_http_llama_session_sh_t, stats.ineffective) },
    { NGX_HTTP_LLAMA_SESSION_M_EVICTIONS, "",
      offsetof(ngx_http_llama_session_sh_t, stats.evictions) },
    { NGX_HTTP_LLAMA_SESSION_M_SAVED_BYTES, "",
      offsetof(ngx_http_llama_session_sh_t, metrics.bytes_saved) },
    { NGX_HTTP_LLAMA_SESSION_M_RESTORED_BYTES, "",
      offsetof(ngx_http_llama_session_sh_t, metrics.bytes_restored) },
    { NGX_HTTP_LLAMA_SESSION_M_TOKENS, ",source=\"cache\"",
      offsetof(ngx_http_llama_session_sh_t, metrics.tokens_cached) },
    { NGX_HTTP_LLAMA_SESSION_M_TOKENS, ",source=\"evaluated\"",
      offsetof(ngx_http_llama_session_sh_t, metrics.tokens_evaluated) },
    { NGX_HTTP_LLAMA_SESSION_M_FORGOTTEN, "",
      offsetof(ngx_http_llama_session_sh_t, stats.forgotten) },
    { NGX_HTTP_LLAMA_SESSION_M_RESTARTS, "",
      offsetof(ngx_http_llama_session_sh_t, stats.restarts) },
    { NGX_HTTP_LLAMA_SESSION_M_UNLOADS, "",
      offsetof(ngx_http_llama_session_sh_t, stats.unloads) },
    { NGX_HTTP_LLAMA_SESSION_M_LOST, "",
      offsetof(ngx_http_llama_session_sh_t, stats.model_lost) },
    { NGX_HTTP_LLAMA_SESSION_M_REPRIMES, ",result=\"ok\"",
      offsetof(ngx_http_llama_session_sh_t, stats.reprimes) },
    { NGX_HTTP_LLAMA_SESSION_M_REPRIMES, ",result=\"failed\"",
      offsetof(ngx_http_llama_session_sh_t, stats.reprime_failed) },
    { NGX_HTTP_LLAMA_SESSION_M_REPRIMES, ",result=\"media\"",
      offsetof(ngx_http_llama_session_sh_t, stats.reprime_media) },
    { NGX_HTTP_LLAMA_SESSION_M_REPRIME_TOKENS, "",
      offsetof(ngx_http_llama_session_sh_t, stats.reprime_tokens) },
    { NGX_HTTP_LLAMA_SESSION_M_REPREFILLS, "",
      offsetof(ngx_http_llama_session_sh_t, stats.reprefills) },
    { NGX_HTTP_LLAMA_SESSION_M_MEDIA_UNSAVED, "",
      offsetof(ngx_http_llama_session_sh_t, stats.media_unsaved) },
    { NGX_HTTP_LLAMA_SESSION_M_SHARED_NEWER, ",at=\"save\"",
      offsetof(ngx_http_llama_session_sh_t, stats.newer_saves) },
    { NGX_HTTP_LLAMA_SESSION_M_SHARED_NEWER, ",at=\"hit\"",
      offsetof(ngx_http_llama_session_sh_t, stats.newer_hits) },
    { NGX_HTTP_LLAMA_SESSION_M_STORE_TIMEOUTS, "",
      offsetof(ngx_http_llama_session_sh_t, stats.store_timeouts) },
    { NGX_HTTP_LLAMA_SESSION_M_RAM, ",event=\"hit\"",
      offsetof(ngx_http_llama_session_sh_t, stats.ram_hits) },
    { NGX_HTTP_LLAMA_SESSION_M_RAM, ",event=\"miss\"",
      offsetof(ngx_http_llama_session_sh_t, stats.ram_misses) },
    { NGX_HTTP_LLAMA_SESSION_M_RAM, ",event=\"stored\"",
      offsetof(ngx_http_llama_session_sh_t, stats.ram_stored) },
    { NGX_HTTP_LLAMA_SESSION_M_RAM, ",event=\"evicted\"",
      offsetof(ngx_http_llama_session_sh_t, stats.ram_evicted) },
    { NGX_HTTP_LLAMA_SESSION_M_RAM, ",event=\"lost\"",
      offsetof(ngx_http_llama_session_sh_t, stats.ram_lost) },
    { 0, NULL, 0 }
};


/* what a zone shows now, taken under its lock once */

typedef struct {
    ngx_http_llama_session_zone_t  *zone;
    ngx_str_t                       labels;     /* zone="a",model="b" */
    ngx_uint_t                      waiting;
    ngx_uint_t                      busy;
    size_t                          used;
    u_char                          slot_busy[NGX_HTTP_LLAMA_SESSION_SLOTS_MAX];
} ngx_http_llama_session_snap_t;


static ngx_int_t ngx_http_llama_session_metrics_handler(ngx_http_request_t *r);
static ngx_int_t ngx_http_llama_session_snap(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_snap_t *snap);
static ngx_int_t ngx_http_llama_session_samples(
    ngx_http_llama_session_out_t *out, ngx_http_llama_session_snap_t *snap,
    ngx_uint_t family);
static ngx_int_t ngx_http_llama_session_counters(
    ngx_http_llama_session_out_t *out, ngx_http_llama_session_sh_t *sh,
    ngx_uint_t family);
static ngx_int_t ngx_http_llama_session_sample(
    ngx_http_llama_session_out_t *out, ngx_uint_t family, const char *labels,
    ngx_atomic_uint_t value);
static ngx_int_t ngx_http_llama_session_saves(
    ngx_http_llama_session_out_t *out, ngx_http_llama_session_metrics_t *m);
static ngx_int_t ngx_http_llama_session_memory_sample(
    ngx_http_llama_session_out_t *out, ngx_http_llama_session_sh_t *sh);
static ngx_int_t ngx_http_llama_session_slot_busy(
    ngx_http_llama_session_out_t *out, ngx_http_llama_session_snap_t *snap);
static ngx_int_t ngx_http_llama_session_print(
    ngx_http_llama_session_out_t *out, const char *fmt, ...);
static ngx_int_t ngx_http_llama_session_hist(
    ngx_http_llama_session_out_t *out, const char *name,
    ngx_http_llama_session_hist_t *h);


/* histograms' upper bounds, in seconds (the last bucket is +Inf) */

static double  ngx_http_llama_session_bounds[NGX_HTTP_LLAMA_SESSION_BUCKETS
                                             - 1] =
{
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60
};


static const char  *ngx_http_llama_session_reasons[] = {
    "swap", "idle", "api", "unload", "base"
};


/* llama_session_metrics [zone ...]; */

char *
ngx_http_llama_session_metrics(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_llama_session_loc_conf_t *llcf = conf;

    ngx_str_t                       *value;
    ngx_uint_t                       i;
    ngx_http_core_loc_conf_t        *clcf;
    ngx_http_llama_session_zone_t   *zone, **zp;

    if (llcf->metrics != NGX_CONF_UNSET_PTR) {
        return "is duplicate";
    }

    llcf->metrics = NULL;
    value = cf->args->elts;

    for (i = 1; i < cf->args->nelts; i++) {

        if (llcf->metrics == NULL) {
            llcf->metrics = ngx_array_create(cf->pool, cf->args->nelts - 1,
                                    sizeof(ngx_http_llama_session_zone_t *));
            if (llcf->metrics == NULL) {
                return NGX_CONF_ERROR;
            }
        }

        zone = ngx_http_llama_session_find_zone(cf, &value[i]);
        if (zone == NULL) {
            return NGX_CONF_ERROR;
        }

        /* models=: the set's zones, each with its model */

        for ( /* void */ ; zone; zone = zone->models_next) {
            zp = ngx_array_push(llcf->metrics);
            if (zp == NULL) {
                return NGX_CONF_ERROR;
            }

            *zp = zone;
        }
    }

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
    clcf->handler = ngx_http_llama_session_metrics_handler;

    return NGX_CONF_OK;
}


static ngx_int_t
ngx_http_llama_session_metrics_handler(ngx_http_request_t *r)
{
    ngx_int_t                            rc;
    ngx_uint_t                           i, n, k, f;
    ngx_http_llama_session_out_t         out;
    ngx_http_llama_session_snap_t       *snaps;
    ngx_http_llama_session_zone_t      **zp;
    ngx_http_llama_session_loc_conf_t   *llcf;
    ngx_http_llama_session_main_conf_t  *lmcf;

    if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
        return NGX_HTTP_NOT_ALLOWED;
    }

    if (r != r->main) {
        /* as the API: never through SSI or a mirror */
        return NGX_HTTP_FORBIDDEN;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);
    lmcf = ngx_http_get_module_main_conf(r, ngx_http_llama_session_module);

    if (llcf->metrics && llcf->metrics != NGX_CONF_UNSET_PTR) {
        zp = llcf->metrics->elts;
        n = llcf->metrics->nelts;

    } else {
        zp = lmcf->zones.elts;
        n = lmcf->zones.nelts;
    }

    ngx_memzero(&out, sizeof(ngx_http_llama_session_out_t));
    out.request = r;

    snaps = ngx_palloc(r->pool, (n + 1) * sizeof(ngx_http_llama_session_snap_t));
    if (snaps == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    k = 0;

    for (i = 0; i < n; i++) {
        if (zp[i]->sh == NULL) {
            continue;
        }

        if (ngx_http_llama_session_snap(r, zp[i], &snaps[k]) != NGX_OK) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        k++;
    }

    /* a family's lines stay together: its help and type, every zone's */

    for (f = 0; k && f < NGX_HTTP_LLAMA_SESSION_M_FAMILIES; f++) {
        if (ngx_http_llama_session_print(&out,
                "# HELP nginx_llama_session_%s %s\n"
                "# TYPE nginx_llama_session_%s %s\n",
                ngx_http_llama_session_families[f].name,
                ngx_http_llama_session_families[f].help,
                ngx_http_llama_session_families[f].name,
                ngx_http_llama_session_families[f].type)
            != NGX_OK)
        {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        for (i = 0; i < k; i++) {
            if (ngx_http_llama_session_samples(&out, &snaps[i], f) != NGX_OK) {
                return NGX_HTTP_INTERNAL_SERVER_ERROR;
            }
        }
    }

    if (out.first == NULL
        && ngx_http_llama_session_print(&out, "") != NGX_OK)
    {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    out.last->buf->last_buf = 1;
    out.last->buf->last_in_chain = 1;

    r->headers_out.status = NGX_HTTP_OK;
    r->headers_out.content_length_n = 0;

    for (out.last = out.first; out.last; out.last = out.last->next) {
        r->headers_out.content_length_n += out.last->buf->last
                                           - out.last->buf->pos;
    }

    ngx_str_set(&r->headers_out.content_type,
                "text/plain; version=0.0.4; charset=utf-8");
    r->headers_out.content_type_len = r->headers_out.content_type.len;

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    return ngx_http_output_filter(r, out.first);
}


static ngx_int_t
ngx_http_llama_session_snap(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_snap_t *snap)
{
    u_char                       *p;
    ngx_uint_t                    i, pages;
    ngx_http_llama_session_sh_t  *sh;

    sh = zone->sh;

    /* models=: the model given to the zone, by another worker perhaps */
    (void) ngx_http_llama_session_models_adopt(zone);

    snap->zone = zone;
    snap->labels.data = ngx_pnalloc(r->pool, sizeof("zone=\"\",model=\"\"")
                                             + zone->name.len
                                             + zone->model.len);
    if (snap->labels.data == NULL) {
        return NGX_ERROR;
    }

    /* zone names and models have no character to escape (module.c) */

    p = ngx_sprintf(snap->labels.data, "zone=\"%V\"", &zone->name);

    if (zone->model.len) {
        p = ngx_sprintf(p, ",model=\"%V\"", &zone->model);
    }

    snap->labels.len = p - snap->labels.data;

    ngx_shmtx_lock(&zone->shpool->mutex);

    snap->waiting = sh->nwaiters;
    pages = (zone->shpool->end - zone->shpool->start) / ngx_pagesize;
    snap->used = (pages - zone->shpool->pfree) * ngx_pagesize;
    snap->busy = 0;

    for (i = 0; i < sh->nslots; i++) {
        snap->slot_busy[i] = sh->slots[i].busy;
        snap->busy += sh->slots[i].busy;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return NGX_OK;
}


/* one zone's samples of a family */

static ngx_int_t
ngx_http_llama_session_samples(ngx_http_llama_session_out_t *out,
    ngx_http_llama_session_snap_t *snap, ngx_uint_t family)
{
    ngx_http_llama_session_sh_t       *sh;
    ngx_http_llama_session_metrics_t  *m;

    sh = snap->zone->sh;
    m = &sh->metrics;

    out->labels = snap->labels;

    switch (family) {

    case NGX_HTTP_LLAMA_SESSION_M_SAVES:
        return ngx_http_llama_session_saves(out, m);

    case NGX_HTTP_LLAMA_SESSION_M_MEMORY:
        return ngx_http_llama_session_memory_sample(out, sh);

    case NGX_HTTP_LLAMA_SESSION_M_PREFILL_SAVED:
        return ngx_http_llama_session_print(out,
                   "nginx_llama_session_prefill_saved_seconds_total{%V} "
                   "%.3f\n", &snap->labels,
                   (double) m->prefill_saved_us / 1e6);

    case NGX_HTTP_LLAMA_SESSION_M_WAIT:
        return ngx_http_llama_session_hist(out, "wait_seconds", &m->wait);

    case NGX_HTTP_LLAMA_SESSION_M_SWAP:
        return ngx_http_llama_session_hist(out, "swap_seconds", &m->swap);

    case NGX_HTTP_LLAMA_SESSION_M_SAVE:
        return ngx_http_llama_session_hist(out, "save_seconds", &m->save);

    case NGX_HTTP_LLAMA_SESSION_M_RESTORE:
        return ngx_http_llama_session_hist(out, "restore_seconds",
                                           &m->restore);

    case NGX_HTTP_LLAMA_SESSION_M_SLOT_BUSY:
        return ngx_http_llama_session_slot_busy(out, snap);

    /* gauges: what the zone holds now */

    case NGX_HTTP_LLAMA_SESSION_M_DISABLED:
        return ngx_http_llama_session_sample(out, family, "", sh->restores_off);

    case NGX_HTTP_LLAMA_SESSION_M_WAITING:
        return ngx_http_llama_session_sample(out, family, "", snap->waiting);

    case NGX_HTTP_LLAMA_SESSION_M_SLOTS:
        return ngx_http_llama_session_sample(out, family, "", sh->nslots);

    case NGX_HTTP_LLAMA_SESSION_M_SLOTS_BUSY:
        return ngx_http_llama_session_sample(out, family, "", snap->busy);

    case NGX_HTTP_LLAMA_SESSION_M_SESSIONS:
        return ngx_http_llama_session_sample(out, family, "", sh->nsessions);

    case NGX_HTTP_LLAMA_SESSION_M_CHAINS:
        return ngx_http_llama_session_sample(out, family, "", sh->ext_n);

    case NGX_HTTP_LLAMA_SESSION_M_FILES:
        return ngx_http_llama_session_sample(out, family, "", sh->files);

    case NGX_HTTP_LLAMA_SESSION_M_BYTES:
        return ngx_http_llama_session_sample(out, family, "", sh->bytes);

    case NGX_HTTP_LLAMA_SESSION_M_BASE_FILES:
        return ngx_http_llama_session_sample(out, family, "", sh->base_files);

    case NGX_HTTP_LLAMA_SESSION_M_BASE_BYTES:
        return ngx_http_llama_session_sample(out, family, "", sh->base_bytes);

    case NGX_HTTP_LLAMA_SESSION_M_SHM_USED:
        return ngx_http_llama_session_sample(out, family, "", snap->used);

    case NGX_HTTP_LLAMA_SESSION_M_SHM_SIZE:
        return ngx_http_llama_session_sample(out, family, "",
                                             snap->zone->shm_zone->shm.size);

    default:
        return ngx_http_llama_session_counters(out, sh, family);
    }
}


/* a family's counters, from the table above */

static ngx_int_t
ngx_http_llama_session_counters(ngx_http_llama_session_out_t *out,
    ngx_http_llama_session_sh_t *sh, ngx_uint_t family)
{
    ngx_atomic_uint_t                 *v;
    ngx_http_llama_session_counter_t  *c;

    for (c = ngx_http_llama_session_counts; c->labels; c++) {

        if (c->family != family) {
            continue;
        }

        v = (ngx_atomic_uint_t *) ((u_char *) sh + c->offset);

        if (ngx_http_llama_session_sample(out, family, c->labels, *v)
            != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


/* a sample of a family: the zone's labels, these ones, the value */

static ngx_int_t
ngx_http_llama_session_sample(ngx_http_llama_session_out_t *out,
    ngx_uint_t family, const char *labels, ngx_atomic_uint_t value)
{
    return ngx_http_llama_session_print(out,
                "nginx_llama_session_%s{%V%s} %uA\n",
                ngx_http_llama_session_families[family].name, &out->labels,
                labels, value);
}


/* saves_total, by reason and result */

static ngx_int_t
ngx_http_llama_session_saves(ngx_http_llama_session_out_t *out,
    ngx_http_llama_session_metrics_t *m)
{
    ngx_uint_t  i;

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_SAVE_REASONS; i++) {
        if (ngx_http_llama_session_print(out,
                "nginx_llama_session_saves_total{%V,reason=\"%s\","
                "result=\"ok\"} %uA\n"
                "nginx_llama_session_saves_total{%V,reason=\"%s\","
                "result=\"failed\"} %uA\n",
                &out->labels, ngx_http_llama_session_reasons[i],
                m->saved[i], &out->labels,
                ngx_http_llama_session_reasons[i], m->save_failed[i])
            != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


/* model_memory: the kind of a model of the backend's configuration */

static ngx_int_t
ngx_http_llama_session_memory_sample(ngx_http_llama_session_out_t *out,
    ngx_http_llama_session_sh_t *sh)
{
    ngx_uint_t  kind;

    kind = (sh->memory_known && sh->fp_known
            && ngx_memcmp(sh->memory_fp, sh->fp,
                          NGX_HTTP_LLAMA_SESSION_FP_LEN) == 0)
           ? sh->memory.kind : NGX_HTTP_LLAMA_SESSION_MEMORY_UNKNOWN;

    return ngx_http_llama_session_print(out,
                "nginx_llama_session_model_memory{%V,kind=\"%s\"} 1\n",
                &out->labels, ngx_http_llama_session_memory_name(kind));
}


/* slot_busy, a sample a slot */

static ngx_int_t
ngx_http_llama_session_slot_busy(ngx_http_llama_session_out_t *out,
    ngx_http_llama_session_snap_t *snap)
{
    ngx_uint_t  i;

    for (i = 0; i < snap->zone->sh->nslots; i++) {
        if (ngx_http_llama_session_print(out,
                "nginx_llama_session_slot_busy{%V,slot=\"%ui\"} %d\n",
                &out->labels, i, (int) snap->slot_busy[i])
            != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_llama_session_hist(ngx_http_llama_session_out_t *out,
    const char *name, ngx_http_llama_session_hist_t *h)
{
    ngx_uint_t         i;
    ngx_atomic_uint_t  n;

    n = 0;

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_BUCKETS - 1; i++) {
        n += h->bucket[i];

        if (ngx_http_llama_session_print(out,
                "nginx_llama_session_%s_bucket{%V,le=\"%.3f\"} %uA\n",
                name, &out->labels, ngx_http_llama_session_bounds[i], n)
            != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    n += h->bucket[i];

    return ngx_http_llama_session_print(out,
                "nginx_llama_session_%s_bucket{%V,le=\"+Inf\"} %uA\n"
                "nginx_llama_session_%s_sum{%V} %.6f\n"
                "nginx_llama_session_%s_count{%V} %uA\n",
                name, &out->labels, n, name, &out->labels,
                (double) h->sum_us / 1e6, name, &out->labels, n);
}


/* appends to the reply; every call prints less than 2 KB */

static ngx_int_t
ngx_http_llama_session_print(ngx_http_llama_session_out_t *out,
    const char *fmt, ...)
{
    va_list       args;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    if (out->last == NULL
        || out->last->buf->end - out->last->buf->last < 2048)
    {
        b = ngx_create_temp_buf(out->request->pool,
                                NGX_HTTP_LLAMA_SESSION_METRICS_BUF);
        if (b == NULL) {
            return NGX_ERROR;
        }

        cl = ngx_alloc_chain_link(out->request->pool);
        if (cl == NULL) {
            return NGX_ERROR;
        }

        cl->buf = b;
        cl->next = NULL;

        if (out->last) {
            out->last->next = cl;

        } else {
            out->first = cl;
        }

        out->last = cl;
    }

    b = out->last->buf;

    va_start(args, fmt);
    b->last = ngx_vslprintf(b->last, b->end, fmt, args);
    va_end(args);

    return NGX_OK;
}


/* counts a time in a histogram */

void
ngx_http_llama_session_observe(ngx_http_llama_session_hist_t *h, double ms)
{
    ngx_uint_t  i;

    if (ms < 0) {
        ms = 0;
    }

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_BUCKETS - 1; i++) {
        if (ms <= ngx_http_llama_session_bounds[i] * 1000) {
            break;
        }
    }

    (void) ngx_atomic_fetch_add(&h->bucket[i], 1);
    (void) ngx_atomic_fetch_add(&h->sum_us, (ngx_atomic_uint_t) (ms * 1000));
}


/* a save's end, for the metrics */

void
ngx_http_llama_session_save_stat(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t reason, ngx_uint_t ok, off_t bytes, double ms)
{
    ngx_http_llama_session_metrics_t  *m;

    m = &zone->sh->metrics;

    if (!ok) {
        (void) ngx_atomic_fetch_add(&m->save_failed[reason], 1);
        return;
    }

    (void) ngx_atomic_fetch_add(&m->saved[reason], 1);
    (void) ngx_atomic_fetch_add(&m->bytes_saved, (ngx_atomic_uint_t) bytes);

    ngx_http_llama_session_observe(&m->save, ms);
}
