
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Which requests use a slot, and which session a request belongs to:
 * headers, then JSON body fields, then a hash of the system prompt, else
 * "default".  The session's key, the only thing that ever reaches a file
 * name, is derived from the client's id through a strict charset and a
 * SHA-256 over (namespace, model, id, the request's prefix).
 *
 * The prefix is the system prompt (with tools) and the first message after
 * it: the part of a conversation that stays the same from turn to turn.
 * A request under a conversation's id with another prefix (a chat
 * frontend's title or tags request, a subagent, a side query) is another
 * session, so it never takes the conversation's state for its own.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_canon.h"
#include "ngx_http_llama_session_ext.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_miss.h"
#include "ngx_http_llama_session_models.h"

#include <cjson/cJSON.h>
#include <openssl/evp.h>


static ngx_int_t ngx_http_llama_session_from_headers(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_array_t *names);
static ngx_int_t ngx_http_llama_session_from_json(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_loc_conf_t *llcf,
    ngx_http_llama_session_span_t *spans);
static ngx_int_t ngx_http_llama_session_prefix(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t *spans);
static ngx_int_t ngx_http_llama_session_leading(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t *messages,
    size_t *len, ngx_http_llama_session_span_t *head);
static ngx_int_t ngx_http_llama_session_prefix_parts(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, EVP_MD_CTX *md,
    ngx_http_llama_session_span_t *spans, size_t *len);
static ngx_int_t ngx_http_llama_session_head(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t *head);
static ngx_int_t ngx_http_llama_session_digest_end(ngx_http_request_t *r,
    u_char *out);
static ngx_uint_t ngx_http_llama_session_client_context(
    ngx_http_llama_session_span_t *content);
static ngx_int_t ngx_http_llama_session_digest_text(ngx_http_request_t *r,
    ngx_http_llama_session_span_t *span, size_t *found, ngx_uint_t billing,
    size_t *budget);
static ngx_int_t ngx_http_llama_session_digest_string(ngx_http_request_t *r,
    u_char *start, u_char *end, size_t *found, ngx_uint_t billing,
    size_t *budget);
static void ngx_http_llama_session_body_span_list(
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t **sp);
static ngx_int_t ngx_http_llama_session_choose_zone(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_identify_body(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *body,
    ngx_http_llama_session_span_t *spans);
static ngx_uint_t ngx_http_llama_session_probe(
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t *spans);
static ngx_int_t ngx_http_llama_session_span_str(ngx_http_request_t *r,
    ngx_http_llama_session_span_t *span, ngx_str_t *s);
static ngx_int_t ngx_http_llama_session_sha256(ngx_http_request_t *r,
    ngx_str_t *parts, ngx_uint_t n, u_char *out);
static EVP_MD_CTX *ngx_http_llama_session_sha256_begin(ngx_http_request_t *r);
static ngx_uint_t ngx_http_llama_session_last_matches(ngx_str_t *parts,
    ngx_uint_t n);
static ngx_int_t ngx_http_llama_session_base_key(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *ns, u_char *sys,
    u_char *hash);
static void ngx_http_llama_session_base_name(
    ngx_http_llama_session_ctx_t *ctx, u_char *hash);
static ngx_int_t ngx_http_llama_session_json_str(ngx_http_request_t *r,
    cJSON *item, ngx_str_t *s);


static EVP_MD      *ngx_http_llama_session_sha256_md;
static EVP_MD_CTX  *ngx_http_llama_session_sha256_ctx;

/* the last key this worker derived, and what it was derived from */
static u_char   ngx_http_llama_session_last_in[512];
static size_t   ngx_http_llama_session_last_len;
static u_char   ngx_http_llama_session_last_key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
static size_t   ngx_http_llama_session_last_key_len;
static u_char   ngx_http_llama_session_last_idk[NGX_HTTP_LLAMA_SESSION_DIGEST];
static u_char   ngx_http_llama_session_last_base[
                    NGX_HTTP_LLAMA_SESSION_HASH_HEX / 2];


static ngx_str_t  ngx_http_llama_session_model_name =
    ngx_string("model");
static ngx_str_t  ngx_http_llama_session_tools_name =
    ngx_string("tools");
static ngx_str_t  ngx_http_llama_session_tool_choice_name =
    ngx_string("tool_choice");
static ngx_str_t  ngx_http_llama_session_kwargs_name =
    ngx_string("chat_template_kwargs");
static ngx_str_t  ngx_http_llama_session_reasoning_name =
    ngx_string("reasoning");
static ngx_str_t  ngx_http_llama_session_max_tokens_name =
    ngx_string("max_tokens");
static ngx_str_t  ngx_http_llama_session_max_completion_name =
    ngx_string("max_completion_tokens");
static ngx_str_t  ngx_http_llama_session_n_predict_name =
    ngx_string("n_predict");

/* the members identify() looks for, before the id fields */

#define NGX_HTTP_LLAMA_SESSION_SP_MODEL        0
#define NGX_HTTP_LLAMA_SESSION_SP_SYSTEM       1
#define NGX_HTTP_LLAMA_SESSION_SP_MESSAGES     2
#define NGX_HTTP_LLAMA_SESSION_SP_TOOLS        3
#define NGX_HTTP_LLAMA_SESSION_SP_TOOL_CHOICE  4
#define NGX_HTTP_LLAMA_SESSION_SP_KWARGS       5
#define NGX_HTTP_LLAMA_SESSION_SP_MAX_TOKENS   6
#define NGX_HTTP_LLAMA_SESSION_SP_MAX_COMPL    7
#define NGX_HTTP_LLAMA_SESSION_SP_N_PREDICT    8
#define NGX_HTTP_LLAMA_SESSION_SP_REASONING    9
#define NGX_HTTP_LLAMA_SESSION_SP_FIELDS       10
#define NGX_HTTP_LLAMA_SESSION_SP_ALL                                        \
    (NGX_HTTP_LLAMA_SESSION_SP_FIELDS + NGX_HTTP_LLAMA_SESSION_FIELDS_MAX)

/* the bytes of the first message that tell a conversation */
#define NGX_HTTP_LLAMA_SESSION_HEAD            256


/*
 * Which requests take the slot: POSTs to the inference endpoints of
 * llama_session_endpoints (an allow-list: anything else passes by).
 * Embeddings and rerank use the slot but carry no conversation, so they
 * count as "default".  Refused (ctx->refuse, and why): a client's POST to
 * the slot API (it would save, restore or erase other sessions' states),
 * the replayable streams (GET /v1/stream?conv_id= reads or cancels another
 * session's generation), the router's model management (/models/load,
 * /models/unload, a POST or DELETE of /models: it would unload a model
 * without its sessions' saves), and, in front of a router, any request
 * outside the endpoints that may name a model (a POST, whose body the
 * router reads a model from, or "?model="): the router would load that
 * model behind the zones' back, and unload one a zone drives.
 */

ngx_uint_t
ngx_http_llama_session_uses_slot(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char                             *p, *last, *c;
    ngx_str_t                           uri, arg;
    ngx_http_llama_session_loc_conf_t  *llcf;

    uri = r->uri;

    while (uri.len > 1 && uri.data[uri.len - 1] == '/') {
        uri.len--;
    }

    /* path components: "slots" followed by another one, "stream(s)" */

    last = uri.data + uri.len;

    for (p = uri.data; p < last; p = c + 1) {
        c = ngx_strlchr(p, last, '/');
        if (c == NULL) {
            c = last;
        }

        if ((c - p == 6 && ngx_strncasecmp(p, (u_char *) "stream", 6) == 0)
            || (c - p == 7
                && ngx_strncasecmp(p, (u_char *) "streams", 7) == 0)
            || (c - p == 5 && c < last && r->method == NGX_HTTP_POST
                && ngx_strncasecmp(p, (u_char *) "slots", 5) == 0))
        {
            ctx->refuse = 1;
            ctx->refuse_why = "llama-server's slot actions and replayable "
                              "streams are not for clients";
            return 0;
        }

        if (c - p == 6 && ngx_strncasecmp(p, (u_char *) "models", 6) == 0
            && ((last - c > 4
                 && ngx_strncasecmp(c + 1, (u_char *) "load", 4) == 0)
                || (last - c > 6
                    && ngx_strncasecmp(c + 1, (u_char *) "unload", 6) == 0)
                || (c == last
                    && (r->method & (NGX_HTTP_POST|NGX_HTTP_PUT
                                     |NGX_HTTP_DELETE|NGX_HTTP_PATCH)))))
        {
            ctx->refuse = 1;
            ctx->refuse_why = "the models are the module's to load and "
                              "unload";
            return 0;
        }
    }

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    if (!ngx_http_llama_session_is_endpoint(r, llcf->endpoints)
        || r->method != NGX_HTTP_POST)
    {

        if ((llcf->zones
             || (llcf->zone && ngx_http_llama_session_by_router(llcf->zone)))
            && (r->method == NGX_HTTP_POST
                || ngx_http_arg(r, (u_char *) "model", 5, &arg) == NGX_OK))
        {
            /* router mode: only the endpoints go through the model switch */
            ctx->refuse = 1;
            ctx->refuse_why = "in front of llama-server's router, only the "
                              "inference endpoints may name a model";
        }

        return 0;
    }

    /* embeddings, rerank: they use the slot but carry no conversation */
    ctx->use_default = (ctx->dialect && ctx->dialect->no_session);

    return 1;
}


ngx_int_t
ngx_http_llama_session_identify(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t                           rc;
    ngx_str_t                           body, ns;
    ngx_http_llama_session_span_t       spans[NGX_HTTP_LLAMA_SESSION_SP_ALL];
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    /* no body read, no member found: the media check reads none */
    ngx_memzero(spans, sizeof(spans));

    ngx_str_null(&ns);

    if (llcf->namespace
        && ngx_http_complex_value(r, llcf->namespace, &ns) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (ctx->use_default) {
        goto fallback;
    }

    rc = ngx_http_llama_session_from_headers(r, ctx, llcf->id_headers);

    if (rc == NGX_ERROR || rc == NGX_ABORT) {
        return rc;
    }

    rc = ngx_http_llama_session_read_body(r, llcf->body_max, &body);

    if (rc == NGX_ERROR) {
        return NGX_ERROR;
    }

    if (rc == NGX_OK) {
        /* Ollama's translation reads it again (ollama.c) */
        ctx->body = body;
        ctx->body_copied = (r->request_body->bufs->next
                            || !ngx_buf_in_memory(r->request_body->bufs->buf));
    }

    if (rc == NGX_DECLINED || body.len == 0) {
        goto fallback;
    }

    rc = ngx_http_llama_session_identify_body(r, ctx, &body, spans);

    if (rc == NGX_ERROR || rc == NGX_ABORT) {
        return rc;
    }

fallback:

    if (ctx->id.len == 0) {
        ngx_str_set(&ctx->id, "default");
        if (!ctx->probe) {
            ngx_str_set(&ctx->source, "default");
        }
        ctx->default_session = 1;
    }

    /* router mode: the zone of the request's model */

    rc = ngx_http_llama_session_choose_zone(r, ctx);
    if (rc != NGX_OK) {
        return rc;
    }

    /*
     * an image, audio or a file, on a backend that refused to save one:
     * such a session stays in its slot while another can go (sched.c); the
     * messages are walked for it only there
     */

    if (ctx->zone && ctx->zone->sh->media_refused) {
        ctx->media = ngx_http_llama_session_json_media(
                               spans[NGX_HTTP_LLAMA_SESSION_SP_MESSAGES].start,
                               spans[NGX_HTTP_LLAMA_SESSION_SP_MESSAGES].end);
    }

    if (ngx_http_llama_session_make_key(r, ctx, &ns) != NGX_OK) {
        return NGX_ERROR;
    }

    if (!ctx->bind) {
        ngx_http_llama_session_key_prefix(ctx);
    }

    /* no id: the conversation whose messages this request extends */

    rc = ngx_http_llama_session_extension(r, ctx);

    if (rc != NGX_DECLINED) {
        return rc;
    }

    /* a new conversation of a family another has: a key of its own */

    if (ngx_http_llama_session_make_key(r, ctx, &ns) != NGX_OK) {
        return NGX_ERROR;
    }

    ngx_http_llama_session_key_prefix(ctx);
    ngx_http_llama_session_ext_record(ctx);

    return NGX_OK;
}


/*
 * The body's members: the model, the system prompt and the conversation
 * (the prefix and the messages' digests), a probe, the id among the
 * location's fields.  NGX_DECLINED: not a JSON object, or a probe; the
 * request goes on as "default".
 */

static ngx_int_t
ngx_http_llama_session_identify_body(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *body,
    ngx_http_llama_session_span_t *spans)
{
    u_char                             *dot;
    ngx_str_t                          *field;
    ngx_str_t                           names[NGX_HTTP_LLAMA_SESSION_SP_ALL];
    ngx_uint_t                          i, n;
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    /*
     * the members the module needs, at the top level of the object; the
     * Responses API's system prompt is its "instructions" and the system
     * and developer items that lead its "input", as llama-server converts
     * them
     */

    names[NGX_HTTP_LLAMA_SESSION_SP_MODEL] = ngx_http_llama_session_model_name;
    names[NGX_HTTP_LLAMA_SESSION_SP_SYSTEM] = ctx->dialect->system;
    names[NGX_HTTP_LLAMA_SESSION_SP_MESSAGES] = ctx->dialect->messages;
    names[NGX_HTTP_LLAMA_SESSION_SP_REASONING] =
                                      ngx_http_llama_session_reasoning_name;
    names[NGX_HTTP_LLAMA_SESSION_SP_TOOLS] = ngx_http_llama_session_tools_name;
    names[NGX_HTTP_LLAMA_SESSION_SP_TOOL_CHOICE] =
                                    ngx_http_llama_session_tool_choice_name;
    names[NGX_HTTP_LLAMA_SESSION_SP_KWARGS] =
                                         ngx_http_llama_session_kwargs_name;
    names[NGX_HTTP_LLAMA_SESSION_SP_MAX_TOKENS] =
                                     ngx_http_llama_session_max_tokens_name;
    names[NGX_HTTP_LLAMA_SESSION_SP_MAX_COMPL] =
                                 ngx_http_llama_session_max_completion_name;
    names[NGX_HTTP_LLAMA_SESSION_SP_N_PREDICT] =
                                      ngx_http_llama_session_n_predict_name;
    n = NGX_HTTP_LLAMA_SESSION_SP_FIELDS;

    field = llcf->id_fields->elts;

    for (i = 0; i < llcf->id_fields->nelts; i++) {
        dot = ngx_strlchr(field[i].data, field[i].data + field[i].len, '.');

        names[n].data = field[i].data;
        names[n].len = dot ? (size_t) (dot - field[i].data) : field[i].len;
        n++;
    }

    if (ngx_http_llama_session_json_body(body->data, body->data + body->len,
                                         names, spans, n)
        != NGX_OK)
    {
        ngx_log_debug0(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "llama_session: the body is not a JSON object");
        return NGX_DECLINED;
    }

    /*
     * per-conversation parts of a system prompt made the same (canon.c):
     * Claude Code's first system block, before anything reads the body
     */

    if (llcf->canonical && ctx->dialect->canon
        && ngx_http_llama_session_canon(r, body,
                               &spans[NGX_HTTP_LLAMA_SESSION_SP_SYSTEM])
           != NGX_OK)
    {
        return NGX_ERROR;
    }

    /* "reasoning" is the Responses API's; elsewhere llama-server ignores it */

    if (ctx->dialect->prime_shape != NGX_HTTP_LLAMA_SESSION_PRIME_RESPONSES) {
        spans[NGX_HTTP_LLAMA_SESSION_SP_REASONING].start = NULL;
    }

    /* only a string is a model name: a span of another type is not parsed */

    if (spans[NGX_HTTP_LLAMA_SESSION_SP_MODEL].start
        && *spans[NGX_HTTP_LLAMA_SESSION_SP_MODEL].start == '"')
    {
        if (ngx_http_llama_session_span_str(r,
                                        &spans[NGX_HTTP_LLAMA_SESSION_SP_MODEL],
                                        &ctx->model)
            == NGX_ERROR)
        {
            return NGX_ERROR;
        }

        ctx->p_model = spans[NGX_HTTP_LLAMA_SESSION_SP_MODEL];
    }

    if (ngx_http_llama_session_prefix(r, ctx, spans) != NGX_OK) {
        return NGX_ERROR;
    }

    if (!ctx->identity
        && ngx_http_llama_session_msgs(r, ctx,
                                       &spans[NGX_HTTP_LLAMA_SESSION_SP_SYSTEM],
                                       &spans[NGX_HTTP_LLAMA_SESSION_SP_MESSAGES])
           != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (ngx_http_llama_session_probe(ctx, spans)) {
        /*
         * a probe (max_tokens 0 or 1: a model or key check, a token
         * count): it runs as "default", so it never takes the place of a
         * conversation's state, nor gets a file
         */

        ngx_str_null(&ctx->id);
        ngx_str_set(&ctx->source, "probe");
        ctx->probe = 1;
        return NGX_DECLINED;
    }

    if (ctx->id.len == 0) {
        return ngx_http_llama_session_from_json(r, ctx, llcf, spans);
    }

    return NGX_OK;
}


/* "<zone>@<key>": the zones of one router share a store folder */

void
ngx_http_llama_session_key_prefix(ngx_http_llama_session_ctx_t *ctx)
{
    if (ctx->zone == NULL || ctx->zone->prefix.len == 0) {
        return;
    }

    ngx_memmove(ctx->key + ctx->zone->prefix.len, ctx->key, ctx->key_len);
    ngx_memcpy(ctx->key, ctx->zone->prefix.data, ctx->zone->prefix.len);
    ctx->key_len += ctx->zone->prefix.len;

    if (ctx->base_len) {
        ngx_memmove(ctx->base_key + ctx->zone->prefix.len, ctx->base_key,
                    ctx->base_len);
        ngx_memcpy(ctx->base_key, ctx->zone->prefix.data,
                   ctx->zone->prefix.len);
        ctx->base_len += ctx->zone->prefix.len;
    }
}


/* the spans a warm start's prime takes from the body */

static void
ngx_http_llama_session_body_span_list(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_span_t **sp)
{
    sp[0] = &ctx->p_model;
    sp[1] = &ctx->p_system;
    sp[2] = &ctx->p_leading;
    sp[3] = &ctx->p_tools;
    sp[4] = &ctx->p_tool_choice;
    sp[5] = &ctx->p_kwargs;
    sp[6] = &ctx->p_reasoning;
}


/*
 * The body is read: a copy of one that nginx wrote to a file goes, so
 * that a request waiting for its slot holds no more than nginx's buffers.
 * What a warm start's prime takes from it later (the spans p_*) is kept as
 * offsets, and read again from the file then (body_spans()).
 */

void
ngx_http_llama_session_body_release(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t                      i;
    ngx_http_llama_session_span_t  *sp[NGX_HTTP_LLAMA_SESSION_PRIME_SPANS];

    if (!ctx->body_copied || ctx->body.data == NULL) {
        return;
    }

    ngx_http_llama_session_body_span_list(ctx, sp);

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_PRIME_SPANS; i++) {
        if (sp[i]->start) {
            sp[i]->start = (u_char *) (sp[i]->start - ctx->body.data);
            sp[i]->end = (u_char *) (sp[i]->end - ctx->body.data);
        }
    }

    ctx->spans_off = 1;

    /* larger than a pool's small block: its own allocation, freed now */
    ngx_pfree(r->pool, ctx->body.data);

    ngx_str_null(&ctx->body);
}


/*
 * For a prime: the spans p_* as pointers again, into body: the request's
 * body read again from its file if body_release() let it go (the caller
 * frees body->data then, when it is not NULL).
 */

ngx_int_t
ngx_http_llama_session_body_spans(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *body)
{
    ngx_int_t                       rc;
    ngx_uint_t                      i;
    ngx_http_llama_session_span_t  *sp[NGX_HTTP_LLAMA_SESSION_PRIME_SPANS];
    ngx_http_llama_session_loc_conf_t  *llcf;

    ngx_str_null(body);

    if (!ctx->spans_off) {
        return NGX_OK;
    }

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    rc = ngx_http_llama_session_read_body(r, llcf->body_max, body);

    if (rc != NGX_OK) {
        return NGX_ERROR;
    }

    ngx_http_llama_session_body_span_list(ctx, sp);

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_PRIME_SPANS; i++) {
        if (sp[i]->start) {
            if ((size_t) sp[i]->end > body->len) {
                return NGX_ERROR;
            }

            sp[i]->start = body->data + (size_t) sp[i]->start;
            sp[i]->end = body->data + (size_t) sp[i]->end;
        }
    }

    ctx->spans_off = 0;

    return NGX_OK;
}


/* NGX_OK: the whole body in one piece; NGX_DECLINED: none or too large */

ngx_int_t
ngx_http_llama_session_read_body(ngx_http_request_t *r, size_t max,
    ngx_str_t *body)
{
    u_char       *p;
    off_t         len, size;
    ssize_t       n;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    ngx_str_null(body);

    if (r->request_body == NULL || r->request_body->bufs == NULL) {
        return NGX_DECLINED;
    }

    len = 0;

    for (cl = r->request_body->bufs; cl; cl = cl->next) {
        len += ngx_buf_size(cl->buf);
    }

    if (len == 0) {
        return NGX_DECLINED;
    }

    if ((size_t) len > max) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: the body of %O bytes is larger than "
                      "llama_session_body_max, it is not parsed", len);
        return NGX_DECLINED;
    }

    cl = r->request_body->bufs;

    if (cl->next == NULL && ngx_buf_in_memory(cl->buf)) {
        body->data = cl->buf->pos;
        body->len = len;
        return NGX_OK;
    }

    p = ngx_pnalloc(r->pool, len);
    if (p == NULL) {
        return NGX_ERROR;
    }

    body->data = p;
    body->len = len;

    for ( /* void */ ; cl; cl = cl->next) {
        b = cl->buf;

        if (ngx_buf_in_memory(b)) {
            p = ngx_cpymem(p, b->pos, b->last - b->pos);
            continue;
        }

        if (b->in_file) {
            size = b->file_last - b->file_pos;

            n = ngx_read_file(b->file, p, size, b->file_pos);

            if (n != size) {
                ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                              "llama_session: cannot read the body from "
                              "\"%V\", it is not parsed", &b->file->name);
                return NGX_DECLINED;
            }

            p += n;
        }
    }

    body->len = p - body->data;

    return NGX_OK;
}


