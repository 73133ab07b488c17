
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Ollama's API in front of llama-server (llama_session_ollama on;), with
 * sessions as for any other request.  llama-server has no Ollama routes:
 *
 *   POST /api/chat       -> /v1/chat/completions
 *   POST /api/generate   -> /v1/chat/completions (system + prompt, the
 *                           model's template applied, as Ollama does), or
 *                           /v1/completions with "raw"
 *   POST /api/embed      -> /v1/embeddings
 *   GET  /api/version, GET|HEAD /: answered here
 *   GET  /api/tags, /api/ps, POST /api/show: from llama-server's
 *                           /v1/models through the slots location
 *
 * The request body is read whole (llama_session_body_max), translated
 * with cJSON, and proxy_pass sends the translation to the new URI.  The
 * reply comes back through a header and a body filter: llama-server's
 * SSE events become Ollama's NDJSON lines as they arrive (Ollama streams
 * by default), a whole JSON reply one Ollama object, an error
 * {"error":"..."} with its status.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_ollama.h"

#include <cjson/cJSON.h>
#include <openssl/evp.h>


#define NGX_HTTP_LLAMA_SESSION_OLLAMA_VERSION  "0.12.0"
#define NGX_HTTP_LLAMA_SESSION_OLLAMA_REPLY    (8 * 1024 * 1024)
#define NGX_HTTP_LLAMA_SESSION_OLLAMA_EVENT    (1024 * 1024)

/* the tool calls of one streamed reply */
#define NGX_HTTP_LLAMA_SESSION_OLLAMA_CALLS    128

/* the translation's output buffers, in flight at once */
#define NGX_HTTP_LLAMA_SESSION_OLLAMA_BUF      8192
#define NGX_HTTP_LLAMA_SESSION_OLLAMA_BUFS     8

/*
 * JSON values a request may have: cJSON spends some 64 bytes on each, so
 * a body of empty arrays would cost twenty times its size; 100,000 values
 * are more than a long conversation with tools has
 */


/* the reply's translation, kept in the request's pool */

/* a streamed tool call's arguments, appended to in place */

typedef struct {
    u_char                         *data;
    size_t                          len;
    size_t                          size;
} ngx_http_llama_session_ollama_arg_t;


typedef struct {
    ngx_uint_t                      kind;       /* CHAT, GENERATE, EMBED */
    ngx_uint_t                      stream;
    ngx_str_t                       model;
    ngx_buf_t                      *in;         /* what is not translated */
    ngx_uint_t                      status;
    ngx_uint_t                      done;
    ngx_str_t                       done_reason;
    ngx_uint_t                      prompt_tokens;
    ngx_int_t                       prompt_n;   /* evaluated, -1: unknown */
    ngx_int_t                       cached;     /* from the cache, -1 */
    ngx_uint_t                      completion_tokens;
    double                          prompt_ms;
    double                          predicted_ms;
    cJSON                          *tool_calls; /* streamed, put together */
    ngx_array_t                    *args;       /* their arguments, as
                                                   they grow: buffers */

    /* the body filter's flow control */
    ngx_chain_t                    *pending;    /* llama-server's, not
                                                   taken yet */
    ngx_uint_t                      last;       /* its last buffer came */
    ngx_buf_t                      *cur;        /* the output being filled */
    ngx_chain_t                    *free;
    ngx_chain_t                    *busy;
    ngx_uint_t                      nbufs;      /* output buffers made */
} ngx_http_llama_session_ollama_t;


static ngx_int_t ngx_http_llama_session_ollama_answer(ngx_http_request_t *r,
    ngx_uint_t status, char *type, u_char *data, size_t len);
static cJSON *ngx_http_llama_session_ollama_chat(cJSON *in,
    ngx_uint_t generate, ngx_uint_t *stream);
static cJSON *ngx_http_llama_session_ollama_messages(cJSON *messages);
static void ngx_http_llama_session_ollama_options(cJSON *in, cJSON *out);
static ngx_int_t ngx_http_llama_session_ollama_header(ngx_http_request_t *r);
static ngx_int_t ngx_http_llama_session_ollama_dups(ngx_pool_t *pool,
    cJSON *item);
static ngx_int_t ngx_http_llama_session_ollama_body(ngx_http_request_t *r,
    ngx_chain_t *in);
static ngx_int_t ngx_http_llama_session_ollama_event(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, u_char *data, size_t len,
    ngx_chain_t ***ll);
static ngx_int_t ngx_http_llama_session_ollama_whole(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, ngx_chain_t ***ll);
static cJSON *ngx_http_llama_session_ollama_object(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, ngx_uint_t done);
static void ngx_http_llama_session_ollama_stats(
    ngx_http_llama_session_ollama_t *o, cJSON *reply);
static ngx_int_t ngx_http_llama_session_ollama_emit(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, cJSON *json, ngx_uint_t nl,
    ngx_chain_t ***ll);
static ngx_int_t ngx_http_llama_session_ollama_write(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, u_char *data, size_t len,
    ngx_chain_t ***ll);
static ngx_uint_t ngx_http_llama_session_ollama_inflight(
    ngx_http_llama_session_ollama_t *o);
static ngx_uint_t ngx_http_llama_session_ollama_index(
    ngx_http_llama_session_ollama_t *o, cJSON *mine);
static ngx_int_t ngx_http_llama_session_ollama_consume(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, ngx_chain_t ***ll);
static void ngx_http_llama_session_ollama_cleanup(void *data);


static ngx_http_output_header_filter_pt  ngx_http_next_header_filter;
static ngx_http_output_body_filter_pt    ngx_http_next_body_filter;


ngx_int_t
ngx_http_llama_session_ollama_init(ngx_conf_t *cf)
{
    ngx_http_next_header_filter = ngx_http_top_header_filter;
    ngx_http_top_header_filter = ngx_http_llama_session_ollama_header;

    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_llama_session_ollama_body;

    return NGX_OK;
}


/*
 * A request in a location with llama_session_ollama: NGX_DECLINED for the
 * inference paths (the session's way, ctx->ollama set), else answered.
 */

ngx_int_t
ngx_http_llama_session_ollama_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    if (r->uri.len == 1 && r->uri.data[0] == '/'
        && (r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD)))
    {
        ngx_http_finalize_request(r,
                       ngx_http_llama_session_ollama_answer(r, NGX_HTTP_OK,
                                           "text/plain; charset=utf-8",
                                           (u_char *) "Ollama is running",
                                           sizeof("Ollama is running") - 1));
        return NGX_DONE;
    }

    if (ngx_http_llama_session_uri_ends(r, "/api/version")
        && (r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD)))
    {
        ngx_http_finalize_request(r,
                       ngx_http_llama_session_ollama_answer(r, NGX_HTTP_OK,
                              "application/json; charset=utf-8",
                              (u_char *) "{\"version\":\""
                              NGX_HTTP_LLAMA_SESSION_OLLAMA_VERSION "\"}",
                              sizeof("{\"version\":\""
                                     NGX_HTTP_LLAMA_SESSION_OLLAMA_VERSION
                                     "\"}") - 1));
        return NGX_DONE;
    }

    if (r->method == NGX_HTTP_POST) {
        if (ngx_http_llama_session_uri_ends(r, "/api/chat")) {
            ctx->ollama = NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT;
            return NGX_DECLINED;
        }

        if (ngx_http_llama_session_uri_ends(r, "/api/generate")) {
            ctx->ollama = NGX_HTTP_LLAMA_SESSION_OLLAMA_GENERATE;
            return NGX_DECLINED;
        }

        if (ngx_http_llama_session_uri_ends(r, "/api/embed")) {
            ctx->ollama = NGX_HTTP_LLAMA_SESSION_OLLAMA_EMBED;
            return NGX_DECLINED;
        }
    }

    if ((ngx_http_llama_session_uri_ends(r, "/api/tags")
         || ngx_http_llama_session_uri_ends(r, "/api/ps"))
        && (r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD)))
    {
        ctx->ollama = ngx_http_llama_session_uri_ends(r, "/api/ps")
                      ? NGX_HTTP_LLAMA_SESSION_OLLAMA_PS
                      : NGX_HTTP_LLAMA_SESSION_OLLAMA_TAGS;
        return NGX_AGAIN;
    }

    if (ngx_http_llama_session_uri_ends(r, "/api/show")
        && r->method == NGX_HTTP_POST)
    {
        ctx->ollama = NGX_HTTP_LLAMA_SESSION_OLLAMA_SHOW;
        return NGX_AGAIN;
    }

    return ngx_http_llama_session_ollama_error(r, ctx, NGX_HTTP_NOT_FOUND,
                                               "404 page not found");
}


