
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The management API, a content handler (llama_session_api <zone>):
 *
 *   GET    .../sessions           saved sessions (the folder is the truth)
 *   GET    .../sessions/current   what each slot holds, and its file
 *   GET    .../sessions/<id>      one session's files
 *   DELETE .../sessions/<id>      delete its files (409 while in use)
 *   POST   .../sessions/save      save the session in each slot now
 *   POST   .../sessions/clear     erase the slots
 *
 * <id> is a session key, or a client's id (with ?model= when the clients
 * send a model; the location's llama_session_namespace applies).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_api.h"
#include "ngx_http_llama_session_models.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_error.h"
#include "ngx_http_llama_session_gguf.h"
#include "ngx_http_llama_session_handler.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_reprime.h"
#include "ngx_http_llama_session_index.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_slots.h"
#include "ngx_http_llama_session_store.h"
#include "ngx_http_llama_session_turn.h"

#include <cjson/cJSON.h>


typedef enum {
    NGX_HTTP_LLAMA_SESSION_API_LIST = 0,
    NGX_HTTP_LLAMA_SESSION_API_CURRENT,
    NGX_HTTP_LLAMA_SESSION_API_ONE,
    NGX_HTTP_LLAMA_SESSION_API_SAVE,
    NGX_HTTP_LLAMA_SESSION_API_CLEAR
} ngx_http_llama_session_api_e;


typedef struct {
    ngx_http_llama_session_ctx_t   *ctx;
    ngx_uint_t                      op;
    ngx_uint_t                      slot;
    ngx_uint_t                      last;       /* the slot after the end */
    cJSON                          *result;    /* the reply's slot list */
    ngx_uint_t                      failed;
    ngx_uint_t                      busy;       /* llama-server ran it */
    ngx_uint_t                      tenant;     /* only its own sessions */
    u_char                          ns[NGX_HTTP_LLAMA_SESSION_DIGEST];
} ngx_http_llama_session_api_t;


