
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
 * reply comes back through convert.c's filters: llama-server's SSE
 * events become Ollama's NDJSON lines as they arrive (Ollama streams by
 * default), a whole JSON reply one Ollama object, an error
 * {"error":"..."} with its status.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_convert.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_ollama.h"

#include <cjson/cJSON.h>
#include <openssl/evp.h>


#define NGX_HTTP_LLAMA_SESSION_OLLAMA_VERSION  "0.12.0"
#define NGX_HTTP_LLAMA_SESSION_OLLAMA_ARGS     (8 * 1024 * 1024)

/* the tool calls of one streamed reply */
#define NGX_HTTP_LLAMA_SESSION_OLLAMA_CALLS    128


/* the reply's translation, kept in the request's pool */

/* a streamed tool call's arguments, appended to in place */

typedef struct {
    u_char                         *data;
    size_t                          len;
    size_t                          size;
} ngx_http_llama_session_ollama_arg_t;


typedef struct {
    ngx_http_llama_session_conv_t  *conv;       /* convert.c's part */
    ngx_uint_t                      kind;       /* CHAT, GENERATE, EMBED */
    ngx_str_t                       model;
    ngx_uint_t                      done;
    ngx_str_t                       done_reason;
    cJSON                          *tool_calls; /* streamed, put together */
    ngx_array_t                    *args;       /* their arguments, as
                                                   they grow: buffers */
} ngx_http_llama_session_ollama_t;


static ngx_int_t ngx_http_llama_session_ollama_answer(ngx_http_request_t *r,
    ngx_uint_t status, char *type, u_char *data, size_t len);
static cJSON *ngx_http_llama_session_ollama_chat(cJSON *in,
    ngx_uint_t generate, ngx_uint_t *stream);
static cJSON *ngx_http_llama_session_ollama_messages(cJSON *messages);
static void ngx_http_llama_session_ollama_options(cJSON *in, cJSON *out);
static ngx_int_t ngx_http_llama_session_ollama_event(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len);
static ngx_int_t ngx_http_llama_session_ollama_calls(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, cJSON *calls);
static ngx_int_t ngx_http_llama_session_ollama_append(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, ngx_uint_t i, char *piece);
static void ngx_http_llama_session_ollama_reason(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, cJSON *finish);
static void ngx_http_llama_session_ollama_text(
    ngx_http_llama_session_ollama_t *o, cJSON *line, cJSON *content,
    cJSON *reasoning);
static ngx_int_t ngx_http_llama_session_ollama_whole(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len);
static cJSON *ngx_http_llama_session_ollama_object(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, ngx_uint_t done);
static ngx_uint_t ngx_http_llama_session_ollama_index(
    ngx_http_llama_session_ollama_t *o, cJSON *mine);
static void ngx_http_llama_session_ollama_cleanup(void *data);


