
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Errors to the client, one way for every file: the JSON body of
 * send_error(), the backend's failures of a slot call (502, or 503 while
 * llama-server loads), and the end of a job's request with either.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_error.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_shm.h"


/* the backend could not be reached or refused a slot call: 502 */

ngx_int_t
ngx_http_llama_session_backend_error(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, const char *what)
{
    u_char  *message;

    ngx_http_llama_session_stat(&ctx->zone->sh->stats.backend_errors);

    if (ctx->job->call_timed_out
        || ctx->job->call_status == NGX_HTTP_GATEWAY_TIME_OUT)
    {
        /* a prime, save or restore of a large state can take minutes */
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: slot call \"%s\" for session \"%*s\" "
                      "timed out in the location of \"%V\": raise "
                      "proxy_read_timeout there (like the inference "
                      "location's)", what, ctx->key_len, ctx->key,
                      &ctx->job->call_uri);

    } else if (ctx->job->call_status == 0) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: slot call \"%s\" for session \"%*s\" "
                      "got no answer from the backend through \"%V\"",
                      what, ctx->key_len, ctx->key, &ctx->job->call_uri);

    } else {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: slot call \"%s\" for session \"%*s\" "
                      "through \"%V\" answered %i: \"%*s\"",
                      what, ctx->key_len, ctx->key, &ctx->job->call_uri,
                      ctx->job->call_status,
                      ctx->job->call_reply
                      ? ngx_min(ctx->job->call_reply->last
                                - ctx->job->call_reply->pos,
                                200)
                      : 0,
                      ctx->job->call_reply ? ctx->job->call_reply->pos
                          : (u_char *) "");
    }

    /* a failed call leaves a slot nobody can vouch for */

    ngx_http_llama_session_release(ctx->zone, ctx->job,
                                   NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN);
    ngx_http_llama_session_wake_local();

    if (ctx->job->call_status == NGX_HTTP_SERVICE_UNAVAILABLE) {
        /* llama-server starts ("Loading model") or sleeps: retry soon */
        return ngx_http_llama_session_error(r, ctx,
                                        NGX_HTTP_SERVICE_UNAVAILABLE,
                                        "unavailable_error",
                                        "the model server is not ready, "
                                        "retry later", 1);
    }

    if (ctx->job->faces_router) {
        /* the configuration's fault, not the backend's: say the fix */
        return ngx_http_llama_session_error(r, ctx, NGX_HTTP_BAD_GATEWAY,
                                        "server_error",
                                        "the model server runs llama-server's "
                                        "router mode, which nginx's "
                                        "llama_session zone is not set for: "
                                        "it needs \"models=\" (see the "
                                        "error log)", 0);
    }

    message = ngx_pnalloc(r->pool, ngx_strlen(what) + 64);
    if (message == NULL) {
        ngx_http_finalize_request(r, NGX_HTTP_INTERNAL_SERVER_ERROR);
        return NGX_DONE;
    }

    /* what: the module's own names of its calls, no client text */

    ngx_sprintf(message, "the model server did not answer a slot call "
                "(%s)%s%Z", what,
                (ctx->job->call_timed_out
                 || ctx->job->call_status == NGX_HTTP_GATEWAY_TIME_OUT)
                ? " in time" : "");

    return ngx_http_llama_session_error(r, ctx, NGX_HTTP_BAD_GATEWAY,
                                        "server_error", (char *) message, 0);
}


/*
 * A job's request ends with an error: its state is done, and the client
 * gets send_error()'s JSON (Ollama's clients their own); NGX_DONE.
 */

ngx_int_t
ngx_http_llama_session_error(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t status, char *type,
    char *message, time_t retry_after)
{
    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_DONE);
    ctx->status = NGX_DONE;
    ctx->job->call = NGX_HTTP_LLAMA_SESSION_CALL_NONE;

    if (ctx->dialect && ctx->dialect->error) {
        /* the dialect's own: an Ollama client reads {"error": "..."} */
        return ctx->dialect->error(r, ctx, status, message);
    }

    ngx_http_finalize_request(r, ngx_http_llama_session_send_error(r, status,
                                               type, message, retry_after));

    return NGX_DONE;
}


/*
 * The one error body of the module, for requests and the API alike:
 * {"error":{"code":N,"message":"...","type":"..."}}, with Retry-After
 * when asked; to a dialect with error types of its own (Anthropic's,
 * anthropic.c) its shape,
 * {"type":"error","error":{...}} with its error types.  Returns for
 * finalizing, as send_json().
 */

ngx_int_t
ngx_http_llama_session_send_error(ngx_http_request_t *r, ngx_uint_t status,
    char *type, char *message, time_t retry_after)
{
    size_t                         len, mlen, tlen;
    ngx_buf_t                     *b;
    ngx_table_elt_t               *h;
    ngx_http_llama_session_ctx_t  *ctx;

    /* a dialect's error types: {"type":"error",...}, Anthropic's shape */

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx && ctx->dialect && ctx->dialect->error_type) {
        type = ctx->dialect->error_type(status);

    } else {
        ctx = NULL;             /* OpenAI's shape */
    }

    mlen = ngx_strlen(message);
    tlen = ngx_strlen(type);

    len = sizeof("{\"type\":\"error\",\"error\":{\"code\":,\"message\":\"\","
                 "\"type\":\"\"}}\n")
          - 1 + NGX_INT_T_LEN
          + mlen + ngx_escape_json(NULL, (u_char *) message, mlen)
          + tlen + ngx_escape_json(NULL, (u_char *) type, tlen);

    b = ngx_create_temp_buf(r->pool, len);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (ctx) {
        b->last = ngx_cpymem(b->last, "{\"type\":\"error\",",
                             sizeof("{\"type\":\"error\",") - 1);

    } else {
        *b->last++ = '{';
    }

    b->last = ngx_sprintf(b->last, "\"error\":{\"code\":%ui,\"message\":\"",
                          status);
    b->last = (u_char *) ngx_escape_json(b->last, (u_char *) message, mlen);
    b->last = ngx_cpymem(b->last, "\",\"type\":\"", sizeof("\",\"type\":\"") - 1);
    b->last = (u_char *) ngx_escape_json(b->last, (u_char *) type, tlen);
    b->last = ngx_cpymem(b->last, "\"}}\n", 4);

    if (retry_after) {
        h = ngx_list_push(&r->headers_out.headers);
        if (h == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        h->hash = 1;
        ngx_str_set(&h->key, "Retry-After");
        h->value.data = ngx_pnalloc(r->pool, NGX_TIME_T_LEN);
        if (h->value.data == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        h->value.len = ngx_sprintf(h->value.data, "%T", retry_after)
                       - h->value.data;
    }

    return ngx_http_llama_session_send_json(r, status, b);
}


/* sends a JSON body in b as the whole response; returns for finalizing */

ngx_int_t
ngx_http_llama_session_send_json(ngx_http_request_t *r, ngx_uint_t status,
    ngx_buf_t *b)
{
    ngx_int_t    rc;
    ngx_chain_t  out;

    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    r->headers_out.status = status;
    r->headers_out.content_length_n = b->last - b->pos;
    ngx_str_set(&r->headers_out.content_type, "application/json");
    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}
