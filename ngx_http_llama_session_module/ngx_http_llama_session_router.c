
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * llama-server's router mode (no -m: --models-dir or --models-preset).
 * The router runs each model as a child llama-server with its own slots,
 * loads a model on demand and unloads the least recently used one past
 * --models-max, its slots and their caches with it.  A zone drives one
 * model (model=): every slot call names it and never loads it (slots.c,
 * idle.c); the zones of one router share its --slot-save-path, each
 * session's file starting with "<zone>@" (store.c); "llama_session a b;"
 * picks the zone by the request's "model".
 *
 * Before a request runs on its model (it holds its slot), the router's
 * GET /models says whether the model is up:
 *
 *   loaded           the request goes on
 *   sleeping         its slots are unknown (the router may have freed
 *                    them), never saved, never trusted; the request goes on
 *   anything else    its slots are empty (files stay); the model is
 *                    loaded by the module, one switch at a time in the
 *                    router's group of zones: when the router is at its
 *                    max_instances, the module unloads the model it would
 *                    unload itself (the least recently used of the zones'
 *                    loaded models) after saving that model's changed
 *                    sessions (its idle saver does it, at once), with no
 *                    request of it running and none let in until the
 *                    router says it is gone; then POST /models/load and
 *                    GET /models until the model is loaded.
 *
 * A model unloaded behind the module's back (another client, a crash)
 * is seen here or by a slot call's 400: its slots are empty then, and the
 * turns since its sessions' last saves are lost (logged, counted).
 *
 * A zone of models= (models.c) whose set drives no zone of the request's
 * model yet: before its slot, the router's GET /models must list the
 * model, then a zone of the set is given it (ngx_http_llama_session_
 * route_bind()).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_error.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_models.h"
#include "ngx_http_llama_session_router.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_slots.h"

#include <cjson/cJSON.h>


#define NGX_HTTP_LLAMA_SESSION_ROUTER_POLL      50
#define NGX_HTTP_LLAMA_SESSION_ROUTER_POLL_MAX  400

/* a model's status in the router's GET /models */
#define NGX_HTTP_LLAMA_SESSION_MODEL_NONE       0   /* not listed */
#define NGX_HTTP_LLAMA_SESSION_MODEL_LOADED     1
#define NGX_HTTP_LLAMA_SESSION_MODEL_SLEEPING   2
#define NGX_HTTP_LLAMA_SESSION_MODEL_LOADING    3
#define NGX_HTTP_LLAMA_SESSION_MODEL_DOWN       4   /* unloaded, failed */