/* an Ollama error: {"error":"..."} */

ngx_int_t
ngx_http_llama_session_ollama_error(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t status, char *message)
{
    u_char  *p, *q;
    size_t   len;

    len = ngx_strlen(message);

    p = ngx_pnalloc(r->pool, sizeof("{\"error\":\"\"}\n") + 2 * len);
    if (p == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    q = ngx_cpymem(p, "{\"error\":\"", sizeof("{\"error\":\"") - 1);
    q = (u_char *) ngx_escape_json(q, (u_char *) message, len);
    q = ngx_cpymem(q, "\"}\n", 3);

    if (ctx) {
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_DONE);
        ctx->status = NGX_DONE;
    }

    ngx_http_finalize_request(r, ngx_http_llama_session_ollama_answer(r,
                                        status,
                                        "application/json; charset=utf-8",
                                        p, q - p));
    return NGX_DONE;
}


static ngx_int_t
ngx_http_llama_session_ollama_answer(ngx_http_request_t *r, ngx_uint_t status,
    char *type, u_char *data, size_t len)
{
    ngx_int_t    rc;
    ngx_buf_t   *b;
    ngx_chain_t  out;

    if (ngx_http_discard_request_body(r) != NGX_OK) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    b = ngx_calloc_buf(r->pool);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    b->pos = data;
    b->last = data + len;
    b->memory = 1;
    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    r->headers_out.status = status;
    r->headers_out.content_length_n = len;
    r->headers_out.content_type.data = (u_char *) type;
    r->headers_out.content_type.len = ngx_strlen(type);
    r->headers_out.content_type_len = r->headers_out.content_type.len;

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}


/*
 * Has any object of the tree a member name twice (names as decoded)?
 * NGX_DECLINED then, NGX_OK if none.  The names of an object are sorted
 * (no pairwise compare: an object may have 100,000 members).
 */

static int ngx_libc_cdecl
ngx_http_llama_session_ollama_cmp(const void *a, const void *b)
{
    return ngx_strcmp(*(char **) a, *(char **) b);
}


static ngx_int_t
ngx_http_llama_session_ollama_dups(ngx_pool_t *pool, cJSON *item)
{
    char        **names;
    cJSON        *c;
    ngx_int_t     rc;
    ngx_uint_t    i, n;

    for ( /* void */ ; item; item = item->next) {

        if (item->child == NULL) {
            continue;
        }

        if (cJSON_IsObject(item) && item->child->next) {
            n = 0;

            for (c = item->child; c; c = c->next) {
                n++;
            }

            names = ngx_palloc(pool, n * sizeof(char *));
            if (names == NULL) {
                return NGX_ERROR;
            }

            n = 0;

            for (c = item->child; c; c = c->next) {
                names[n++] = c->string ? c->string : "";
            }

            ngx_qsort(names, n, sizeof(char *),
                      ngx_http_llama_session_ollama_cmp);

            for (i = 1; i < n; i++) {
                if (ngx_strcmp(names[i - 1], names[i]) == 0) {
                    ngx_pfree(pool, names);
                    return NGX_DECLINED;
                }
            }

            ngx_pfree(pool, names);
        }

        rc = ngx_http_llama_session_ollama_dups(pool, item->child);

        if (rc != NGX_OK) {
            return rc;
        }
    }

    return NGX_OK;
}


/*
 * The body was read and the session found: the Ollama request becomes
 * llama-server's.  NGX_OK, or NGX_DONE when an error was sent.
 */

