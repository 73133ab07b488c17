
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Warm starts: what a session without a file of its own starts from.
 *
 * Conversations that share a system prompt (and tools) share the start of
 * their KV cache, and llama-server reuses the exact common token prefix of
 * the slot's content and a new prompt.  So a new session starts, best
 * first, from:
 *
 *   1. the slot's content, when it belongs to a session of the same
 *      namespace, model and system prompt: cut back to the system prompt
 *      by a "prime", a completion of the system prompt alone with one
 *      token to generate (llama-server keeps the common prefix and drops
 *      the rest); nothing is read from disk;
 *   2. the base: the saved state of that system prompt alone, restored;
 *   3. else an empty slot, where the prime computes the system prompt and
 *      the state is saved as the base for the sessions to come.
 *
 * The base holds the system prompt alone, never another session's
 * messages: llama-server reports how many prompt tokens it reused, and a
 * session that started from another's whole history could probe it token
 * by token.  "llama_session_warm history" lets sessions of one namespace
 * start from the slot as it is (step 1 without the cut), for operators
 * whose users share everything anyway.
 *
 * Bases are keyed by (namespace, model, system prompt digest): tenants
 * never start from each other's state.  The request's own session then
 * saves under its own name, the base is never written by it.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_error.h"
#include "ngx_http_llama_session_gguf.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_reprime.h"
#include "ngx_http_llama_session_index.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_slots.h"
#include "ngx_http_llama_session_store.h"
#include "ngx_http_llama_session_warm.h"

#include <cjson/cJSON.h>


