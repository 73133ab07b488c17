
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What llama-server's replies to the slot calls say (the calls are
 * call.c's): GET /slots, the actions, GET /props and GET /v1/models (the
 * fingerprint).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_slots.h"

#include <cjson/cJSON.h>
#include <openssl/evp.h>




static cJSON *ngx_http_llama_session_reply_json(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx);




static cJSON *
ngx_http_llama_session_reply_json(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx)
{
    cJSON  *json;

    if (ctx->job->call_reply == NULL) {
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: empty reply to a slot call");
        return NULL;
    }

    json = ngx_http_llama_session_json_tree(ctx->job->call_reply->pos,
                                 ctx->job->call_reply->last
                                     - ctx->job->call_reply->pos);

    if (json == NULL) {
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: the reply to a slot call is not "
                      "JSON of at most %d values: \"%*s\"",
                      NGX_HTTP_LLAMA_SESSION_JSON_VALUES,
                      ngx_min(ctx->job->call_reply->last
                              - ctx->job->call_reply->pos,
                              200),
                      ctx->job->call_reply->pos);
    }

    return json;
}


/* GET /slots: is the slot running, how many tokens does it hold */

ngx_int_t
ngx_http_llama_session_parse_slots(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t *processing)
{
    cJSON  *json, *slot, *id, *tokens, *task, *n_ctx;

    json = ngx_http_llama_session_reply_json(log, ctx);
    if (json == NULL) {
        return NGX_ERROR;
    }

    if (!cJSON_IsArray(json)) {
        cJSON_Delete(json);
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: GET /slots did not answer an array");
        return NGX_ERROR;
    }

    cJSON_ArrayForEach(slot, json) {
        id = cJSON_GetObjectItemCaseSensitive(slot, "id");

        if (!cJSON_IsNumber(id) || (ngx_uint_t) id->valueint
            != ctx->job->slot) {
            continue;
        }

        *processing = cJSON_IsTrue(
                  cJSON_GetObjectItemCaseSensitive(slot, "is_processing"));

        tokens = cJSON_GetObjectItemCaseSensitive(slot, "n_prompt_tokens");

        /*
         * a slot that never ran a task shows no n_prompt_tokens, even
         * right after a restore: what is in it is not known, -1, and is
         * erased before another session runs there
         */

        ctx->job->slot_tokens = (cJSON_IsNumber(tokens)
                                && tokens->valuedouble >= 0)
                           ? tokens->valueint : -1;

        /*
         * more tokens than the slot's context holds is a bogus reply: the
         * estimate of the slot's file (store_room()) would make room for
         * what no slot can hold; a full context is the most it holds
         */

        n_ctx = cJSON_GetObjectItemCaseSensitive(slot, "n_ctx");

        if (ctx->job->slot_tokens > 0 && cJSON_IsNumber(n_ctx)
            && n_ctx->valuedouble >= 1
            && tokens->valuedouble > n_ctx->valuedouble)
        {
            ngx_log_error(NGX_LOG_WARN, log, 0,
                          "llama_session: GET /slots says slot %ui holds "
                          "%.0f tokens, more than its context of %.0f: "
                          "taken as that", ctx->job->slot,
                          tokens->valuedouble, n_ctx->valuedouble);

            ctx->job->slot_tokens = (ngx_int_t) n_ctx->valuedouble;
        }

        task = cJSON_GetObjectItemCaseSensitive(slot, "id_task");
        ctx->job->slot_task = cJSON_IsNumber(task) ? task->valueint : -1;

        /* a draft model beside the target: restores erase first (call.c) */

        ctx->job->speculative = cJSON_IsTrue(
                    cJSON_GetObjectItemCaseSensitive(slot, "speculative"));

        if (ctx->job->speculative
            && (!ctx->zone->sh->speculative
                || ngx_memcmp(ctx->zone->sh->speculative_fp, ctx->job->fp,
                              NGX_HTTP_LLAMA_SESSION_FP_LEN) != 0))
        {
            /* for the cost of a restore (cost.c); one writer's bytes */
            ngx_memcpy(ctx->zone->sh->speculative_fp, ctx->job->fp,
                       NGX_HTTP_LLAMA_SESSION_FP_LEN);
            ctx->zone->sh->speculative = 1;
        }

        if (ctx->job->speculative && !ctx->zone->sh->speculative_said) {
            ctx->zone->sh->speculative_said = 1;
            ngx_log_error(NGX_LOG_NOTICE, log, 0,
                          "llama_session: llama-server runs speculative "
                          "decoding (a draft model) for zone \"%V\": its "
                          "slot files hold the target model's context "
                          "alone, so each restore erases the slot first "
                          "(a restore over a longer draft context fails "
                          "every request with 500), and the draft starts "
                          "over after it (docs/models.md)", &ctx->zone->name);
        }

        cJSON_Delete(json);

        return NGX_OK;
    }

    cJSON_Delete(json);

    /* llama-server came back with fewer slots: NGX_DECLINED */

    ngx_log_error(NGX_LOG_WARN, log, 0,
                  "llama_session: llama-server has no slot %ui (now): does "
                  "llama_session_zone's slots= match llama-server's -np?",
                  ctx->job->slot);

    return NGX_DECLINED;
}


