
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Which requests use a slot, and which session a request belongs to:
 * headers, then JSON body fields, then a hash of the system prompt, else
 * "default".  The session's key, the only thing that ever reaches a file
 * name, is derived from the client's id through a strict charset and a
 * SHA-256 over (namespace, model, id).
 */


#include "ngx_http_llama_session_module.h"

#include <cjson/cJSON.h>
#include <openssl/evp.h>


static ngx_int_t ngx_http_llama_session_read_body(ngx_http_request_t *r,
    size_t max, ngx_str_t *body);
static ngx_int_t ngx_http_llama_session_from_headers(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_array_t *names);
static ngx_int_t ngx_http_llama_session_from_json(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_loc_conf_t *llcf,
    ngx_http_llama_session_span_t *spans);
static ngx_int_t ngx_http_llama_session_system_text(ngx_http_request_t *r,
    ngx_http_llama_session_span_t *system,
    ngx_http_llama_session_span_t *messages, ngx_str_t *text);
static ngx_int_t ngx_http_llama_session_span_text(ngx_http_request_t *r,
    ngx_http_llama_session_span_t *span, ngx_str_t *text);
static ngx_int_t ngx_http_llama_session_span_str(ngx_http_request_t *r,
    ngx_http_llama_session_span_t *span, ngx_str_t *s);
static ngx_int_t ngx_http_llama_session_sha256(ngx_http_request_t *r,
    ngx_str_t *parts, ngx_uint_t n, u_char *out);
static ngx_uint_t ngx_http_llama_session_last_matches(ngx_str_t *ns,
    ngx_str_t *model, ngx_str_t *id);
static ngx_int_t ngx_http_llama_session_append_text(ngx_http_request_t *r,
    cJSON *content, ngx_str_t *text);
static ngx_int_t ngx_http_llama_session_json_str(ngx_http_request_t *r,
    cJSON *item, ngx_str_t *s);


static EVP_MD      *ngx_http_llama_session_sha256_md;
static EVP_MD_CTX  *ngx_http_llama_session_sha256_ctx;

/* the last key this worker derived, and what it was derived from */
static u_char   ngx_http_llama_session_last_in[512];
static size_t   ngx_http_llama_session_last_len;
static u_char   ngx_http_llama_session_last_key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
static size_t   ngx_http_llama_session_last_key_len;


static ngx_str_t  ngx_http_llama_session_model_name =
    ngx_string("model");
static ngx_str_t  ngx_http_llama_session_system_name =
    ngx_string("system");
static ngx_str_t  ngx_http_llama_session_messages_name =
    ngx_string("messages");


static ngx_str_t  ngx_http_llama_session_no_slot[] = {
    ngx_string("tokenize"),
    ngx_string("detokenize"),
    ngx_string("apply-template"),
    ngx_string("count_tokens"),
    ngx_string("props"),
    ngx_string("slots"),
    ngx_string("health"),
    ngx_string("models"),
    ngx_string("metrics"),
    ngx_string("lora-adapters"),
    ngx_string("show"),
    ngx_string("tags"),
    ngx_null_string
};


static ngx_str_t  ngx_http_llama_session_no_session[] = {
    ngx_string("embedding"),
    ngx_string("embeddings"),
    ngx_string("rerank"),
    ngx_string("reranking"),
    ngx_null_string
};


/*
 * Only POSTs run inference.  Among them, llama-server's endpoints that never
 * touch a slot pass by; embeddings and rerank use the slot but carry no
 * conversation, so they count as "default".
 */