ngx_int_t
ngx_http_llama_session_ollama_request(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    char                               *text;
    cJSON                              *in, *out, *raw, *model, *item;
    ngx_int_t                           rc;
    ngx_str_t                           body, uri;
    ngx_buf_t                          *b;
    ngx_uint_t                          stream;
    ngx_chain_t                        *cl;
    ngx_pool_cleanup_t                 *cln;
    ngx_http_llama_session_ollama_t    *o;
    ngx_http_llama_session_loc_conf_t  *llcf;

    /* the body identify read whole, or, for an embed, read now */

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    body = ctx->body;

    if (body.data == NULL
        && ngx_http_llama_session_read_body(r, llcf->body_max, &body)
           != NGX_OK)
    {
        return ngx_http_llama_session_ollama_error(r, ctx,
                                  NGX_HTTP_BAD_REQUEST,
                                  "the request body is missing or larger "
                                  "than the server takes");
    }

    if (ngx_http_llama_session_json_values(body.data, body.len)
        > NGX_HTTP_LLAMA_SESSION_JSON_VALUES)
    {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: an Ollama request with more than %d "
                      "JSON values, refused",
                      NGX_HTTP_LLAMA_SESSION_JSON_VALUES);

        return ngx_http_llama_session_ollama_error(r, ctx,
                                  NGX_HTTP_BAD_REQUEST,
                                  "the request has too many JSON values");
    }

    in = cJSON_ParseWithLength((char *) body.data, body.len);

    if (!cJSON_IsObject(in)) {
        cJSON_Delete(in);
        return ngx_http_llama_session_ollama_error(r, ctx,
                                                   NGX_HTTP_BAD_REQUEST,
                                                   "invalid JSON body");
    }

    /*
     * cJSON finds the first of duplicate members, the body scanner (the
     * session, the router's zone) and llama-server the last: a body that
     * has any is refused, so that all read one request
     */

    rc = ngx_http_llama_session_ollama_dups(r->pool, in);

    if (rc != NGX_OK) {
        cJSON_Delete(in);

        if (rc == NGX_ERROR) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: an Ollama request with a member twice "
                      "in one object, refused");

        return ngx_http_llama_session_ollama_error(r, ctx,
                                  NGX_HTTP_BAD_REQUEST,
                                  "a JSON object of the request has a member "
                                  "twice");
    }

    model = cJSON_GetObjectItemCaseSensitive(in, "model");

    if (!cJSON_IsString(model) || model->valuestring[0] == '\0') {
        cJSON_Delete(in);
        return ngx_http_llama_session_ollama_error(r, ctx,
                                                   NGX_HTTP_BAD_REQUEST,
                                                   "model is required");
    }

    o = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_ollama_t));
    if (o == NULL) {
        cJSON_Delete(in);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    o->kind = ctx->ollama;
    o->prompt_n = -1;
    o->cached = -1;
    o->model.len = ngx_strlen(model->valuestring);
    o->model.data = ngx_pnalloc(r->pool, o->model.len);
    if (o->model.data == NULL) {
        cJSON_Delete(in);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ngx_memcpy(o->model.data, model->valuestring, o->model.len);

    stream = 0;

    item = cJSON_GetObjectItemCaseSensitive(
                        cJSON_GetObjectItemCaseSensitive(in, "options"),
                        "num_ctx");

    if (item) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: Ollama's options.num_ctx is ignored: "
                      "llama-server's context is its -c");
    }

    switch (ctx->ollama) {

    case NGX_HTTP_LLAMA_SESSION_OLLAMA_EMBED:
        ngx_str_set(&uri, "/v1/embeddings");

        out = cJSON_CreateObject();
        item = cJSON_GetObjectItemCaseSensitive(in, "input");

        if (out == NULL || item == NULL
            || !cJSON_AddItemToObject(out, "model",
                                      cJSON_Duplicate(model, 1))
            || !cJSON_AddItemToObject(out, "input",
                                      cJSON_Duplicate(item, 1)))
        {
            cJSON_Delete(out);
            cJSON_Delete(in);
            return ngx_http_llama_session_ollama_error(r, ctx,
                                                   NGX_HTTP_BAD_REQUEST,
                                                   "input is required");
        }

        break;

    case NGX_HTTP_LLAMA_SESSION_OLLAMA_GENERATE:
        raw = cJSON_GetObjectItemCaseSensitive(in, "raw");

        if (cJSON_IsTrue(raw)) {
            ngx_str_set(&uri, "/v1/completions");
            out = ngx_http_llama_session_ollama_chat(in, 2, &stream);
            break;
        }

        ngx_str_set(&uri, "/v1/chat/completions");
        out = ngx_http_llama_session_ollama_chat(in, 1, &stream);
        break;

    default: /* NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT */
        ngx_str_set(&uri, "/v1/chat/completions");
        out = ngx_http_llama_session_ollama_chat(in, 0, &stream);
        break;
    }

    cJSON_Delete(in);

    if (out == NULL) {
        return ngx_http_llama_session_ollama_error(r, ctx,
                                  NGX_HTTP_BAD_REQUEST,
                                  "invalid request: messages, prompt, "
                                  "options or format of the wrong type");
    }

    text = cJSON_PrintUnformatted(out);
    cJSON_Delete(out);

    if (text == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    b = ngx_create_temp_buf(r->pool, ngx_strlen(text));
    if (b == NULL) {
        cJSON_free(text);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    b->last = ngx_cpymem(b->last, text, ngx_strlen(text));
    b->last_buf = 1;
    b->last_in_chain = 1;
    cJSON_free(text);

    cl = ngx_alloc_chain_link(r->pool);
    if (cl == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    cl->buf = b;
    cl->next = NULL;

    r->request_body->bufs = cl;
    r->request_body->temp_file = NULL;
    r->headers_in.content_length_n = b->last - b->pos;

    /* proxy_pass sends the new path (without a URI part of its own) */

    r->uri = uri;
    r->valid_unparsed_uri = 0;
    r->args.len = 0;

    o->stream = stream;
    ctx->ollama_reply = o;

    /* tool calls put together from a stream are cJSON's: freed at the end */

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    cln->handler = ngx_http_llama_session_ollama_cleanup;
    cln->data = o;

    return NGX_OK;
}


/*
 * Ollama's chat or generate request as llama-server's chat completion
 * (generate 1: system + prompt as messages; 2: raw, a completion).
 */

static cJSON *
ngx_http_llama_session_ollama_chat(cJSON *in, ngx_uint_t generate,
    ngx_uint_t *stream)
{
    cJSON  *out, *item, *messages, *m, *format, *rf, *think, *kw, *so;

    out = cJSON_CreateObject();
    if (out == NULL) {
        return NULL;
    }

    item = cJSON_GetObjectItemCaseSensitive(in, "model");
    cJSON_AddItemToObject(out, "model", cJSON_Duplicate(item, 1));

    if (generate == 2) {
        item = cJSON_GetObjectItemCaseSensitive(in, "prompt");

        if (!cJSON_IsString(item)) {
            goto failed;
        }

        cJSON_AddItemToObject(out, "prompt", cJSON_Duplicate(item, 1));

    } else if (generate) {
        messages = cJSON_AddArrayToObject(out, "messages");
        if (messages == NULL) {
            goto failed;
        }

        item = cJSON_GetObjectItemCaseSensitive(in, "system");

        if (cJSON_IsString(item) && item->valuestring[0]) {
            m = cJSON_CreateObject();
            cJSON_AddItemToArray(messages, m);
            cJSON_AddStringToObject(m, "role", "system");
            cJSON_AddItemToObject(m, "content", cJSON_Duplicate(item, 1));
        }

        item = cJSON_GetObjectItemCaseSensitive(in, "prompt");

        if (item && !cJSON_IsString(item)) {
            goto failed;
        }

        m = cJSON_CreateObject();
        cJSON_AddItemToArray(messages, m);
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content",
                                item ? item->valuestring : "");

        item = cJSON_GetObjectItemCaseSensitive(in, "images");

        if (cJSON_IsArray(item)) {
            cJSON_AddItemToObject(m, "images", cJSON_Duplicate(item, 1));
        }

        item = ngx_http_llama_session_ollama_messages(messages);
        if (item == NULL) {
            goto failed;
        }

        cJSON_ReplaceItemInObjectCaseSensitive(out, "messages", item);

    } else {
        item = cJSON_GetObjectItemCaseSensitive(in, "messages");

        if (item && !cJSON_IsArray(item)) {
            goto failed;
        }

        messages = ngx_http_llama_session_ollama_messages(item);
        if (messages == NULL) {
            goto failed;
        }

        cJSON_AddItemToObject(out, "messages", messages);

        item = cJSON_GetObjectItemCaseSensitive(in, "tools");

        if (cJSON_IsArray(item)) {
            cJSON_AddItemToObject(out, "tools", cJSON_Duplicate(item, 1));
        }
    }

    /* Ollama streams unless told not to */

    item = cJSON_GetObjectItemCaseSensitive(in, "stream");
    *stream = !cJSON_IsFalse(item);

    cJSON_AddBoolToObject(out, "stream", *stream);

    if (*stream) {
        so = cJSON_AddObjectToObject(out, "stream_options");
        cJSON_AddTrueToObject(so, "include_usage");
    }

    /* "json" or a JSON schema */

    format = cJSON_GetObjectItemCaseSensitive(in, "format");

    if (cJSON_IsString(format) && ngx_strcmp(format->valuestring, "json") == 0)
    {
        rf = cJSON_AddObjectToObject(out, "response_format");
        cJSON_AddStringToObject(rf, "type", "json_object");

    } else if (cJSON_IsObject(format)) {
        rf = cJSON_AddObjectToObject(out, "response_format");
        cJSON_AddStringToObject(rf, "type", "json_schema");
        item = cJSON_AddObjectToObject(rf, "json_schema");
        cJSON_AddStringToObject(item, "name", "format");
        cJSON_AddItemToObject(item, "schema", cJSON_Duplicate(format, 1));

    } else if (format && !cJSON_IsNull(format)
               && !(cJSON_IsString(format) && format->valuestring[0] == '\0'))
    {
        goto failed;
    }

    /* think: the template's enable_thinking */

    think = cJSON_GetObjectItemCaseSensitive(in, "think");

    if (cJSON_IsBool(think) || cJSON_IsString(think)) {
        kw = cJSON_AddObjectToObject(out, "chat_template_kwargs");
        cJSON_AddBoolToObject(kw, "enable_thinking", !cJSON_IsFalse(think));
    }

    item = cJSON_GetObjectItemCaseSensitive(in, "options");

    if (item && !cJSON_IsObject(item) && !cJSON_IsNull(item)) {
        goto failed;
    }

    ngx_http_llama_session_ollama_options(item, out);

    return out;

failed:

    cJSON_Delete(out);
    return NULL;
}


/*
 * Ollama's messages as OpenAI's: images become image parts, a tool call's
 * arguments object a JSON string, thinking reasoning_content, tool_name
 * the tool message's name.
 */

static cJSON *
ngx_http_llama_session_ollama_messages(cJSON *messages)
{
    char   *args;
    cJSON  *out, *m, *o, *item, *images, *image, *parts, *part, *url, *calls;
    cJSON  *call, *f, *c, *cf, *a;
    u_char  data[64];

    out = cJSON_CreateArray();
    if (out == NULL) {
        return NULL;
    }

    cJSON_ArrayForEach(m, messages) {
        if (!cJSON_IsObject(m)) {
            goto failed;
        }

        o = cJSON_CreateObject();
        if (o == NULL) {
            goto failed;
        }

        cJSON_AddItemToArray(out, o);

        item = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsString(item)) {
            goto failed;
        }

        cJSON_AddItemToObject(o, "role", cJSON_Duplicate(item, 1));

        item = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (item && !cJSON_IsString(item)) {
            goto failed;
        }

        images = cJSON_GetObjectItemCaseSensitive(m, "images");

        if (cJSON_IsArray(images) && cJSON_GetArraySize(images)) {
            parts = cJSON_AddArrayToObject(o, "content");

            part = cJSON_CreateObject();
            cJSON_AddItemToArray(parts, part);
            cJSON_AddStringToObject(part, "type", "text");
            cJSON_AddStringToObject(part, "text",
                                    item ? item->valuestring : "");

            cJSON_ArrayForEach(image, images) {
                if (!cJSON_IsString(image)) {
                    goto failed;
                }

                /* Ollama sends base64 without a type: guess it */

                ngx_cpystrn(data, (u_char *)
                            (ngx_strncmp(image->valuestring, "iVBOR", 5) == 0
                             ? "data:image/png;base64,"
                             : ngx_strncmp(image->valuestring, "R0lG", 4) == 0
                             ? "data:image/gif;base64,"
                             : ngx_strncmp(image->valuestring, "UklG", 4) == 0
                             ? "data:image/webp;base64,"
                             : "data:image/jpeg;base64,"), sizeof(data));

                part = cJSON_CreateObject();
                cJSON_AddItemToArray(parts, part);
                cJSON_AddStringToObject(part, "type", "image_url");
                url = cJSON_AddObjectToObject(part, "image_url");

                /* cJSON's allocator: the strings end up in its objects */

                args = cJSON_malloc(ngx_strlen((char *) data)
                                    + ngx_strlen(image->valuestring) + 1);
                if (args == NULL) {
                    goto failed;
                }

                ngx_sprintf((u_char *) args, "%s%s%Z", data,
                            image->valuestring);
                cJSON_AddStringToObject(url, "url", args);
                cJSON_free(args);
            }

        } else {
            cJSON_AddStringToObject(o, "content",
                                    item ? item->valuestring : "");
        }

        item = cJSON_GetObjectItemCaseSensitive(m, "thinking");
        if (cJSON_IsString(item)) {
            cJSON_AddItemToObject(o, "reasoning_content",
                                  cJSON_Duplicate(item, 1));
        }

        item = cJSON_GetObjectItemCaseSensitive(m, "tool_name");
        if (cJSON_IsString(item)) {
            cJSON_AddItemToObject(o, "name", cJSON_Duplicate(item, 1));
        }

        calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");

        if (cJSON_IsArray(calls)) {
            c = cJSON_AddArrayToObject(o, "tool_calls");

            cJSON_ArrayForEach(call, calls) {
                f = cJSON_GetObjectItemCaseSensitive(call, "function");
                item = cJSON_GetObjectItemCaseSensitive(f, "name");
                a = cJSON_GetObjectItemCaseSensitive(f, "arguments");

                if (!cJSON_IsString(item)) {
                    goto failed;
                }

                cf = cJSON_CreateObject();
                cJSON_AddItemToArray(c, cf);
                cJSON_AddStringToObject(cf, "type", "function");
                f = cJSON_AddObjectToObject(cf, "function");
                cJSON_AddItemToObject(f, "name", cJSON_Duplicate(item, 1));

                args = a ? cJSON_PrintUnformatted(a) : NULL;
                cJSON_AddStringToObject(f, "arguments", args ? args : "{}");

                if (args) {
                    cJSON_free(args);
                }
            }
        }
    }

    return out;

failed:

    cJSON_Delete(out);
    return NULL;
}