/*
 * A request in a location with llama_session_ollama: NGX_DECLINED for the
 * inference paths (the session's way: their dialect's rows), else
 * answered.
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

    if (ctx->dialect->request == ngx_http_llama_session_ollama_request) {
        /* /api/chat, /api/generate, /api/embed: the session's way */
        return NGX_DECLINED;
    }

    if ((ngx_http_llama_session_uri_ends(r, "/api/tags")
         || ngx_http_llama_session_uri_ends(r, "/api/ps"))
        && (r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD)))
    {
        return NGX_AGAIN;
    }

    if (ngx_http_llama_session_uri_ends(r, "/api/show")
        && r->method == NGX_HTTP_POST)
    {
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
 * The body was read and the session found: the Ollama request becomes
 * llama-server's.  NGX_OK, or NGX_DONE when an error was sent.
 */

ngx_int_t
ngx_http_llama_session_ollama_request(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    char                             *uri, *error;
    cJSON                            *in, *out, *raw, *model, *item;
    ngx_uint_t                        stream;
    ngx_pool_cleanup_t               *cln;
    ngx_http_llama_session_conv_t    *c;
    ngx_http_llama_session_ollama_t  *o;

    in = ngx_http_llama_session_conv_parse(r, ctx, "an Ollama", &error);

    if (in == NULL) {
        if (error == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        return ngx_http_llama_session_ollama_error(r, ctx,
                                                   NGX_HTTP_BAD_REQUEST,
                                                   error);
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

    o->kind = ctx->dialect->kind;
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

    switch (o->kind) {

    case NGX_HTTP_LLAMA_SESSION_OLLAMA_EMBED:
        uri = "/v1/embeddings";

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
            uri = "/v1/completions";
            out = ngx_http_llama_session_ollama_chat(in, 2, &stream);
            break;
        }

        uri = "/v1/chat/completions";
        out = ngx_http_llama_session_ollama_chat(in, 1, &stream);
        break;

    default: /* NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT */
        uri = "/v1/chat/completions";
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

    c = ngx_http_llama_session_conv_create(r, ctx, "Ollama");

    if (c == NULL || ngx_http_llama_session_conv_request(r, ctx, out, uri)
                      != NGX_OK)
    {
        cJSON_Delete(out);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    cJSON_Delete(out);

    c->stream = stream;
    c->stream_type = "application/x-ndjson";
    c->event = ngx_http_llama_session_ollama_event;
    c->whole = ngx_http_llama_session_ollama_whole;
    c->data = o;
    o->conv = c;

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
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len)
{
    cJSON                            *json, *choices, *choice, *delta;
    cJSON                            *content, *reasoning, *line;
    ngx_int_t                         rc;
    ngx_http_llama_session_ollama_t  *o;

    o = c->data;

    if (data == NULL || (len == 6 && ngx_strncmp(data, "[DONE]", 6) == 0)) {
        /* the last line: at [DONE], or at the end of a stream without */

        if (o->done) {
            return NGX_OK;
        }

        o->done = 1;
        return ngx_http_llama_session_conv_emit(r, c,
                             ngx_http_llama_session_ollama_object(r, o, 1),
                             1);
    }

    json = ngx_http_llama_session_json_tree(data, len);

    if (json == NULL) {
        return NGX_OK;
    }

    ngx_http_llama_session_conv_stats(c, json);

    choices = cJSON_GetObjectItemCaseSensitive(json, "choices");
    choice = cJSON_GetArrayItem(choices, 0);
    delta = cJSON_GetObjectItemCaseSensitive(choice, "delta");

    ngx_http_llama_session_ollama_reason(r, o,
                    cJSON_GetObjectItemCaseSensitive(choice, "finish_reason"));

    content = cJSON_GetObjectItemCaseSensitive(delta, "content");
    reasoning = cJSON_GetObjectItemCaseSensitive(delta, "reasoning_content");

    if (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_GENERATE && choice
        && content == NULL)
    {
        /* a raw completion's event */
        content = cJSON_GetObjectItemCaseSensitive(choice, "text");
    }

    /* tool calls come in pieces: put together, sent with the last line */

    rc = ngx_http_llama_session_ollama_calls(r, o,
                         cJSON_GetObjectItemCaseSensitive(delta, "tool_calls"));

    if (rc == NGX_OK
        && ((cJSON_IsString(content) && content->valuestring[0])
            || (cJSON_IsString(reasoning) && reasoning->valuestring[0])))
    {
        line = ngx_http_llama_session_ollama_object(r, o, 0);
        ngx_http_llama_session_ollama_text(o, line, content, reasoning);

        rc = ngx_http_llama_session_conv_emit(r, c, line, 1);
    }

    cJSON_Delete(json);

    return rc;
}


/*
 * a delta's pieces of tool calls, each to its call (by its index, else
 * the last; a new one when it comes with its name)
 */

static ngx_int_t
ngx_http_llama_session_ollama_calls(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, cJSON *calls)
{
    cJSON                                *call, *index, *f, *name, *args;
    cJSON                                *mine, *mf;
    ngx_http_llama_session_ollama_arg_t  *arg;

    cJSON_ArrayForEach(call, calls) {
        index = cJSON_GetObjectItemCaseSensitive(call, "index");
        f = cJSON_GetObjectItemCaseSensitive(call, "function");
        name = cJSON_GetObjectItemCaseSensitive(f, "name");
        args = cJSON_GetObjectItemCaseSensitive(f, "arguments");

        if (o->tool_calls == NULL) {
            o->tool_calls = cJSON_CreateArray();
            if (o->tool_calls == NULL) {
                return NGX_OK;
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
                    return NGX_ERROR;
                }
            }

            arg = ngx_array_push(o->args);
            if (arg == NULL) {
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

        if (cJSON_IsString(args)
            && ngx_http_llama_session_ollama_append(r, o,
                                  ngx_http_llama_session_ollama_index(o, mine),
                                  args->valuestring)
               != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


/*
 * a piece of the arguments of call i, at the end of its buffer, which
 * doubles as it fills: linear in the arguments, however many pieces
 */

static ngx_int_t
ngx_http_llama_session_ollama_append(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, ngx_uint_t i, char *piece)
{
    u_char                               *joined;
    size_t                                n, m;
    ngx_http_llama_session_ollama_arg_t  *arg;

    if (o->args == NULL || i >= o->args->nelts) {
        return NGX_OK;
    }

    arg = &((ngx_http_llama_session_ollama_arg_t *) o->args->elts)[i];
    m = ngx_strlen(piece);

    if (arg->len + m > NGX_HTTP_LLAMA_SESSION_OLLAMA_ARGS) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: a tool call's arguments are "
                      "too large to translate for Ollama");
        return NGX_ERROR;
    }

    if (arg->len + m > arg->size) {
        n = ngx_max(2 * (arg->len + m), 256);

        joined = ngx_palloc(r->pool, n);
        if (joined == NULL) {
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

    ngx_memcpy(arg->data + arg->len, piece, m);
    arg->len += m;

    return NGX_OK;
}


/* a finish_reason kept: the last line's done_reason */

static void
ngx_http_llama_session_ollama_reason(ngx_http_request_t *r,
    ngx_http_llama_session_ollama_t *o, cJSON *finish)
{
    if (!cJSON_IsString(finish)) {
        return;
    }

    o->done_reason.len = ngx_strlen(finish->valuestring);
    o->done_reason.data = ngx_pnalloc(r->pool, o->done_reason.len);

    if (o->done_reason.data) {
        ngx_memcpy(o->done_reason.data, finish->valuestring,
                   o->done_reason.len);

    } else {
        o->done_reason.len = 0;
    }
}


/* the text of a line: a chat's message's content, a generate's response */

static void
ngx_http_llama_session_ollama_text(ngx_http_llama_session_ollama_t *o,
    cJSON *line, cJSON *content, cJSON *reasoning)
{
    cJSON  *item;

    if (line == NULL) {
        return;
    }

    item = (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT)
           ? cJSON_GetObjectItemCaseSensitive(line, "message") : line;

    cJSON_ReplaceItemInObjectCaseSensitive(item,
                             (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT)
                             ? "content" : "response",
                             cJSON_CreateString(cJSON_IsString(content)
                                                ? content->valuestring : ""));

    if (cJSON_IsString(reasoning)) {
        cJSON_AddStringToObject(item, "thinking", reasoning->valuestring);
    }
}


/* a whole reply (not streamed, or an error): one Ollama object */

static ngx_int_t
ngx_http_llama_session_ollama_whole(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len)
{
    u_char                           *p;
    cJSON                            *json, *err, *message, *choice, *msg;
    cJSON                            *content, *reasoning, *line, *calls;
    cJSON                            *list, *item, *emb, *out;
    ngx_http_llama_session_ollama_t  *o;

    o = c->data;

    /* the backend's reply too is counted before cJSON builds its tree */

    json = ngx_http_llama_session_json_tree(data, len);

    if (c->status != NGX_HTTP_OK) {
        err = cJSON_GetObjectItemCaseSensitive(json, "error");
        message = cJSON_IsObject(err)
                  ? cJSON_GetObjectItemCaseSensitive(err, "message") : err;

        out = cJSON_CreateObject();
        cJSON_AddStringToObject(out, "error",
                                cJSON_IsString(message)
                                ? message->valuestring
                                : "the model server failed the request");
        cJSON_Delete(json);

        return ngx_http_llama_session_conv_emit(r, c, out, 1);
    }

    if (json == NULL) {
        out = cJSON_CreateObject();
        cJSON_AddStringToObject(out, "error",
                                "the model server's reply is not JSON");
        return ngx_http_llama_session_conv_emit(r, c, out, 1);
    }

    ngx_http_llama_session_conv_stats(c, json);

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

        list = cJSON_GetObjectItemCaseSensitive(json, "data");

        cJSON_ArrayForEach(item, list) {
            cJSON_AddItemToArray(emb, cJSON_Duplicate(
                     cJSON_GetObjectItemCaseSensitive(item, "embedding"), 1));
        }

        cJSON_AddNumberToObject(out, "total_duration", 0);
        cJSON_AddNumberToObject(out, "load_duration", 0);
        cJSON_AddNumberToObject(out, "prompt_eval_count",
                                c->prompt_tokens);
        cJSON_Delete(json);

        return ngx_http_llama_session_conv_emit(r, c, out, 0);
    }

    choice = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(json,
                                                                 "choices"),
                                0);
    msg = cJSON_GetObjectItemCaseSensitive(choice, "message");
    content = cJSON_GetObjectItemCaseSensitive(msg, "content");
    reasoning = cJSON_GetObjectItemCaseSensitive(msg, "reasoning_content");

    if (content == NULL) {
        content = cJSON_GetObjectItemCaseSensitive(choice, "text");
    }

    ngx_http_llama_session_ollama_reason(r, o,
                    cJSON_GetObjectItemCaseSensitive(choice, "finish_reason"));

    calls = cJSON_GetObjectItemCaseSensitive(msg, "tool_calls");

    if (cJSON_IsArray(calls)) {
        o->tool_calls = cJSON_Duplicate(calls, 1);
    }

    line = ngx_http_llama_session_ollama_object(r, o, 1);
    ngx_http_llama_session_ollama_text(o, line, content, reasoning);

    cJSON_Delete(json);

    o->done = 1;

    return ngx_http_llama_session_conv_emit(r, c, line, 0);
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
    ngx_http_llama_session_conv_t        *c;
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

    c = o->conv;

    cJSON_AddNumberToObject(line, "total_duration",
                            (c->prompt_ms + c->predicted_ms) * 1e6);
    cJSON_AddNumberToObject(line, "load_duration", 0);
    /* Ollama counts the prompt's tokens it evaluated, not the cached */
    cJSON_AddNumberToObject(line, "prompt_eval_count",
                            c->prompt_n >= 0 ? (ngx_uint_t) c->prompt_n
                            : (c->cached >= 0
                               && (ngx_uint_t) c->cached <= c->prompt_tokens)
                              ? c->prompt_tokens - c->cached
                              : c->prompt_tokens);
    cJSON_AddNumberToObject(line, "prompt_eval_duration", c->prompt_ms * 1e6);
    cJSON_AddNumberToObject(line, "eval_count", c->completion_tokens);
    cJSON_AddNumberToObject(line, "eval_duration", c->predicted_ms * 1e6);

    if (o->kind == NGX_HTTP_LLAMA_SESSION_OLLAMA_GENERATE) {
        cJSON_AddArrayToObject(line, "context");
    }

    if (o->tool_calls) {
        cJSON_Delete(o->tool_calls);
        o->tool_calls = NULL;
    }

    return line;
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

    if (ctx->job->call_status != NGX_HTTP_OK || ctx->job->call_reply == NULL) {
        return ngx_http_llama_session_ollama_error(r, ctx,
                                  NGX_HTTP_BAD_GATEWAY,
                                  "the model server did not list its models");
    }

    json = ngx_http_llama_session_json_tree(ctx->job->call_reply->pos,
                                 ctx->job->call_reply->last
                                     - ctx->job->call_reply->pos);
    data = cJSON_GetObjectItemCaseSensitive(json, "data");

    out = cJSON_CreateObject();
    if (out == NULL) {
        cJSON_Delete(json);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    list = ngx_http_llama_session_uri_ends(r, "/api/show")
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

        if (ngx_http_llama_session_uri_ends(r, "/api/ps")) {
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