static ngx_int_t ngx_http_llama_session_router_models(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_switch_take(
    ngx_http_llama_session_ctx_t *ctx);
static void ngx_http_llama_session_victim_end(
    ngx_http_llama_session_ctx_t *ctx);
static void ngx_http_llama_session_switch_end(
    ngx_http_llama_session_ctx_t *ctx);
static ngx_uint_t ngx_http_llama_session_victim_clean(
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_zone_t *zone);
static ngx_int_t ngx_http_llama_session_router_props(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_router_switch(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t running,
    ngx_http_llama_session_zone_t *victim);
static ngx_int_t ngx_http_llama_session_router_poll(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_router_done(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_router_fail(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, const char *what);
static void ngx_http_llama_session_router_reset(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t state, const char *why);
static ngx_int_t ngx_http_llama_session_router_listed(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_router_list(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, cJSON **json, cJSON **data);
static ngx_http_llama_session_zone_t *ngx_http_llama_session_group_zone(
    ngx_http_llama_session_zone_t *zone, const char *model);


/*
 * The request's model is none of the set's yet: the router's GET /models
 * first (handler.c runs it in ST_BIND), then ngx_http_llama_session_
 * router_listed()
 */

ngx_int_t
ngx_http_llama_session_route_bind(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    if (ctx->job->call != NGX_HTTP_LLAMA_SESSION_CALL_ROUTER) {
        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_ROUTER,
                                           NULL, 0);
    }

    if (!ctx->job->call_done) {
        return NGX_AGAIN;
    }

    ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;

    return ngx_http_llama_session_router_listed(r, ctx);
}


/*
 * GET /models is in: a model the router lists gets a zone of the set;
 * NGX_OK: ctx->zone is the model's, the request goes on to its slot
 */

static ngx_int_t
ngx_http_llama_session_router_listed(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    cJSON                          *json, *data, *item, *id;
    ngx_int_t                       rc;
    ngx_uint_t                      listed;
    ngx_http_llama_session_zone_t  *lead, *zone;

    lead = ctx->zone->models;

    rc = ngx_http_llama_session_router_list(r, ctx, &json, &data);
    if (rc != NGX_OK) {
        return ngx_http_llama_session_router_fail(r, ctx,
                                   (rc == NGX_DECLINED) ? "GET /models" : NULL);
    }

    listed = 0;

    cJSON_ArrayForEach(item, data) {
        id = cJSON_GetObjectItemCaseSensitive(item, "id");

        if (cJSON_IsString(id)
            && ngx_strlen(id->valuestring) == ctx->model.len
            && ngx_strncmp(id->valuestring, ctx->model.data, ctx->model.len)
               == 0)
        {
            listed = 1;
            break;
        }
    }

    cJSON_Delete(json);

    if (!listed) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: llama-server's router has no model "
                      "\"%V\" (zone \"%V\"): refused", &ctx->model,
                      &lead->models_name);

        ngx_http_llama_session_stat(&ctx->zone->sh->stats.refused);

        return ngx_http_llama_session_error(r, ctx, NGX_HTTP_BAD_REQUEST,
                                            "invalid_request_error",
                                            "the request's model is not one "
                                            "this server keeps sessions for",
                                            0);
    }

    zone = ngx_http_llama_session_models_take(lead, ctx->model.data,
                                            ctx->model.len,
                                            r->connection->log);

    if (zone == NULL) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: zone \"%V\" keeps the sessions of %ui "
                      "models already, its \"models=\": the router's model "
                      "\"%V\" is refused (raise models=, or give the model "
                      "a zone of its own with model=)", &lead->models_name,
                      ngx_http_llama_session_models_size(lead), &ctx->model);

        ngx_http_llama_session_stat(&ctx->zone->sh->stats.refused);

        return ngx_http_llama_session_error(r, ctx,
                                            NGX_HTTP_SERVICE_UNAVAILABLE,
                                            "unavailable_error",
                                            "the server keeps sessions for "
                                            "no more models", 0);
    }

    ctx->zone = zone;
    ctx->bind = 0;

    ngx_http_llama_session_key_prefix(ctx);

    return NGX_OK;
}


/* the request holds its slot: is its model up?  handler.c's plan */

ngx_int_t
ngx_http_llama_session_route(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_ROUTER);

    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_ROUTER,
                                       NULL, 0);
}


/* a call of the router step is done, or its pause is over */