/* the reply to save, restore or erase */

ngx_int_t
ngx_http_llama_session_parse_action(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t *tokens, off_t *bytes,
    double *ms)
{
    cJSON  *json, *item, *timings;

    json = ngx_http_llama_session_reply_json(log, ctx);
    if (json == NULL) {
        return NGX_ERROR;
    }

    *tokens = 0;
    *bytes = 0;
    *ms = 0;

    item = cJSON_GetObjectItemCaseSensitive(json, "n_saved");
    if (item == NULL) {
        item = cJSON_GetObjectItemCaseSensitive(json, "n_restored");
    }
    if (item == NULL) {
        item = cJSON_GetObjectItemCaseSensitive(json, "n_erased");
    }

    if (!cJSON_IsNumber(item)) {
        cJSON_Delete(json);
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: unexpected reply to a slot call: "
                      "\"%*s\"",
                      ngx_min(ctx->job->call_reply->last
                              - ctx->job->call_reply->pos,
                              200),
                      ctx->job->call_reply->pos);
        return NGX_ERROR;
    }

    *tokens = (item->valuedouble > 0 && item->valuedouble < 1e15)
              ? (ngx_uint_t) item->valuedouble : 0;

    item = cJSON_GetObjectItemCaseSensitive(json, "n_written");
    if (item == NULL) {
        item = cJSON_GetObjectItemCaseSensitive(json, "n_read");
    }

    if (cJSON_IsNumber(item) && item->valuedouble > 0
        && item->valuedouble < 1e15)
    {
        *bytes = (off_t) item->valuedouble;
    }

    timings = cJSON_GetObjectItemCaseSensitive(json, "timings");

    if (cJSON_IsObject(timings)) {
        item = cJSON_GetObjectItemCaseSensitive(timings, "save_ms");
        if (item == NULL) {
            item = cJSON_GetObjectItemCaseSensitive(timings, "restore_ms");
        }

        if (cJSON_IsNumber(item) && item->valuedouble >= 0
            && item->valuedouble < 1e9)
        {
            *ms = item->valuedouble;
        }
    }

    cJSON_Delete(json);

    return NGX_OK;
}


/*
 * GET /props: the backend's configuration.  A saved state fits only the
 * model and KV layout that wrote it, so every file name carries a
 * fingerprint: model path, slot context, slot count, the model's type and
 * llama-server's build from /props, then what GET /v1/models says of the
 * model (ngx_http_llama_session_parse_models).  What stays outside
 * (unified KV, -fa, cache types) makes a restore fail with a clean 400.
 */