ngx_uint_t
ngx_http_llama_session_uses_slot(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char     *p, *last;
    ngx_str_t   name, *s;

    if (r->method != NGX_HTTP_POST) {
        return 0;
    }

    last = r->uri.data + r->uri.len;

    while (last > r->uri.data && last[-1] == '/') {
        last--;
    }

    for (p = last; p > r->uri.data && p[-1] != '/'; p--) { /* void */ }

    name.data = p;
    name.len = last - p;

    /*
     * POST .../slots/N is llama-server's slot API: a client could save,
     * restore or erase other sessions' states with it
     */

    if (p - r->uri.data >= 7
        && ngx_strncasecmp(p - 7, (u_char *) "/slots/", 7) == 0)
    {
        ctx->refuse = 1;
        return 0;
    }

    for (s = ngx_http_llama_session_no_slot; s->len; s++) {
        if (s->len == name.len
            && ngx_strncasecmp(s->data, name.data, name.len) == 0)
        {
            return 0;
        }
    }

    for (s = ngx_http_llama_session_no_session; s->len; s++) {
        if (s->len == name.len
            && ngx_strncasecmp(s->data, name.data, name.len) == 0)
        {
            ctx->use_default = 1;
            break;
        }
    }

    return 1;
}


ngx_int_t
ngx_http_llama_session_identify(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char                             *dot;
    ngx_int_t                           rc;
    ngx_str_t                           body, ns, *field;
    ngx_str_t                           names[3 + NGX_HTTP_LLAMA_SESSION_FIELDS_MAX];
    ngx_uint_t                          i, n;
    ngx_http_llama_session_span_t       spans[3 + NGX_HTTP_LLAMA_SESSION_FIELDS_MAX];
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

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

    if (rc == NGX_ERROR) {
        return NGX_ERROR;
    }

    rc = ngx_http_llama_session_read_body(r, llcf->body_max, &body);

    if (rc == NGX_ERROR) {
        return NGX_ERROR;
    }

    if (rc == NGX_DECLINED || body.len == 0) {
        goto fallback;
    }

    /* the members the module needs, at the top level of the object */

    names[0] = ngx_http_llama_session_model_name;
    names[1] = ngx_http_llama_session_system_name;
    names[2] = ngx_http_llama_session_messages_name;
    n = 3;

    field = llcf->id_fields->elts;

    for (i = 0; i < llcf->id_fields->nelts; i++) {
        dot = ngx_strlchr(field[i].data, field[i].data + field[i].len, '.');

        names[n].data = field[i].data;
        names[n].len = dot ? (size_t) (dot - field[i].data) : field[i].len;
        n++;
    }

    if (ngx_http_llama_session_json_body(body.data, body.data + body.len,
                                         names, spans, n)
        != NGX_OK)
    {
        ngx_log_debug0(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "llama_session: the body is not a JSON object");
        goto fallback;
    }

    if (spans[0].start
        && ngx_http_llama_session_span_str(r, &spans[0], &ctx->model)
           == NGX_ERROR)
    {
        return NGX_ERROR;
    }

    if (ctx->id.len == 0
        && ngx_http_llama_session_from_json(r, ctx, llcf, spans) == NGX_ERROR)
    {
        return NGX_ERROR;
    }

fallback:

    if (ctx->id.len == 0) {
        ngx_str_set(&ctx->id, "default");
        ngx_str_set(&ctx->source, "default");
        ctx->default_session = 1;
    }

    return ngx_http_llama_session_make_key(r, ctx, &ns);
}


/* NGX_OK: the whole body in one piece; NGX_DECLINED: none or too large */

static ngx_int_t
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