ngx_int_t
ngx_http_llama_session_routed(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t  call;

    call = ctx->job->call;
    ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;

    switch (call) {

    case NGX_HTTP_LLAMA_SESSION_CALL_ROUTER:
        return ngx_http_llama_session_router_models(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_CALL_RPROPS:
        return ngx_http_llama_session_router_props(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_CALL_LOAD:

        /* 400: "model is already running" (another client's), as good */

        if (ctx->job->call_status != NGX_HTTP_OK
            && ctx->job->call_status != NGX_HTTP_BAD_REQUEST)
        {
            return ngx_http_llama_session_router_fail(r, ctx,
                                                      "POST /models/load");
        }

        return ngx_http_llama_session_router_poll(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_CALL_UNLOAD:

        /* 400: "model is not running" already, which is as good */

        if (ctx->job->call_status != NGX_HTTP_OK
            && ctx->job->call_status != NGX_HTTP_BAD_REQUEST)
        {
            return ngx_http_llama_session_router_fail(r, ctx,
                                                      "POST /models/unload");
        }

        (void) ngx_http_llama_session_model_reset(ctx->route->victim, NULL,
                                     -1, NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY);

        ngx_atomic_fetch_add(&ctx->route->victim->sh->stats.unloads, 1);

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: the router's model \"%V\" of zone "
                      "\"%V\" is unloaded for \"%V\", its sessions saved",
                      &ctx->route->victim->model, &ctx->route->victim->name,
                      &ctx->zone->model);

        return ngx_http_llama_session_router_poll(r, ctx);

    default:
        /* a pause is over: look again */
        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_ROUTER,
                                           NULL, 0);
    }
}


/* GET /models: the model's status, how many run, the victim if needed */

static ngx_int_t
ngx_http_llama_session_router_models(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    cJSON                          *json, *data, *item, *id, *status, *value;
    cJSON                          *failed;
    ngx_int_t                       rc;
    ngx_uint_t                      running, own, own_failed, victim_running;
    ngx_msec_t                      used;
    ngx_http_llama_session_zone_t  *zone, *victim;

    rc = ngx_http_llama_session_router_list(r, ctx, &json, &data);
    if (rc != NGX_OK) {
        return ngx_http_llama_session_router_fail(r, ctx,
                                   (rc == NGX_DECLINED) ? "GET /models" : NULL);
    }

    /*
     * "loaded", "loading", "sleeping": running, as the router counts them
     * against --models-max; the victim is the least recently used of the
     * group's loaded models, as the router would choose
     */

    running = 0;
    own = NGX_HTTP_LLAMA_SESSION_MODEL_NONE;
    own_failed = 0;
    victim = NULL;
    victim_running = 0;
    used = 0;

    cJSON_ArrayForEach(item, data) {
        id = cJSON_GetObjectItemCaseSensitive(item, "id");
        status = cJSON_GetObjectItemCaseSensitive(item, "status");
        value = cJSON_GetObjectItemCaseSensitive(status, "value");
        failed = cJSON_GetObjectItemCaseSensitive(status, "failed");

        if (!cJSON_IsString(id) || !cJSON_IsString(value)) {
            continue;
        }

        zone = ngx_http_llama_session_group_zone(ctx->zone, id->valuestring);

        if (ngx_strcmp(value->valuestring, "loaded") == 0
            || ngx_strcmp(value->valuestring, "loading") == 0
            || ngx_strcmp(value->valuestring, "sleeping") == 0)
        {
            running++;

            if (zone && zone == ctx->route->victim) {
                victim_running = 1;
            }
        }

        if (zone == ctx->zone) {
            own = (ngx_strcmp(value->valuestring, "loaded") == 0)
                  ? NGX_HTTP_LLAMA_SESSION_MODEL_LOADED
                  : (ngx_strcmp(value->valuestring, "sleeping") == 0)
                    ? NGX_HTTP_LLAMA_SESSION_MODEL_SLEEPING
                  : (ngx_strcmp(value->valuestring, "loading") == 0)
                    ? NGX_HTTP_LLAMA_SESSION_MODEL_LOADING
                    : NGX_HTTP_LLAMA_SESSION_MODEL_DOWN;

            own_failed = cJSON_IsTrue(failed);
            continue;
        }

        if (zone && ngx_strcmp(value->valuestring, "loaded") == 0
            && (victim == NULL || zone->sh->model_used < used))
        {
            victim = zone;
            used = zone->sh->model_used;
        }
    }

    cJSON_Delete(json);

    switch (own) {

    case NGX_HTTP_LLAMA_SESSION_MODEL_LOADED:
        return ngx_http_llama_session_router_done(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_MODEL_SLEEPING:
        /* the router may have let its slots go */
        ngx_http_llama_session_router_reset(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN,
                                            "sleeps");
        return ngx_http_llama_session_router_done(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_MODEL_LOADING:
        /* a new child, empty slots: wait for it */
        ngx_http_llama_session_router_reset(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY,
                                            "is loading");
        return ngx_http_llama_session_router_poll(r, ctx);

    case NGX_HTTP_LLAMA_SESSION_MODEL_NONE:
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: llama-server's router has no model "
                      "\"%V\" (zone \"%V\"): check model= against its "
                      "GET /models", &ctx->zone->model, &ctx->zone->name);
        return ngx_http_llama_session_router_fail(r, ctx, NULL);

    default:
        break;
    }

    /* unloaded (or failed, or downloading): its slots are empty */

    ngx_http_llama_session_router_reset(r, ctx,
                                        NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY,
                                        "is not running");

    if (ctx->route->load_sent && own_failed) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: llama-server's router failed to load "
                      "the model \"%V\" (zone \"%V\"): see its log",
                      &ctx->zone->model, &ctx->zone->name);
        return ngx_http_llama_session_router_fail(r, ctx, NULL);
    }

    if (ctx->route->load_sent) {
        /* on its way */
        return ngx_http_llama_session_router_poll(r, ctx);
    }

    if (ngx_http_llama_session_switch_take(ctx) != NGX_OK) {
        /* another request switches the router's models: look again */
        return ngx_http_llama_session_router_poll(r, ctx);
    }

    if (ctx->route->victim && !victim_running) {
        /* the model unloaded for this one is gone: its zone may go on */
        ngx_http_llama_session_victim_end(ctx);
        ngx_http_llama_session_wake_local();
    }

    if (!ctx->zone->group->sh->router_known) {
        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_RPROPS,
                                           NULL, 0);
    }

    return ngx_http_llama_session_router_switch(r, ctx, running, victim);
}