ngx_int_t
ngx_http_llama_session_parse_props(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char  *p;
    cJSON   *json, *path, *slots, *settings, *n_ctx, *ftype, *build, *role;

    json = ngx_http_llama_session_reply_json(r->connection->log, ctx);
    if (json == NULL) {
        return NGX_ERROR;
    }

    role = cJSON_GetObjectItemCaseSensitive(json, "role");

    if (cJSON_IsString(role) && ngx_strcmp(role->valuestring, "router") == 0)
    {
        /*
         * llama-server's router (no -m): its models come and go with their
         * slots; a zone drives the slots of one model
         */

        cJSON_Delete(json);
        ctx->job->faces_router = 1;
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: zone \"%V\" faces llama-server's "
                      "router mode: give each of the router's models a "
                      "zone with \"model=\", or give the zone "
                      "\"models=\" for all of them (docs/scaling.md)",
                      &ctx->zone->name);
        return NGX_ERROR;
    }

    path = cJSON_GetObjectItemCaseSensitive(json, "model_path");
    slots = cJSON_GetObjectItemCaseSensitive(json, "total_slots");
    settings = cJSON_GetObjectItemCaseSensitive(json,
                                               "default_generation_settings");
    n_ctx = cJSON_GetObjectItemCaseSensitive(settings, "n_ctx");
    ftype = cJSON_GetObjectItemCaseSensitive(json, "model_ftype");
    build = cJSON_GetObjectItemCaseSensitive(json, "build_info");

    if (!cJSON_IsString(path) || !cJSON_IsNumber(slots)
        || !cJSON_IsNumber(n_ctx) || slots->valuedouble < 1
        || slots->valuedouble > 1e6 || n_ctx->valuedouble < 0
        || n_ctx->valuedouble > 1e12)
    {
        cJSON_Delete(json);
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: GET /props lacks model_path, "
                      "total_slots or default_generation_settings.n_ctx");
        return NGX_ERROR;
    }

    ctx->job->props_slots = (ngx_uint_t) slots->valuedouble;
    ctx->job->props_n_ctx = (ngx_uint_t) n_ctx->valuedouble;

    ctx->job->props_model.len = ngx_min(ngx_strlen(path->valuestring),
                                   NGX_HTTP_LLAMA_SESSION_PATH_SHOW);
    ctx->job->props_model.data = ngx_pnalloc(r->pool,
                                             ctx->job->props_model.len);
    if (ctx->job->props_model.data == NULL) {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    ngx_memcpy(ctx->job->props_model.data, path->valuestring,
               ctx->job->props_model.len);

    ctx->job->props_text.data = ngx_pnalloc(r->pool, 1024);
    if (ctx->job->props_text.data == NULL) {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    /* the model path last: a path too long for the text cuts only itself */

    p = ngx_snprintf(ctx->job->props_text.data, 1024, "%ui%Z%ui%Z%*s%Z%*s%Z%s",
                     ctx->job->props_n_ctx, ctx->job->props_slots,
                     cJSON_IsString(ftype)
                     ? ngx_min(ngx_strlen(ftype->valuestring), 64) : 0,
                     cJSON_IsString(ftype) ? ftype->valuestring : "",
                     cJSON_IsString(build)
                     ? ngx_min(ngx_strlen(build->valuestring), 128) : 0,
                     cJSON_IsString(build) ? build->valuestring : "",
                     path->valuestring);

    ctx->job->props_text.len = p - ctx->job->props_text.data;

    /* fewer or more slots than the zone's: said once, by set_fingerprint */

    cJSON_Delete(json);

    return NGX_OK;
}


/*
 * GET /v1/models: the model's size, parameters, vocabulary and shape join
 * /props in the fingerprint, so a requantized or fine-tuned model at the
 * same path never gets a file of the other.  A backend without the reply
 * (an error, no "meta") keeps the fingerprint of /props alone.
 */

ngx_int_t
ngx_http_llama_session_parse_models(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char        fp[NGX_HTTP_LLAMA_SESSION_FP_LEN], text[2048], *p, *last;
    u_char        hash[32];
    cJSON        *json, *data, *model, *meta, *item, *id;
    ngx_uint_t    i;
    unsigned int  hlen;

    static const char  *fields[] = {
        "n_vocab", "n_ctx_train", "n_embd", "n_params", "size", "ftype",
        "vocab_type", NULL
    };

    if (ctx->job->props_text.len == 0) {
        return NGX_ERROR;
    }

    p = ngx_cpymem(text, ctx->job->props_text.data,
                   ngx_min(ctx->job->props_text.len, 1024));
    last = text + sizeof(text);

    json = (ctx->job->call_status == NGX_HTTP_OK)
           ? ngx_http_llama_session_reply_json(r->connection->log, ctx)
           : NULL;

    data = cJSON_GetObjectItemCaseSensitive(json, "data");
    model = NULL;

    if (cJSON_IsArray(data) && ctx->zone->model.len) {
        /* the router lists every model: this zone's by its id */

        cJSON_ArrayForEach(item, data) {
            id = cJSON_GetObjectItemCaseSensitive(item, "id");

            if (cJSON_IsString(id)
                && ngx_strlen(id->valuestring) == ctx->zone->model.len
                && ngx_strncmp(id->valuestring, ctx->zone->model.data,
                               ctx->zone->model.len) == 0)
            {
                model = item;
                break;
            }
        }

    } else if (cJSON_IsArray(data)) {
        model = cJSON_GetArrayItem(data, 0);
    }

    meta = cJSON_GetObjectItemCaseSensitive(model, "meta");

    ctx->job->props_n_embd = 0;

    if (cJSON_IsObject(meta)) {
        item = cJSON_GetObjectItemCaseSensitive(meta, "n_embd");

        if (cJSON_IsNumber(item) && item->valuedouble > 0
            && item->valuedouble < 1e9)
        {
            /* to tell the model's file from another's (gguf.c) */
            ctx->job->props_n_embd = (uint64_t) item->valuedouble;
        }

        for (i = 0; fields[i]; i++) {
            item = cJSON_GetObjectItemCaseSensitive(meta, fields[i]);

            if (cJSON_IsNumber(item) && item->valuedouble > -1e15
                && item->valuedouble < 1e15)
            {
                p = ngx_slprintf(p, last, "%Z%s=%.0f", fields[i],
                                 item->valuedouble);

            } else if (cJSON_IsNumber(item)) {
                p = ngx_slprintf(p, last, "%Z%s=%s", fields[i],
                                 item->valuedouble > 0 ? "big" : "-big");

            } else if (cJSON_IsString(item)) {
                p = ngx_slprintf(p, last, "%Z%s=%*s", fields[i],
                                 ngx_min(ngx_strlen(item->valuestring), 64),
                                 item->valuestring);

            } else if (cJSON_IsBool(item)) {
                p = ngx_slprintf(p, last, "%Z%s=%d", fields[i],
                                 cJSON_IsTrue(item));
            }
        }

    } else {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: GET /v1/models answered %i without "
                      "the model's \"meta\": file names carry what /props "
                      "says only", ctx->job->call_status);
    }

    cJSON_Delete(json);

    if (EVP_Digest(text, p - text, hash, &hlen, EVP_sha256(), NULL) != 1) {
        return NGX_ERROR;
    }

    ngx_hex_dump(fp, hash, NGX_HTTP_LLAMA_SESSION_FP_LEN / 2);

    ngx_http_llama_session_set_fingerprint(ctx->zone, ctx->job, fp,
                                           ctx->job->props_n_ctx,
                                           ctx->job->props_slots,
                                           &ctx->job->props_model);

    return NGX_OK;
}


/*
 * Did the backend fail, rather than answer the call: no answer, its API
 * key refused, the path not proxied to it, or nginx's proxy errors.  The
 * request ends with 502 (or 503 while llama-server loads) then; any other
 * status is llama-server's answer to the call itself.
 */

ngx_uint_t
ngx_http_llama_session_backend_failed(ngx_int_t status)
{
    switch (status) {

    case 0:
    case NGX_HTTP_UNAUTHORIZED:
    case NGX_HTTP_FORBIDDEN:
    case NGX_HTTP_NOT_FOUND:
    case NGX_HTTP_BAD_GATEWAY:
    case NGX_HTTP_SERVICE_UNAVAILABLE:
    case NGX_HTTP_GATEWAY_TIME_OUT:
        return 1;

    default:
        return 0;
    }
}