static ngx_int_t
ngx_http_llama_session_from_headers(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_array_t *names)
{
    u_char           *p, *last;
    ngx_str_t        *name;
    ngx_uint_t        i, n;
    ngx_list_part_t  *part;
    ngx_table_elt_t  *h;

    name = names->elts;

    for (n = 0; n < names->nelts; n++) {

        part = &r->headers_in.headers.part;
        h = part->elts;

        for (i = 0; /* void */; i++) {

            if (i >= part->nelts) {
                if (part->next == NULL) {
                    break;
                }

                part = part->next;
                h = part->elts;
                i = 0;
            }

            if (h[i].key.len != name[n].len
                || ngx_strncmp(h[i].lowcase_key, name[n].data, name[n].len)
                   != 0)
            {
                continue;
            }

            p = h[i].value.data;
            last = p + h[i].value.len;

            while (p < last && (*p == ' ' || *p == '\t')) { p++; }
            while (last > p && (last[-1] == ' ' || last[-1] == '\t')) {
                last--;
            }

            if (p == last) {
                continue;
            }

            if (last - p > NGX_HTTP_LLAMA_SESSION_ID_MAX) {
                ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                              "llama_session: the session id in header "
                              "\"%V\" is longer than %d bytes",
                              &name[n], NGX_HTTP_LLAMA_SESSION_ID_MAX);
                return NGX_ABORT;
            }

            ctx->id.data = p;
            ctx->id.len = last - p;
            ctx->source.len = sizeof("header:") - 1 + name[n].len;
            ctx->source.data = ngx_pnalloc(r->pool, ctx->source.len);
            if (ctx->source.data == NULL) {
                return NGX_ERROR;
            }

            ngx_sprintf(ctx->source.data, "header:%V", &name[n]);

            return NGX_OK;
        }
    }

    return NGX_DECLINED;
}