static ngx_int_t ngx_http_llama_session_api_handler(ngx_http_request_t *r);
static ngx_int_t ngx_http_llama_session_api_list(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone);
static ngx_int_t ngx_http_llama_session_api_current(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone);
static ngx_int_t ngx_http_llama_session_api_one(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone, ngx_str_t *id, ngx_uint_t delete);
static ngx_int_t ngx_http_llama_session_api_slots(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static void ngx_http_llama_session_api_start(ngx_http_request_t *r);
static void ngx_http_llama_session_api_resume(ngx_http_request_t *r);
static void ngx_http_llama_session_api_cleanup(void *data);
static ngx_int_t ngx_http_llama_session_api_checked(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_done(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api, cJSON *item);
static cJSON *ngx_http_llama_session_api_node(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_node_t *node,
    ngx_uint_t in_slot);
static ngx_int_t ngx_http_llama_session_api_tenant(ngx_http_request_t *r,
    u_char *ns);
static off_t ngx_http_llama_session_api_bytes(
    ngx_http_llama_session_node_t *nodes, ngx_uint_t n);
static ngx_uint_t ngx_http_llama_session_api_mine(ngx_uint_t tenant,
    u_char *ns, ngx_uint_t has, u_char *theirs);
static ngx_uint_t ngx_http_llama_session_api_in_slot(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_slot_t *slots,
    ngx_http_llama_session_node_t *node);
static ngx_int_t ngx_http_llama_session_api_send(ngx_http_request_t *r,
    ngx_uint_t status, cJSON *json);
static ngx_int_t ngx_http_llama_session_api_error(ngx_http_request_t *r,
    ngx_uint_t status, char *message, char *allow);
static ngx_int_t ngx_http_llama_session_api_arg(ngx_http_request_t *r,
    char *name, ngx_str_t *value);
static cJSON *ngx_http_llama_session_api_str(cJSON *obj, const char *name,
    u_char *data, size_t len);


static char *ngx_http_llama_session_slot_states[] = {
    "unknown", "empty", "session"
};


char *
ngx_http_llama_session_api(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_llama_session_loc_conf_t *llcf = conf;

    ngx_str_t                      *value;
    ngx_http_core_loc_conf_t       *clcf;
    ngx_http_llama_session_zone_t  *zone;

    if (llcf->api_zone) {
        return "is duplicate";
    }

    value = cf->args->elts;

    llcf->api_zone = ngx_http_llama_session_find_zone(cf, &value[1]);
    if (llcf->api_zone == NULL) {
        return NGX_CONF_ERROR;
    }

    /* the API's own requests never take the inference path */

    if (llcf->enable == NGX_CONF_UNSET) {
        llcf->enable = 0;
        llcf->zone = NULL;
    }

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
    clcf->handler = ngx_http_llama_session_api_handler;

    /* a zone of the API alone: its idle saves run here (job.c) */

    for (zone = llcf->api_zone; zone; zone = zone->models_next) {
        if (zone->log_conf == NULL) {
            zone->log_conf = clcf;
            zone->conf_ctx = cf->ctx;
        }
    }

    return NGX_CONF_OK;
}


static ngx_int_t
ngx_http_llama_session_api_handler(ngx_http_request_t *r)
{
    u_char                             *p, *last, *s;
    ngx_int_t                           rc, n;
    ngx_str_t                           rest, id, arg;
    ngx_pool_cleanup_t                 *cln;
    ngx_http_llama_session_api_t       *api;
    ngx_http_llama_session_zone_t      *zone;
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);
    zone = llcf->api_zone;

    if (r != r->main) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: refused a subrequest to the "
                      "management API \"%V\"", &r->uri);
        return NGX_HTTP_FORBIDDEN;
    }

    if (zone->models) {
        /* models=: the zone of the model that ?model= names */

        rc = ngx_http_llama_session_api_arg(r, "model", &id);

        if (rc == NGX_ERROR) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        if (rc == NGX_DECLINED) {
            rc = ngx_http_discard_request_body(r);
            if (rc != NGX_OK) {
                return rc;
            }

            return ngx_http_llama_session_api_error(r, NGX_HTTP_BAD_REQUEST,
                                  "this zone keeps the sessions of several "
                                  "models: name one with ?model=", NULL);
        }

        zone = ngx_http_llama_session_models_find(zone->models, id.data,
                                                  id.len);
        if (zone == NULL) {
            rc = ngx_http_discard_request_body(r);
            if (rc != NGX_OK) {
                return rc;
            }

            return ngx_http_llama_session_api_error(r, NGX_HTTP_NOT_FOUND,
                                  "no sessions of this model", NULL);
        }
    }

    /* the part after the last "/sessions" */

    last = r->uri.data + r->uri.len;
    s = NULL;

    for (p = r->uri.data;
         (p = ngx_strlcasestrn(p, last, (u_char *) "/sessions", 9 - 1));
         p++)
    {
        s = p;
    }

    if (s == NULL) {
        rc = ngx_http_discard_request_body(r);
        if (rc != NGX_OK) {
            return rc;
        }

        return ngx_http_llama_session_api_error(r, NGX_HTTP_NOT_FOUND,
                                  "use .../sessions, .../sessions/current, "
                                  ".../sessions/<id>, .../sessions/save or "
                                  ".../sessions/clear", NULL);
    }

    rest.data = s + sizeof("/sessions") - 1;
    rest.len = last - rest.data;

    while (rest.len && rest.data[rest.len - 1] == '/') {
        rest.len--;
    }

    if (rest.len && rest.data[0] != '/') {
        rc = ngx_http_discard_request_body(r);
        if (rc != NGX_OK) {
            return rc;
        }

        return ngx_http_llama_session_api_error(r, NGX_HTTP_NOT_FOUND,
                                                "no such resource", NULL);
    }

    if (rest.len == 0) {
        rc = ngx_http_discard_request_body(r);
        if (rc != NGX_OK) {
            return rc;
        }

        rc = ngx_http_llama_session_api_arg(r, "id", &id);

        if (rc == NGX_ERROR) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        if (rc == NGX_OK) {
            /*
             * .../sessions?id=ID: an id that the path cannot carry (nginx
             * resolves "/" and ".." in a path before the location is
             * chosen); the argument is decoded once
             */

            if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD|NGX_HTTP_DELETE))) {
                return ngx_http_llama_session_api_error(r,
                                  NGX_HTTP_NOT_ALLOWED,
                                  "a session is read with GET and "
                                  "deleted with DELETE",
                                  "GET, HEAD, DELETE");
            }

            return ngx_http_llama_session_api_one(r, zone, &id,
                                                  r->method
                                                  == NGX_HTTP_DELETE);
        }

        if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
            return ngx_http_llama_session_api_error(r,
                                  NGX_HTTP_NOT_ALLOWED,
                                  "the session list is read with GET",
                                  "GET, HEAD");
        }

        return ngx_http_llama_session_api_list(r, zone);
    }

    rest.data++;
    rest.len--;

    if (rest.len == 7 && ngx_strncmp(rest.data, "current", 7) == 0) {
        rc = ngx_http_discard_request_body(r);
        if (rc != NGX_OK) {
            return rc;
        }

        if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
            return ngx_http_llama_session_api_error(r,
                                  NGX_HTTP_NOT_ALLOWED,
                                  "the slots are read with GET", "GET, HEAD");
        }

        return ngx_http_llama_session_api_current(r, zone);
    }

    if ((rest.len == 4 && ngx_strncmp(rest.data, "save", 4) == 0)
        || (rest.len == 5 && ngx_strncmp(rest.data, "clear", 5) == 0))
    {
        if (r->method != NGX_HTTP_POST) {
            rc = ngx_http_discard_request_body(r);
            if (rc != NGX_OK) {
                return rc;
            }

            return ngx_http_llama_session_api_error(r,
                                  NGX_HTTP_NOT_ALLOWED,
                                  "save and clear are POSTs", "POST");
        }

        api = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_api_t));
        if (api == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cln = ngx_pool_cleanup_add(r->pool, 0);
        if (cln == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cln->handler = ngx_http_llama_session_api_cleanup;
        cln->data = api;

        api->ctx = ngx_http_llama_session_create_ctx(r, zone);
        if (api->ctx == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        api->ctx->api = api;
        api->ctx->deadline = ngx_current_msec + llcf->wait_timeout;

        rc = ngx_http_llama_session_api_tenant(r, api->ns);
        if (rc == NGX_ERROR) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        api->tenant = (rc == NGX_OK);
        api->op = (rest.len == 4) ? NGX_HTTP_LLAMA_SESSION_API_SAVE
                                  : NGX_HTTP_LLAMA_SESSION_API_CLEAR;
        api->last = ngx_http_llama_session_slots_usable(zone->sh);

        /* ?slot=k: that slot alone */

        if (ngx_http_arg(r, (u_char *) "slot", 4, &arg) == NGX_OK) {
            n = ngx_atoi(arg.data, arg.len);

            if (n == NGX_ERROR || (ngx_uint_t) n >= api->last) {
                rc = ngx_http_discard_request_body(r);
                if (rc != NGX_OK) {
                    return rc;
                }

                return ngx_http_llama_session_api_error(r,
                                  NGX_HTTP_BAD_REQUEST,
                                  "no such slot", NULL);
            }

            api->slot = n;
            api->last = n + 1;
        }

        /*
         * the body is read whole first (and ignored): a discard still
         * running would take the client's read events from the slot
         * calls' subrequests
         */

        rc = ngx_http_read_client_request_body(r,
                                          ngx_http_llama_session_api_start);

        if (rc >= NGX_HTTP_SPECIAL_RESPONSE) {
            return rc;
        }

        return NGX_DONE;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    if (r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD|NGX_HTTP_DELETE)) {

        /* nginx decoded the path already: the id is taken as it is */

        id = rest;

        return ngx_http_llama_session_api_one(r, zone, &id,
                                              r->method == NGX_HTTP_DELETE);
    }

    return ngx_http_llama_session_api_error(r, NGX_HTTP_NOT_ALLOWED,
                                            "a session is read with GET and "
                                            "deleted with DELETE",
                                            "GET, HEAD, DELETE");
}


/* GET .../sessions */

static ngx_int_t
ngx_http_llama_session_api_list(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone)
{
    u_char                          ns[NGX_HTTP_LLAMA_SESSION_DIGEST];
    cJSON                          *json, *list, *item;
    ngx_int_t                       rc;
    ngx_uint_t                      i, n, tenant;
    ngx_queue_t                    *q;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_node_t  *nodes, *node;
    ngx_http_llama_session_slot_t   slots[NGX_HTTP_LLAMA_SESSION_SLOTS_MAX];

    sh = zone->sh;

    rc = ngx_http_llama_session_api_tenant(r, ns);
    if (rc == NGX_ERROR) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    tenant = (rc == NGX_OK);

    (void) ngx_http_llama_session_store_sync(zone, r->connection->log);

    /* a snapshot, most recently used first */

    ngx_shmtx_lock(&zone->shpool->mutex);

    nodes = ngx_palloc(r->pool, (sh->files + 1)
                                * sizeof(ngx_http_llama_session_node_t));
    if (nodes == NULL) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    n = 0;

    for (q = ngx_queue_head(&sh->lru);
         q != ngx_queue_sentinel(&sh->lru) && n < sh->files;
         q = ngx_queue_next(q))
    {
        node = ngx_queue_data(q, ngx_http_llama_session_node_t, lru);

        if (node->saved
            && ngx_http_llama_session_api_mine(tenant, ns, node->has_ns,
                                               node->ns))
        {
            nodes[n++] = *node;
        }
    }

    ngx_memcpy(slots, sh->slots, sh->nslots * sizeof(slots[0]));

    ngx_shmtx_unlock(&zone->shpool->mutex);

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    list = NULL;

    if (ngx_http_llama_session_api_str(json, "zone", zone->name.data,
                                       zone->name.len) == NULL
        || ngx_http_llama_session_api_str(json, "store", zone->store.data,
                                          zone->store.len) == NULL
        || (sh->fp_known
            ? ngx_http_llama_session_api_str(json, "fingerprint", sh->fp,
                                          NGX_HTTP_LLAMA_SESSION_FP_LEN)
            : cJSON_AddNullToObject(json, "fingerprint")) == NULL
        || cJSON_AddNumberToObject(json, "files", n) == NULL
        || cJSON_AddNumberToObject(json, "bytes",
                                   tenant ? ngx_http_llama_session_api_bytes(
                                                nodes, n)
                                          : sh->bytes) == NULL
        || (!tenant
            && (cJSON_AddNumberToObject(json, "base_files", sh->base_files)
                == NULL
                || cJSON_AddNumberToObject(json, "base_bytes", sh->base_bytes)
                   == NULL))
        || cJSON_AddNumberToObject(json, "max_files", zone->max_files) == NULL
        || cJSON_AddNumberToObject(json, "max_size", zone->max_size) == NULL
        || (list = cJSON_AddArrayToObject(json, "sessions")) == NULL)
    {
        cJSON_Delete(json);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    for (i = 0; i < n; i++) {
        item = ngx_http_llama_session_api_node(zone, &nodes[i],
                   ngx_http_llama_session_api_in_slot(zone, slots,
                                                      &nodes[i]));
        if (item == NULL) {
            cJSON_Delete(json);
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cJSON_AddItemToArray(list, item);
    }

    return ngx_http_llama_session_api_send(r, NGX_HTTP_OK, json);
}


static cJSON *
ngx_http_llama_session_api_node(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_node_t *node, ngx_uint_t in_slot)
{
    cJSON   *item;
    size_t   klen;
    u_char  *fp, hex[2 * NGX_HTTP_LLAMA_SESSION_DIGEST];

    klen = node->name_len - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN;
    fp = node->name + klen + 1;

    item = cJSON_CreateObject();
    if (item == NULL) {
        return NULL;
    }

    if (ngx_http_llama_session_api_str(item, "key", node->name, klen) == NULL
        || ngx_http_llama_session_api_str(item, "id", node->id,
                                          node->id_len) == NULL
        || ngx_http_llama_session_api_str(item, "model", node->model,
                                          node->model_len) == NULL
        || ngx_http_llama_session_api_str(item, "fingerprint", fp,
                                      NGX_HTTP_LLAMA_SESSION_FP_LEN) == NULL
        || cJSON_AddNumberToObject(item, "bytes", node->bytes) == NULL
        || cJSON_AddNumberToObject(item, "tokens", node->tokens) == NULL
        || cJSON_AddNumberToObject(item, "saved_at", node->saved_at) == NULL
        || cJSON_AddNumberToObject(item, "last_used", node->used_at) == NULL
        || cJSON_AddBoolToObject(item, "stale",
                                 zone->sh->fp_known
                                 && ngx_memcmp(fp, zone->sh->fp,
                                            NGX_HTTP_LLAMA_SESSION_FP_LEN))
           == NULL
        || cJSON_AddBoolToObject(item, "in_slot", in_slot) == NULL
        || (node->is_base
            && cJSON_AddNumberToObject(item, "base_uses", node->base_uses)
               == NULL))
    {
        cJSON_Delete(item);
        return NULL;
    }

    if (node->has_sys) {
        ngx_hex_dump(hex, node->sys, NGX_HTTP_LLAMA_SESSION_DIGEST);

        if (ngx_http_llama_session_api_str(item, "system", hex, sizeof(hex))
            == NULL)
        {
            cJSON_Delete(item);
            return NULL;
        }
    }

    return item;
}


/* GET .../sessions/current */

static ngx_int_t
ngx_http_llama_session_api_current(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    cJSON                          *json, *list, *item, *backend, *stats,
                                   *memory;
    cJSON                          *file, *session;
    u_char                          ns[NGX_HTTP_LLAMA_SESSION_DIGEST];
    ngx_int_t                       rc;
    ngx_uint_t                      i, waiting, has_node, pages, free_pages;
    ngx_uint_t                      tenant, mine;
    ngx_http_llama_session_sh_t    *sh, copy;
    ngx_http_llama_session_node_t   node;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;

    rc = ngx_http_llama_session_api_tenant(r, ns);
    if (rc == NGX_ERROR) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    tenant = (rc == NGX_OK);

    ngx_shmtx_lock(&zone->shpool->mutex);
    copy = *sh;
    waiting = sh->nwaiters;
    pages = (zone->shpool->end - zone->shpool->start) / ngx_pagesize;
    free_pages = zone->shpool->pfree;
    ngx_shmtx_unlock(&zone->shpool->mutex);

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    list = NULL;
    backend = NULL;
    stats = NULL;

    if (ngx_http_llama_session_api_str(json, "zone", zone->name.data,
                                       zone->name.len) == NULL
        || cJSON_AddNumberToObject(json, "waiting", waiting) == NULL
        || cJSON_AddNumberToObject(json, "max_waiting", copy.waiters_max)
           == NULL
        || cJSON_AddNumberToObject(json, "sessions", copy.nsessions) == NULL
        || cJSON_AddBoolToObject(json, "restores_disabled",
                                 copy.restores_off) == NULL
        || cJSON_AddNumberToObject(json, "shm_bytes",
                                   zone->shm_zone->shm.size) == NULL
        || cJSON_AddNumberToObject(json, "shm_used_bytes",
                                   (pages - free_pages) * ngx_pagesize)
           == NULL
        || (backend = cJSON_AddObjectToObject(json, "backend")) == NULL
        || (stats = cJSON_AddObjectToObject(json, "stats")) == NULL
        || (list = cJSON_AddArrayToObject(json, "slots")) == NULL)
    {
        goto failed;
    }

    if (zone->model.len
        && ngx_http_llama_session_api_str(backend, "model", zone->model.data,
                                          zone->model.len) == NULL)
    {
        goto failed;
    }

    if (copy.fp_known) {
        if (ngx_http_llama_session_api_str(backend, "fingerprint", copy.fp,
                                         NGX_HTTP_LLAMA_SESSION_FP_LEN)
            == NULL
            || ngx_http_llama_session_api_str(backend, "model_path",
                                              copy.model_path,
                                              copy.model_path_len) == NULL
            || cJSON_AddNumberToObject(backend, "n_ctx", copy.n_ctx) == NULL
            || cJSON_AddNumberToObject(backend, "total_slots",
                                       copy.total_slots) == NULL)
        {
            goto failed;
        }
    }

    if (copy.fp_known && copy.memory_known
        && ngx_memcmp(copy.memory_fp, copy.fp, NGX_HTTP_LLAMA_SESSION_FP_LEN)
           == 0)
    {
        /* what a slot file can bring back on this model (gguf.c) */

        memory = cJSON_AddObjectToObject(backend, "memory");

        if (memory == NULL
            || cJSON_AddStringToObject(memory, "kind",
                              ngx_http_llama_session_memory_name(
                                                     copy.memory.kind))
               == NULL
            || (copy.memory.kind != NGX_HTTP_LLAMA_SESSION_MEMORY_UNKNOWN
                && cJSON_AddStringToObject(memory, "architecture",
                                           (char *) copy.memory.arch)
                   == NULL)
            || (copy.memory.kind == NGX_HTTP_LLAMA_SESSION_MEMORY_SWA
                && cJSON_AddNumberToObject(memory, "sliding_window",
                                           copy.memory.window)
                   == NULL))
        {
            goto failed;
        }
    }

#define ngx_http_llama_session_api_stat(name)                                 \
    if (cJSON_AddNumberToObject(stats, #name, copy.stats.name) == NULL) {    \
        goto failed;                                                         \
    }

    ngx_http_llama_session_api_stat(requests);
    ngx_http_llama_session_api_stat(hits);
    ngx_http_llama_session_api_stat(restores);
    ngx_http_llama_session_api_stat(fresh);
    ngx_http_llama_session_api_stat(bypass);
    ngx_http_llama_session_api_stat(swaps);
    ngx_http_llama_session_api_stat(saves);
    ngx_http_llama_session_api_stat(save_errors);
    ngx_http_llama_session_api_stat(restore_errors);
    ngx_http_llama_session_api_stat(wait_timeouts);
    ngx_http_llama_session_api_stat(backend_errors);
    ngx_http_llama_session_api_stat(evictions);
    ngx_http_llama_session_api_stat(idle_saves);
    ngx_http_llama_session_api_stat(restarts);
    ngx_http_llama_session_api_stat(queue_full);
    ngx_http_llama_session_api_stat(forgotten);
    ngx_http_llama_session_api_stat(refused);
    ngx_http_llama_session_api_stat(warm);
    ngx_http_llama_session_api_stat(bases);
    ngx_http_llama_session_api_stat(probes);
    ngx_http_llama_session_api_stat(unloads);
    ngx_http_llama_session_api_stat(model_lost);
    ngx_http_llama_session_api_stat(reprimes);
    ngx_http_llama_session_api_stat(reprime_failed);
    ngx_http_llama_session_api_stat(reprime_media);
    ngx_http_llama_session_api_stat(media_unsaved);
    ngx_http_llama_session_api_stat(reprime_tokens);
    ngx_http_llama_session_api_stat(reprefills);

#undef ngx_http_llama_session_api_stat

    for (i = 0; i < zone->sh->nslots; i++) {
        slot = &copy.slots[i];

        item = cJSON_CreateObject();
        if (item == NULL) {
            goto failed;
        }

        cJSON_AddItemToArray(list, item);

        mine = ngx_http_llama_session_api_mine(tenant, ns, slot->has_ns,
                                               slot->ns);

        /* another tenant's session: that the slot is used, no more */

        if (cJSON_AddNumberToObject(item, "slot", i) == NULL
            || cJSON_AddStringToObject(item, "state",
                              (slot->state
                               == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION && !mine)
                              ? "other"
                              : ngx_http_llama_session_slot_states[slot->state])
               == NULL
            || cJSON_AddBoolToObject(item, "busy", slot->busy) == NULL
            || cJSON_AddBoolToObject(item, "changed_since_save",
                                     mine && slot->dirty && slot->saveable)
               == NULL)
        {
            goto failed;
        }

        if (slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION || !mine) {

            if (cJSON_AddNullToObject(item, "session") == NULL
                || cJSON_AddNullToObject(item, "file") == NULL)
            {
                goto failed;
            }

            continue;
        }

        has_node = 0;

        if (copy.fp_known) {
            n = ngx_http_llama_session_file_name(name, slot->key,
                                                 slot->key_len, copy.fp);
            has_node = (ngx_http_llama_session_node_info(zone, name, n, &node)
                        == NGX_OK);
        }

        session = cJSON_AddObjectToObject(item, "session");

        if (session == NULL
            || ngx_http_llama_session_api_str(session, "key", slot->key,
                                              slot->key_len) == NULL
            || ngx_http_llama_session_api_str(session, "id",
                                              has_node ? node.id : NULL,
                                              has_node ? node.id_len : 0)
               == NULL
            || ngx_http_llama_session_api_str(session, "model",
                                              has_node ? node.model : NULL,
                                              has_node ? node.model_len : 0)
               == NULL)
        {
            goto failed;
        }

        if (!slot->saveable) {
            if (cJSON_AddNullToObject(item, "file") == NULL) {
                goto failed;
            }

            continue;
        }

        file = cJSON_AddObjectToObject(item, "file");

        if (file == NULL
            || cJSON_AddBoolToObject(file, "saved",
                                     has_node && node.saved) == NULL
            || cJSON_AddNumberToObject(file, "bytes",
                                       has_node ? node.bytes : 0) == NULL
            || cJSON_AddNumberToObject(file, "tokens",
                                       has_node ? node.tokens : 0) == NULL
            || cJSON_AddNumberToObject(file, "saved_at",
                                       has_node ? node.saved_at : 0) == NULL)
        {
            goto failed;
        }
    }

    return ngx_http_llama_session_api_send(r, NGX_HTTP_OK, json);

failed:

    cJSON_Delete(json);
    return NGX_HTTP_INTERNAL_SERVER_ERROR;
}


/* GET or DELETE .../sessions/<id> */

static ngx_int_t
ngx_http_llama_session_api_one(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone, ngx_str_t *id, ngx_uint_t delete)
{
    u_char                             *p;
    u_char                              mine[NGX_HTTP_LLAMA_SESSION_DIGEST];
    size_t                              klen, skip;
    cJSON                              *json, *list, *item;
    ngx_int_t                           rc;
    ngx_str_t                           ns;
    ngx_uint_t                          i, k, n, is_key, narrow, tenant;
    ngx_queue_t                        *q, *queue;
    ngx_http_llama_session_ctx_t       *ctx;
    ngx_http_llama_session_node_t      *nodes, *node;
    ngx_http_llama_session_loc_conf_t  *llcf;
    ngx_http_llama_session_slot_t       slots[NGX_HTTP_LLAMA_SESSION_SLOTS_MAX];

    if (id->len == 0) {
        return ngx_http_llama_session_api_error(r, NGX_HTTP_NOT_FOUND,
                                                "no session id", NULL);
    }

    ctx = ngx_http_llama_session_create_ctx(r, zone);
    if (ctx == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    rc = ngx_http_llama_session_api_tenant(r, mine);
    if (rc == NGX_ERROR) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    tenant = (rc == NGX_OK);

    /* a key as the API lists it, or a client's id to derive the key from */

    /* a router's model zone: "<zone>@" and the key */

    skip = (zone->prefix.len && id->len > zone->prefix.len
            && ngx_strncmp(id->data, zone->prefix.data, zone->prefix.len)
               == 0)
           ? zone->prefix.len : 0;

    narrow = 0;

    is_key = (id->len - skip > NGX_HTTP_LLAMA_SESSION_HASH_HEX + 1
              && id->len - skip <= NGX_HTTP_LLAMA_SESSION_SAFE_MAX + 1
                                   + NGX_HTTP_LLAMA_SESSION_HASH_HEX
              && id->data[id->len - NGX_HTTP_LLAMA_SESSION_HASH_HEX - 1]
                 == '-'
              && (skip || zone->prefix.len == 0));

    for (i = skip; is_key && i < id->len; i++) {
        p = &id->data[i];

        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z')
              || (*p >= '0' && *p <= '9') || *p == '-' || *p == '_'))
        {
            is_key = 0;
        }
    }

    if (is_key) {
        ngx_memcpy(ctx->key, id->data, id->len);
        ctx->key_len = id->len;

    } else {
        llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

        ngx_str_null(&ns);

        if (llcf->namespace
            && ngx_http_complex_value(r, llcf->namespace, &ns) != NGX_OK)
        {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        rc = ngx_http_llama_session_api_arg(r, "model", &ctx->model);

        if (rc == NGX_ERROR) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        if (rc == NGX_OK) {
            /* ?model= narrows the id's sessions to one model's */
            narrow = 1;

        } else if (zone->model.len) {
            /* a router's model zone: its model */
            ctx->model = zone->model;
        }

        ctx->id = *id;

        if (ngx_http_llama_session_make_key(r, ctx, &ns) != NGX_OK) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
    }

    (void) ngx_http_llama_session_store_sync(zone, r->connection->log);

    /* its files, for every backend configuration */

    ngx_shmtx_lock(&zone->shpool->mutex);

    nodes = ngx_palloc(r->pool, 64 * sizeof(ngx_http_llama_session_node_t));
    if (nodes == NULL) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    /*
     * a key names one session; a client's id every session under it (a
     * chat, its title and tags requests, its subagents), in the request's
     * namespace
     */

    n = 0;

    for (k = 0; k < 2; k++) {
        queue = k ? &zone->sh->nofile : &zone->sh->lru;

        for (q = ngx_queue_head(queue);
             q != ngx_queue_sentinel(queue) && n < 64;
             q = ngx_queue_next(q))
        {
            node = ngx_queue_data(q, ngx_http_llama_session_node_t, lru);
            klen = node->name_len - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN;

            if (!ngx_http_llama_session_api_mine(tenant, mine, node->has_ns,
                                                 node->ns))
            {
                /* another tenant's, even by its key */
                continue;
            }

            if (is_key ? (klen != ctx->key_len
                          || ngx_memcmp(node->name, ctx->key, klen) != 0)
                       : (!node->has_idk
                          || ngx_memcmp(node->idk, ctx->idk,
                                        NGX_HTTP_LLAMA_SESSION_DIGEST) != 0
                          || (narrow
                              && (node->model_len
                                  != ngx_min(ctx->model.len,
                                        NGX_HTTP_LLAMA_SESSION_MODEL_SHOW)
                                  || ngx_memcmp(node->model, ctx->model.data,
                                                node->model_len) != 0))))
            {
                continue;
            }

            nodes[n++] = *node;
        }
    }

    ngx_memcpy(slots, zone->sh->slots, zone->sh->nslots * sizeof(slots[0]));

    ngx_shmtx_unlock(&zone->shpool->mutex);

    /* a session in a slot may have no file yet: it is in use all the same */

    for (i = 0; delete && i < n; i++) {
        klen = nodes[i].name_len - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN;

        if (ngx_http_llama_session_in_use(zone, nodes[i].name, klen)) {
            return ngx_http_llama_session_api_error(r, NGX_HTTP_CONFLICT,
                                  "the session is in a slot or in use; "
                                  "clear the slots or retry later", NULL);
        }
    }

    if (delete && is_key && (!tenant || n)
        && ngx_http_llama_session_in_use(zone, ctx->key, ctx->key_len))
    {
        return ngx_http_llama_session_api_error(r, NGX_HTTP_CONFLICT,
                                  "the session is in a slot or in use; "
                                  "clear the slots or retry later", NULL);
    }

    /* only the records with a file from here on */

    for (i = 0, k = 0; i < n; i++) {
        if (nodes[i].saved) {
            nodes[k++] = nodes[i];
        }
    }

    n = k;

    if (n == 0) {
        return ngx_http_llama_session_api_error(r, NGX_HTTP_NOT_FOUND,
                                                "no saved session by that "
                                                "id", NULL);
    }

    for (i = 0; delete && i < n; i++) {
        ngx_shmtx_lock(&zone->shpool->mutex);

        node = ngx_http_llama_session_lookup_name(zone, nodes[i].name,
                                                  nodes[i].name_len);
        if (node) {
            ngx_http_llama_session_node_file(zone->sh, node, 0, 0);
        }

        ngx_shmtx_unlock(&zone->shpool->mutex);
    }

    if (!is_key) {
        /* the most recently used of the id's sessions */
        ctx->key_len = nodes[0].name_len - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN;
        ngx_memcpy(ctx->key, nodes[0].name, ctx->key_len);
    }

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    list = cJSON_AddArrayToObject(json, delete ? "deleted" : "files");

    if (list == NULL
        || ngx_http_llama_session_api_str(json, "key", ctx->key,
                                          ctx->key_len) == NULL)
    {
        cJSON_Delete(json);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    for (i = 0; i < n; i++) {
        if (delete) {
            ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                          "llama_session: deleting session \"%*s\" through "
                          "the API", (size_t) nodes[i].name_len,
                          nodes[i].name);

            (void) ngx_http_llama_session_store_unlink(zone, nodes[i].name,
                                                       nodes[i].name_len,
                                                       r->connection->log);

            /* its last turn's text, if a slot's turn file still has it */
            ngx_http_llama_session_turn_forget(zone, nodes[i].name,
                                         nodes[i].name_len - 1
                                         - NGX_HTTP_LLAMA_SESSION_FP_LEN,
                                         r->connection->log);
        }

        item = ngx_http_llama_session_api_node(zone, &nodes[i],
                   !delete
                   && ngx_http_llama_session_api_in_slot(zone, slots,
                                                         &nodes[i]));
        if (item == NULL) {
            cJSON_Delete(json);
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cJSON_AddItemToArray(list, item);
    }

    return ngx_http_llama_session_api_send(r, NGX_HTTP_OK, json);
}


/*
 * The caller's tenant: with llama_session_namespace in the API's location,
 * every verb keeps to that namespace (NGX_OK, its digest in ns), as the
 * requests do; without it the API is the operator's, over all
 * (NGX_DECLINED).
 */

static ngx_int_t
ngx_http_llama_session_api_tenant(ngx_http_request_t *r, u_char *ns)
{
    ngx_str_t                           value;
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    if (llcf->namespace == NULL) {
        return NGX_DECLINED;
    }

    if (ngx_http_complex_value(r, llcf->namespace, &value) != NGX_OK) {
        return NGX_ERROR;
    }

    return ngx_http_llama_session_ns_digest(r, &value, ns);
}


/* the bytes of the records' files */

static off_t
ngx_http_llama_session_api_bytes(ngx_http_llama_session_node_t *nodes,
    ngx_uint_t n)
{
    off_t       bytes;
    ngx_uint_t  i;

    bytes = 0;

    for (i = 0; i < n; i++) {
        bytes += nodes[i].bytes;
    }

    return bytes;
}


/* may the caller see it: the operator all, a tenant its own only */

static ngx_uint_t
ngx_http_llama_session_api_mine(ngx_uint_t tenant, u_char *ns, ngx_uint_t has,
    u_char *theirs)
{
    return !tenant
           || (has && ngx_memcmp(ns, theirs, NGX_HTTP_LLAMA_SESSION_DIGEST)
                      == 0);
}


/* is the record's session in one of the slots (a snapshot of them)? */

static ngx_uint_t
ngx_http_llama_session_api_in_slot(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_slot_t *slots, ngx_http_llama_session_node_t *node)
{
    size_t      klen;
    ngx_uint_t  j;

    klen = node->name_len - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN;

    for (j = 0; j < zone->sh->nslots; j++) {
        if (slots[j].state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
            && slots[j].key_len == klen
            && ngx_memcmp(slots[j].key, node->name, klen) == 0)
        {
            return 1;
        }
    }

    return 0;
}


/*
 * POST .../sessions/save and .../sessions/clear, slot after slot: take the
 * slot when it is free (wait for it up to llama_session_wait_timeout, then
 * 409), learn the backend's fingerprint if needed, ask GET /slots (idle?
 * tokens? restarted?), then save the session in it (when it changed since
 * its last save) or erase it.  A save takes the checks and the commit of
 * every other save.
 */

static ngx_int_t
ngx_http_llama_session_api_slots(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    cJSON                         *json, *item;
    ngx_int_t                      rc;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = api->ctx;

    if (api->result == NULL) {
        api->result = cJSON_CreateArray();
        if (api->result == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
    }

    for ( ;; ) {

        if (api->slot >= api->last) {
            break;
        }

        ctx->job->slot = api->slot;

        if (!ctx->job->acquired || ctx->job->released) {
            if (ngx_http_llama_session_try_slot(ctx->zone, ctx->job)
                != NGX_OK)
            {

                if ((ngx_msec_int_t) (ngx_current_msec - ctx->deadline) < 0) {
                    /* a request or an idle save has it: try again soon */
                    goto again;
                }

                return ngx_http_llama_session_api_error(r, NGX_HTTP_CONFLICT,
                                  "a slot stayed busy with requests, retry "
                                  "later", NULL);
            }

            ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
            ctx->job->slots_checked = 0;
            ctx->job->restarted = 0;
            ctx->job->slot_tokens = -1;
            ctx->job->slot_task = -1;

            if (api->tenant
                && !ngx_http_llama_session_slot_of_tenant(ctx->zone,
                                                          api->slot, api->ns))
            {
                /* a tenant saves and clears its own sessions only */
                ngx_http_llama_session_release(ctx->zone, ctx->job, NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
                api->slot++;
                continue;
            }
        }

        if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_NONE) {

            if (api->op == NGX_HTTP_LLAMA_SESSION_API_SAVE
                && !ctx->job->save_pending)
            {
                ngx_http_llama_session_release(ctx->zone, ctx->job, NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
                api->slot++;
                continue;
            }

            if (api->op == NGX_HTTP_LLAMA_SESSION_API_SAVE
                && !ngx_http_llama_session_fingerprint(ctx->zone, ctx->job->fp))
            {
                ngx_http_llama_session_job_state(ctx,
                   NGX_HTTP_LLAMA_SESSION_ST_PROPS);
                rc = ngx_http_llama_session_call(r, ctx,
                                             NGX_HTTP_LLAMA_SESSION_CALL_PROPS,
                                             NULL, 0);

            } else {
                ngx_http_llama_session_job_state(ctx,
                   NGX_HTTP_LLAMA_SESSION_ST_CHECK);
                rc = ngx_http_llama_session_call(r, ctx,
                                             NGX_HTTP_LLAMA_SESSION_CALL_GET,
                                             NULL, 0);
            }

            if (rc != NGX_AGAIN) {
                return rc;
            }

            goto wait;
        }

        if (!ctx->job->call_done) {
            goto wait;
        }

        if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_PROPS
            || ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_MODELS)
        {
            rc = ngx_http_llama_session_learn(r, ctx);

            if (rc == NGX_AGAIN) {
                goto wait;
            }

            if (rc == NGX_ERROR) {
                api->failed = 1;
                ngx_http_llama_session_job_state(ctx,
                   NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
                ngx_http_llama_session_release(ctx->zone, ctx->job, NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
                break;
            }

            if (rc != NGX_OK) {
                return rc;
            }

            ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_CHECK);

            rc = ngx_http_llama_session_call(r, ctx,
                                             NGX_HTTP_LLAMA_SESSION_CALL_GET,
                                             NULL, 0);
            if (rc != NGX_AGAIN) {
                return rc;
            }

            goto wait;
        }

        if (ctx->job->state == NGX_HTTP_LLAMA_SESSION_ST_REPRIME) {
            rc = ngx_http_llama_session_reprime_next(r, ctx);

            if (rc == NGX_AGAIN) {
                goto wait;
            }

            return rc;
        }

        if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_GET) {
            rc = ngx_http_llama_session_api_checked(r, api);

            if (rc == NGX_AGAIN) {
                goto wait;
            }

            if (rc == NGX_BUSY) {
                goto again;
            }

            if (rc != NGX_DECLINED) {
                return rc;
            }

            /* nothing to do on this slot */
            continue;
        }

        item = cJSON_CreateObject();
        if (item == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cJSON_AddItemToArray(api->result, item);

        if (ngx_http_llama_session_api_done(r, api, item) != NGX_OK) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
    }

    ngx_http_llama_session_wake_local();

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    cJSON_AddItemToObject(json,
                          api->op == NGX_HTTP_LLAMA_SESSION_API_SAVE
                          ? "saved" : "cleared", api->result);
    api->result = NULL;

    return ngx_http_llama_session_api_send(r, api->failed
                                              ? NGX_HTTP_BAD_GATEWAY
                                              : NGX_HTTP_OK, json);

again:

    ngx_add_timer(&ctx->job->wait_ev, 20);

wait:

    /* a client that leaves while the API waits ends the request */

    r->read_event_handler = ngx_http_test_reading;
    r->write_event_handler = ngx_http_llama_session_api_resume;

    return NGX_DONE;
}


/*
 * GET /slots answered: NGX_AGAIN with the next call started, NGX_BUSY to
 * try again later (llama-server still runs the slot), NGX_DECLINED when
 * the slot is done with.
 */

static ngx_int_t
ngx_http_llama_session_api_checked(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    ngx_int_t                      rc;
    ngx_uint_t                     verdict;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = api->ctx;

    verdict = ngx_http_llama_session_slots_verdict(r->connection->log, ctx);

    if (verdict == NGX_HTTP_LLAMA_SESSION_SLOTS_ERROR
        || verdict == NGX_HTTP_LLAMA_SESSION_SLOTS_NO_API
        || verdict == NGX_HTTP_LLAMA_SESSION_SLOTS_MODEL_GONE)
    {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: the API's GET /slots for slot %ui "
                      "failed (%i): nothing is done to it", api->slot,
                      ctx->job->call_status);

        api->failed = 1;
        ngx_http_llama_session_job_state(ctx,
           NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
        ngx_http_llama_session_release(ctx->zone, ctx->job, NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
        api->slot++;
        return NGX_DECLINED;
    }

    if (verdict == NGX_HTTP_LLAMA_SESSION_SLOTS_RESTARTED) {
        /* nothing of the session to save; a clear erases what is there */
        ngx_http_llama_session_slot_lost(ctx);
    }

    if (verdict == NGX_HTTP_LLAMA_SESSION_SLOTS_BUSY
        || (ngx_msec_int_t) (ctx->job->quiet_until - ngx_current_msec) > 0)
    {
        /* llama-server runs the slot, or may start a request on it */
        ngx_http_llama_session_job_state(ctx,
           NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
        ngx_http_llama_session_release(ctx->zone, ctx->job, NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);

        if ((ngx_msec_int_t) (ngx_current_msec - ctx->deadline) < 0) {
            return NGX_BUSY;
        }

        api->failed = 1;
        api->slot++;

        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: the API left slot %ui alone: "
                      "llama-server kept running it", ctx->job->slot);
        return NGX_DECLINED;
    }

    if (api->op == NGX_HTTP_LLAMA_SESSION_API_SAVE) {

        if (!ngx_http_llama_session_may_save(ctx)) {
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
            ngx_http_llama_session_release(ctx->zone, ctx->job, ctx->job->restarted
                                          ? NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN
                                          : NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
            api->slot++;
            return NGX_DECLINED;
        }

        /* re-primed first when its last turn is known (reprime.c) */
        rc = ngx_http_llama_session_save(r, ctx);

    } else {
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_LOAD);
        ctx->job->load_file = 0;
        rc = ngx_http_llama_session_call(r, ctx,
                                         NGX_HTTP_LLAMA_SESSION_CALL_ERASE,
                                         NULL, 0);
    }

    return rc;
}


/* the save or the erase answered: the slot's line of the reply */

static ngx_int_t
ngx_http_llama_session_api_done(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api, cJSON *item)
{
    off_t                          bytes;
    double                         ms;
    ngx_uint_t                     tokens, state;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = api->ctx;
    state = NGX_HTTP_LLAMA_SESSION_SLOT_SESSION;

    if (cJSON_AddNumberToObject(item, "slot", api->slot) == NULL
        || cJSON_AddNumberToObject(item, "status", ctx->job->call_status)
            == NULL)
    {
        return NGX_ERROR;
    }

    if (api->op == NGX_HTTP_LLAMA_SESSION_API_SAVE) {

        if (ngx_http_llama_session_save_done(r->connection->log, ctx,
                                             NGX_HTTP_LLAMA_SESSION_SAVE_API,
                                             ctx->job->out_key,
                                                 ctx->job->out_len)
            == NGX_OK)
        {
            if (ngx_http_llama_session_api_str(item, "key", ctx->job->out_key,
                                               ctx->job->out_len) == NULL
                || cJSON_AddNumberToObject(item, "tokens",
                                           ctx->job->saved_tokens)
                   == NULL
                || cJSON_AddNumberToObject(item, "bytes", ctx->job->saved_bytes)
                   == NULL
                || cJSON_AddNumberToObject(item, "save_ms", ctx->job->save_ms)
                   == NULL)
            {
                return NGX_ERROR;
            }

        } else {
            api->failed = 1;

            if (ctx->job->call_status == 0) {
                state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
            }
        }

    } else if (ctx->job->call_status == NGX_HTTP_OK
               && ngx_http_llama_session_parse_action(r->connection->log,
                                                      ctx, &tokens, &bytes,
                                                      &ms)
                  == NGX_OK)
    {
        state = NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY;

        ngx_http_llama_session_job_slot_set(ctx,
                                        NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY,
                                        NULL, 0, 0);

        /* the slot's last turn (the conversation's text) goes with it */
        ctx->zone->sh->slots[api->slot].turn_seq = 0;
        ngx_http_llama_session_turn_drop(ctx->zone, api->slot,
                                         r->connection->log);

        if (cJSON_AddNumberToObject(item, "erased_tokens", tokens) == NULL) {
            return NGX_ERROR;
        }

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: slot %ui of zone \"%V\" cleared "
                      "through the API (%ui tokens)", api->slot,
                      &ctx->zone->name, tokens);

    } else {
        api->failed = 1;
        state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;

        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: the API's erase of slot %ui failed "
                      "(%i), its content is unknown now", api->slot,
                      ctx->job->call_status);
    }

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
    ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;

    ngx_http_llama_session_release(ctx->zone, ctx->job, state);
    ngx_http_llama_session_wake_local();

    api->slot++;

    return NGX_OK;
}


/* the body of a save or a clear is in: the slots, one after the other */

static void
ngx_http_llama_session_api_start(ngx_http_request_t *r)
{
    ngx_int_t                      rc;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    rc = ngx_http_llama_session_api_slots(r, ctx->api);

    if (rc == NGX_DONE) {
        /* the request lives on across its slot calls */
        return;
    }

    ngx_http_finalize_request(r, rc);
}


static void
ngx_http_llama_session_api_resume(ngx_http_request_t *r)
{
    ngx_int_t                      rc;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx == NULL || ctx->api == NULL
        || (ctx->job->call != NGX_HTTP_LLAMA_SESSION_CALL_NONE
            && !ctx->job->call_done)
        || ctx->job->wait_ev.timer_set)
    {
        return;
    }

    r->write_event_handler = ngx_http_request_empty_handler;

    rc = ngx_http_llama_session_api_slots(r, ctx->api);

    if (rc == NGX_DONE) {
        return;
    }

    ngx_http_finalize_request(r, rc);
}


/* the reply's slot list, whatever ended the request */

static void
ngx_http_llama_session_api_cleanup(void *data)
{
    ngx_http_llama_session_api_t *api = data;

    if (api->result) {
        cJSON_Delete(api->result);
        api->result = NULL;
    }
}


/* a query's argument, decoded once; NGX_DECLINED: there is none */

static ngx_int_t
ngx_http_llama_session_api_arg(ngx_http_request_t *r, char *name,
    ngx_str_t *value)
{
    u_char     *p;
    ngx_str_t   arg;

    if (ngx_http_arg(r, (u_char *) name, ngx_strlen(name), &arg) != NGX_OK) {
        return NGX_DECLINED;
    }

    value->data = ngx_pnalloc(r->pool, arg.len);
    if (value->data == NULL) {
        return NGX_ERROR;
    }

    p = value->data;
    ngx_unescape_uri(&p, &arg.data, arg.len, 0);
    value->len = p - value->data;

    return NGX_OK;
}


static cJSON *
ngx_http_llama_session_api_str(cJSON *obj, const char *name, u_char *data,
    size_t len)
{
    u_char  buf[512];

    len = ngx_min(len, sizeof(buf) - 1);

    if (len) {
        ngx_memcpy(buf, data, len);
    }

    buf[len] = '\0';

    return cJSON_AddStringToObject(obj, name, (char *) buf);
}


static ngx_int_t
ngx_http_llama_session_api_send(ngx_http_request_t *r, ngx_uint_t status,
    cJSON *json)
{
    char       *text;
    size_t      len;
    ngx_buf_t  *b;

    text = cJSON_PrintUnformatted(json);
    cJSON_Delete(json);

    if (text == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    len = ngx_strlen(text);

    b = ngx_create_temp_buf(r->pool, len + 1);
    if (b == NULL) {
        cJSON_free(text);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    b->last = ngx_cpymem(b->last, text, len);
    *b->last++ = '\n';
    cJSON_free(text);

    return ngx_http_llama_session_send_json(r, status, b);
}


static ngx_int_t
ngx_http_llama_session_api_error(ngx_http_request_t *r, ngx_uint_t status,
    char *message, char *allow)
{
    ngx_table_elt_t  *h;

    if (allow) {
        h = ngx_list_push(&r->headers_out.headers);
        if (h == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        h->hash = 1;
        ngx_str_set(&h->key, "Allow");
        h->value.data = (u_char *) allow;
        h->value.len = ngx_strlen(allow);
    }

    return ngx_http_llama_session_send_error(r, status,
                                             status == NGX_HTTP_NOT_FOUND
                                             ? "not_found_error"
                                             : "invalid_request_error",
                                             message, 0);
}