/* Ollama's options as llama-server's sampling parameters */

static void
ngx_http_llama_session_ollama_options(cJSON *in, cJSON *out)
{
    cJSON       *item;
    ngx_uint_t   i;

    static const char  *same[] = {
        "temperature", "top_k", "top_p", "min_p", "seed", "stop",
        "repeat_penalty", "repeat_last_n", "presence_penalty",
        "frequency_penalty", "typical_p", "mirostat", "mirostat_tau",
        "mirostat_eta", "tfs_z", NULL
    };

    if (!cJSON_IsObject(in)) {
        return;
    }

    for (i = 0; same[i]; i++) {
        item = cJSON_GetObjectItemCaseSensitive(in, same[i]);

        if (item && (cJSON_IsNumber(item) || cJSON_IsArray(item)
                     || cJSON_IsString(item)))
        {
            cJSON_AddItemToObject(out, same[i], cJSON_Duplicate(item, 1));
        }
    }

    /* num_predict: max_tokens (-1: no limit); num_ctx: llama-server's -c */

    item = cJSON_GetObjectItemCaseSensitive(in, "num_predict");

    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        cJSON_AddNumberToObject(out, "max_tokens", item->valuedouble);
    }
}


/* the reply: its header */

static ngx_int_t
ngx_http_llama_session_ollama_header(ngx_http_request_t *r)
{
    ngx_http_llama_session_ctx_t     *ctx;
    ngx_http_llama_session_ollama_t  *o;

    if (r != r->main) {
        return ngx_http_next_header_filter(r);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx == NULL || ctx->ollama_reply == NULL
        || ctx->job.state != NGX_HTTP_LLAMA_SESSION_ST_PROXY)
    {
        return ngx_http_next_header_filter(r);
    }

    o = ctx->ollama_reply;
    o->status = r->headers_out.status;

    if (o->status != NGX_HTTP_OK || !o->stream) {
        /* a whole JSON reply, translated at its end */
        ngx_str_set(&r->headers_out.content_type,
                    "application/json; charset=utf-8");

    } else {
        ngx_str_set(&r->headers_out.content_type, "application/x-ndjson");
    }

    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;

    ngx_http_clear_content_length(r);
    ngx_http_clear_accept_ranges(r);
    ngx_http_weak_etag(r);

    r->filter_need_in_memory = 1;

    if (r->upstream) {
        /*
         * the reply is translated from memory as it comes: never spooled
         * to a temporary file (this filter runs before nginx's copy
         * filter would read one back)
         */
        r->upstream->buffering = 0;
    }

    o->in = ngx_create_temp_buf(r->pool, 4096);
    if (o->in == NULL) {
        return NGX_ERROR;
    }

    return ngx_http_next_header_filter(r);
}


/*
 * The reply's body: SSE events become lines, a whole JSON one object.
 *
 * With nginx's flow control, as the plain proxy path has it: the output
 * goes into a few buffers of the filter's own (NGX_HTTP_LLAMA_SESSION_
 * OLLAMA_BUFS of NGX_HTTP_LLAMA_SESSION_OLLAMA_BUF bytes), reused once
 * sent; while all of them wait for a client that does not read, the
 * filter stops taking llama-server's bytes: they stay in the upstream's
 * buffer, which then stops reading from llama-server.  Memory per stream
 * is those buffers, the upstream's, and one event being put together.
 */