/*
 * The id from the body fields, in their order; else the system prompt's
 * digest.  NGX_DECLINED: none; NGX_ABORT: an id too long (the client's
 * error).
 */

static ngx_int_t
ngx_http_llama_session_from_json(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_loc_conf_t *llcf,
    ngx_http_llama_session_span_t *spans)
{
    u_char                         *p, *last, *dot;
    ngx_str_t                      *field, name;
    ngx_uint_t                      n;
    ngx_http_llama_session_span_t   span;

    field = llcf->id_fields->elts;

    for (n = 0; n < llcf->id_fields->nelts; n++) {

        /* the first part of the path was found with the top level */

        span = spans[NGX_HTTP_LLAMA_SESSION_SP_FIELDS + n];
        p = field[n].data;
        last = p + field[n].len;

        dot = ngx_strlchr(p, last, '.');
        p = dot ? dot + 1 : last;

        while (span.start && p < last) {
            dot = ngx_strlchr(p, last, '.');
            if (dot == NULL) {
                dot = last;
            }

            name.data = p;
            name.len = dot - p;

            if (ngx_http_llama_session_json_object(span.start, span.end,
                                                   &name, &span, 1)
                == NULL)
            {
                span.start = NULL;
            }

            p = dot + 1;
        }

        /* a string or a number: anything else is not parsed at all */

        if (span.start == NULL
            || !(*span.start == '"' || *span.start == '-'
                 || (*span.start >= '0' && *span.start <= '9')))
        {
            continue;
        }

        /* every byte of an id decodes to at most 6 of JSON text */

        if (span.end - span.start > 6 * NGX_HTTP_LLAMA_SESSION_ID_MAX + 2) {
            goto too_long;
        }

        if (ngx_http_llama_session_span_str(r, &span, &ctx->id) == NGX_ERROR)
        {
            return NGX_ERROR;
        }

        if (ctx->id.len > NGX_HTTP_LLAMA_SESSION_ID_MAX) {
            goto too_long;
        }

        if (ctx->id.len) {
            ctx->source.len = sizeof("body:") - 1 + field[n].len;
            ctx->source.data = ngx_pnalloc(r->pool, ctx->source.len);
            if (ctx->source.data == NULL) {
                return NGX_ERROR;
            }

            ngx_sprintf(ctx->source.data, "body:%V", &field[n]);

            return NGX_OK;
        }
    }

    if (llcf->fallback != NGX_HTTP_LLAMA_SESSION_FALLBACK_SYSTEM) {
        return NGX_DECLINED;
    }

    if (ctx->sys_len == 0) {
        return NGX_DECLINED;
    }

    ctx->id.data = ngx_pnalloc(r->pool, sizeof("sys-") - 1
                                        + 2 * NGX_HTTP_LLAMA_SESSION_DIGEST);
    if (ctx->id.data == NULL) {
        return NGX_ERROR;
    }

    p = ngx_cpymem(ctx->id.data, "sys-", sizeof("sys-") - 1);
    p = ngx_hex_dump(p, ctx->sys, NGX_HTTP_LLAMA_SESSION_DIGEST);
    ctx->id.len = p - ctx->id.data;

    ngx_str_set(&ctx->source, "system_hash");
    ctx->ext_fallback = 1;
    ctx->id_own = 1;

    return NGX_OK;

too_long:

    ngx_str_null(&ctx->id);

    ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                  "llama_session: the session id in body field \"%V\" is "
                  "longer than %d bytes", &field[n],
                  NGX_HTTP_LLAMA_SESSION_ID_MAX);

    return NGX_ABORT;
}