/*
 * The request has the group's turn and its model is not running: load
 * it, after unloading the victim when the router is full.
 */

static ngx_int_t
ngx_http_llama_session_router_switch(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t running,
    ngx_http_llama_session_zone_t *victim)
{
    ngx_uint_t  max;

    max = ctx->zone->group->sh->router_max;

    if (max == 0 || running < max
        || (victim == NULL && ctx->route->victim == NULL))
    {
        /*
         * room for it; or the router's models that run are none of the
         * group's (the router chooses among them, nothing of the module's
         * is lost)
         */

        ctx->route->load_sent = 1;

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_LOAD,
                                           NULL, 0);
    }

    if (ctx->route->victim == NULL) {
        ctx->route->victim = victim;
        ctx->route->unload_sent = 0;

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: the router runs %ui of %ui models: "
                      "\"%V\" (zone \"%V\") is saved and unloaded for \"%V\"",
                      running, max, &victim->model, &victim->name,
                      &ctx->zone->model);
    }

    if (ctx->route->unload_sent) {
        /* until the router says it is gone */
        return ngx_http_llama_session_router_poll(r, ctx);
    }

    if (!ngx_http_llama_session_victim_clean(ctx, ctx->route->victim)) {
        /* its requests end, its idle saver saves what changed */
        return ngx_http_llama_session_router_poll(r, ctx);
    }

    ctx->route->unload_sent = 1;

    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_UNLOAD,
                                       NULL, 0);
}


/* the router's GET /props: max_instances, once for the group */

static ngx_int_t
ngx_http_llama_session_router_props(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    cJSON                        *json, *role, *max;
    ngx_http_llama_session_sh_t  *sh;

    if (ctx->job->call_status != NGX_HTTP_OK || ctx->job->call_reply == NULL) {
        return ngx_http_llama_session_router_fail(r, ctx, "GET /props");
    }

    json = ngx_http_llama_session_json_tree(ctx->job->call_reply->pos,
                                 ctx->job->call_reply->last
                                     - ctx->job->call_reply->pos);

    role = cJSON_GetObjectItemCaseSensitive(json, "role");
    max = cJSON_GetObjectItemCaseSensitive(json, "max_instances");

    if (!cJSON_IsString(role) || ngx_strcmp(role->valuestring, "router") != 0
        || !cJSON_IsNumber(max) || max->valuedouble > 1e6)
    {
        cJSON_Delete(json);
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: zone \"%V\" has \"%s\" and the "
                      "backend's GET /props is not a router's "
                      "(role: router, max_instances)", &ctx->zone->name,
                      ctx->zone->models ? "models=" : "model=");
        return ngx_http_llama_session_router_fail(r, ctx, NULL);
    }

    sh = ctx->zone->group->sh;

    sh->router_max = (max->valuedouble > 0) ? (ngx_uint_t) max->valuedouble
                                            : 0;
    sh->router_known = 1;

    cJSON_Delete(json);

    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_ROUTER,
                                       NULL, 0);
}


