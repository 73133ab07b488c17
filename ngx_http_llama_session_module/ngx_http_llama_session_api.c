
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
 * send a model; the location's llama_session_namespace applies); an id
 * that a path cannot carry goes in .../sessions?id=<id>.  The routes are
 * the table ngx_http_llama_session_api_routes.
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
#include "ngx_http_llama_session_io.h"
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


typedef struct ngx_http_llama_session_api_s  ngx_http_llama_session_api_t;

typedef ngx_int_t (*ngx_http_llama_session_api_pt)(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);


typedef struct {
    ngx_str_t                            path;     /* after .../sessions/ */
    ngx_uint_t                           id;       /* the rest is the id */
    ngx_uint_t                           methods;
    ngx_uint_t                           body;     /* it reads the body */
    ngx_uint_t                           op;
    char                                *allow;
    char                                *refusal;  /* the 405's message */
    ngx_http_llama_session_api_pt        parse;    /* its arguments */
    ngx_http_llama_session_api_pt        handler;
} ngx_http_llama_session_api_route_t;


/* a request to the API, parsed; for save and clear, the job too */

struct ngx_http_llama_session_api_s {
    ngx_http_llama_session_api_route_t  *route;
    ngx_http_llama_session_zone_t       *zone;
    ngx_http_llama_session_ctx_t        *ctx;
    ngx_str_t                            id;
    ngx_uint_t                           is_key;   /* the id is a key */
    ngx_uint_t                           narrow;   /* ?model= with an id */
    ngx_uint_t                           tenant;   /* only its own sessions */
    ngx_str_t                            namespace;
    u_char                               ns[NGX_HTTP_LLAMA_SESSION_DIGEST];
    ngx_uint_t                           slot;
    ngx_uint_t                           last;     /* the slot after the end */
    cJSON                               *result;   /* the reply's slot list */
    ngx_uint_t                           failed;
    char                                *message;  /* a refusal's */
    char                                *allow;

    cJSON                               *item;     /* the slot's, being done */

    /* the list's look at the folder, in a thread (store_sync_start()) */
    ngx_http_request_t                  *request;
    ngx_http_llama_session_io_t         *io;
    ngx_event_t                          sync_ev;
    ngx_uint_t                           synced;
};