static ngx_int_t
ngx_http_llama_session_from_json(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_loc_conf_t *llcf,
    ngx_http_llama_session_span_t *spans)
{
    u_char                         *p, *last, *dot, hash[EVP_MAX_MD_SIZE];
    ngx_str_t                      *field, text, name;
    ngx_uint_t                      n;
    ngx_http_llama_session_span_t   span;

    field = llcf->id_fields->elts;

    for (n = 0; n < llcf->id_fields->nelts; n++) {

        /* the first part of the path was found with the top level */

        span = spans[3 + n];
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

        if (span.start == NULL) {
            continue;
        }

        if (ngx_http_llama_session_span_str(r, &span, &ctx->id) == NGX_ERROR)
        {
            return NGX_ERROR;
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

    if (ngx_http_llama_session_system_text(r, &spans[1], &spans[2], &text)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (text.len == 0) {
        return NGX_DECLINED;
    }

    if (ngx_http_llama_session_sha256(r, &text, 1, hash) != NGX_OK) {
        return NGX_ERROR;
    }

    ctx->id.data = ngx_pnalloc(r->pool, sizeof("sys-") - 1 + 16);
    if (ctx->id.data == NULL) {
        return NGX_ERROR;
    }

    p = ngx_cpymem(ctx->id.data, "sys-", sizeof("sys-") - 1);
    p = ngx_hex_dump(p, hash, 8);
    ctx->id.len = p - ctx->id.data;

    ngx_str_set(&ctx->source, "system_hash");

    return NGX_OK;
}


/*
 * The system prompt: Anthropic's top-level "system" (a string or text
 * blocks; also Ollama's /api/generate "system"), then every message with
 * role "system" (OpenAI, Ollama /api/chat), joined by newlines.
 */

static ngx_int_t
ngx_http_llama_session_system_text(ngx_http_request_t *r,
    ngx_http_llama_session_span_t *system,
    ngx_http_llama_session_span_t *messages, ngx_str_t *text)
{
    u_char                         *pos;
    ngx_int_t                       rc;
    ngx_str_t                       names[2];
    ngx_http_llama_session_span_t   elt, fields[2];

    ngx_str_null(text);

    if (system->start
        && ngx_http_llama_session_span_text(r, system, text) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (messages->start == NULL || *messages->start != '[') {
        return NGX_OK;
    }

    ngx_str_set(&names[0], "role");
    ngx_str_set(&names[1], "content");

    pos = messages->start;

    for ( ;; ) {
        rc = ngx_http_llama_session_json_next(&pos, messages->end, &elt);

        if (rc != NGX_OK) {
            return NGX_OK;
        }

        if (*elt.start != '{'
            || ngx_http_llama_session_json_object(elt.start, elt.end, names,
                                                  fields, 2)
               == NULL)
        {
            continue;
        }

        if (fields[0].start == NULL || fields[1].start == NULL
            || fields[0].end - fields[0].start != sizeof("\"system\"") - 1
            || ngx_strncmp(fields[0].start, "\"system\"",
                           sizeof("\"system\"") - 1) != 0)
        {
            continue;
        }

        if (ngx_http_llama_session_span_text(r, &fields[1], text) != NGX_OK) {
            return NGX_ERROR;
        }
    }
}


/* the text of a string or of text parts, decoded, appended to text */

static ngx_int_t
ngx_http_llama_session_span_text(ngx_http_request_t *r,
    ngx_http_llama_session_span_t *span, ngx_str_t *text)
{
    cJSON      *json;
    ngx_int_t   rc;

    json = cJSON_ParseWithLength((const char *) span->start,
                                 span->end - span->start);
    if (json == NULL) {
        return NGX_OK;
    }

    rc = ngx_http_llama_session_append_text(r, json, text);

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


static ngx_int_t
ngx_http_llama_session_append_text(ngx_http_request_t *r, cJSON *content,
    ngx_str_t *text)
{
    u_char  *p;
    cJSON   *part, *t;
    size_t   len;

    if (cJSON_IsArray(content)) {
        cJSON_ArrayForEach(part, content) {
            t = cJSON_IsObject(part)
                ? cJSON_GetObjectItemCaseSensitive(part, "text") : part;

            if (cJSON_IsString(t)
                && ngx_http_llama_session_append_text(r, t, text) != NGX_OK)
            {
                return NGX_ERROR;
            }
        }

        return NGX_OK;
    }

    if (!cJSON_IsString(content) || content->valuestring[0] == '\0') {
        return NGX_OK;
    }

    len = ngx_strlen(content->valuestring);

    p = ngx_pnalloc(r->pool, text->len + 1 + len);
    if (p == NULL) {
        return NGX_ERROR;
    }

    if (text->len) {
        ngx_memcpy(p, text->data, text->len);
        p[text->len++] = '\n';
    }

    ngx_memcpy(p + text->len, content->valuestring, len);

    text->data = p;
    text->len += len;

    return NGX_OK;
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
 * "_"), "-", and 24 hex digits of SHA-256(namespace \0 model \0 id): safe
 * as a file name, readable, and different for different tenants, models
 * and ids.  The "default" session's key is "default".
 */

ngx_int_t
ngx_http_llama_session_make_key(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *ns)
{
    u_char      *p, c, hash[EVP_MAX_MD_SIZE];
    size_t       i, n, len;
    ngx_str_t    parts[5];

    if (ctx->default_session) {
        p = ngx_cpymem(ctx->key, "default", sizeof("default") - 1);
        ctx->key_len = p - ctx->key;
        return NGX_OK;
    }

    /*
     * the same session comes again and again: the worker keeps the last
     * key it derived, and its input, to skip SHA-256 then
     */

    len = ns->len + ctx->model.len + ctx->id.len + 2;

    if (len <= sizeof(ngx_http_llama_session_last_in)
        && len == ngx_http_llama_session_last_len
        && ngx_http_llama_session_last_matches(ns, &ctx->model, &ctx->id))
    {
        ctx->key_len = ngx_http_llama_session_last_key_len;
        ngx_memcpy(ctx->key, ngx_http_llama_session_last_key, ctx->key_len);
        return NGX_OK;
    }

    parts[0] = *ns;
    ngx_str_set(&parts[1], "\0");
    parts[2] = ctx->model;
    parts[3] = parts[1];
    parts[4] = ctx->id;

    if (ngx_http_llama_session_sha256(r, parts, 5, hash) != NGX_OK) {
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
        p = ngx_cpymem(ngx_http_llama_session_last_in, ns->data, ns->len);
        *p++ = '\0';
        p = ngx_cpymem(p, ctx->model.data, ctx->model.len);
        *p++ = '\0';
        ngx_memcpy(p, ctx->id.data, ctx->id.len);

        ngx_http_llama_session_last_len = len;
        ngx_http_llama_session_last_key_len = ctx->key_len;
        ngx_memcpy(ngx_http_llama_session_last_key, ctx->key, ctx->key_len);
    }

    ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: session from %V, key \"%*s\"",
                   &ctx->source, ctx->key_len, ctx->key);

    return NGX_OK;
}


/* SHA-256 of the parts, with digest objects fetched once per worker */

static ngx_int_t
ngx_http_llama_session_sha256(ngx_http_request_t *r, ngx_str_t *parts,
    ngx_uint_t n, u_char *out)
{
    ngx_uint_t     i;
    EVP_MD_CTX    *md;
    unsigned int   len;

    if (ngx_http_llama_session_sha256_ctx == NULL) {
        /* fetching the digest is slow in OpenSSL 3: do it once */
        ngx_http_llama_session_sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
        ngx_http_llama_session_sha256_ctx = EVP_MD_CTX_new();

        if (ngx_http_llama_session_sha256_md == NULL
            || ngx_http_llama_session_sha256_ctx == NULL)
        {
            EVP_MD_free(ngx_http_llama_session_sha256_md);
            EVP_MD_CTX_free(ngx_http_llama_session_sha256_ctx);
            ngx_http_llama_session_sha256_md = NULL;
            ngx_http_llama_session_sha256_ctx = NULL;
            goto failed;
        }
    }

    md = ngx_http_llama_session_sha256_ctx;

    if (EVP_DigestInit_ex(md, ngx_http_llama_session_sha256_md, NULL) != 1) {
        goto failed;
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


static ngx_uint_t
ngx_http_llama_session_last_matches(ngx_str_t *ns, ngx_str_t *model,
    ngx_str_t *id)
{
    u_char  *p;

    p = ngx_http_llama_session_last_in;

    if (ngx_memcmp(p, ns->data, ns->len) != 0 || p[ns->len] != '\0') {
        return 0;
    }

    p += ns->len + 1;

    if (ngx_memcmp(p, model->data, model->len) != 0 || p[model->len] != '\0')
    {
        return 0;
    }

    p += model->len + 1;

    return ngx_memcmp(p, id->data, id->len) == 0;
}


/* at a worker's exit: the digest objects of ngx_http_llama_session_sha256 */

void
ngx_http_llama_session_sha256_free(void)
{
    EVP_MD_CTX_free(ngx_http_llama_session_sha256_ctx);
    EVP_MD_free(ngx_http_llama_session_sha256_md);

    ngx_http_llama_session_sha256_ctx = NULL;
    ngx_http_llama_session_sha256_md = NULL;
}
