
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Slot calls: subrequests to the operator's internal location
 * (llama_session_slots_uri), each with its own method, JSON body and
 * headers, so nothing of the client's request (Content-Length,
 * Authorization, body) leaks into them.  A body filter captures the reply.
 */


#include "ngx_http_llama_session_module.h"

#include <cjson/cJSON.h>
#include <openssl/evp.h>


#define NGX_HTTP_LLAMA_SESSION_REPLY_MAX  (4 * 1024 * 1024)


static ngx_int_t ngx_http_llama_session_call_done(ngx_http_request_t *sr,
    void *data, ngx_int_t rc);
static ngx_int_t ngx_http_llama_session_capture_filter(ngx_http_request_t *r,
    ngx_chain_t *in);
static ngx_int_t ngx_http_llama_session_capture_append(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, u_char *data, size_t size);
static cJSON *ngx_http_llama_session_reply_json(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx);


static ngx_http_output_body_filter_pt  ngx_http_next_body_filter;


static ngx_str_t  ngx_http_llama_session_actions[] = {
    ngx_null_string,
    ngx_null_string,
    ngx_string("action=save"),
    ngx_string("action=restore"),
    ngx_string("action=erase"),
    ngx_null_string,
    ngx_null_string,
    ngx_null_string,
    ngx_null_string,
    ngx_null_string,
    ngx_null_string,
    ngx_null_string
};


/* the backend's path of each call; none: "/slots/N" (or the prime's) */

static ngx_str_t  ngx_http_llama_session_paths[] = {
    ngx_null_string,
    ngx_string("/slots"),
    ngx_null_string,
    ngx_null_string,
    ngx_null_string,
    ngx_string("/props"),
    ngx_string("/v1/models"),
    ngx_null_string,
    ngx_string("/models"),
    ngx_string("/props"),
    ngx_string("/models/load"),
    ngx_string("/models/unload")
};


/*
 * Router mode: a call that looks or saves never loads a model (the
 * router would unload another for it); a restore does, as the request
 * needs the model anyway.
 */

static ngx_str_t  ngx_http_llama_session_router_actions[] = {
    ngx_null_string,
    ngx_null_string,
    ngx_string("action=save&autoload=false"),
    ngx_string("action=restore"),
    ngx_string("action=erase&autoload=false"),
    ngx_null_string,
    ngx_null_string,
    ngx_null_string,
    ngx_null_string,
    ngx_null_string,
    ngx_null_string,
    ngx_null_string
};


ngx_int_t
ngx_http_llama_session_capture_init(ngx_conf_t *cf)
{
    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_llama_session_capture_filter;

    return NGX_OK;
}


/*
 * Starts a slot call; the handler is run again when it is done.
 * key: the session to save or restore (the file is "<key>.bin").
 */