/*
 * The request's prefix, in one pass over the body:
 *
 *   ctx->sys: SHA-256 of the system prompt, Anthropic's top-level "system"
 *   (a string or text blocks; also Ollama's /api/generate "system") and
 *   the messages with role "system" or "developer" that lead "messages"
 *   (the Responses API's "instructions" and the items of such roles that
 *   lead its "input"), their texts joined by newlines, then "tools",
 *   "tool_choice", "chat_template_kwargs" and the Responses API's
 *   "reasoning" as sent; ctx->sys_len: the bytes of all that, 0 when
 *   there is none.  What llama-server changes in Anthropic's
 *   system prompt (the "cch=" of Claude Code's billing header) is changed
 *   here too, so a value that differs from request to request is in no key.
 *
 *   ctx->head: SHA-256 of the start of the first message after the system
 *   ones: its role and the first NGX_HTTP_LLAMA_SESSION_HEAD bytes of its
 *   texts.  A conversation's first message stays from turn to turn, a
 *   frontend's title or tags request has one of its own; requests that
 *   share a long context and differ in their question at its end (a
 *   document, then a question) keep one session.
 *
 * Strings are hashed one by one as the scanner finds them, so memory
 * stays that of the largest single string, whatever the body holds.
 */

static ngx_int_t
ngx_http_llama_session_prefix(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t *spans)
{
    size_t                          len;
    EVP_MD_CTX                     *md;
    ngx_http_llama_session_span_t   head, *sp;

    md = ngx_http_llama_session_sha256_begin(r);
    if (md == NULL) {
        return NGX_ERROR;
    }

    len = 0;
    head.start = NULL;

    sp = &spans[NGX_HTTP_LLAMA_SESSION_SP_SYSTEM];

    if (sp->start) {
        if (ngx_http_llama_session_digest_text(r, sp, &len, 1, NULL)
            != NGX_OK)
        {
            return NGX_ERROR;
        }

        ctx->p_system = *sp;
    }

    if (ngx_http_llama_session_leading(r, ctx,
                                  &spans[NGX_HTTP_LLAMA_SESSION_SP_MESSAGES],
                                  &len, &head)
        != NGX_OK
        || ngx_http_llama_session_prefix_parts(r, ctx, md, spans, &len)
           != NGX_OK
        || ngx_http_llama_session_digest_end(r, ctx->sys) != NGX_OK)
    {
        return NGX_ERROR;
    }

    ctx->sys_len = len;

    if (head.start == NULL) {
        return NGX_OK;
    }

    return ngx_http_llama_session_head(r, ctx, &head);
}