static ngx_int_t
ngx_http_llama_session_ollama_body(ngx_http_request_t *r, ngx_chain_t *in)
{
    ngx_int_t                         rc;
    ngx_chain_t                      *cl, *out, **ll;
    ngx_http_llama_session_ctx_t     *ctx;
    ngx_http_llama_session_ollama_t  *o;

    if (r != r->main) {
        return ngx_http_next_body_filter(r, in);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx == NULL || ctx->ollama_reply == NULL) {
        return ngx_http_next_body_filter(r, in);
    }

    o = ctx->ollama_reply;

    if (o->in == NULL) {
        /* not translated, or translated whole already */
        return ngx_http_next_body_filter(r, in);
    }

    if (in && ngx_chain_add_copy(r->pool, &o->pending, in) != NGX_OK) {
        return NGX_ERROR;
    }

    for ( ;; ) {
        out = NULL;
        ll = &out;

        if (ngx_http_llama_session_ollama_consume(r, o, &ll) != NGX_OK) {
            return NGX_ERROR;
        }

        if (out) {
            /* every line as it comes: flushed */
            for (cl = out; cl->next; cl = cl->next) { /* void */ }
            cl->buf->flush = 1;
        }

        if (out == NULL && o->busy == NULL) {
            return NGX_OK;
        }

        rc = ngx_http_next_body_filter(r, out);

        o->cur = NULL;
        ngx_chain_update_chains(r->pool, &o->free, &o->busy, &out,
                                (ngx_buf_tag_t) &ngx_http_llama_session_module);

        if (rc == NGX_ERROR || o->in == NULL || o->pending == NULL
            || ngx_http_llama_session_ollama_inflight(o)
               >= NGX_HTTP_LLAMA_SESSION_OLLAMA_BUFS)
        {
            /* done, or the next write event of the client's goes on */
            return rc;
        }

        /*
         * the client took some: on with what waits (with room, consume()
         * takes at least a line, or all), else nothing would: llama-
         * server's bytes would wait in the upstream's full buffer with no
         * event to come
         */
    }
}


/* the output buffers sent on and not yet written to the client */

static ngx_uint_t
ngx_http_llama_session_ollama_inflight(ngx_http_llama_session_ollama_t *o)
{
    ngx_uint_t    n;
    ngx_chain_t  *cl;

    n = o->nbufs;

    for (cl = o->free; cl; cl = cl->next) {
        n--;
    }

    return n;
}


/*
 * Takes what waits of llama-server's reply while there is room for its
 * translation: a stream line by line, a whole reply until its end.
 */

static ngx_int_t
ngx_http_llama_session_ollama_consume(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, ngx_chain_t ***ll)
{
    u_char       *p, *line, *end, *nl;
    size_t        size, len;
    ngx_buf_t    *b, *nb;
    ngx_uint_t    stream;
    ngx_chain_t  *cl;

    stream = (o->stream && o->status == NGX_HTTP_OK);

    while (o->pending) {
        cl = o->pending;
        b = cl->buf;

        if (!ngx_buf_in_memory(b) && ngx_buf_size(b)) {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "llama_session: a reply in a file cannot be "
                          "translated for Ollama");
            return NGX_ERROR;
        }

        if (ngx_buf_in_memory(b) && b->last > b->pos) {

            if (stream
                && ngx_http_llama_session_ollama_inflight(o)
                   >= NGX_HTTP_LLAMA_SESSION_OLLAMA_BUFS)
            {
                /* the client does not read: llama-server's bytes wait */
                return NGX_OK;
            }

            /* a stream one line at a time, a whole reply as it comes */

            nl = stream ? ngx_strlchr(b->pos, b->last, '\n') : NULL;
            len = nl ? (size_t) (nl + 1 - b->pos) : (size_t) (b->last - b->pos);
            size = (o->in->last - o->in->pos) + len;

            if (size > (stream ? NGX_HTTP_LLAMA_SESSION_OLLAMA_EVENT
                               : NGX_HTTP_LLAMA_SESSION_OLLAMA_REPLY))
            {
                ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                              "llama_session: a reply too large to "
                              "translate for Ollama");
                return NGX_ERROR;
            }

            if ((size_t) (o->in->end - o->in->last) < len) {
                nb = ngx_create_temp_buf(r->pool, ngx_max(2 * size, 4096));
                if (nb == NULL) {
                    return NGX_ERROR;
                }

                nb->last = ngx_cpymem(nb->last, o->in->pos,
                                      o->in->last - o->in->pos);
                o->in = nb;
            }

            o->in->last = ngx_cpymem(o->in->last, b->pos, len);
            b->pos += len;

            if (nl == NULL) {
                continue;
            }

            /* a whole line: "data: {...}" */

            line = o->in->pos;
            end = o->in->last - 1;
            o->in->pos = o->in->start;
            o->in->last = o->in->start;

            p = end;
            if (p > line && p[-1] == '\r') {
                p--;
            }

            if (p - line > 5 && ngx_strncmp(line, "data:", 5) == 0) {
                line += 5;

                while (line < p && *line == ' ') {
                    line++;
                }

                if (ngx_http_llama_session_ollama_event(r, o, line, p - line,
                                                        ll)
                    != NGX_OK)
                {
                    return NGX_ERROR;
                }
            }

            continue;
        }

        if (b->last_buf) {
            o->last = 1;
        }

        o->pending = cl->next;
        ngx_free_chain(r->pool, cl);
    }

    if (!o->last) {
        return NGX_OK;
    }

    if (!stream) {
        if (ngx_http_llama_session_ollama_whole(r, o, ll) != NGX_OK) {
            return NGX_ERROR;
        }

    } else if (!o->done) {
        /* a stream that ended without its last event */
        if (ngx_http_llama_session_ollama_emit(r, o,
                          ngx_http_llama_session_ollama_object(r, o, 1), 1,
                          ll)
            != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    nb = ngx_calloc_buf(r->pool);
    if (nb == NULL) {
        return NGX_ERROR;
    }

    nb->last_buf = 1;
    nb->last_in_chain = 1;

    cl = ngx_alloc_chain_link(r->pool);
    if (cl == NULL) {
        return NGX_ERROR;
    }

    cl->buf = nb;
    cl->next = NULL;
    **ll = cl;
    *ll = &cl->next;

    o->in = NULL;

    return NGX_OK;
}


/* the position of a tool call in the calls put together */

static ngx_uint_t
ngx_http_llama_session_ollama_index(ngx_http_llama_session_ollama_t *o,
    cJSON *mine)
{
    cJSON       *c;
    ngx_uint_t   i;

    i = 0;

    for (c = o->tool_calls->child; c && c != mine; c = c->next) {
        i++;
    }

    return i;
}


/* one SSE event of llama-server: a line of Ollama's stream, or none */

static ngx_int_t
ngx_http_llama_session_ollama_event(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, u_char *data, size_t len,
    ngx_chain_t ***ll)
{
    cJSON      *json, *choices, *choice, *delta, *content, *reasoning;
    cJSON      *finish, *calls, *call, *index, *f, *name, *args, *mine, *mf;
    cJSON      *line, *msg;
    u_char     *joined;
    size_t      n, m;
    ngx_int_t   rc;
    ngx_uint_t  i;
    ngx_http_llama_session_ollama_arg_t  *arg;

    if (len == 6 && ngx_strncmp(data, "[DONE]", 6) == 0) {
        if (o->done) {
            return NGX_OK;
        }

        o->done = 1;
        return ngx_http_llama_session_ollama_emit(r, o,
                             ngx_http_llama_session_ollama_object(r, o, 1),
                             1, ll);
    }

    json = ngx_http_llama_session_json_tree(data, len);

    if (json == NULL) {
        return NGX_OK;
    }

    ngx_http_llama_session_ollama_stats(o, json);

    choices = cJSON_GetObjectItemCaseSensitive(json, "choices");
    choice = cJSON_GetArrayItem(choices, 0);
    delta = cJSON_GetObjectItemCaseSensitive(choice, "delta");
    finish = cJSON_GetObjectItemCaseSensitive(choice, "finish_reason");

    if (cJSON_IsString(finish)) {
        o->done_reason.len = ngx_strlen(finish->valuestring);
        o->done_reason.data = ngx_pnalloc(r->pool, o->done_reason.len);
        if (o->done_reason.data) {
            ngx_memcpy(o->done_reason.data, finish->valuestring,
                       o->done_reason.len);

        } else {
            o->done_reason.len = 0;
        }
    }

    content = cJSON_GetObjectItemCaseSensitive(delta, "content");
    reasoning = cJSON_GetObjectItemCaseSensitive(delta, "reasoning_content");

    if (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_GENERATE && choice
        && content == NULL)
    {
        /* a raw completion's event */
        content = cJSON_GetObjectItemCaseSensitive(choice, "text");
    }

    /* tool calls come in pieces: put together, sent with the last line */

    calls = cJSON_GetObjectItemCaseSensitive(delta, "tool_calls");

    cJSON_ArrayForEach(call, calls) {
        index = cJSON_GetObjectItemCaseSensitive(call, "index");
        f = cJSON_GetObjectItemCaseSensitive(call, "function");
        name = cJSON_GetObjectItemCaseSensitive(f, "name");
        args = cJSON_GetObjectItemCaseSensitive(f, "arguments");

        if (o->tool_calls == NULL) {
            o->tool_calls = cJSON_CreateArray();
            if (o->tool_calls == NULL) {
                break;
            }
        }

        mine = cJSON_GetArrayItem(o->tool_calls,
                                  cJSON_IsNumber(index) ? index->valueint
                                  : cJSON_GetArraySize(o->tool_calls) - 1);

        if (mine == NULL || (cJSON_IsString(name) && name->valuestring[0]
                             && cJSON_IsNumber(index)
                             && index->valueint
                                >= cJSON_GetArraySize(o->tool_calls)))
        {
            if (cJSON_GetArraySize(o->tool_calls)
                >= NGX_HTTP_LLAMA_SESSION_OLLAMA_CALLS)
            {
                /* each piece looks its call up: a few calls, not a million */
                ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                              "llama_session: a reply with more than %d tool "
                              "calls, not translated for Ollama",
                              NGX_HTTP_LLAMA_SESSION_OLLAMA_CALLS);
                cJSON_Delete(json);
                return NGX_ERROR;
            }

            mine = cJSON_CreateObject();
            cJSON_AddItemToArray(o->tool_calls, mine);
            mf = cJSON_AddObjectToObject(mine, "function");
            cJSON_AddStringToObject(mf, "name", "");
            cJSON_AddStringToObject(mf, "arguments", "");

            if (o->args == NULL) {
                o->args = ngx_array_create(r->pool, 4,
                                   sizeof(ngx_http_llama_session_ollama_arg_t));
                if (o->args == NULL) {
                    cJSON_Delete(json);
                    return NGX_ERROR;
                }
            }

            arg = ngx_array_push(o->args);
            if (arg == NULL) {
                cJSON_Delete(json);
                return NGX_ERROR;
            }

            ngx_memzero(arg, sizeof(ngx_http_llama_session_ollama_arg_t));
        }

        mf = cJSON_GetObjectItemCaseSensitive(mine, "function");

        if (cJSON_IsString(name) && name->valuestring[0]) {
            cJSON_ReplaceItemInObjectCaseSensitive(mf, "name",
                                              cJSON_CreateString(
                                                  name->valuestring));
        }

        /*
         * the piece goes at the end of the call's buffer, which doubles as
         * it fills: linear in the arguments, however many pieces
         */

        i = ngx_http_llama_session_ollama_index(o, mine);

        if (cJSON_IsString(args) && o->args && i < o->args->nelts) {
            arg = &((ngx_http_llama_session_ollama_arg_t *) o->args->elts)[i];
            m = ngx_strlen(args->valuestring);

            if (arg->len + m > NGX_HTTP_LLAMA_SESSION_OLLAMA_REPLY) {
                ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                              "llama_session: a tool call's arguments are "
                              "too large to translate for Ollama");
                cJSON_Delete(json);
                return NGX_ERROR;
            }

            if (arg->len + m > arg->size) {
                n = ngx_max(2 * (arg->len + m), 256);

                joined = ngx_palloc(r->pool, n);
                if (joined == NULL) {
                    cJSON_Delete(json);
                    return NGX_ERROR;
                }

                if (arg->len) {
                    ngx_memcpy(joined, arg->data, arg->len);
                }

                if (arg->data) {
                    ngx_pfree(r->pool, arg->data);
                }

                arg->data = joined;
                arg->size = n;
            }

            ngx_memcpy(arg->data + arg->len, args->valuestring, m);
            arg->len += m;
        }
    }

    rc = NGX_OK;

    if ((cJSON_IsString(content) && content->valuestring[0])
        || (cJSON_IsString(reasoning) && reasoning->valuestring[0]))
    {
        line = ngx_http_llama_session_ollama_object(r, o, 0);

        if (line) {
            if (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT) {
                msg = cJSON_GetObjectItemCaseSensitive(line, "message");
                cJSON_ReplaceItemInObjectCaseSensitive(msg, "content",
                                 cJSON_CreateString(cJSON_IsString(content)
                                                    ? content->valuestring
                                                    : ""));
                if (cJSON_IsString(reasoning)) {
                    cJSON_AddStringToObject(msg, "thinking",
                                            reasoning->valuestring);
                }

            } else {
                cJSON_ReplaceItemInObjectCaseSensitive(line, "response",
                                 cJSON_CreateString(cJSON_IsString(content)
                                                    ? content->valuestring
                                                    : ""));
                if (cJSON_IsString(reasoning)) {
                    cJSON_AddStringToObject(line, "thinking",
                                            reasoning->valuestring);
                }
            }
        }

        rc = ngx_http_llama_session_ollama_emit(r, o, line, 1, ll);
    }

    cJSON_Delete(json);

    return rc;
}