/* GET /models again after a pause, until the deadline */

static ngx_int_t
ngx_http_llama_session_router_poll(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_msec_t  delay;

    if ((ngx_msec_int_t) (ngx_current_msec - ctx->deadline) >= 0) {
        if (ctx->route->victim) {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "llama_session: the router's model \"%V\" (zone "
                          "\"%V\") was not up within "
                          "llama_session_wait_timeout: \"%V\" was to be "
                          "unloaded for it, after its sessions' saves "
                          "(see the idle saves' errors)", &ctx->zone->model,
                          &ctx->zone->name, &ctx->route->victim->model);

        } else {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "llama_session: the router's model \"%V\" (zone "
                          "\"%V\") was not up within "
                          "llama_session_wait_timeout", &ctx->zone->model,
                          &ctx->zone->name);
        }

        ngx_http_llama_session_route_end(ctx);
        ngx_http_llama_session_stat(&ctx->zone->sh->stats.wait_timeouts);

        return ngx_http_llama_session_error(r, ctx,
                                  NGX_HTTP_SERVICE_UNAVAILABLE,
                                  "unavailable_error",
                                  "the model server is switching models, "
                                  "retry later", 1);
    }

    delay = NGX_HTTP_LLAMA_SESSION_ROUTER_POLL
            << ngx_min(ctx->route->router_polls, 3);
    delay = ngx_min(delay, NGX_HTTP_LLAMA_SESSION_ROUTER_POLL_MAX);
    ctx->route->router_polls++;

    return ngx_http_llama_session_sleep(r, ctx,
                                        ngx_min(delay,
                                                (ngx_msec_t) (ctx->deadline
                                                        - ngx_current_msec)));
}


/* the model is up: the swap goes on from what its slot holds */

static ngx_int_t
ngx_http_llama_session_router_done(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_route_end(ctx);

    ctx->route->routed = 1;
    ctx->zone->sh->model_used = ngx_current_msec;

    if (ctx->route->model_reset) {
        /*
         * the slot holds nothing of the session the zone thought, and the
         * model may be another file under its name: the fingerprint again
         */

        ngx_http_llama_session_slot_lost(ctx);

        ctx->job->slot_state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        ctx->job->slot_tokens = 0;
        ctx->job->slot_has_base = 0;
    }

    /* the handler goes on with its plan */
    return NGX_OK;
}


static ngx_int_t
ngx_http_llama_session_router_fail(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, const char *what)
{
    ngx_http_llama_session_route_end(ctx);

    if (what) {
        return ngx_http_llama_session_backend_error(r, ctx, what);
    }

    ngx_http_llama_session_stat(&ctx->zone->sh->stats.backend_errors);

    return ngx_http_llama_session_error(r, ctx, NGX_HTTP_BAD_GATEWAY,
                                        "server_error",
                                        "the model server cannot run this "
                                        "model now", 0);
}


/* the model is not up as the zone thought: its slots are reset, once */

static void
ngx_http_llama_session_router_reset(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t state, const char *why)
{
    ngx_uint_t  lost;

    if (ctx->route->model_reset) {
        return;
    }

    ctx->route->model_reset = 1;

    lost = ngx_http_llama_session_model_reset(ctx->zone, ctx->job,
                           (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_HIT)
                           ? (ngx_int_t) ctx->hit_dirty : -1, state);

    if (lost) {
        ngx_atomic_fetch_add(&ctx->zone->sh->stats.model_lost, lost);

        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: the router's model \"%V\" (zone "
                      "\"%V\") %s behind the module's back: %ui sessions "
                      "lost their turns since their last save",
                      &ctx->zone->model, &ctx->zone->name, why, lost);

    } else {
        ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "llama_session: the router's model \"%V\" %s",
                       &ctx->zone->model, why);
    }
}


/* the router step ends (done, failed, or the request went): turns back */

void
ngx_http_llama_session_route_end(ngx_http_llama_session_ctx_t *ctx)
{
    if (ctx->route->switching || ctx->route->victim) {
        ngx_http_llama_session_switch_end(ctx);

        /* this worker's requests of the victim, or of the group, go on */
        ngx_http_llama_session_wake_local();
    }
}