/*
 * The system and developer messages that lead the conversation (and a
 * client's context given as a user message), into the system prompt's
 * digest; head: the first message after them.
 */

static ngx_int_t
ngx_http_llama_session_leading(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t *messages,
    size_t *len, ngx_http_llama_session_span_t *head)
{
    u_char                         *pos;
    ngx_str_t                       names[2];
    ngx_http_llama_session_span_t   elt, fields[2];

    static ngx_str_t   system = ngx_string("system");
    static ngx_str_t   developer = ngx_string("developer");
    static ngx_str_t   user = ngx_string("user");

    if (messages->start == NULL || *messages->start != '[') {
        return NGX_OK;
    }

    ngx_str_set(&names[0], "role");
    ngx_str_set(&names[1], "content");

    pos = messages->start;

    while (ngx_http_llama_session_json_next(&pos, messages->end, &elt)
           == NGX_OK)
    {
        if (*elt.start != '{'
            || ngx_http_llama_session_json_object(elt.start, elt.end,
                                                  names, fields, 2)
               == NULL
            || fields[0].start == NULL)
        {
            *head = elt;
            break;
        }

        /* the role as llama-server decodes it ("syst\u0065m" too) */

        if (!ngx_http_llama_session_json_string_is(&fields[0], &system)
            && !ngx_http_llama_session_json_string_is(&fields[0], &developer)
            && !(ngx_http_llama_session_json_string_is(&fields[0], &user)
                 && fields[1].start
                 && ngx_http_llama_session_client_context(&fields[1])))
        {
            *head = elt;
            break;
        }

        if (ctx->p_leading.start == NULL) {
            ctx->p_leading.start = elt.start;
        }

        ctx->p_leading.end = elt.end;

        if (fields[1].start
            && ngx_http_llama_session_digest_text(r, &fields[1], len, 0,
                                                  NULL)
               != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


/* tools are part of the prompt that comes before the conversation */

static ngx_int_t
ngx_http_llama_session_prefix_parts(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, EVP_MD_CTX *md,
    ngx_http_llama_session_span_t *spans, size_t *len)
{
    u_char                         *pos;
    ngx_uint_t                      i;
    ngx_http_llama_session_span_t  *sp;

    static struct {
        ngx_uint_t                  span;
        size_t                      off;
    } parts[] = {
        { NGX_HTTP_LLAMA_SESSION_SP_TOOLS,
          offsetof(ngx_http_llama_session_ctx_t, p_tools) },
        { NGX_HTTP_LLAMA_SESSION_SP_TOOL_CHOICE,
          offsetof(ngx_http_llama_session_ctx_t, p_tool_choice) },
        { NGX_HTTP_LLAMA_SESSION_SP_KWARGS,
          offsetof(ngx_http_llama_session_ctx_t, p_kwargs) },
        { NGX_HTTP_LLAMA_SESSION_SP_REASONING,
          offsetof(ngx_http_llama_session_ctx_t, p_reasoning) }
    };

    for (i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
        sp = &spans[parts[i].span];

        if (sp->start == NULL
            || (sp->end - sp->start == 4
                && ngx_strncmp(sp->start, "null", 4) == 0))
        {
            continue;
        }

        if (i == 0 && *sp->start == '[') {
            for (pos = sp->start + 1;
                 pos < sp->end && (*pos == ' ' || *pos == '\t'
                                   || *pos == '\r' || *pos == '\n');
                 pos++)
            { /* void */ }

            if (pos < sp->end && *pos == ']') {
                /* "tools": [] */
                continue;
            }
        }

        if (EVP_DigestUpdate(md, "\0", 1) != 1
            || EVP_DigestUpdate(md, sp->start, sp->end - sp->start) != 1)
        {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "llama_session: SHA-256 failed");
            return NGX_ERROR;
        }

        *len += sp->end - sp->start;

        *(ngx_http_llama_session_span_t *) ((u_char *) ctx + parts[i].off)
                                                                      = *sp;
    }

    return NGX_OK;
}


/* the first message of the conversation: its role and texts */

static ngx_int_t
ngx_http_llama_session_head(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t *head)
{
    size_t                          len, budget;
    ngx_str_t                       names[2];
    EVP_MD_CTX                     *md;
    ngx_http_llama_session_span_t   fields[2];

    md = ngx_http_llama_session_sha256_begin(r);
    if (md == NULL) {
        return NGX_ERROR;
    }

    ngx_str_set(&names[0], "role");
    ngx_str_set(&names[1], "content");

    len = 0;

    if (*head->start == '{'
        && ngx_http_llama_session_json_object(head->start, head->end, names,
                                              fields, 2)
           != NULL)
    {
        if ((fields[0].start
             && EVP_DigestUpdate(md, fields[0].start,
                                 fields[0].end - fields[0].start) != 1)
            || EVP_DigestUpdate(md, "\0", 1) != 1)
        {
            goto failed;
        }

        budget = NGX_HTTP_LLAMA_SESSION_HEAD;

        if (fields[1].start
            && ngx_http_llama_session_digest_text(r, &fields[1], &len, 0,
                                                  &budget)
               != NGX_OK)
        {
            return NGX_ERROR;
        }

    } else if (EVP_DigestUpdate(md, head->start, head->end - head->start)
               != 1)
    {
        goto failed;
    }

    if (ngx_http_llama_session_digest_end(r, ctx->head) != NGX_OK) {
        return NGX_ERROR;
    }

    ctx->has_head = 1;

    return NGX_OK;

failed:

    ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                  "llama_session: SHA-256 failed");
    return NGX_ERROR;
}


static ngx_int_t
ngx_http_llama_session_digest_end(ngx_http_request_t *r, u_char *out)
{
    u_char        hash[EVP_MAX_MD_SIZE];
    unsigned int  len;

    if (EVP_DigestFinal_ex(ngx_http_llama_session_sha256_ctx, hash, &len)
        != 1)
    {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "llama_session: SHA-256 failed");
        return NGX_ERROR;
    }

    ngx_memcpy(out, hash, NGX_HTTP_LLAMA_SESSION_DIGEST);

    return NGX_OK;
}


/*
 * max_tokens (max_completion_tokens, n_predict) of 0 or 1: a model check,
 * a key check, a token count by the fallback way
 */