static ngx_int_t ngx_http_llama_session_warm_call(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t step);
static ngx_int_t ngx_http_llama_session_warm_go(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t action);
static ngx_int_t ngx_http_llama_session_prime_body(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_buf_t **out);
static void ngx_http_llama_session_warm_used(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_prime_prefix(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_uint_t ngx_http_llama_session_prime_tokens(ngx_log_t *log,
    ngx_buf_t *b, ngx_int_t *cached);


static ngx_str_t  ngx_http_llama_session_base_id = ngx_string("base");


/*
 * NGX_DECLINED: no warm start for this request (off, no system prompt or
 * a short one, an endpoint without a prime); NGX_OK: the slot is ready as
 * it is (the handler proxies); else the first call is made.
 */

ngx_int_t
ngx_http_llama_session_warm(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    if (llcf->warm == NGX_HTTP_LLAMA_SESSION_WARM_OFF
        || ctx->base_len == 0
        || ctx->sys_len < llcf->warm_min)
    {
        return NGX_DECLINED;
    }

    /*
     * the dialects a prime can be made for, with their system prompt:
     * Anthropic's "system" (a translated request is primed as the chat
     * completion it became), the Responses API's instructions, leading
     * input items or tools, the chat's system messages or tools
     */

    switch (ctx->dialect->prime_shape) {

    case NGX_HTTP_LLAMA_SESSION_PRIME_ANTHROPIC:
        if (ctx->p_system.start == NULL) {
            return NGX_DECLINED;
        }

        break;

    case NGX_HTTP_LLAMA_SESSION_PRIME_RESPONSES:
        if (ctx->p_system.start == NULL && ctx->p_leading.start == NULL
            && ctx->p_tools.start == NULL)
        {
            return NGX_DECLINED;
        }

        break;

    case NGX_HTTP_LLAMA_SESSION_PRIME_CHAT:
        if (ctx->p_leading.start == NULL && ctx->p_tools.start == NULL) {
            return NGX_DECLINED;
        }

        break;

    default:
        return NGX_DECLINED;
    }

    /* 1. the slot holds a session of the same base */

    if (ctx->job->slot_has_base && !ctx->job->restarted
        && ctx->job->slot_state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
        && ctx->job->slot_tokens != 0
        && ngx_memcmp(ctx->job->slot_base, ctx->base_id,
                      NGX_HTTP_LLAMA_SESSION_DIGEST) == 0)
    {
        if (llcf->warm == NGX_HTTP_LLAMA_SESSION_WARM_HISTORY) {
            ctx->warm->history = 1;
            return ngx_http_llama_session_warm_go(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_ACTION_WARM);
        }

        ctx->warm->trimmed = 1;
        ctx->warm->base_file = (ngx_http_llama_session_store_has_file(r, ctx,
                                                          ctx->base_key,
                                                          ctx->base_len)
                          == 1);

        return ngx_http_llama_session_warm_call(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_WARM_PRIME);
    }

    /* 2. the base's file */

    ctx->warm->base_file = (ngx_http_llama_session_store_has_file(r, ctx,
        ctx->base_key,
                                                      ctx->base_len)
                      == 1
                      && !ngx_http_llama_session_restores_off(ctx->zone,
                                                              ctx->job->fp));

    if (ctx->warm->base_file) {
        return ngx_http_llama_session_warm_call(r, ctx,
                                          NGX_HTTP_LLAMA_SESSION_WARM_RESTORE);
    }

    /* 3. an empty slot, then the base is made */

    if (ctx->job->slot_tokens != 0) {
        return ngx_http_llama_session_warm_call(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_WARM_ERASE);
    }

    return ngx_http_llama_session_warm_call(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_WARM_PRIME);
}


static ngx_int_t
ngx_http_llama_session_warm_call(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t step)
{
    ngx_uint_t  call, kind;

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_WARM);
    ctx->warm->warm_step = step;

    switch (step) {

    case NGX_HTTP_LLAMA_SESSION_WARM_RESTORE:
        call = NGX_HTTP_LLAMA_SESSION_CALL_RESTORE;
        break;

    case NGX_HTTP_LLAMA_SESSION_WARM_PRIME:
        call = NGX_HTTP_LLAMA_SESSION_CALL_PRIME;

        /* the call sends the body made here */
        if (ngx_http_llama_session_prime_body(r, ctx, &ctx->job->call_body)
            != NGX_OK)
        {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        kind = ngx_http_llama_session_memory_kind(ctx->zone, ctx->job->fp);

        ctx->warm->prefix = (ctx->dialect->prime_shape
                                == NGX_HTTP_LLAMA_SESSION_PRIME_CHAT
                            && (kind == NGX_HTTP_LLAMA_SESSION_MEMORY_HYBRID
                                || kind
                                   == NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT));

        if (ctx->warm->prefix) {
            /* the prefix prime (reprime.c) of that body */
            return ngx_http_llama_session_prime_prefix(r, ctx);
        }

        break;

    case NGX_HTTP_LLAMA_SESSION_WARM_SAVE:
        call = NGX_HTTP_LLAMA_SESSION_CALL_SAVE;
        break;

    default: /* ERASE, CLEAN */
        call = NGX_HTTP_LLAMA_SESSION_CALL_ERASE;
    }

    return ngx_http_llama_session_call(r, ctx, call, ctx->base_key,
                                       ctx->base_len);
}


/*
 * A session starts from the base: counted (eviction takes the bases that
 * no session used first); the first use is written to the base's .json,
 * so that it counts after a restart too.
 */

static void
ngx_http_llama_session_warm_used(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char  name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t  n;

    if (ngx_http_llama_session_base_used(ctx->zone, ctx->job->fp,
                                         ctx->base_key, ctx->base_len)
        == 0 && ctx->zone->store.len)
    {
        n = ngx_http_llama_session_file_name(name, ctx->base_key,
                                             ctx->base_len, ctx->job->fp);
        (void) ngx_http_llama_session_store_meta(r->connection->log,
                                                 ctx->zone, name, n,
                                                 ctx->job->slot);
    }
}


/*
 * A call of the warm start is over: the next step, or NGX_OK when the
 * slot is ready (the handler proxies).
 */

ngx_int_t
ngx_http_llama_session_warm_done(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t   status, rc, cached, evaluated;
    ngx_uint_t  step;

    static char  *names[] = { "", "restore of the base", "erase",
                              "prime", "save of the base", "erase" };

    status = ctx->job->call_status;
    step = ctx->warm->warm_step;

    ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;

    if (ngx_http_llama_session_backend_failed(status)) {
        if (step == NGX_HTTP_LLAMA_SESSION_WARM_SAVE) {
            ngx_http_llama_session_store_drop_tmp(r->connection->log, ctx,
                                                  ctx->base_key,
                                                  ctx->base_len);
        }

        return ngx_http_llama_session_backend_error(r, ctx, names[step]);
    }

    switch (step) {

    case NGX_HTTP_LLAMA_SESSION_WARM_RESTORE:

        if (ngx_http_llama_session_restore_done(r->connection->log, ctx,
                                                ctx->base_key, ctx->base_len)
            == NGX_OK)
        {
            /* in use: the base goes to the front of the queue */
            ngx_http_llama_session_job_remember(ctx, ctx->base_key,
                                                ctx->base_len,
                                            &ngx_http_llama_session_base_id);
            ngx_http_llama_session_warm_used(r, ctx);

            return ngx_http_llama_session_warm_go(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_ACTION_WARM);
        }

        /* a failed restore leaves the slot empty: the base is made anew */

        ctx->warm->base_file = 0;
        ctx->job->slot_tokens = 0;

        return ngx_http_llama_session_warm_call(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_WARM_PRIME);

    case NGX_HTTP_LLAMA_SESSION_WARM_ERASE:

        if (status == NGX_HTTP_OK) {
            ctx->job->slot_tokens = 0;

            return ngx_http_llama_session_warm_call(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_WARM_PRIME);
        }

        break;

    case NGX_HTTP_LLAMA_SESSION_WARM_PRIME:

        rc = NGX_OK;

        if (ctx->warm->prefix) {
            rc = ngx_http_llama_session_prefix_next(r, ctx, "base's prime");

            if (rc == NGX_AGAIN) {
                return rc;
            }
        }

        if (status != NGX_HTTP_OK || rc != NGX_OK) {
            /*
             * the template may refuse a system prompt alone: the slot
             * must not keep another session's history for this one
             */

            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "llama_session: llama-server refused the system "
                          "prompt alone for base \"%*s\" (%i: \"%*s\"), the "
                          "session starts fresh",
                          ctx->base_len, ctx->base_key, status,
                          ctx->job->call_reply
                          ? ngx_min(ctx->job->call_reply->last
                                    - ctx->job->call_reply->pos, 200)
                          : 0,
                          ctx->job->call_reply ? ctx->job->call_reply->pos
                                          : (u_char *) "");

            ctx->warm->trimmed = 0;

            if (ctx->job->slot_tokens == 0) {
                return ngx_http_llama_session_warm_go(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_ACTION_FRESH);
            }

            return ngx_http_llama_session_warm_call(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_WARM_CLEAN);
        }

        if (!ctx->warm->prefix) {
            ctx->warm->base_tokens = ngx_http_llama_session_prime_tokens(
                                         r->connection->log,
                                             ctx->job->call_reply,
                                         &ctx->warm->base_cached);

        } else {
            ngx_http_llama_session_prefix_tokens(ctx, &cached, &evaluated);
            ctx->warm->base_cached = cached;
            ctx->warm->base_tokens = (cached >= 0 && evaluated >= 0)
                                    ? (ngx_uint_t) (cached + evaluated) : 0;
        }

        if (ctx->warm->trimmed && ctx->warm->base_file) {
            ngx_http_llama_session_warm_used(r, ctx);
        }

        /* one slot at a time saves a base: its file has one name */

        if (!ctx->warm->base_file
            && !ngx_http_llama_session_restores_off(ctx->zone, ctx->job->fp)
            && ngx_http_llama_session_base_claim(ctx->zone, ctx->job,
                                                 ctx->base_id))
        {
            return ngx_http_llama_session_warm_call(r, ctx,
                                            NGX_HTTP_LLAMA_SESSION_WARM_SAVE);
        }

        return ngx_http_llama_session_warm_go(r, ctx,
                                   ctx->warm->trimmed
                                   ? NGX_HTTP_LLAMA_SESSION_ACTION_WARM
                                   : NGX_HTTP_LLAMA_SESSION_ACTION_FRESH);

    case NGX_HTTP_LLAMA_SESSION_WARM_SAVE:

        rc = ngx_http_llama_session_save_done(r->connection->log, ctx,
                                              NGX_HTTP_LLAMA_SESSION_SAVE_BASE,
                                              ctx->base_key, ctx->base_len,
                                              &ctx->job->wait_ev);

        if (rc == NGX_AGAIN) {
            /* the commit's file calls run in a thread (store_commit()) */
            r->read_event_handler = ngx_http_test_reading;
            r->write_event_handler = ngx_http_core_run_phases;
            return NGX_AGAIN;
        }

        if (rc == NGX_OK) {
            ctx->warm->base_built = 1;
            ngx_http_llama_session_job_remember(ctx, ctx->base_key,
                                                ctx->base_len,
                                            &ngx_http_llama_session_base_id);
            ngx_http_llama_session_stat(&ctx->zone->sh->stats.bases);

            if (ctx->warm->trimmed) {
                /* made from another session's slot: this one uses it */
                ngx_http_llama_session_warm_used(r, ctx);
            }
        }

        return ngx_http_llama_session_warm_go(r, ctx,
                                   ctx->warm->trimmed
                                   ? NGX_HTTP_LLAMA_SESSION_ACTION_WARM
                                   : NGX_HTTP_LLAMA_SESSION_ACTION_FRESH);

    default: /* NGX_HTTP_LLAMA_SESSION_WARM_CLEAN */
        break;
    }

    /* after an erase, the request goes on fresh */

    if (status != NGX_HTTP_OK) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: erasing slot %ui failed (%i), the "
                      "request goes on", ctx->job->slot, status);
    }

    return ngx_http_llama_session_warm_go(r, ctx,
                                          NGX_HTTP_LLAMA_SESSION_ACTION_FRESH);
}