/* a whole reply (not streamed, or an error): one Ollama object */

static ngx_int_t
ngx_http_llama_session_ollama_whole(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, ngx_chain_t ***ll)
{
    u_char     *p;
    cJSON      *json, *err, *message, *choice, *msg, *content, *reasoning;
    cJSON      *line, *calls, *data, *item, *emb, *out, *finish;
    size_t      len;
    ngx_str_t   text;

    text.data = o->in->pos;
    text.len = o->in->last - o->in->pos;

    /* the backend's reply too is counted before cJSON builds its tree */

    json = ngx_http_llama_session_json_tree(text.data, text.len);

    if (o->status != NGX_HTTP_OK) {
        err = cJSON_GetObjectItemCaseSensitive(json, "error");
        message = cJSON_IsObject(err)
                  ? cJSON_GetObjectItemCaseSensitive(err, "message") : err;

        out = cJSON_CreateObject();
        cJSON_AddStringToObject(out, "error",
                                cJSON_IsString(message)
                                ? message->valuestring
                                : "the model server failed the request");
        cJSON_Delete(json);

        return ngx_http_llama_session_ollama_emit(r, o, out, 1, ll);
    }

    if (json == NULL) {
        out = cJSON_CreateObject();
        cJSON_AddStringToObject(out, "error",
                                "the model server's reply is not JSON");
        return ngx_http_llama_session_ollama_emit(r, o, out, 1, ll);
    }

    ngx_http_llama_session_ollama_stats(o, json);

    if (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_EMBED) {
        out = cJSON_CreateObject();
        p = ngx_pnalloc(r->pool, o->model.len + 1);
        if (p == NULL || out == NULL) {
            cJSON_Delete(json);
            cJSON_Delete(out);
            return NGX_ERROR;
        }

        *ngx_cpymem(p, o->model.data, o->model.len) = '\0';
        cJSON_AddStringToObject(out, "model", (char *) p);
        emb = cJSON_AddArrayToObject(out, "embeddings");

        data = cJSON_GetObjectItemCaseSensitive(json, "data");

        cJSON_ArrayForEach(item, data) {
            cJSON_AddItemToArray(emb, cJSON_Duplicate(
                     cJSON_GetObjectItemCaseSensitive(item, "embedding"), 1));
        }

        cJSON_AddNumberToObject(out, "total_duration", 0);
        cJSON_AddNumberToObject(out, "load_duration", 0);
        cJSON_AddNumberToObject(out, "prompt_eval_count", o->prompt_tokens);
        cJSON_Delete(json);

        return ngx_http_llama_session_ollama_emit(r, o, out, 0, ll);
    }

    choice = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(json,
                                                                 "choices"),
                                0);
    msg = cJSON_GetObjectItemCaseSensitive(choice, "message");
    content = cJSON_GetObjectItemCaseSensitive(msg, "content");
    reasoning = cJSON_GetObjectItemCaseSensitive(msg, "reasoning_content");
    finish = cJSON_GetObjectItemCaseSensitive(choice, "finish_reason");

    if (content == NULL) {
        content = cJSON_GetObjectItemCaseSensitive(choice, "text");
    }

    if (cJSON_IsString(finish)) {
        len = ngx_strlen(finish->valuestring);
        o->done_reason.data = ngx_pnalloc(r->pool, len);
        if (o->done_reason.data) {
            ngx_memcpy(o->done_reason.data, finish->valuestring, len);
            o->done_reason.len = len;
        }
    }

    calls = cJSON_GetObjectItemCaseSensitive(msg, "tool_calls");

    if (cJSON_IsArray(calls)) {
        o->tool_calls = cJSON_Duplicate(calls, 1);
    }

    line = ngx_http_llama_session_ollama_object(r, o, 1);

    if (line) {
        if (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT) {
            item = cJSON_GetObjectItemCaseSensitive(line, "message");
            cJSON_ReplaceItemInObjectCaseSensitive(item, "content",
                             cJSON_CreateString(cJSON_IsString(content)
                                                ? content->valuestring : ""));
            if (cJSON_IsString(reasoning)) {
                cJSON_AddStringToObject(item, "thinking",
                                        reasoning->valuestring);
            }

        } else {
            cJSON_ReplaceItemInObjectCaseSensitive(line, "response",
                             cJSON_CreateString(cJSON_IsString(content)
                                                ? content->valuestring : ""));
            if (cJSON_IsString(reasoning)) {
                cJSON_AddStringToObject(line, "thinking",
                                        reasoning->valuestring);
            }
        }
    }

    cJSON_Delete(json);

    o->done = 1;

    return ngx_http_llama_session_ollama_emit(r, o, line, 0, ll);
}