static ngx_uint_t
ngx_http_llama_session_probe(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_span_t *spans)
{
    u_char                          buf[64];
    double                          v;
    size_t                          len;
    int64_t                         n;
    ngx_uint_t                      i;
    ngx_http_llama_session_span_t  *sp;

    static const ngx_uint_t  order[] = {
        NGX_HTTP_LLAMA_SESSION_SP_N_PREDICT,
        NGX_HTTP_LLAMA_SESSION_SP_MAX_COMPL,
        NGX_HTTP_LLAMA_SESSION_SP_MAX_TOKENS
    };

    /*
     * the limit llama-server takes: the first of n_predict,
     * max_completion_tokens and max_tokens that is not null; Anthropic's
     * /v1/messages passes on max_tokens alone
     */

    i = ctx->dialect->max_tokens ? 2 : 0;

    for ( /* void */ ; i < 3; i++) {
        sp = &spans[order[i]];

        if (sp->start == NULL
            || (sp->end - sp->start == 4
                && ngx_strncmp(sp->start, "null", 4) == 0))
        {
            continue;
        }

        len = sp->end - sp->start;

        /*
         * a number as llama-server's JSON library reads it into an
         * int32_t: an integer wraps (4294967297 is 1), a fraction is
         * truncated; anything else (true, a string) is refused there
         */

        if (len >= sizeof(buf)
            || !(*sp->start == '-' || (*sp->start >= '0' && *sp->start <= '9')))
        {
            return 0;
        }

        ngx_memcpy(buf, sp->start, len);
        buf[len] = '\0';

        if (strpbrk((char *) buf, ".eE") == NULL) {
            errno = 0;

            if (*buf == '-') {
                n = (int64_t) strtoll((char *) buf, NULL, 10);

            } else {
                n = (int64_t) strtoull((char *) buf, NULL, 10);
            }

            /* out of 64 bits: a float for it, far out of range: refused */

            return errno == 0 && ((int32_t) n == 0 || (int32_t) n == 1);
        }

        v = strtod((char *) buf, NULL);

        return v > -1.0 && v < 2.0;
    }

    return 0;
}


/*
 * A user message that is the client's context, not the user's words:
 * Codex's "<environment_context>" item (its folder, shell, date, time
 * zone), the same in every conversation it starts there that day.  Its
 * content is that one text, as a string or a single part; it belongs to
 * the prompt that comes before the conversation.
 */

static ngx_uint_t
ngx_http_llama_session_client_context(ngx_http_llama_session_span_t *content)
{
    u_char                         *pos;
    ngx_str_t                       name;
    ngx_http_llama_session_span_t   text, elt, more;

    static u_char  open[] = "\"<environment_context>";
    static u_char  close[] = "</environment_context>\"";

    text = *content;

    if (*content->start == '[') {
        ngx_str_set(&name, "text");

        pos = content->start;

        if (ngx_http_llama_session_json_next(&pos, content->end, &elt)
               != NGX_OK
            || ngx_http_llama_session_json_next(&pos, content->end, &more)
               == NGX_OK
            || *elt.start != '{'
            || ngx_http_llama_session_json_object(elt.start, elt.end, &name,
                                                  &text, 1)
               == NULL
            || text.start == NULL)
        {
            return 0;
        }
    }

    return (text.end - text.start >= (ssize_t) (sizeof(open) + sizeof(close)
                                                - 2)
            && ngx_strncmp(text.start, open, sizeof(open) - 1) == 0
            && ngx_strncmp(text.end - (sizeof(close) - 1), close,
                           sizeof(close) - 1) == 0);
}


/* a string, or the strings and "text" members of an array's parts */