static ngx_int_t
ngx_http_llama_session_warm_go(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t action)
{
    ctx->warm->warm_step = NGX_HTTP_LLAMA_SESSION_WARM_NONE;
    ctx->action = action;

    /* the slot is ready: the handler lets proxy_pass carry the request */
    return NGX_OK;
}


/*
 * The prime's body: the request's own system prompt, tools and template
 * arguments, as the client sent them (so the template renders the same
 * tokens), no conversation, one token to generate.  OpenAI's chat shape,
 * or Anthropic's for llama-server's /v1/messages, or Anthropic's
 * translated into a chat completion for the module's, or the Responses
 * API's ("instructions", the leading "input" items, "reasoning"), which
 * llama-server converts keeping "id_slot".
 */

static ngx_int_t
ngx_http_llama_session_prime_body(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_buf_t **out)
{
    size_t                          len;
    ngx_str_t                       body;
    ngx_buf_t                      *b;
    ngx_uint_t                      i, anthropic, responses, system;
    ngx_http_llama_session_span_t  *sp;

    static struct {
        const char                 *name;
        size_t                      off;
    } members[] = {
        { "model", offsetof(ngx_http_llama_session_ctx_t, p_model) },
        { "system", offsetof(ngx_http_llama_session_ctx_t, p_system) },
        { "tools", offsetof(ngx_http_llama_session_ctx_t, p_tools) },
        { "tool_choice",
          offsetof(ngx_http_llama_session_ctx_t, p_tool_choice) },
        { "chat_template_kwargs",
          offsetof(ngx_http_llama_session_ctx_t, p_kwargs) },
        { "reasoning", offsetof(ngx_http_llama_session_ctx_t, p_reasoning) }
    };

    /* a body nginx keeps in a file is read again for the prime */

    if (ngx_http_llama_session_body_spans(r, ctx, &body) != NGX_OK) {
        return NGX_ERROR;
    }

    len = sizeof("{\"messages\":[],\"max_tokens\":1,\"temperature\":0,"
                 "\"stream\":false,\"id_slot\":}") - 1 + NGX_INT_T_LEN;

    anthropic = (ctx->dialect->prime_shape
                 == NGX_HTTP_LLAMA_SESSION_PRIME_ANTHROPIC);
    responses = (ctx->dialect->prime_shape
                 == NGX_HTTP_LLAMA_SESSION_PRIME_RESPONSES);

    /* the Responses API's system prompt is "instructions", as "system" */
    system = (anthropic || responses);

    if (!anthropic && ctx->p_leading.start) {
        len += ctx->p_leading.end - ctx->p_leading.start;
    }

    for (i = 0; i < sizeof(members) / sizeof(members[0]); i++) {
        sp = (ngx_http_llama_session_span_t *) ((u_char *) ctx
                                                + members[i].off);
        if (sp->start && (i != 1 || system)) {
            len += sizeof(",\"instructions\":") - 1
                   + ngx_strlen(members[i].name) + (sp->end - sp->start);
        }
    }

    b = ngx_create_temp_buf(r->pool, len);
    if (b == NULL) {
        return NGX_ERROR;
    }

    b->last = responses
              ? ngx_cpymem(b->last, "{\"input\":[", sizeof("{\"input\":[") - 1)
              : ngx_cpymem(b->last, "{\"messages\":[",
                           sizeof("{\"messages\":[") - 1);

    if (!anthropic && ctx->p_leading.start) {
        b->last = ngx_cpymem(b->last, ctx->p_leading.start,
                             ctx->p_leading.end - ctx->p_leading.start);
    }

    b->last = ngx_cpymem(b->last, "]", 1);

    for (i = 0; i < sizeof(members) / sizeof(members[0]); i++) {
        sp = (ngx_http_llama_session_span_t *) ((u_char *) ctx
                                                + members[i].off);
        if (sp->start && (i != 1 || system)) {
            b->last = ngx_sprintf(b->last, ",\"%s\":",
                                  (i == 1 && responses) ? "instructions"
                                                             : members[i].name);
            b->last = ngx_cpymem(b->last, sp->start, sp->end - sp->start);
        }
    }

    b->last = ngx_cpymem(b->last, ",\"max_tokens\":1,\"temperature\":0,"
                         "\"stream\":false",
                         sizeof(",\"max_tokens\":1,\"temperature\":0,"
                                "\"stream\":false") - 1);

    /* Anthropic's converter drops id_slot, OpenAI's keeps it */

    if (!anthropic) {
        b->last = ngx_sprintf(b->last, ",\"id_slot\":%ui", ctx->job->slot);
    }

    *b->last++ = '}';

    b->last_buf = 1;
    b->last_in_chain = 1;

    if (ctx->dialect->prime_filter) {
        /* translated as the request was (Anthropic's: anthropic.c) */
        b = ctx->dialect->prime_filter(r, b, ctx->job->slot);
        if (b == NULL) {
            return NGX_ERROR;
        }
    }

    if (body.data) {
        /* and let go again */
        ctx->body = body;
        ngx_http_llama_session_body_release(r, ctx);
    }

    *out = b;

    return NGX_OK;
}