/*
 * An Ollama object: a chat's {"model","created_at","message","done"} or a
 * generate's {"model","created_at","response","done"}; the last one with
 * done_reason, the durations in nanoseconds and the counts, and the tool
 * calls with their arguments as objects.
 */

static cJSON *
ngx_http_llama_session_ollama_object(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, ngx_uint_t done)
{
    u_char      *p, model[256], reason[64];
    cJSON       *line, *msg, *calls, *call, *f, *args, *parsed, *name, *oc;
    cJSON       *of;
    ngx_uint_t   i;
    ngx_http_llama_session_ollama_arg_t  *arg;

    line = cJSON_CreateObject();
    if (line == NULL) {
        return NULL;
    }

    *ngx_cpymem(model, o->model.data, ngx_min(o->model.len, 255)) = '\0';
    cJSON_AddStringToObject(line, "model", (char *) model);

    p = ngx_pnalloc(r->pool, ngx_cached_http_log_iso8601.len + 1);
    if (p) {
        *ngx_cpymem(p, ngx_cached_http_log_iso8601.data,
                    ngx_cached_http_log_iso8601.len) = '\0';
        cJSON_AddStringToObject(line, "created_at", (char *) p);
    }

    if (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT) {
        msg = cJSON_AddObjectToObject(line, "message");
        cJSON_AddStringToObject(msg, "role", "assistant");
        cJSON_AddStringToObject(msg, "content", "");

        if (done && o->tool_calls && cJSON_GetArraySize(o->tool_calls)) {
            calls = cJSON_AddArrayToObject(msg, "tool_calls");

            i = 0;

            cJSON_ArrayForEach(call, o->tool_calls) {
                f = cJSON_GetObjectItemCaseSensitive(call, "function");
                name = cJSON_GetObjectItemCaseSensitive(f, "name");
                args = cJSON_GetObjectItemCaseSensitive(f, "arguments");

                /* a streamed call's arguments are in its buffer */

                arg = (o->args && i < o->args->nelts)
                      ? &((ngx_http_llama_session_ollama_arg_t *)
                          o->args->elts)[i]
                      : NULL;
                i++;

                parsed = arg ? ngx_http_llama_session_json_tree(arg->data,
                                                                arg->len)
                       : cJSON_IsString(args)
                         ? ngx_http_llama_session_json_tree(
                               (u_char *) args->valuestring,
                               ngx_strlen(args->valuestring))
                         : NULL;

                oc = cJSON_CreateObject();
                cJSON_AddItemToArray(calls, oc);
                of = cJSON_AddObjectToObject(oc, "function");
                cJSON_AddStringToObject(of, "name", cJSON_IsString(name)
                                                    ? name->valuestring : "");
                cJSON_AddItemToObject(of, "arguments",
                                      cJSON_IsObject(parsed) ? parsed
                                      : (cJSON_Delete(parsed),
                                         cJSON_CreateObject()));
            }
        }

    } else {
        cJSON_AddStringToObject(line, "response", "");
    }

    cJSON_AddBoolToObject(line, "done", done);

    if (!done) {
        return line;
    }

    *ngx_cpymem(reason, o->done_reason.data,
                ngx_min(o->done_reason.len, 63)) = '\0';

    cJSON_AddStringToObject(line, "done_reason",
                            o->done_reason.len == 0
                            || ngx_strcmp(reason, "tool_calls") == 0
                            ? "stop" : (char *) reason);

    cJSON_AddNumberToObject(line, "total_duration",
                            (o->prompt_ms + o->predicted_ms) * 1e6);
    cJSON_AddNumberToObject(line, "load_duration", 0);
    /* Ollama counts the prompt's tokens it evaluated, not the cached */
    cJSON_AddNumberToObject(line, "prompt_eval_count",
                            o->prompt_n >= 0 ? (ngx_uint_t) o->prompt_n
                            : (o->cached >= 0
                               && (ngx_uint_t) o->cached <= o->prompt_tokens)
                              ? o->prompt_tokens - o->cached
                              : o->prompt_tokens);
    cJSON_AddNumberToObject(line, "prompt_eval_duration", o->prompt_ms * 1e6);
    cJSON_AddNumberToObject(line, "eval_count", o->completion_tokens);
    cJSON_AddNumberToObject(line, "eval_duration", o->predicted_ms * 1e6);

    if (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_GENERATE) {
        cJSON_AddArrayToObject(line, "context");
    }

    if (o->tool_calls) {
        cJSON_Delete(o->tool_calls);
        o->tool_calls = NULL;
    }

    return line;
}


/* usage and timings, wherever they come */