static ngx_int_t
ngx_http_llama_session_digest_text(ngx_http_request_t *r,
    ngx_http_llama_session_span_t *span, size_t *found, ngx_uint_t billing,
    size_t *budget)
{
    u_char                         *pos;
    ngx_str_t                       name;
    ngx_http_llama_session_span_t   elt, text;

    if (*span->start == '"') {
        return ngx_http_llama_session_digest_string(r, span->start,
                                                    span->end, found,
                                                    billing, budget);
    }

    if (*span->start != '[') {
        return NGX_OK;
    }

    ngx_str_set(&name, "text");

    pos = span->start;

    while (ngx_http_llama_session_json_next(&pos, span->end, &elt) == NGX_OK)
    {
        if (*elt.start == '"') {
            text = elt;

        } else if (*elt.start != '{'
                   || ngx_http_llama_session_json_object(elt.start, elt.end,
                                                         &name, &text, 1)
                      == NULL
                   || text.start == NULL || *text.start != '"')
        {
            continue;
        }

        if (ngx_http_llama_session_digest_string(r, text.start, text.end,
                                                 found, billing, budget)
            != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


/*
 * One JSON string, decoded, into the digest: "\n" before all but the
 * first; *found counts the bytes.  In Anthropic's system prompt, the five
 * characters after "cch=" of a block that starts with
 * "x-anthropic-billing-header:" become "fffff", as llama-server makes them.
 */

static ngx_int_t
ngx_http_llama_session_digest_string(ngx_http_request_t *r, u_char *start,
    u_char *end, size_t *found, ngx_uint_t billing, size_t *budget)
{
    u_char      *p, *cch;
    cJSON       *json;
    size_t       len;
    ngx_int_t    rc;
    EVP_MD_CTX  *md;

    static u_char  header[] = "x-anthropic-billing-header:";

    json = cJSON_ParseWithLength((const char *) start, end - start);
    if (json == NULL) {
        return NGX_OK;
    }

    rc = NGX_OK;
    md = ngx_http_llama_session_sha256_ctx;

    if (cJSON_IsString(json) && json->valuestring[0] != '\0') {
        p = (u_char *) json->valuestring;
        len = ngx_strlen(p);

        if (billing && len > sizeof(header) - 1
            && ngx_strncmp(p, header, sizeof(header) - 1) == 0)
        {
            cch = ngx_strlcasestrn(p + sizeof(header) - 1, p + len,
                                   (u_char *) "cch=", 4 - 1);

            if (cch && cch + 4 + 5 < p + len && cch[4 + 5] == ';') {
                ngx_memset(cch + 4, 'f', 5);
            }
        }

        if (budget) {
            /* the start of the first message only */

            if (*budget == 0) {
                cJSON_Delete(json);
                return NGX_OK;
            }

            if (*found) {
                (*budget)--;
            }

            len = ngx_min(len, *budget);
            *budget -= len;
        }

        if ((*found && EVP_DigestUpdate(md, "\n", 1) != 1)
            || EVP_DigestUpdate(md, p, len) != 1)
        {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "llama_session: SHA-256 failed");
            rc = NGX_ERROR;
        }

        *found += len;
    }

    cJSON_Delete(json);

    return rc;
}


/* a string or an integer value, decoded */

static ngx_int_t
ngx_http_llama_session_span_str(ngx_http_request_t *r,
    ngx_http_llama_session_span_t *span, ngx_str_t *s)
{
    cJSON      *json;
    ngx_int_t   rc;

    ngx_str_null(s);

    json = cJSON_ParseWithLength((const char *) span->start,
                                 span->end - span->start);
    if (json == NULL) {
        return NGX_OK;
    }

    rc = ngx_http_llama_session_json_str(r, json, s);

    cJSON_Delete(json);

    return rc;
}


/* a string, or an integer as its decimal digits; else empty */

static ngx_int_t
ngx_http_llama_session_json_str(ngx_http_request_t *r, cJSON *item,
    ngx_str_t *s)
{
    size_t  len;

    ngx_str_null(s);

    if (cJSON_IsString(item)) {
        len = ngx_strlen(item->valuestring);

        s->data = ngx_pnalloc(r->pool, len);
        if (s->data == NULL) {
            return NGX_ERROR;
        }

        s->len = len;
        ngx_memcpy(s->data, item->valuestring, len);

        return NGX_OK;
    }

    if (cJSON_IsNumber(item) && item->valuedouble == (double) item->valueint)
    {
        s->data = ngx_pnalloc(r->pool, NGX_INT_T_LEN);
        if (s->data == NULL) {
            return NGX_ERROR;
        }

        s->len = ngx_sprintf(s->data, "%i", (ngx_int_t) item->valueint)
                 - s->data;
    }

    return NGX_OK;
}


/*
 * key = up to 32 characters of the id from [A-Za-z0-9_-] (others become
 * "_"), "-", and 24 hex digits of SHA-256(namespace \0 model \0 id), with
 * "\0s" and the system prompt's digest, and "\0h" and the first message's,
 * when the request has them: safe as a file name, readable, and different
 * for different tenants, models, ids and conversations under one id.  The
 * "default" session's key is "default", or with a namespace "default-"
 * and 24 hex digits of SHA-256 of the namespace.
 *
 * A request with a system prompt also gets its base's key: "base-" and 24
 * hex digits of SHA-256("base" \0 namespace \0 model \0 system digest),
 * the state that holds the system prompt alone (warm.c).
 */

/*
 * The namespace's digest, the tenant a session, a file and a slot's
 * content belong to (the API shows a tenant its own only):
 * SHA-256("ns" \0 namespace), the empty namespace included.  The worker
 * keeps the last one.
 */

ngx_int_t
ngx_http_llama_session_ns_digest(ngx_http_request_t *r, ngx_str_t *ns,
    u_char *out)
{
    u_char      hash[EVP_MAX_MD_SIZE];
    ngx_str_t   parts[2];

    static u_char  last_ns[256], last_out[NGX_HTTP_LLAMA_SESSION_DIGEST];
    static size_t  last_len = (size_t) -1;

    if (ns->len == last_len && ngx_memcmp(ns->data, last_ns, ns->len) == 0) {
        ngx_memcpy(out, last_out, NGX_HTTP_LLAMA_SESSION_DIGEST);
        return NGX_OK;
    }

    ngx_str_set(&parts[0], "ns\0");
    parts[1] = *ns;

    if (ngx_http_llama_session_sha256(r, parts, 2, hash) != NGX_OK) {
        return NGX_ERROR;
    }

    ngx_memcpy(out, hash, NGX_HTTP_LLAMA_SESSION_DIGEST);

    if (ns->len <= sizeof(last_ns)) {
        ngx_memcpy(last_ns, ns->data, ns->len);
        last_len = ns->len;
        ngx_memcpy(last_out, out, NGX_HTTP_LLAMA_SESSION_DIGEST);
    }

    return NGX_OK;
}


ngx_int_t
ngx_http_llama_session_make_key(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *ns)
{
    u_char      *p, c, hash[EVP_MAX_MD_SIZE];
    u_char       sys[2 + NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char       head[2 + NGX_HTTP_LLAMA_SESSION_DIGEST];
    size_t       i, n, len;
    ngx_str_t    parts[8], idn[4], client;
    ngx_uint_t   nparts, nidn;

    sys[0] = '\0';
    sys[1] = 's';
    ngx_memcpy(sys + 2, ctx->sys, NGX_HTTP_LLAMA_SESSION_DIGEST);

    head[0] = '\0';
    head[1] = 'h';
    ngx_memcpy(head + 2, ctx->head, NGX_HTTP_LLAMA_SESSION_DIGEST);

    if (ngx_http_llama_session_ns_digest(r, ns, ctx->nsk) != NGX_OK) {
        return NGX_ERROR;
    }

    ctx->has_nsk = 1;

    if (ctx->default_session) {
        if (ctx->sys_len
            && ngx_http_llama_session_base_key(r, ctx, ns, sys, hash)
               != NGX_OK)
        {
            return NGX_ERROR;
        }

        p = ngx_cpymem(ctx->key, "default", sizeof("default") - 1);

        if (ns->len) {
            /* tenants never share the default session either */

            if (ngx_http_llama_session_sha256(r, ns, 1, hash) != NGX_OK) {
                return NGX_ERROR;
            }

            *p++ = '-';
            p = ngx_hex_dump(p, hash, NGX_HTTP_LLAMA_SESSION_HASH_HEX / 2);
        }

        ctx->key_len = p - ctx->key;
        return NGX_OK;
    }

    parts[0] = *ns;
    ngx_str_set(&parts[1], "\0");
    parts[2] = ctx->model;
    parts[3] = parts[1];
    parts[4] = ctx->id;
    nparts = 5;
    ngx_str_null(&client);

    /*
     * a client's id in the form of the module's own ("sys-…") is a key
     * space of its own: a client that knows a system prompt cannot name
     * the conversation the module keeps for it
     */

    if (!ctx->id_own && ctx->id.len >= sizeof("sys-") - 1
        && ngx_strncmp(ctx->id.data, "sys-", sizeof("sys-") - 1) == 0)
    {
        ngx_str_set(&client, "\0client");
        parts[nparts++] = client;
    }

    if (ctx->sys_len) {
        parts[nparts].data = sys;
        parts[nparts].len = sizeof(sys);
        nparts++;
    }

    if (ctx->has_head) {
        parts[nparts].data = head;
        parts[nparts].len = sizeof(head);
        nparts++;
    }

    /*
     * the same session comes again and again: the worker keeps the last
     * key it derived, with its id's and its base's digests, and the input,
     * to skip SHA-256 then
     */

    len = 0;

    for (i = 0; i < nparts; i++) {
        len += parts[i].len;
    }

    if (len <= sizeof(ngx_http_llama_session_last_in)
        && len == ngx_http_llama_session_last_len
        && ngx_http_llama_session_last_matches(parts, nparts))
    {
        ctx->key_len = ngx_http_llama_session_last_key_len;
        ngx_memcpy(ctx->key, ngx_http_llama_session_last_key, ctx->key_len);
        ngx_memcpy(ctx->idk, ngx_http_llama_session_last_idk,
                   NGX_HTTP_LLAMA_SESSION_DIGEST);

        if (ctx->sys_len) {
            ngx_http_llama_session_base_name(ctx,
                                             ngx_http_llama_session_last_base);
        }

        return NGX_OK;
    }

    /*
     * what the API finds the client's id by, whatever the model and the
     * prefix: SHA-256(namespace \0 id)
     */

    idn[0] = parts[0];
    idn[1] = parts[1];
    idn[2] = parts[4];
    nidn = 3;

    if (client.len) {
        idn[nidn++] = client;
    }

    if (ngx_http_llama_session_sha256(r, idn, nidn, hash) != NGX_OK) {
        return NGX_ERROR;
    }

    ngx_memcpy(ctx->idk, hash, NGX_HTTP_LLAMA_SESSION_DIGEST);

    if (ctx->sys_len
        && ngx_http_llama_session_base_key(r, ctx, ns, sys, hash) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (len <= sizeof(ngx_http_llama_session_last_in)) {
        ngx_memcpy(ngx_http_llama_session_last_base, hash,
                   NGX_HTTP_LLAMA_SESSION_HASH_HEX / 2);
    }

    if (ngx_http_llama_session_sha256(r, parts, nparts, hash) != NGX_OK) {
        return NGX_ERROR;
    }

    p = ctx->key;
    n = ngx_min(ctx->id.len, NGX_HTTP_LLAMA_SESSION_SAFE_MAX);

    for (i = 0; i < n; i++) {
        c = ctx->id.data[i];

        *p++ = ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
                || (c >= '0' && c <= '9') || c == '-' || c == '_')
               ? c : '_';
    }

    *p++ = '-';
    p = ngx_hex_dump(p, hash, NGX_HTTP_LLAMA_SESSION_HASH_HEX / 2);

    ctx->key_len = p - ctx->key;

    if (len <= sizeof(ngx_http_llama_session_last_in)) {
        p = ngx_http_llama_session_last_in;

        for (i = 0; i < nparts; i++) {
            if (parts[i].len) {
                p = ngx_cpymem(p, parts[i].data, parts[i].len);
            }
        }

        ngx_http_llama_session_last_len = len;
        ngx_http_llama_session_last_key_len = ctx->key_len;
        ngx_memcpy(ngx_http_llama_session_last_key, ctx->key, ctx->key_len);
        ngx_memcpy(ngx_http_llama_session_last_idk, ctx->idk,
                   NGX_HTTP_LLAMA_SESSION_DIGEST);
    }

    ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: session from %V, key \"%*s\"",
                   &ctx->source, ctx->key_len, ctx->key);

    return NGX_OK;
}


/*
 * The base's key: SHA-256("base" \0 namespace \0 model \0s system digest);
 * its first bytes are left in hash for the worker's cache
 */

static ngx_int_t
ngx_http_llama_session_base_key(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *ns, u_char *sys,
    u_char *hash)
{
    ngx_str_t  parts[6];

    ngx_str_set(&parts[0], "base");
    ngx_str_set(&parts[1], "\0");
    parts[2] = *ns;
    parts[3] = parts[1];
    parts[4] = ctx->model;
    parts[5].data = sys;
    parts[5].len = 2 + NGX_HTTP_LLAMA_SESSION_DIGEST;

    if (ngx_http_llama_session_sha256(r, parts, 6, hash) != NGX_OK) {
        return NGX_ERROR;
    }

    ngx_http_llama_session_base_name(ctx, hash);

    return NGX_OK;
}


static void
ngx_http_llama_session_base_name(ngx_http_llama_session_ctx_t *ctx,
    u_char *hash)
{
    u_char  *p;

    ngx_memcpy(ctx->base_id, hash, NGX_HTTP_LLAMA_SESSION_DIGEST);

    p = ngx_cpymem(ctx->base_key, "base-", sizeof("base-") - 1);
    p = ngx_hex_dump(p, hash, NGX_HTTP_LLAMA_SESSION_HASH_HEX / 2);
    ctx->base_len = p - ctx->base_key;
}


/* SHA-256 of the parts */

static ngx_int_t
ngx_http_llama_session_sha256(ngx_http_request_t *r, ngx_str_t *parts,
    ngx_uint_t n, u_char *out)
{
    ngx_uint_t     i;
    EVP_MD_CTX    *md;
    unsigned int   len;

    md = ngx_http_llama_session_sha256_begin(r);
    if (md == NULL) {
        return NGX_ERROR;
    }

    for (i = 0; i < n; i++) {
        if (EVP_DigestUpdate(md, parts[i].data, parts[i].len) != 1) {
            goto failed;
        }
    }

    if (EVP_DigestFinal_ex(md, out, &len) == 1) {
        return NGX_OK;
    }

failed:

    ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                  "llama_session: SHA-256 failed");
    return NGX_ERROR;
}


/*
 * The worker's digest context, started; the digest is fetched once per
 * worker (slow in OpenSSL 3), or taken from EVP_sha256() before 3.0.
 */

static EVP_MD_CTX *
ngx_http_llama_session_sha256_begin(ngx_http_request_t *r)
{
    if (ngx_http_llama_session_sha256_ctx == NULL) {
#if (OPENSSL_VERSION_NUMBER >= 0x30000000L)
        ngx_http_llama_session_sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
        ngx_http_llama_session_sha256_md = (EVP_MD *) EVP_sha256();
#endif
        ngx_http_llama_session_sha256_ctx = EVP_MD_CTX_new();

        if (ngx_http_llama_session_sha256_md == NULL
            || ngx_http_llama_session_sha256_ctx == NULL)
        {
            ngx_http_llama_session_sha256_free();
            goto failed;
        }
    }

    if (EVP_DigestInit_ex(ngx_http_llama_session_sha256_ctx,
                          ngx_http_llama_session_sha256_md, NULL)
        == 1)
    {
        return ngx_http_llama_session_sha256_ctx;
    }

failed:

    ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                  "llama_session: SHA-256 failed");
    return NULL;
}