/*
 * A chat base's prime on a model with recurrent or hybrid memory: the
 * system prompt (and tools) rendered with a user message after it, cut
 * where that message starts, is all the slot holds (reprime.c), so that
 * every session's first turn extends it, as such a model needs to reuse a
 * restored base.  A completion of the system prompt alone ends with the
 * template's assistant prompt, which no next turn has: models with full
 * attention (and sliding windows, whose next turn differs within the
 * window) reuse the rest of it, and keep that one call.
 */

static ngx_int_t
ngx_http_llama_session_prime_prefix(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    cJSON      *body;
    ngx_int_t   rc;
    ngx_buf_t  *b, *first, *second;

    b = ctx->job->call_body;
    ctx->job->call_body = NULL;

    body = ngx_http_llama_session_json_tree(b->pos, b->last - b->pos);
    if (body == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    rc = ngx_http_llama_session_prefix_bodies(r, body, NULL, NULL, &first,
                                              &second);

    cJSON_Delete(body);

    if (rc != NGX_OK) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    return ngx_http_llama_session_prefix_start(r, ctx, first, second);
}


/*
 * The prompt's tokens in the prime's reply: what the base will hold; and
 * in cached, those llama-server took from the slot (timings.cache_n, -1:
 * not shown): after an erase, none, whatever the tenant before.
 */

static ngx_uint_t
ngx_http_llama_session_prime_tokens(ngx_log_t *log, ngx_buf_t *b,
    ngx_int_t *cached)
{
    cJSON       *json, *usage, *n, *timings;
    ngx_uint_t   i, tokens;

    static const char  *names[] = { "prompt_tokens", "input_tokens",
                                    "cache_read_input_tokens" };

    *cached = -1;

    if (b == NULL) {
        return 0;
    }

    json = ngx_http_llama_session_json_tree(b->pos, b->last - b->pos);
    if (json == NULL) {
        return 0;
    }

    tokens = 0;

    timings = cJSON_GetObjectItemCaseSensitive(json, "timings");
    n = cJSON_GetObjectItemCaseSensitive(timings, "cache_n");

    if (cJSON_IsNumber(n) && n->valuedouble >= 0 && n->valuedouble < 1e12) {
        *cached = (ngx_int_t) n->valuedouble;
    }

    usage = cJSON_GetObjectItemCaseSensitive(json, "usage");

    /* no timings in a Responses API reply: its usage's cached_tokens */

    n = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(usage, "input_tokens_details"),
            "cached_tokens");

    if (*cached < 0 && cJSON_IsNumber(n) && n->valuedouble >= 0
        && n->valuedouble < 1e12)
    {
        *cached = (ngx_int_t) n->valuedouble;
    }

    /* OpenAI's prompt_tokens; Anthropic's input_tokens leave out the cached */

    for (i = 0; i < 3; i++) {
        n = cJSON_GetObjectItemCaseSensitive(usage, names[i]);

        if (cJSON_IsNumber(n) && n->valuedouble > 0 && n->valuedouble < 1e12)
        {
            tokens += (ngx_uint_t) n->valuedouble;

            if (i == 0) {
                break;
            }
        }
    }

    cJSON_Delete(json);

    return tokens;
}