ngx_int_t
ngx_http_llama_session_call(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t call, u_char *key,
    size_t len)
{
    u_char                             *p;
    size_t                              blen;
    ngx_str_t                           uri, *args, *model;
    ngx_buf_t                          *b;
    ngx_chain_t                        *cl;
    ngx_table_elt_t                    *h;
    ngx_http_request_t                 *sr;
    ngx_http_core_main_conf_t          *cmcf;
    ngx_http_post_subrequest_t         *ps;
    ngx_http_request_body_t            *rb;
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    uri.len = llcf->slots_uri.len + sizeof("/v1/chat/completions") - 1
              + NGX_INT_T_LEN;
    uri.data = ngx_pnalloc(r->pool, uri.len);
    if (uri.data == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_PRIME) {
        p = ngx_sprintf(uri.data, ctx->anthropic ? "%V/v1/messages"
                                  : "%V/v1/chat/completions",
                        &llcf->slots_uri);

    } else if (ngx_http_llama_session_paths[call].len) {
        p = ngx_sprintf(uri.data, "%V%V", &llcf->slots_uri,
                        &ngx_http_llama_session_paths[call]);

    } else {
        p = ngx_sprintf(uri.data, "%V/slots/%ui", &llcf->slots_uri,
                        ctx->slot);
    }

    uri.len = p - uri.data;
    args = &ngx_http_llama_session_actions[call];

    /* router mode: every call names the zone's model */

    model = ctx->zone->model.len ? &ctx->zone->model : NULL;

    if (model) {
        args = (call == NGX_HTTP_LLAMA_SESSION_CALL_GET
                || call == NGX_HTTP_LLAMA_SESSION_CALL_PROPS)
               ? &ctx->zone->model_arg
               : &ngx_http_llama_session_router_actions[call];

        if (call == NGX_HTTP_LLAMA_SESSION_CALL_UNLOAD) {
            model = &ctx->victim->model;
        }
    }

    ctx->call_uri = uri;

    ps = ngx_palloc(r->pool, sizeof(ngx_http_post_subrequest_t));
    if (ps == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ps->handler = ngx_http_llama_session_call_done;
    ps->data = ctx;

    if (ngx_http_subrequest(r, &uri, args->len ? args : NULL, &sr, ps,
                            NGX_HTTP_SUBREQUEST_WAITED)
        != NGX_OK)
    {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    /* its own method, headers and body */

    cmcf = ngx_http_get_module_main_conf(r, ngx_http_core_module);

    sr->variables = ngx_pcalloc(r->pool, cmcf->variables.nelts
                                         * sizeof(ngx_http_variable_value_t));
    if (sr->variables == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ngx_memzero(&sr->headers_in, sizeof(ngx_http_headers_in_t));

    if (ngx_list_init(&sr->headers_in.headers, r->pool, 2,
                      sizeof(ngx_table_elt_t))
        != NGX_OK)
    {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    sr->headers_in.server = r->headers_in.server;
    sr->headers_in.content_length_n = -1;
    sr->headers_in.keep_alive_n = -1;

    rb = ngx_pcalloc(r->pool, sizeof(ngx_http_request_body_t));
    if (rb == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    sr->request_body = rb;

    if (call == NGX_HTTP_LLAMA_SESSION_CALL_GET
        || call == NGX_HTTP_LLAMA_SESSION_CALL_PROPS
        || call == NGX_HTTP_LLAMA_SESSION_CALL_MODELS
        || call == NGX_HTTP_LLAMA_SESSION_CALL_ROUTER
        || call == NGX_HTTP_LLAMA_SESSION_CALL_RPROPS)
    {
        sr->method = NGX_HTTP_GET;
        ngx_str_set(&sr->method_name, "GET");

    } else {
        sr->method = NGX_HTTP_POST;
        ngx_str_set(&sr->method_name, "POST");

        blen = sizeof("{\"filename\":\"..bin\"}") - 1 + len
               + NGX_HTTP_LLAMA_SESSION_FP_LEN
               + sizeof(",\"model\":\"\"") + NGX_HTTP_LLAMA_SESSION_MODEL_SHOW;

        if (call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE && ctx->zone->store.len) {
            blen += sizeof(".tmp") - 1;
        }

        b = ngx_create_temp_buf(r->pool, blen);
        if (b == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        if (model
            && (call == NGX_HTTP_LLAMA_SESSION_CALL_ERASE
                || call == NGX_HTTP_LLAMA_SESSION_CALL_LOAD
                || call == NGX_HTTP_LLAMA_SESSION_CALL_UNLOAD))
        {
            /* the model's name has no character to escape (module.c) */
            b->last = ngx_sprintf(b->last, "{\"model\":\"%V\"}", model);

        } else if (call == NGX_HTTP_LLAMA_SESSION_CALL_ERASE) {
            b->last = ngx_cpymem(b->last, "{}", 2);

        } else if (call == NGX_HTTP_LLAMA_SESSION_CALL_PRIME) {
            if (ngx_http_llama_session_prime_body(r, ctx, &b) != NGX_OK) {
                return NGX_HTTP_INTERNAL_SERVER_ERROR;
            }

        } else {
            /* the key has only [A-Za-z0-9_-] in it (and "@" in router mode) */

            b->last = ngx_sprintf(b->last,
                                  "{\"filename\":\"%*s.%*s.bin%s\"",
                                  len, key,
                                  (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN,
                                  ctx->fp,
                                  (call == NGX_HTTP_LLAMA_SESSION_CALL_SAVE
                                   && ctx->zone->store.len)
                                  ? ".tmp" : "");

            if (model) {
                b->last = ngx_sprintf(b->last, ",\"model\":\"%V\"", model);
            }

            *b->last++ = '}';
        }

        b->last_buf = 1;
        b->last_in_chain = 1;

        cl = ngx_alloc_chain_link(r->pool);
        if (cl == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        cl->buf = b;
        cl->next = NULL;

        rb->bufs = cl;
        sr->headers_in.content_length_n = b->last - b->pos;

        h = ngx_list_push(&sr->headers_in.headers);
        if (h == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        ngx_str_set(&h->key, "Content-Type");
        ngx_str_set(&h->value, "application/json");
        h->lowcase_key = (u_char *) "content-type";
        h->hash = ngx_hash_key(h->lowcase_key, h->key.len);
#if (nginx_version >= 1023000)
        h->next = NULL;
#endif

        sr->headers_in.content_type = h;
    }

    /* the reply's buffer is kept from call to call */

    if (ctx->capture) {
        ctx->capture->pos = ctx->capture->start;
        ctx->capture->last = ctx->capture->start;
    }

    ctx->call = call;
    ctx->call_done = 0;
    ctx->call_timed_out = 0;
    ctx->call_inflight = 1;
    ctx->call_status = 0;
    ctx->call_reply = NULL;

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: slot call %V?%V", &uri, args);

    return NGX_AGAIN;
}


static ngx_int_t
ngx_http_llama_session_call_done(ngx_http_request_t *sr, void *data,
    ngx_int_t rc)
{
    ngx_http_llama_session_ctx_t *ctx = data;

    if (ctx->call_done) {
        return rc;
    }

    ctx->call_done = 1;
    ctx->call_inflight = 0;

    ctx->call_reply = (ctx->capture && ctx->capture->last > ctx->capture->pos)
                      ? ctx->capture : NULL;

    if (sr->upstream) {
        /* 0: no answer from the backend (refused, reset, timed out) */
        ctx->call_status = sr->upstream->headers_in.status_n;
        ctx->call_timed_out = (ctx->call_status == 0
                               && rc == NGX_HTTP_GATEWAY_TIME_OUT);

    } else {
        /* the location does not proxy: a misconfiguration */
        ctx->call_status = sr->headers_out.status ? sr->headers_out.status
                                                  : NGX_HTTP_NOT_FOUND;
        if (ctx->call_status < NGX_HTTP_BAD_REQUEST) {
            ctx->call_status = NGX_HTTP_NOT_FOUND;
        }

        ngx_log_error(NGX_LOG_ERR, sr->connection->log, 0,
                      "llama_session: \"%V\" is not proxied to llama-server, "
                      "check llama_session_slots_uri and its location",
                      &sr->uri);
    }

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, sr->connection->log, 0,
                   "llama_session: slot call done: %i, rc %i",
                   ctx->call_status, rc);

    return rc;
}


/*
 * Keeps the reply of the module's own slot calls instead of sending it
 * anywhere.  They are known by their post-subrequest handler, which an
 * internal redirect (error_page in the slots location) does not change,
 * unlike the request's module context.  For the main request, the end of
 * the response gives the slot back.
 */

static ngx_int_t
ngx_http_llama_session_capture_filter(ngx_http_request_t *r, ngx_chain_t *in)
{
    off_t                          size;
    ssize_t                        n;
    u_char                        *p;
    ngx_buf_t                     *b;
    ngx_chain_t                   *cl;
    ngx_http_llama_session_ctx_t  *ctx;

    if (r == r->main) {
        ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

        if (ctx && ctx->state == NGX_HTTP_LLAMA_SESSION_ST_PROXY
            && ctx->acquired && !ctx->released)
        {
            for (cl = in; cl; cl = cl->next) {
                if (cl->buf->last_buf) {
                    ngx_http_llama_session_finish(ctx);
                    break;
                }
            }
        }

        return ngx_http_next_body_filter(r, in);
    }

    if (!ngx_http_llama_session_own_call(r)) {
        return ngx_http_next_body_filter(r, in);
    }

    ctx = r->post_subrequest->data;

    for (cl = in; cl; cl = cl->next) {
        b = cl->buf;

        if (ngx_buf_in_memory(b)) {
            if (ngx_http_llama_session_capture_append(r, ctx, b->pos,
                                                      b->last - b->pos)
                != NGX_OK)
            {
                return NGX_ERROR;
            }

            b->pos = b->last;

        } else if (b->in_file) {
            size = b->file_last - b->file_pos;

            if (size > NGX_HTTP_LLAMA_SESSION_REPLY_MAX) {
                size = NGX_HTTP_LLAMA_SESSION_REPLY_MAX;
            }

            p = ngx_pnalloc(r->pool, size);
            if (p == NULL) {
                return NGX_ERROR;
            }

            n = ngx_read_file(b->file, p, size, b->file_pos);

            if (n == NGX_ERROR) {
                return NGX_ERROR;
            }

            if (ngx_http_llama_session_capture_append(r, ctx, p, n)
                != NGX_OK)
            {
                return NGX_ERROR;
            }

            b->file_pos = b->file_last;
        }
    }

    return NGX_OK;
}


/* is this subrequest one of the module's slot calls? */

ngx_uint_t
ngx_http_llama_session_own_call(ngx_http_request_t *r)
{
    return r != r->main && r->post_subrequest
           && r->post_subrequest->handler
              == ngx_http_llama_session_call_done;
}


static ngx_int_t
ngx_http_llama_session_capture_append(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, u_char *data, size_t size)
{
    size_t      want;
    ngx_buf_t  *b;

    if (size == 0 || ctx->call_done) {
        return NGX_OK;
    }

    b = ctx->capture;

    if (b == NULL || (size_t) (b->end - b->last) < size) {

        want = b ? (size_t) (b->last - b->pos) + size : size;

        if (want > NGX_HTTP_LLAMA_SESSION_REPLY_MAX) {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "llama_session: a slot call's reply is larger "
                          "than %d bytes, the rest is dropped",
                          NGX_HTTP_LLAMA_SESSION_REPLY_MAX);
            return NGX_OK;
        }

        want = ngx_max(want * 2, 4096);

        /* in the main request's pool: it outlives the subrequest */

        b = ngx_create_temp_buf(r->main->pool, want);
        if (b == NULL) {
            return NGX_ERROR;
        }

        if (ctx->capture) {
            b->last = ngx_cpymem(b->last, ctx->capture->pos,
                                 ctx->capture->last - ctx->capture->pos);
        }

        ctx->capture = b;
    }

    b->last = ngx_cpymem(b->last, data, size);

    return NGX_OK;
}


static cJSON *
ngx_http_llama_session_reply_json(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx)
{
    cJSON  *json;

    if (ctx->call_reply == NULL) {
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: empty reply to a slot call");
        return NULL;
    }

    json = ngx_http_llama_session_json_tree(ctx->call_reply->pos,
                                 ctx->call_reply->last - ctx->call_reply->pos);

    if (json == NULL) {
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: the reply to a slot call is not "
                      "JSON of at most %d values: \"%*s\"",
                      NGX_HTTP_LLAMA_SESSION_JSON_VALUES,
                      ngx_min(ctx->call_reply->last - ctx->call_reply->pos,
                              200),
                      ctx->call_reply->pos);
    }

    return json;
}


/* GET /slots: is the slot running, how many tokens does it hold */

ngx_int_t
ngx_http_llama_session_parse_slots(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t *processing)
{
    cJSON  *json, *slot, *id, *tokens, *task;

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

        if (!cJSON_IsNumber(id) || (ngx_uint_t) id->valueint != ctx->slot) {
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

        ctx->slot_tokens = (cJSON_IsNumber(tokens) && tokens->valuedouble >= 0)
                           ? tokens->valueint : -1;

        task = cJSON_GetObjectItemCaseSensitive(slot, "id_task");
        ctx->slot_task = cJSON_IsNumber(task) ? task->valueint : -1;

        cJSON_Delete(json);

        return NGX_OK;
    }

    cJSON_Delete(json);

    /* llama-server came back with fewer slots: NGX_DECLINED */

    ngx_log_error(NGX_LOG_WARN, log, 0,
                  "llama_session: llama-server has no slot %ui (now): does "
                  "llama_session_zone's slots= match llama-server's -np?",
                  ctx->slot);

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
                      ngx_min(ctx->call_reply->last - ctx->call_reply->pos,
                              200),
                      ctx->call_reply->pos);
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
 * The end of a save, the same for a swap, an idle save and the API: the
 * reply must say the slot held tokens, and with store= the file must be
 * what llama-server says it wrote (it does not check its last fclose: a
 * full disk or NFS can answer 200 with a short file).  Then the file
 * takes its name and the session is recorded.  Else its previous file is
 * kept, untouched.  NGX_OK: saved.
 */

ngx_int_t
ngx_http_llama_session_save_done(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t reason, u_char *key,
    size_t len)
{
    off_t        bytes;
    double       ms;
    ngx_uint_t   tokens;
    const char  *what;

    static const char  *reasons[] = {
        "swap", "idle save", "API", "save before an unload", "base"
    };

    what = reasons[reason];
    tokens = 0;
    bytes = 0;
    ms = 0;

    if (ctx->call_status == NGX_HTTP_OK
        && ngx_http_llama_session_parse_action(log, ctx, &tokens, &bytes, &ms)
           == NGX_OK)
    {
        if (tokens == 0) {
            ngx_log_error(NGX_LOG_ERR, log, 0,
                          "llama_session: %s: llama-server saved no tokens "
                          "of session \"%*s\" from slot %ui, nothing is "
                          "kept of it", what, len, key, ctx->slot);

        } else if (ngx_http_llama_session_store_commit(log, ctx, key, len,
                                                       bytes)
                   == NGX_OK)
        {
            if (key == ctx->out_key) {
                ctx->saved_tokens = tokens;
                ctx->saved_bytes = bytes;
                ctx->save_ms = ms;

            } else {
                ctx->base_tokens = tokens;
                ctx->base_bytes = bytes;
                ctx->base_ms = ms;
            }

            ngx_http_llama_session_saved_ok(log, ctx, key, len, tokens,
                                            bytes);
            ngx_http_llama_session_save_stat(ctx->zone, reason, 1, bytes, ms);

            return NGX_OK;
        }
    }

    if (ctx->zone->store.len == 0 && ctx->call_status == NGX_HTTP_OK) {
        /* llama-server wrote over the file itself: it cannot be trusted */
        ngx_http_llama_session_file_saved(ctx, key, len, 0, 0, 0);
    }

    ngx_http_llama_session_store_drop_tmp(log, ctx, key, len);

    ngx_http_llama_session_stat(ctx, &ctx->zone->sh->stats.save_errors);
    ngx_http_llama_session_save_stat(ctx->zone, reason, 0, 0, 0);

    ngx_log_error(NGX_LOG_ERR, log, 0,
                  "llama_session: %s: saving session \"%*s\" from slot %ui "
                  "failed (%i: \"%*s\"), its previous file is kept and its "
                  "latest turns are lost", what,
                  len, key, ctx->slot, ctx->call_status,
                  ctx->call_reply
                  ? ngx_min(ctx->call_reply->last - ctx->call_reply->pos, 200)
                  : 0,
                  ctx->call_reply ? ctx->call_reply->pos : (u_char *) "");

    return NGX_ERROR;
}


/*
 * May the slot be saved?  Only after a GET /slots in the same hold of the
 * slot showed it idle, holding tokens, and llama-server not restarted
 * (the caller checked the task ids): else the state may be empty, or
 * another session's.
 */

ngx_uint_t
ngx_http_llama_session_may_save(ngx_http_llama_session_ctx_t *ctx)
{
    return ctx->save_pending && ctx->slots_checked && ctx->slot_tokens > 0
           && !ctx->restarted;
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
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: zone \"%V\" faces llama-server's "
                      "router mode: give each of the router's models a "
                      "zone with \"model=\" (docs/scaling.md)",
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

    ctx->props_slots = (ngx_uint_t) slots->valuedouble;
    ctx->props_n_ctx = (ngx_uint_t) n_ctx->valuedouble;

    ctx->props_model.len = ngx_min(ngx_strlen(path->valuestring),
                                   NGX_HTTP_LLAMA_SESSION_PATH_SHOW);
    ctx->props_model.data = ngx_pnalloc(r->pool, ctx->props_model.len);
    if (ctx->props_model.data == NULL) {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    ngx_memcpy(ctx->props_model.data, path->valuestring,
               ctx->props_model.len);

    ctx->props_text.data = ngx_pnalloc(r->pool, 1024);
    if (ctx->props_text.data == NULL) {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    /* the model path last: a path too long for the text cuts only itself */

    p = ngx_snprintf(ctx->props_text.data, 1024, "%ui%Z%ui%Z%*s%Z%*s%Z%s",
                     ctx->props_n_ctx, ctx->props_slots,
                     cJSON_IsString(ftype)
                     ? ngx_min(ngx_strlen(ftype->valuestring), 64) : 0,
                     cJSON_IsString(ftype) ? ftype->valuestring : "",
                     cJSON_IsString(build)
                     ? ngx_min(ngx_strlen(build->valuestring), 128) : 0,
                     cJSON_IsString(build) ? build->valuestring : "",
                     path->valuestring);

    ctx->props_text.len = p - ctx->props_text.data;

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

    if (ctx->props_text.len == 0) {
        return NGX_ERROR;
    }

    p = ngx_cpymem(text, ctx->props_text.data,
                   ngx_min(ctx->props_text.len, 1024));
    last = text + sizeof(text);

    json = (ctx->call_status == NGX_HTTP_OK)
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

    if (cJSON_IsObject(meta)) {
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
                      "says only", ctx->call_status);
    }

    cJSON_Delete(json);

    if (EVP_Digest(text, p - text, hash, &hlen, EVP_sha256(), NULL) != 1) {
        return NGX_ERROR;
    }

    ngx_hex_dump(fp, hash, NGX_HTTP_LLAMA_SESSION_FP_LEN / 2);

    ngx_http_llama_session_set_fingerprint(ctx, fp, ctx->props_n_ctx,
                                           ctx->props_slots,
                                           &ctx->props_model);

    return NGX_OK;
}


/*
 * The fingerprint's two calls, for the request path and the API alike:
 * once GET /props answered, GET /v1/models; once that answered, the
 * fingerprint is set.  NGX_AGAIN: the next call is on its way; NGX_OK:
 * known; NGX_ERROR: the backend failed the call in ctx->call; else an
 * HTTP status to end with.
 */

ngx_int_t
ngx_http_llama_session_learn(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    if (ctx->call == NGX_HTTP_LLAMA_SESSION_CALL_PROPS) {

        if (ctx->call_status != NGX_HTTP_OK
            || ngx_http_llama_session_parse_props(r, ctx) != NGX_OK)
        {
            return NGX_ERROR;
        }

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_MODELS,
                                           NULL, 0);
    }

    if (ctx->call_status == 0
        || ngx_http_llama_session_parse_models(r, ctx) != NGX_OK)
    {
        return NGX_ERROR;
    }

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