static ngx_int_t ngx_http_llama_session_api_handler(ngx_http_request_t *r);
static ngx_int_t ngx_http_llama_session_api_parse(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_route(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_parse_id(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_parse_slot(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_list(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_http_llama_session_node_t *ngx_http_llama_session_api_records(
    ngx_http_request_t *r, ngx_http_llama_session_api_t *api,
    ngx_http_llama_session_slot_t *slots, ngx_uint_t *found);
static cJSON *ngx_http_llama_session_api_node(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_node_t *node,
    ngx_uint_t in_slot);
static ngx_int_t ngx_http_llama_session_api_one(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_files(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api, ngx_http_llama_session_node_t *nodes,
    ngx_uint_t n, ngx_http_llama_session_slot_t *slots);
static ngx_int_t ngx_http_llama_session_api_current(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_backend(cJSON *backend,
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_sh_t *copy);
static ngx_int_t ngx_http_llama_session_api_stats(cJSON *stats,
    ngx_http_llama_session_sh_t *copy);
static ngx_int_t ngx_http_llama_session_api_slot(cJSON *item,
    ngx_http_llama_session_api_t *api, ngx_http_llama_session_sh_t *copy,
    ngx_uint_t i);
static ngx_uint_t ngx_http_llama_session_api_mine(ngx_uint_t tenant,
    u_char *ns, ngx_uint_t has, u_char *theirs);
static ngx_uint_t ngx_http_llama_session_api_in_slot(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_slot_t *slots,
    ngx_http_llama_session_node_t *node);
static ngx_int_t ngx_http_llama_session_api_slots(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_take(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_step(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_checked(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static ngx_int_t ngx_http_llama_session_api_done(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api, cJSON *item);
static void ngx_http_llama_session_api_resume(ngx_http_request_t *r);
static void ngx_http_llama_session_api_cleanup(void *data);
static ngx_int_t ngx_http_llama_session_api_sync(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api);
static void ngx_http_llama_session_api_synced(ngx_event_t *ev);
static void ngx_http_llama_session_api_sync_end(void *data);
static ngx_int_t ngx_http_llama_session_api_send(ngx_http_request_t *r,
    ngx_uint_t status, cJSON *json);
static ngx_int_t ngx_http_llama_session_api_error(ngx_http_request_t *r,
    ngx_uint_t status, char *message, char *allow);
static ngx_int_t ngx_http_llama_session_api_arg(ngx_http_request_t *r,
    char *name, ngx_str_t *value);
static cJSON *ngx_http_llama_session_api_str(cJSON *obj, const char *name,
    u_char *data, size_t len);


/*
 * The routes, by the part of the path after its last "/sessions/": the
 * methods (a 405 with Allow for the others), whether the route reads the
 * body (the others discard it), its arguments' parse and its handler.
 * <id>, the last, takes any other path, and .../sessions?id=<id>.
 */

static ngx_http_llama_session_api_route_t
    ngx_http_llama_session_api_routes[] =
{
    { ngx_string(""), 0, NGX_HTTP_GET|NGX_HTTP_HEAD, 0,
      NGX_HTTP_LLAMA_SESSION_API_LIST, "GET, HEAD",
      "the session list is read with GET",
      NULL, ngx_http_llama_session_api_list },

    { ngx_string("current"), 0, NGX_HTTP_GET|NGX_HTTP_HEAD, 0,
      NGX_HTTP_LLAMA_SESSION_API_CURRENT, "GET, HEAD",
      "the slots are read with GET",
      NULL, ngx_http_llama_session_api_current },

    { ngx_string("save"), 0, NGX_HTTP_POST, 1,
      NGX_HTTP_LLAMA_SESSION_API_SAVE, "POST", "save and clear are POSTs",
      ngx_http_llama_session_api_parse_slot, ngx_http_llama_session_api_slots },

    { ngx_string("clear"), 0, NGX_HTTP_POST, 1,
      NGX_HTTP_LLAMA_SESSION_API_CLEAR, "POST", "save and clear are POSTs",
      ngx_http_llama_session_api_parse_slot, ngx_http_llama_session_api_slots },

    { ngx_string("<id>"), 1, NGX_HTTP_GET|NGX_HTTP_HEAD|NGX_HTTP_DELETE, 0,
      NGX_HTTP_LLAMA_SESSION_API_ONE, "GET, HEAD, DELETE",
      "a session is read with GET and deleted with DELETE",
      ngx_http_llama_session_api_parse_id, ngx_http_llama_session_api_one }
};


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


/*
 * The request is parsed first: its route, method and arguments.  A route
 * with a body has it read whole (and ignored: a discard still running
 * would take the client's read events from the slot calls' subrequests),
 * then resume() runs its handler; the others and a refusal discard it.
 */

static ngx_int_t
ngx_http_llama_session_api_handler(ngx_http_request_t *r)
{
    ngx_int_t                      rc, discard;
    ngx_http_llama_session_api_t  *api;

    if (r != r->main) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: refused a subrequest to the "
                      "management API \"%V\"", &r->uri);
        return NGX_HTTP_FORBIDDEN;
    }

    api = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_api_t));
    if (api == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    rc = ngx_http_llama_session_api_parse(r, api);

    if (rc == NGX_ERROR) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (rc == NGX_OK && api->route->body) {
        rc = ngx_http_read_client_request_body(r,
                                           ngx_http_llama_session_api_resume);

        return (rc >= NGX_HTTP_SPECIAL_RESPONSE) ? rc : NGX_DONE;
    }

    discard = ngx_http_discard_request_body(r);
    if (discard != NGX_OK) {
        return discard;
    }

    if (rc != NGX_OK) {
        return ngx_http_llama_session_api_error(r, rc, api->message,
                                                api->allow);
    }

    return api->route->handler(r, api);
}


/*
 * The zone (in a set of models, the one ?model= names), the route, its
 * method, the caller's tenant and the route's arguments: NGX_OK, NGX_ERROR
 * or the status of a refusal, its message in api.
 *
 * The tenant: with llama_session_namespace in the API's location, every
 * verb keeps to that namespace, as the requests do; without it the API
 * is the operator's, over all.
 */

static ngx_int_t
ngx_http_llama_session_api_parse(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    ngx_int_t                           rc;
    ngx_str_t                           value;
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);
    api->zone = llcf->api_zone;

    if (api->zone->models) {
        rc = ngx_http_llama_session_api_arg(r, "model", &value);

        if (rc == NGX_ERROR) {
            return NGX_ERROR;
        }

        if (rc == NGX_DECLINED) {
            api->message = "this zone keeps the sessions of several models: "
                           "name one with ?model=";
            return NGX_HTTP_BAD_REQUEST;
        }

        api->zone = ngx_http_llama_session_models_find(api->zone->models,
                                                       value.data, value.len);
        if (api->zone == NULL) {
            api->message = "no sessions of this model";
            return NGX_HTTP_NOT_FOUND;
        }
    }

    rc = ngx_http_llama_session_api_route(r, api);
    if (rc != NGX_OK) {
        return rc;
    }

    if (!(r->method & api->route->methods)) {
        api->message = api->route->refusal;
        api->allow = api->route->allow;
        return NGX_HTTP_NOT_ALLOWED;
    }

    if (llcf->namespace) {
        api->tenant = 1;

        if (ngx_http_complex_value(r, llcf->namespace, &api->namespace)
            != NGX_OK
            || ngx_http_llama_session_ns_digest(r, &api->namespace, api->ns)
               != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return api->route->parse ? api->route->parse(r, api) : NGX_OK;
}


/* the route of the path's part after its last "/sessions" */

static ngx_int_t
ngx_http_llama_session_api_route(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    u_char                              *p, *last, *s;
    ngx_int_t                            rc;
    ngx_str_t                            rest;
    ngx_http_llama_session_api_route_t  *route;

    last = r->uri.data + r->uri.len;
    s = NULL;

    for (p = r->uri.data;
         (p = ngx_strlcasestrn(p, last, (u_char *) "/sessions", 9 - 1));
         p++)
    {
        s = p;
    }

    if (s == NULL) {
        api->message = "use .../sessions, .../sessions/current, "
                       ".../sessions/<id>, .../sessions/save or "
                       ".../sessions/clear";
        return NGX_HTTP_NOT_FOUND;
    }

    rest.data = s + sizeof("/sessions") - 1;
    rest.len = last - rest.data;

    while (rest.len && rest.data[rest.len - 1] == '/') {
        rest.len--;
    }

    if (rest.len && rest.data[0] != '/') {
        api->message = "no such resource";
        return NGX_HTTP_NOT_FOUND;
    }

    rc = NGX_DECLINED;

    if (rest.len) {
        rest.data++;
        rest.len--;

    } else {
        /*
         * .../sessions?id=ID: an id that the path cannot carry (nginx
         * resolves "/" and ".." in a path before the location is
         * chosen); the argument is decoded once
         */

        rc = ngx_http_llama_session_api_arg(r, "id", &api->id);

        if (rc == NGX_ERROR) {
            return NGX_ERROR;
        }
    }

    for (route = ngx_http_llama_session_api_routes; !route->id; route++) {
        if (rc != NGX_OK
            && rest.len == route->path.len
            && ngx_strncmp(rest.data, route->path.data, rest.len) == 0)
        {
            break;
        }
    }

    if (route->id && rest.len) {
        /* nginx decoded the path already: the id is taken as it is */
        api->id = rest;
    }

    api->route = route;

    return NGX_OK;
}


/*
 * .../sessions/<id> and ?id=<id>: a key as the API lists it, or a
 * client's id to derive the key from, in the request's context
 */

static ngx_int_t
ngx_http_llama_session_api_parse_id(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    u_char                        *p;
    size_t                         skip;
    ngx_int_t                      rc;
    ngx_str_t                     *id;
    ngx_uint_t                     i;
    ngx_http_llama_session_ctx_t  *ctx;

    id = &api->id;

    if (id->len == 0) {
        api->message = "no session id";
        return NGX_HTTP_NOT_FOUND;
    }

    ctx = ngx_http_llama_session_create_ctx(r, api->zone);
    if (ctx == NULL) {
        return NGX_ERROR;
    }

    api->ctx = ctx;

    /* a router's model zone: "<zone>@" and the key */

    skip = (api->zone->prefix.len && id->len > api->zone->prefix.len
            && ngx_strncmp(id->data, api->zone->prefix.data,
                           api->zone->prefix.len) == 0)
           ? api->zone->prefix.len : 0;

    api->is_key = (id->len - skip > NGX_HTTP_LLAMA_SESSION_HASH_HEX + 1
                   && id->len - skip <= NGX_HTTP_LLAMA_SESSION_SAFE_MAX + 1
                                        + NGX_HTTP_LLAMA_SESSION_HASH_HEX
                   && id->data[id->len - NGX_HTTP_LLAMA_SESSION_HASH_HEX - 1]
                      == '-'
                   && (skip || api->zone->prefix.len == 0));

    for (i = skip; api->is_key && i < id->len; i++) {
        p = &id->data[i];

        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z')
              || (*p >= '0' && *p <= '9') || *p == '-' || *p == '_'))
        {
            api->is_key = 0;
        }
    }

    if (api->is_key) {
        ngx_memcpy(ctx->key, id->data, id->len);
        ctx->key_len = id->len;
        return NGX_OK;
    }

    rc = ngx_http_llama_session_api_arg(r, "model", &ctx->model);

    if (rc == NGX_ERROR) {
        return NGX_ERROR;
    }

    if (rc == NGX_OK) {
        /* ?model= narrows the id's sessions to one model's */
        api->narrow = 1;

    } else if (api->zone->model.len) {
        /* a router's model zone: its model */
        ctx->model = api->zone->model;
    }

    ctx->id = *id;

    /* "sys-…" names the module's conversation, not a client's id of that
     * form (found by its key) */
    ctx->id_own = 1;

    if (ngx_http_llama_session_make_key(r, ctx, &api->namespace) != NGX_OK) {
        return NGX_ERROR;
    }

    return NGX_OK;
}


/* save and clear: the job's context and its slots (?slot=k: that alone) */

static ngx_int_t
ngx_http_llama_session_api_parse_slot(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    ngx_int_t                           n;
    ngx_str_t                           arg;
    ngx_pool_cleanup_t                 *cln;
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NGX_ERROR;
    }

    cln->handler = ngx_http_llama_session_api_cleanup;
    cln->data = api;

    api->ctx = ngx_http_llama_session_create_ctx(r, api->zone);
    if (api->ctx == NULL) {
        return NGX_ERROR;
    }

    api->ctx->api = api;
    api->ctx->deadline = ngx_current_msec + llcf->wait_timeout;
    api->last = ngx_http_llama_session_slots_usable(api->zone->sh);

    api->result = cJSON_CreateArray();
    if (api->result == NULL) {
        return NGX_ERROR;
    }

    if (ngx_http_arg(r, (u_char *) "slot", 4, &arg) == NGX_OK) {
        n = ngx_atoi(arg.data, arg.len);

        if (n == NGX_ERROR || (ngx_uint_t) n >= api->last) {
            api->message = "no such slot";
            return NGX_HTTP_BAD_REQUEST;
        }

        api->slot = n;
        api->last = n + 1;
    }

    return NGX_OK;
}


/* GET .../sessions */

static ngx_int_t
ngx_http_llama_session_api_list(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    off_t                           bytes;
    cJSON                          *json, *list, *item;
    ngx_uint_t                      i, n;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *zone;
    ngx_http_llama_session_node_t  *nodes;
    ngx_http_llama_session_slot_t   slots[NGX_HTTP_LLAMA_SESSION_SLOTS_MAX];

    zone = api->zone;
    sh = zone->sh;

    if (ngx_http_llama_session_api_sync(r, api) == NGX_AGAIN) {
        return NGX_DONE;
    }

    nodes = ngx_http_llama_session_api_records(r, api, slots, &n);
    if (nodes == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    /* a tenant's bytes are its files' */

    for (bytes = 0, i = 0; api->tenant && i < n; i++) {
        bytes += nodes[i].bytes;
    }

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
                                   api->tenant ? bytes : sh->bytes) == NULL
        || (!api->tenant
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


/*
 * A snapshot of the records the caller may see, and of the slots: for
 * the list the saved sessions, most recently used first; for an id its
 * records, for every backend configuration (a key names one session; a
 * client's id every session under it: a chat, its title and tags
 * requests, its subagents).
 */

static ngx_http_llama_session_node_t *
ngx_http_llama_session_api_records(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api, ngx_http_llama_session_slot_t *slots,
    ngx_uint_t *found)
{
    size_t                          klen;
    ngx_uint_t                      k, n, max, one;
    ngx_queue_t                    *q, *queue;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_ctx_t   *ctx;
    ngx_http_llama_session_node_t  *nodes, *node;

    ctx = api->ctx;
    sh = api->zone->sh;
    one = (api->route->op == NGX_HTTP_LLAMA_SESSION_API_ONE);

    ngx_shmtx_lock(&api->zone->shpool->mutex);

    max = one ? 64 : sh->files;

    nodes = ngx_palloc(r->pool, (one ? 64 : sh->files + 1)
                                * sizeof(ngx_http_llama_session_node_t));
    if (nodes == NULL) {
        ngx_shmtx_unlock(&api->zone->shpool->mutex);
        return NULL;
    }

    n = 0;

    for (k = 0; k < (one ? 2 : 1); k++) {
        queue = k ? &sh->nofile : &sh->lru;

        for (q = ngx_queue_head(queue);
             q != ngx_queue_sentinel(queue) && n < max;
             q = ngx_queue_next(q))
        {
            node = ngx_queue_data(q, ngx_http_llama_session_node_t, lru);
            klen = node->name_len - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN;

            /* the caller's (not another tenant's, even by its key) */

            if (!ngx_http_llama_session_api_mine(api->tenant, api->ns,
                                                 node->has_ns, node->ns)
                || (!one && !node->saved)
                || (one && api->is_key
                    && (klen != ctx->key_len
                        || ngx_memcmp(node->name, ctx->key, klen) != 0))
                || (one && !api->is_key
                    && (!node->has_idk
                        || ngx_memcmp(node->idk, ctx->idk,
                                      NGX_HTTP_LLAMA_SESSION_DIGEST) != 0
                        || (api->narrow
                            && (node->model_len
                                != ngx_min(ctx->model.len,
                                           NGX_HTTP_LLAMA_SESSION_MODEL_SHOW)
                                || ngx_memcmp(node->model, ctx->model.data,
                                              node->model_len) != 0)))))
            {
                continue;
            }

            nodes[n++] = *node;
        }
    }

    ngx_memcpy(slots, sh->slots, sh->nslots * sizeof(slots[0]));

    ngx_shmtx_unlock(&api->zone->shpool->mutex);

    *found = n;

    return nodes;
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


/* GET or DELETE .../sessions/<id> */

static ngx_int_t
ngx_http_llama_session_api_one(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    ngx_uint_t                      i, k, n, delete, used;
    ngx_http_llama_session_node_t  *nodes, *node;
    ngx_http_llama_session_slot_t   slots[NGX_HTTP_LLAMA_SESSION_SLOTS_MAX];

    delete = (r->method == NGX_HTTP_DELETE);

    if (ngx_http_llama_session_api_sync(r, api) == NGX_AGAIN) {
        return NGX_DONE;
    }

    nodes = ngx_http_llama_session_api_records(r, api, slots, &n);
    if (nodes == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    /* a session in a slot may have no file yet: it is in use all the same */

    for (i = 0, used = 0; delete && !used && i < n; i++) {
        used = ngx_http_llama_session_in_use(api->zone, nodes[i].name,
                                             nodes[i].name_len - 1
                                             - NGX_HTTP_LLAMA_SESSION_FP_LEN);
    }

    if (delete && !used && api->is_key && (!api->tenant || n)) {
        used = ngx_http_llama_session_in_use(api->zone, api->ctx->key,
                                             api->ctx->key_len);
    }

    if (used) {
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

    /* DELETE: the records lose their files, then the files go */

    for (i = 0; delete && i < n; i++) {
        ngx_shmtx_lock(&api->zone->shpool->mutex);

        node = ngx_http_llama_session_lookup_name(api->zone, nodes[i].name,
                                                  nodes[i].name_len);
        if (node) {
            ngx_http_llama_session_node_file(api->zone->sh, node, 0, 0);
        }

        ngx_shmtx_unlock(&api->zone->shpool->mutex);
    }

    for (i = 0; delete && i < n; i++) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: deleting session \"%*s\" through "
                      "the API", (size_t) nodes[i].name_len, nodes[i].name);

        (void) ngx_http_llama_session_store_unlink(api->zone, nodes[i].name,
                                                   nodes[i].name_len,
                                                   r->connection->log);

        /* its last turn's text, if a slot's turn file still has it */
        ngx_http_llama_session_turn_forget(api->zone, nodes[i].name,
                                         nodes[i].name_len - 1
                                         - NGX_HTTP_LLAMA_SESSION_FP_LEN,
                                         r->connection->log);
    }

    if (!api->is_key) {
        /* the most recently used of the id's sessions */
        api->ctx->key_len = nodes[0].name_len - 1
                            - NGX_HTTP_LLAMA_SESSION_FP_LEN;
        ngx_memcpy(api->ctx->key, nodes[0].name, api->ctx->key_len);
    }

    return ngx_http_llama_session_api_files(r, api, nodes, n, slots);
}


/* the reply: the id's files, or the ones a DELETE deleted */

static ngx_int_t
ngx_http_llama_session_api_files(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api, ngx_http_llama_session_node_t *nodes,
    ngx_uint_t n, ngx_http_llama_session_slot_t *slots)
{
    cJSON       *json, *list, *item;
    ngx_uint_t   i, delete;

    delete = (r->method == NGX_HTTP_DELETE);

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    list = cJSON_AddArrayToObject(json, delete ? "deleted" : "files");

    if (list == NULL
        || ngx_http_llama_session_api_str(json, "key", api->ctx->key,
                                          api->ctx->key_len) == NULL)
    {
        cJSON_Delete(json);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    for (i = 0; i < n; i++) {
        item = ngx_http_llama_session_api_node(api->zone, &nodes[i],
                   !delete
                   && ngx_http_llama_session_api_in_slot(api->zone, slots,
                                                         &nodes[i]));
        if (item == NULL) {
            cJSON_Delete(json);
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cJSON_AddItemToArray(list, item);
    }

    return ngx_http_llama_session_api_send(r, NGX_HTTP_OK, json);
}


/* GET .../sessions/current */

static ngx_int_t
ngx_http_llama_session_api_current(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    cJSON                          *json, *list, *item, *backend, *stats;
    ngx_uint_t                      i, waiting, pages, free_pages;
    ngx_http_llama_session_sh_t    *sh, copy;
    ngx_http_llama_session_zone_t  *zone;

    zone = api->zone;
    sh = zone->sh;

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
        || cJSON_AddNumberToObject(json, "ram", (double) zone->ram) == NULL
        || cJSON_AddBoolToObject(json, "ram_disabled", copy.ram_off) == NULL
        || cJSON_AddNumberToObject(json, "ram_sessions_bytes",
                                   (double) copy.ram_bytes) == NULL
        || cJSON_AddNumberToObject(json, "shm_bytes",
                                   zone->shm_zone->shm.size) == NULL
        || cJSON_AddNumberToObject(json, "shm_used_bytes",
                                   (pages - free_pages) * ngx_pagesize)
           == NULL
        || (backend = cJSON_AddObjectToObject(json, "backend")) == NULL
        || (stats = cJSON_AddObjectToObject(json, "stats")) == NULL
        || (list = cJSON_AddArrayToObject(json, "slots")) == NULL
        || ngx_http_llama_session_api_backend(backend, zone, &copy) != NGX_OK
        || ngx_http_llama_session_api_stats(stats, &copy) != NGX_OK)
    {
        goto failed;
    }

    for (i = 0; i < zone->sh->nslots; i++) {
        item = cJSON_CreateObject();
        if (item == NULL) {
            goto failed;
        }

        cJSON_AddItemToArray(list, item);

        if (ngx_http_llama_session_api_slot(item, api, &copy, i) != NGX_OK) {
            goto failed;
        }
    }

    return ngx_http_llama_session_api_send(r, NGX_HTTP_OK, json);

failed:

    cJSON_Delete(json);
    return NGX_HTTP_INTERNAL_SERVER_ERROR;
}


static ngx_int_t
ngx_http_llama_session_api_backend(cJSON *backend,
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_sh_t *copy)
{
    cJSON  *memory;

    if (zone->model.len
        && ngx_http_llama_session_api_str(backend, "model", zone->model.data,
                                          zone->model.len) == NULL)
    {
        return NGX_ERROR;
    }

    if (copy->fp_known) {
        if (ngx_http_llama_session_api_str(backend, "fingerprint", copy->fp,
                                         NGX_HTTP_LLAMA_SESSION_FP_LEN)
            == NULL
            || ngx_http_llama_session_api_str(backend, "model_path",
                                              copy->model_path,
                                              copy->model_path_len) == NULL
            || cJSON_AddNumberToObject(backend, "n_ctx", copy->n_ctx) == NULL
            || cJSON_AddNumberToObject(backend, "total_slots",
                                       copy->total_slots) == NULL)
        {
            return NGX_ERROR;
        }
    }

    if (copy->fp_known && copy->memory_known
        && ngx_memcmp(copy->memory_fp, copy->fp,
                      NGX_HTTP_LLAMA_SESSION_FP_LEN) == 0)
    {
        /* what a slot file can bring back on this model (gguf.c) */

        memory = cJSON_AddObjectToObject(backend, "memory");

        if (memory == NULL
            || cJSON_AddStringToObject(memory, "kind",
                              ngx_http_llama_session_memory_name(
                                                     copy->memory.kind))
               == NULL
            || (copy->memory.kind != NGX_HTTP_LLAMA_SESSION_MEMORY_UNKNOWN
                && cJSON_AddStringToObject(memory, "architecture",
                                           (char *) copy->memory.arch)
                   == NULL)
            || (copy->memory.kind == NGX_HTTP_LLAMA_SESSION_MEMORY_SWA
                && cJSON_AddNumberToObject(memory, "sliding_window",
                                           copy->memory.window)
                   == NULL))
        {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_llama_session_api_stats(cJSON *stats,
    ngx_http_llama_session_sh_t *copy)
{
#define ngx_http_llama_session_api_stat(name)                                 \
    if (cJSON_AddNumberToObject(stats, #name, copy->stats.name) == NULL) {   \
        return NGX_ERROR;                                                    \
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
    ngx_http_llama_session_api_stat(idle_lent);
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
    ngx_http_llama_session_api_stat(newer_saves);
    ngx_http_llama_session_api_stat(newer_hits);
    ngx_http_llama_session_api_stat(ram_hits);
    ngx_http_llama_session_api_stat(ram_misses);
    ngx_http_llama_session_api_stat(ram_stored);
    ngx_http_llama_session_api_stat(ram_evicted);
    ngx_http_llama_session_api_stat(ram_lost);

#undef ngx_http_llama_session_api_stat

    return NGX_OK;
}


/* slot i of the snapshot: what it holds, and the session's file */

static ngx_int_t
ngx_http_llama_session_api_slot(cJSON *item, ngx_http_llama_session_api_t *api,
    ngx_http_llama_session_sh_t *copy, ngx_uint_t i)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    cJSON                          *file, *session;
    ngx_uint_t                      has_node, mine;
    ngx_http_llama_session_node_t   node;
    ngx_http_llama_session_slot_t  *slot;

    slot = &copy->slots[i];

    mine = ngx_http_llama_session_api_mine(api->tenant, api->ns, slot->has_ns,
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
        return NGX_ERROR;
    }

    if (slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION || !mine) {
        return (cJSON_AddNullToObject(item, "session") == NULL
                || cJSON_AddNullToObject(item, "file") == NULL)
               ? NGX_ERROR : NGX_OK;
    }

    has_node = 0;

    if (copy->fp_known) {
        n = ngx_http_llama_session_file_name(name, slot->key, slot->key_len,
                                             copy->fp);
        has_node = (ngx_http_llama_session_node_info(api->zone, name, n,
                                                     &node)
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
        return NGX_ERROR;
    }

    if (!slot->saveable) {
        return (cJSON_AddNullToObject(item, "file") == NULL)
               ? NGX_ERROR : NGX_OK;
    }

    file = cJSON_AddObjectToObject(item, "file");

    if (file == NULL
        || cJSON_AddBoolToObject(file, "saved", has_node && node.saved)
           == NULL
        || cJSON_AddNumberToObject(file, "bytes",
                                   has_node ? node.bytes : 0) == NULL
        || cJSON_AddNumberToObject(file, "tokens",
                                   has_node ? node.tokens : 0) == NULL
        || cJSON_AddNumberToObject(file, "saved_at",
                                   has_node ? node.saved_at : 0) == NULL)
    {
        return NGX_ERROR;
    }

    return NGX_OK;
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
 * every other save.  Run by resume(), once the body is in and after each
 * slot call.
 */

static ngx_int_t
ngx_http_llama_session_api_slots(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    cJSON                         *json;
    ngx_int_t                      rc;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = api->ctx;

    while (api->slot < api->last) {

        ctx->job->slot = api->slot;

        rc = (!ctx->job->acquired || ctx->job->released)
             ? ngx_http_llama_session_api_take(r, api)
             : ngx_http_llama_session_api_step(r, api);

        if (rc == NGX_AGAIN) {
            goto wait;
        }

        if (rc == NGX_BUSY) {
            goto again;
        }

        if (rc == NGX_DONE) {
            break;
        }

        if (rc == NGX_ABORT) {
            return ngx_http_llama_session_api_error(r, NGX_HTTP_CONFLICT,
                                  "a slot stayed busy with requests, retry "
                                  "later", NULL);
        }

        if (rc != NGX_OK) {
            return rc;
        }
    }

    ngx_http_llama_session_wake_local();

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    cJSON_AddItemToObject(json,
                          api->route->op == NGX_HTTP_LLAMA_SESSION_API_SAVE
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
 * The slot, taken when it is free, its job begun anew and its first step
 * made; NGX_BUSY: try again soon; NGX_ABORT: it stayed busy.  Another
 * tenant's slot is given back and passed over.
 */

static ngx_int_t
ngx_http_llama_session_api_take(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = api->ctx;

    if (ngx_http_llama_session_try_slot(ctx->zone, ctx->job) != NGX_OK) {
        /* a request or an idle save has it */
        return ((ngx_msec_int_t) (ngx_current_msec - ctx->deadline) < 0)
               ? NGX_BUSY : NGX_ABORT;
    }

    ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;
    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
    ctx->job->slots_checked = 0;
    ctx->job->restarted = 0;
    ctx->job->slot_tokens = -1;
    ctx->job->slot_task = -1;

    if (api->tenant
        && !ngx_http_llama_session_slot_of_tenant(ctx->zone, api->slot,
                                                  api->ns))
    {
        /* a tenant saves and clears its own sessions only */
        ngx_http_llama_session_release(ctx->zone, ctx->job,
                                       NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
        api->slot++;
        return NGX_OK;
    }

    return ngx_http_llama_session_api_step(r, api);
}


/*
 * The taken slot's next step: its first call, GET /slots (GET /props and
 * GET /v1/models first when a save needs the backend's fingerprint), then
 * the save or the erase.  NGX_OK: on to the next step or slot; NGX_AGAIN:
 * a call is on its way; NGX_BUSY: try again soon; NGX_DONE: no slot more
 * (the backend failed the fingerprint's calls); else an HTTP status.
 */

static ngx_int_t
ngx_http_llama_session_api_step(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    cJSON                         *item;
    ngx_int_t                      rc;
    ngx_uint_t                     save;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = api->ctx;
    save = (api->route->op == NGX_HTTP_LLAMA_SESSION_API_SAVE);

    if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_NONE
        && save && !ctx->job->save_pending)
    {
        ngx_http_llama_session_release(ctx->zone, ctx->job,
                                       NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
        api->slot++;
        return NGX_OK;
    }

    if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_NONE
        && save && !ngx_http_llama_session_fingerprint(ctx->zone, ctx->job->fp))
    {
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_PROPS);
        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_PROPS,
                                           NULL, 0);
    }

    if (ctx->job->call != NGX_HTTP_LLAMA_SESSION_CALL_NONE
        && !ctx->job->call_done)
    {
        return NGX_AGAIN;
    }

    if (ctx->job->state == NGX_HTTP_LLAMA_SESSION_ST_TURN) {
        if (ngx_http_llama_session_io_pending(ctx->job->io,
                                              &ctx->job->wait_ev))
        {
            return NGX_AGAIN;
        }

        /* the slot's turn file read in a thread (reprime.c), or its bound */
        return ngx_http_llama_session_save(r, ctx);
    }

    if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_PROPS
        || ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_MODELS)
    {
        rc = ngx_http_llama_session_learn(r, ctx);

        if (rc == NGX_ERROR) {
            api->failed = 1;
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
            ngx_http_llama_session_release(ctx->zone, ctx->job,
                                           NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
            return NGX_DONE;
        }

        if (rc != NGX_OK) {
            return rc;
        }

        ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;
    }

    if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_NONE) {
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_CHECK);
        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_GET,
                                           NULL, 0);
    }

    if (ctx->job->state == NGX_HTTP_LLAMA_SESSION_ST_REPRIME) {
        return ngx_http_llama_session_reprime_next(r, ctx);
    }

    if (ctx->job->call == NGX_HTTP_LLAMA_SESSION_CALL_GET) {
        rc = ngx_http_llama_session_api_checked(r, api);

        /* NGX_DECLINED: nothing to do on this slot */
        return (rc == NGX_DECLINED) ? NGX_OK : rc;
    }

    if (api->item == NULL) {
        item = cJSON_CreateObject();
        if (item == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cJSON_AddItemToArray(api->result, item);
        api->item = item;
    }

    rc = ngx_http_llama_session_api_done(r, api, api->item);

    if (rc == NGX_AGAIN) {
        /* its save's commit runs in a thread */
        return NGX_AGAIN;
    }

    api->item = NULL;

    if (rc != NGX_OK) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    return NGX_OK;
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
        ngx_http_llama_session_release(ctx->zone, ctx->job,
                                       NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);
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
        ngx_http_llama_session_release(ctx->zone, ctx->job,
                                       NGX_HTTP_LLAMA_SESSION_SLOT_SESSION);

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

    if (api->route->op == NGX_HTTP_LLAMA_SESSION_API_SAVE) {

        if (!ngx_http_llama_session_may_save(ctx)) {
            ngx_http_llama_session_job_state(ctx,
               NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE);
            ngx_http_llama_session_release(ctx->zone, ctx->job,
                                      ctx->job->restarted
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
    ngx_int_t                      rc;
    ngx_uint_t                     tokens, state, seq;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = api->ctx;
    state = NGX_HTTP_LLAMA_SESSION_SLOT_SESSION;
    rc = NGX_OK;

    if (api->route->op == NGX_HTTP_LLAMA_SESSION_API_SAVE) {
        /* the commit's file calls in a thread: NGX_AGAIN, here again */

        rc = ngx_http_llama_session_save_done(r->connection->log, ctx,
                                              NGX_HTTP_LLAMA_SESSION_SAVE_API,
                                              ctx->job->out_key,
                                              ctx->job->out_len,
                                              &ctx->job->wait_ev);
        if (rc == NGX_AGAIN) {
            return NGX_AGAIN;
        }
    }

    if (cJSON_AddNumberToObject(item, "slot", api->slot) == NULL
        || cJSON_AddNumberToObject(item, "status", ctx->job->call_status)
            == NULL)
    {
        return NGX_ERROR;
    }

    if (api->route->op == NGX_HTTP_LLAMA_SESSION_API_SAVE) {

        if (rc == NGX_DECLINED) {
            /* shared=on: the store holds another owner's newer state */
            if (ngx_http_llama_session_api_str(item, "key", ctx->job->out_key,
                                               ctx->job->out_len) == NULL
                || cJSON_AddTrueToObject(item, "newer_in_store") == NULL)
            {
                return NGX_ERROR;
            }

        } else if (rc == NGX_OK) {
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
        seq = ctx->zone->sh->slots[api->slot].turn_seq;
        ctx->zone->sh->slots[api->slot].turn_seq = 0;
        ngx_http_llama_session_turn_drop(ctx->zone, api->slot, seq,
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


static void
ngx_http_llama_session_api_resume(ngx_http_request_t *r)
{
    ngx_int_t                      rc;
    ngx_http_llama_session_api_t  *api;
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

    api = ctx->api;
    rc = api->route->handler(r, api);

    if (rc == NGX_DONE) {
        return;
    }

    ngx_http_finalize_request(r, rc);
}


/*
 * The folder is read again before a list, in a thread of the store's
 * (store_sync_start()): NGX_AGAIN, the request waits for it, at most the
 * zone's store_timeout=, and the route's handler runs again then
 */

static ngx_int_t
ngx_http_llama_session_api_sync(ngx_http_request_t *r,
    ngx_http_llama_session_api_t *api)
{
    ngx_int_t            rc;
    ngx_pool_cleanup_t  *cln;

    if (api->synced) {
        if (api->io) {
            ngx_http_llama_session_store_sync_end(api->io,
                                                  r->connection->log);
            api->io = NULL;
        }

        return NGX_OK;
    }

    api->synced = 1;

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NGX_OK;
    }

    cln->handler = ngx_http_llama_session_api_sync_end;
    cln->data = api;

    api->request = r;
    api->sync_ev.handler = ngx_http_llama_session_api_synced;
    api->sync_ev.data = api;
    api->sync_ev.log = r->connection->log;

    rc = ngx_http_llama_session_store_sync_start(api->zone,
                                                 r->connection->log,
                                                 &api->sync_ev, &api->io);
    if (rc != NGX_AGAIN) {
        return NGX_OK;
    }

    /* a client that leaves while the folder is read ends the request */

    r->main->count++;
    r->read_event_handler = ngx_http_test_reading;
    r->write_event_handler = ngx_http_request_empty_handler;

    return NGX_AGAIN;
}


static void
ngx_http_llama_session_api_synced(ngx_event_t *ev)
{
    ngx_int_t                      rc;
    ngx_connection_t              *c;
    ngx_http_request_t            *r;
    ngx_http_llama_session_api_t  *api;

    api = ev->data;
    r = api->request;
    c = r->connection;

    ngx_http_set_log_request(c->log, r);

    rc = api->route->handler(r, api);

    ngx_http_finalize_request(r, rc);
    ngx_http_run_posted_requests(c);
}


/* the request ends while the folder is read: the read ends in its thread */

static void
ngx_http_llama_session_api_sync_end(void *data)
{
    ngx_http_llama_session_api_t *api = data;

    if (api->sync_ev.timer_set) {
        ngx_del_timer(&api->sync_ev);
    }

    if (api->sync_ev.posted) {
        ngx_delete_posted_event(&api->sync_ev);
    }

    if (api->io) {
        ngx_http_llama_session_io_leave(api->io, api->sync_ev.log, NULL);
        api->io = NULL;
    }
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