static void
ngx_http_llama_session_ollama_stats(ngx_http_llama_session_ollama_t *o,
    cJSON *reply)
{
    cJSON  *usage, *timings, *item;

    usage = cJSON_GetObjectItemCaseSensitive(reply, "usage");
    timings = cJSON_GetObjectItemCaseSensitive(reply, "timings");

    item = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        o->prompt_tokens = (ngx_uint_t) item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(usage, "completion_tokens");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        o->completion_tokens = (ngx_uint_t) item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(timings, "prompt_n");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        o->prompt_n = (ngx_int_t) item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(
               cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens_details"),
               "cached_tokens");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        o->cached = (ngx_int_t) item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(timings, "prompt_ms");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        o->prompt_ms = item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(timings, "predicted_ms");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        o->predicted_ms = item->valuedouble;
    }

    if (usage == NULL) {
        /* llama-server's own counts, when the usage comes without */

        item = cJSON_GetObjectItemCaseSensitive(timings, "prompt_n");
        if (cJSON_IsNumber(item) && item->valuedouble >= 0
            && o->prompt_tokens == 0)
        {
            o->prompt_tokens = (ngx_uint_t) item->valuedouble;

            item = cJSON_GetObjectItemCaseSensitive(timings, "cache_n");
            if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
                o->prompt_tokens += (ngx_uint_t) item->valuedouble;
            }
        }

        item = cJSON_GetObjectItemCaseSensitive(timings, "predicted_n");
        if (cJSON_IsNumber(item) && item->valuedouble >= 0
            && o->completion_tokens == 0)
        {
            o->completion_tokens = (ngx_uint_t) item->valuedouble;
        }
    }
}


/* appends an object (a line when nl) to the output; frees it */

static ngx_int_t
ngx_http_llama_session_ollama_emit(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, cJSON *json, ngx_uint_t nl,
    ngx_chain_t ***ll)
{
    char       *text;
    ngx_int_t   rc;

    if (json == NULL) {
        return NGX_ERROR;
    }

    text = cJSON_PrintUnformatted(json);
    cJSON_Delete(json);

    if (text == NULL) {
        return NGX_ERROR;
    }

    rc = ngx_http_llama_session_ollama_write(r, o, (u_char *) text,
                                             ngx_strlen(text), ll);

    if (rc == NGX_OK && nl) {
        rc = ngx_http_llama_session_ollama_write(r, o, (u_char *) "\n", 1,
                                                 ll);
    }

    cJSON_free(text);

    return rc;
}


/*
 * Copies bytes of the translation into the filter's output buffers: the
 * one being filled, then free ones, then new ones (counted in nbufs; a
 * line may take several, and may go beyond NGX_HTTP_LLAMA_SESSION_OLLAMA_
 * BUFS: the next line then waits).
 */

static ngx_int_t
ngx_http_llama_session_ollama_write(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, u_char *data, size_t len,
    ngx_chain_t ***ll)
{
    size_t        n;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    while (len) {
        b = o->cur;

        if (b == NULL || b->last == b->end) {

            if (o->free) {
                cl = o->free;
                o->free = cl->next;
                b = cl->buf;
                b->pos = b->start;
                b->last = b->start;
                b->flush = 0;

            } else {
                b = ngx_create_temp_buf(r->pool,
                                        NGX_HTTP_LLAMA_SESSION_OLLAMA_BUF);
                if (b == NULL) {
                    return NGX_ERROR;
                }

                b->tag = (ngx_buf_tag_t) &ngx_http_llama_session_module;

                cl = ngx_alloc_chain_link(r->pool);
                if (cl == NULL) {
                    return NGX_ERROR;
                }

                cl->buf = b;
                o->nbufs++;
            }

            cl->next = NULL;
            **ll = cl;
            *ll = &cl->next;
            o->cur = b;
        }

        n = ngx_min(len, (size_t) (b->end - b->last));
        b->last = ngx_cpymem(b->last, data, n);
        data += n;
        len -= n;
    }

    return NGX_OK;
}


/*
 * GET /api/tags, GET /api/ps, POST /api/show: what llama-server's
 * GET /v1/models says of its models.
 */

ngx_int_t
ngx_http_llama_session_ollama_info(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char         digest[65], hash[EVP_MAX_MD_SIZE], *p;
    char          *text, *name;
    unsigned int   hlen;
    cJSON         *json, *data, *item, *id, *meta, *out, *list, *m, *details;
    cJSON         *sz, *ftype;
    size_t         len;

    if (ctx->job.call_status != NGX_HTTP_OK || ctx->job.call_reply == NULL) {
        return ngx_http_llama_session_ollama_error(r, ctx,
                                  NGX_HTTP_BAD_GATEWAY,
                                  "the model server did not list its models");
    }

    json = ngx_http_llama_session_json_tree(ctx->job.call_reply->pos,
                                 ctx->job.call_reply->last
                                     - ctx->job.call_reply->pos);
    data = cJSON_GetObjectItemCaseSensitive(json, "data");

    out = cJSON_CreateObject();
    if (out == NULL) {
        cJSON_Delete(json);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    list = (ctx->ollama == NGX_HTTP_LLAMA_SESSION_OLLAMA_SHOW)
           ? NULL : cJSON_AddArrayToObject(out, "models");

    cJSON_ArrayForEach(item, data) {
        id = cJSON_GetObjectItemCaseSensitive(item, "id");
        meta = cJSON_GetObjectItemCaseSensitive(item, "meta");

        if (!cJSON_IsString(id)) {
            continue;
        }

        name = id->valuestring;
        len = ngx_strlen(name);

        /* a stable digest of the name: Ollama clients show one */
        if (EVP_Digest(name, len, hash, &hlen, EVP_sha256(), NULL) != 1) {
            ngx_memzero(hash, sizeof(hash));
        }

        *ngx_hex_dump(digest, hash, 32) = '\0';

        sz = cJSON_GetObjectItemCaseSensitive(meta, "size");
        ftype = cJSON_GetObjectItemCaseSensitive(meta, "ftype");

        m = list ? cJSON_CreateObject() : out;
        if (m == NULL) {
            break;
        }

        if (list) {
            cJSON_AddItemToArray(list, m);
            cJSON_AddStringToObject(m, "name", name);
            cJSON_AddStringToObject(m, "model", name);
            cJSON_AddStringToObject(m, "modified_at", "1970-01-01T00:00:00Z");
            cJSON_AddNumberToObject(m, "size", cJSON_IsNumber(sz)
                                               ? sz->valuedouble : 0);
            cJSON_AddStringToObject(m, "digest", (char *) digest);
        }

        details = cJSON_AddObjectToObject(m, "details");
        cJSON_AddStringToObject(details, "format", "gguf");
        cJSON_AddStringToObject(details, "family", "");
        cJSON_AddStringToObject(details, "parameter_size", "");
        cJSON_AddStringToObject(details, "quantization_level",
                                cJSON_IsString(ftype) ? ftype->valuestring
                                                      : "");

        if (ctx->ollama == NGX_HTTP_LLAMA_SESSION_OLLAMA_PS) {
            cJSON_AddStringToObject(m, "expires_at", "2999-01-01T00:00:00Z");
            cJSON_AddNumberToObject(m, "size_vram", cJSON_IsNumber(sz)
                                                    ? sz->valuedouble : 0);
        }

        if (!list) {
            cJSON_AddStringToObject(m, "modelfile", "");
            cJSON_AddStringToObject(m, "parameters", "");
            cJSON_AddStringToObject(m, "template", "");
            cJSON_AddObjectToObject(m, "model_info");
            item = cJSON_AddArrayToObject(m, "capabilities");
            cJSON_AddItemToArray(item, cJSON_CreateString("completion"));
            break;
        }
    }

    cJSON_Delete(json);

    text = cJSON_PrintUnformatted(out);
    cJSON_Delete(out);

    if (text == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    len = ngx_strlen(text);
    p = ngx_pnalloc(r->pool, len);
    if (p == NULL) {
        cJSON_free(text);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ngx_memcpy(p, text, len);
    cJSON_free(text);

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_DONE);
    ctx->status = NGX_DONE;

    ngx_http_finalize_request(r, ngx_http_llama_session_ollama_answer(r,
                                        NGX_HTTP_OK,
                                        "application/json; charset=utf-8",
                                        p, len));
    return NGX_DONE;
}


static void
ngx_http_llama_session_ollama_cleanup(void *data)
{
    ngx_http_llama_session_ollama_t *o = data;

    if (o->tool_calls) {
        cJSON_Delete(o->tool_calls);
        o->tool_calls = NULL;
    }
}