/*
 * The router's GET /models reply: its "data" list (json: the tree to
 * delete); NGX_DECLINED: the call failed, NGX_ABORT: no list (logged)
 */

static ngx_int_t
ngx_http_llama_session_router_list(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, cJSON **json, cJSON **data)
{
    if (ngx_http_llama_session_backend_failed(ctx->job->call_status)
        || ctx->job->call_status != NGX_HTTP_OK || ctx->job->call_reply == NULL)
    {
        return NGX_DECLINED;
    }

    *json = ngx_http_llama_session_json_tree(ctx->job->call_reply->pos,
                                  ctx->job->call_reply->last
                                      - ctx->job->call_reply->pos);

    *data = cJSON_GetObjectItemCaseSensitive(*json, "data");

    if (cJSON_IsArray(*data)) {
        return NGX_OK;
    }

    cJSON_Delete(*json);

    ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                  "llama_session: GET /models did not answer a list of "
                  "models: zone \"%V\" has \"%s\" and needs llama-server's "
                  "router mode", &ctx->zone->name,
                  ctx->zone->models ? "models=" : "model=");

    return NGX_ABORT;
}


/* the group's zone of a model, by the router's name for it */

static ngx_http_llama_session_zone_t *
ngx_http_llama_session_group_zone(ngx_http_llama_session_zone_t *zone,
    const char *model)
{
    size_t                          len;
    ngx_http_llama_session_zone_t  *z;

    len = ngx_strlen(model);

    for (z = zone->group; z; z = z->group_next) {
        (void) ngx_http_llama_session_models_adopt(z);

        if (z->model.len == len
            && ngx_strncmp(z->model.data, model, len) == 0)
        {
            return z;
        }
    }

    return NULL;
}



/*
 * One model switch at a time in a router's group of zones: the turn is
 * kept in the group's first zone.  NGX_OK: the request has it;
 * NGX_AGAIN: another request's switch runs.
 */

static ngx_int_t
ngx_http_llama_session_switch_take(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t                       rc;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *lead;

    if (ctx->route->switching) {
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
        sh->switch_start = ngx_http_llama_session_self();
        sh->switch_seq = ++sh->switch_next;

        ctx->route->switch_seq = sh->switch_seq;
        ctx->route->switching = 1;

        rc = NGX_OK;
    }

    ngx_shmtx_unlock(&lead->shpool->mutex);

    return rc;
}


/* the victim of the switch is gone (or the switch ends): its zone goes on */

static void
ngx_http_llama_session_victim_end(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *victim;

    victim = ctx->route->victim;

    if (victim == NULL) {
        return;
    }

    ctx->route->victim = NULL;
    ctx->route->unload_sent = 0;
    sh = victim->sh;

    ngx_shmtx_lock(&victim->shpool->mutex);

    if (sh->unloading == ngx_pid && sh->unloading_seq
        == ctx->route->switch_seq) {
        sh->unloading = 0;
        sh->unloading_start = 0;
    }

    ngx_shmtx_unlock(&victim->shpool->mutex);
}


/* the switch ends: the group's turn and the victim's flag are given back */

static void
ngx_http_llama_session_switch_end(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *lead;

    ngx_http_llama_session_victim_end(ctx);

    if (!ctx->route->switching) {
        return;
    }

    ctx->route->switching = 0;

    lead = ctx->zone->group;
    sh = lead->sh;

    ngx_shmtx_lock(&lead->shpool->mutex);

    if (sh->switch_pid == ngx_pid && sh->switch_seq == ctx->route->switch_seq) {
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

static ngx_uint_t
ngx_http_llama_session_victim_clean(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_zone_t *zone)
{
    ngx_uint_t                      i, clean;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (!(sh->unloading == ngx_pid && sh->unloading_seq
          == ctx->route->switch_seq)) {
        sh->unloading = ngx_pid;
        sh->unloading_start = ngx_http_llama_session_self();
        sh->unloading_seq = ctx->route->switch_seq;
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