static ngx_uint_t
ngx_http_llama_session_last_matches(ngx_str_t *parts, ngx_uint_t n)
{
    u_char      *p;
    ngx_uint_t   i;

    p = ngx_http_llama_session_last_in;

    for (i = 0; i < n; i++) {
        if (parts[i].len && ngx_memcmp(p, parts[i].data, parts[i].len) != 0)
        {
            return 0;
        }

        p += parts[i].len;
    }

    return 1;
}


/* at a worker's exit: the digest objects of ngx_http_llama_session_sha256 */

void
ngx_http_llama_session_sha256_free(void)
{
    EVP_MD_CTX_free(ngx_http_llama_session_sha256_ctx);
#if (OPENSSL_VERSION_NUMBER >= 0x30000000L)
    EVP_MD_free(ngx_http_llama_session_sha256_md);
#endif

    ngx_http_llama_session_sha256_ctx = NULL;
    ngx_http_llama_session_sha256_md = NULL;
}


/*
 * Router mode: the zone of the request's "model" among the location's
 * (llama_session zoneA zoneB ...); NGX_DECLINED: none drives it.
 */

static ngx_int_t
ngx_http_llama_session_choose_zone(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t                          i;
    ngx_http_llama_session_zone_t      *zone, **zp;
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    if (!ctx->identity && llcf->zone && llcf->zone->models) {
        /*
         * models=: the zone of the model, or none yet: the router's list
         * first (ST_BIND), never a name a client makes up
         */

        if (!ngx_http_llama_session_model_valid(ctx->model.data,
                                                ctx->model.len))
        {
            goto refused;
        }

        zone = ngx_http_llama_session_models_find(llcf->zone,
                                                  ctx->model.data,
                                                  ctx->model.len);
        if (zone) {
            ctx->zone = zone;

        } else {
            ctx->bind = 1;
        }

        return NGX_OK;
    }

    if (ctx->identity || llcf->zones == NULL) {
        return NGX_OK;
    }

    zp = llcf->zones->elts;

    for (i = 0; i < llcf->zones->nelts; i++) {
        if (zp[i]->model.len == ctx->model.len
            && ngx_strncmp(zp[i]->model.data, ctx->model.data,
                           ctx->model.len) == 0)
        {
            ctx->zone = zp[i];
            return NGX_OK;
        }
    }

refused:

    ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                  "llama_session: no zone of this location drives the "
                  "model \"%*s\"%s: refused", ngx_min(ctx->model.len, 64),
                  ctx->model.data, ctx->model.len > 64 ? "..." : "");

    return NGX_DECLINED;
}


/* does the request's path end with suffix, trailing slashes aside? */

ngx_uint_t
ngx_http_llama_session_uri_ends(ngx_http_request_t *r, char *suffix)
{
    ngx_str_t  s;

    s.data = (u_char *) suffix;
    s.len = ngx_strlen(suffix);

    return ngx_http_llama_session_path_ends(r, &s);
}


ngx_uint_t
ngx_http_llama_session_path_ends(ngx_http_request_t *r, ngx_str_t *suffix)
{
    ngx_str_t  uri;

    uri = r->uri;

    while (uri.len > 1 && uri.data[uri.len - 1] == '/') {
        uri.len--;
    }

    return uri.len >= suffix->len
           && ngx_strncmp(uri.data + uri.len - suffix->len, suffix->data,
                          suffix->len) == 0;
}


/* is the path one of the location's llama_session_endpoints? */

ngx_uint_t
ngx_http_llama_session_is_endpoint(ngx_http_request_t *r,
    ngx_array_t *endpoints)
{
    ngx_str_t   *s;
    ngx_uint_t   i;

    s = endpoints->elts;

    for (i = 0; i < endpoints->nelts; i++) {
        if (ngx_http_llama_session_path_ends(r, &s[i])) {
            return 1;
        }
    }

    return 0;
}
