
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The APIs the module speaks in front of llama-server, Ollama's
 * (ollama.c) and Anthropic's (anthropic.c), share this: the translated
 * request becomes the body proxy_pass sends, and the reply is translated
 * back as it passes through a header and a body filter, llama-server's
 * SSE events one by one (conv->event()), a whole reply or an error's at
 * its end (conv->whole()).
 *
 * With nginx's flow control, as the plain proxy path has it: the output
 * goes into a few buffers of the filter's own (NGX_HTTP_LLAMA_SESSION_
 * CONV_BUFS of NGX_HTTP_LLAMA_SESSION_CONV_BUF bytes), reused once sent;
 * while all of them wait for a client that does not read, the filter
 * stops taking llama-server's bytes: they stay in the upstream's buffer,
 * which then stops reading from llama-server.  Memory per stream is those
 * buffers, the upstream's, and one event being put together.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_convert.h"
#include "ngx_http_llama_session_json.h"


#define NGX_HTTP_LLAMA_SESSION_CONV_REPLY    (8 * 1024 * 1024)
#define NGX_HTTP_LLAMA_SESSION_CONV_EVENT    (1024 * 1024)

/* the translation's output buffers, in flight at once */
#define NGX_HTTP_LLAMA_SESSION_CONV_BUF      8192
#define NGX_HTTP_LLAMA_SESSION_CONV_BUFS     8


static ngx_int_t ngx_http_llama_session_conv_header(ngx_http_request_t *r);
static ngx_int_t ngx_http_llama_session_conv_body(ngx_http_request_t *r,
    ngx_chain_t *in);
static ngx_uint_t ngx_http_llama_session_conv_inflight(
    ngx_http_llama_session_conv_t *c);
static ngx_int_t ngx_http_llama_session_conv_consume(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c);


static ngx_http_output_header_filter_pt  ngx_http_next_header_filter;
static ngx_http_output_body_filter_pt    ngx_http_next_body_filter;


ngx_int_t
ngx_http_llama_session_conv_init(ngx_conf_t *cf)
{
    ngx_http_next_header_filter = ngx_http_top_header_filter;
    ngx_http_top_header_filter = ngx_http_llama_session_conv_header;

    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_llama_session_conv_body;

    return NGX_OK;
}


/* the reply's translation, in the request's pool, set in ctx->conv */

ngx_http_llama_session_conv_t *
ngx_http_llama_session_conv_create(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, char *api)
{
    ngx_http_llama_session_conv_t  *c;

    c = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_conv_t));
    if (c == NULL) {
        return NULL;
    }

    c->api = api;
    c->prompt_n = -1;
    c->cached = -1;

    ctx->conv = c;

    return c;
}


/*
 * The translated request is what proxy_pass sends, to the new path
 * (proxy_pass without a URI part of its own).  The client's body stays
 * in memory (ctx->body): a warm start's prime is made of its parts
 * (warm.c), which body_release() would otherwise read again from
 * request_body, the translation now.
 */

ngx_int_t
ngx_http_llama_session_conv_request(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, cJSON *out, char *uri)
{
    char         *text;
    size_t        len;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    text = cJSON_PrintUnformatted(out);

    if (text == NULL) {
        return NGX_ERROR;
    }

    len = ngx_strlen(text);

    b = ngx_create_temp_buf(r->pool, len);
    if (b == NULL) {
        cJSON_free(text);
        return NGX_ERROR;
    }

    b->last = ngx_cpymem(b->last, text, len);
    b->last_buf = 1;
    b->last_in_chain = 1;
    cJSON_free(text);

    cl = ngx_alloc_chain_link(r->pool);
    if (cl == NULL) {
        return NGX_ERROR;
    }

    cl->buf = b;
    cl->next = NULL;

    r->request_body->bufs = cl;
    r->request_body->temp_file = NULL;
    r->headers_in.content_length_n = len;

    ctx->body_copied = 0;

    r->uri.data = (u_char *) uri;
    r->uri.len = ngx_strlen(uri);
    r->valid_unparsed_uri = 0;
    r->args.len = 0;

    return NGX_OK;
}


/*
 * The request's JSON, read whole (identify() kept it, or it is read now:
 * an embed's), its values counted before cJSON builds the tree, without
 * duplicate members.  NULL with *error the client's message, or NULL
 * without one (a server error).
 */

cJSON *
ngx_http_llama_session_conv_parse(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, char *what, char **error)
{
    cJSON                              *in;
    ngx_int_t                           rc;
    ngx_str_t                           body;
    ngx_http_llama_session_loc_conf_t  *llcf;

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    *error = NULL;
    body = ctx->body;

    if (body.data == NULL
        && ngx_http_llama_session_read_body(r, llcf->body_max, &body)
           != NGX_OK)
    {
        *error = "the request body is missing or larger than the server "
                 "takes";
        return NULL;
    }

    if (ngx_http_llama_session_json_values(body.data, body.len)
        > NGX_HTTP_LLAMA_SESSION_JSON_VALUES)
    {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: %s request with more than %d JSON "
                      "values, refused", what,
                      NGX_HTTP_LLAMA_SESSION_JSON_VALUES);

        *error = "the request has too many JSON values";
        return NULL;
    }

    in = cJSON_ParseWithLength((char *) body.data, body.len);

    if (!cJSON_IsObject(in)) {
        cJSON_Delete(in);
        *error = "invalid JSON body";
        return NULL;
    }

    rc = ngx_http_llama_session_conv_dups(r->pool, in);

    if (rc == NGX_OK) {
        return in;
    }

    cJSON_Delete(in);

    if (rc == NGX_DECLINED) {
        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: %s request with a member twice in "
                      "one object, refused", what);

        *error = "a JSON object of the request has a member twice";
    }

    return NULL;
}


/*
 * Has any object of the tree a member name twice (names as decoded)?
 * NGX_DECLINED then, NGX_OK if none.  cJSON finds the first of duplicate
 * members, the body scanner (the session, the router's zone) and
 * llama-server the last: a body that has any is refused, so that all
 * read one request.  The names of an object are sorted (no pairwise
 * compare: an object may have 100,000 members).
 */

static int ngx_libc_cdecl
ngx_http_llama_session_conv_cmp(const void *a, const void *b)
{
    return ngx_strcmp(*(char **) a, *(char **) b);
}


ngx_int_t
ngx_http_llama_session_conv_dups(ngx_pool_t *pool, cJSON *item)
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
                      ngx_http_llama_session_conv_cmp);

            for (i = 1; i < n; i++) {
                if (ngx_strcmp(names[i - 1], names[i]) == 0) {
                    ngx_pfree(pool, names);
                    return NGX_DECLINED;
                }
            }

            ngx_pfree(pool, names);
        }

        rc = ngx_http_llama_session_conv_dups(pool, item->child);

        if (rc != NGX_OK) {
            return rc;
        }
    }

    return NGX_OK;
}


/* the reply: its header */

static ngx_int_t
ngx_http_llama_session_conv_header(ngx_http_request_t *r)
{
    ngx_http_llama_session_ctx_t   *ctx;
    ngx_http_llama_session_conv_t  *c;

    if (r != r->main) {
        return ngx_http_next_header_filter(r);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx == NULL || ctx->conv == NULL
        || ctx->job->state != NGX_HTTP_LLAMA_SESSION_ST_PROXY)
    {
        return ngx_http_next_header_filter(r);
    }

    c = ctx->conv;
    c->status = r->headers_out.status;

    if (c->status != NGX_HTTP_OK || !c->stream) {
        /* a whole JSON reply, translated at its end */
        ngx_str_set(&r->headers_out.content_type,
                    "application/json; charset=utf-8");

    } else {
        r->headers_out.content_type.data = (u_char *) c->stream_type;
        r->headers_out.content_type.len = ngx_strlen(c->stream_type);
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

    c->in = ngx_create_temp_buf(r->pool, 4096);
    if (c->in == NULL) {
        return NGX_ERROR;
    }

    return ngx_http_next_header_filter(r);
}


/* the reply's body: translated while there is room for the output */

static ngx_int_t
ngx_http_llama_session_conv_body(ngx_http_request_t *r, ngx_chain_t *in)
{
    ngx_int_t                       rc;
    ngx_chain_t                    *cl, *out;
    ngx_http_llama_session_ctx_t   *ctx;
    ngx_http_llama_session_conv_t  *c;

    if (r != r->main) {
        return ngx_http_next_body_filter(r, in);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx == NULL || ctx->conv == NULL) {
        return ngx_http_next_body_filter(r, in);
    }

    c = ctx->conv;

    if (c->in == NULL) {
        /* not translated, or translated whole already */
        return ngx_http_next_body_filter(r, in);
    }

    if (in && ngx_chain_add_copy(r->pool, &c->pending, in) != NGX_OK) {
        return NGX_ERROR;
    }

    for ( ;; ) {
        out = NULL;
        c->ll = &out;

        if (ngx_http_llama_session_conv_consume(r, c) != NGX_OK) {
            return NGX_ERROR;
        }

        if (out) {
            /* every event as it comes: flushed */
            for (cl = out; cl->next; cl = cl->next) { /* void */ }
            cl->buf->flush = 1;
        }

        if (out == NULL && c->busy == NULL) {
            return NGX_OK;
        }

        rc = ngx_http_next_body_filter(r, out);

        c->cur = NULL;
        ngx_chain_update_chains(r->pool, &c->free, &c->busy, &out,
                                (ngx_buf_tag_t) &ngx_http_llama_session_module);

        if (rc == NGX_ERROR || c->in == NULL || c->pending == NULL
            || ngx_http_llama_session_conv_inflight(c)
               >= NGX_HTTP_LLAMA_SESSION_CONV_BUFS)
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
ngx_http_llama_session_conv_inflight(ngx_http_llama_session_conv_t *c)
{
    ngx_uint_t    n;
    ngx_chain_t  *cl;

    n = c->nbufs;

    for (cl = c->free; cl; cl = cl->next) {
        n--;
    }

    return n;
}


/*
 * Takes what waits of llama-server's reply while there is room for its
 * translation: a stream line by line, a whole reply until its end.
 */

static ngx_int_t
ngx_http_llama_session_conv_consume(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c)
{
    u_char       *p, *line, *end, *nl;
    size_t        size, len;
    ngx_buf_t    *b, *nb;
    ngx_uint_t    stream;
    ngx_chain_t  *cl;

    stream = (c->stream && c->status == NGX_HTTP_OK);

    while (c->pending) {
        cl = c->pending;
        b = cl->buf;

        if (!ngx_buf_in_memory(b) && ngx_buf_size(b)) {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "llama_session: a reply in a file cannot be "
                          "translated for %s", c->api);
            return NGX_ERROR;
        }

        if (ngx_buf_in_memory(b) && b->last > b->pos) {

            if (stream
                && ngx_http_llama_session_conv_inflight(c)
                   >= NGX_HTTP_LLAMA_SESSION_CONV_BUFS)
            {
                /* the client does not read: llama-server's bytes wait */
                return NGX_OK;
            }

            /* a stream one line at a time, a whole reply as it comes */

            nl = stream ? ngx_strlchr(b->pos, b->last, '\n') : NULL;
            len = nl ? (size_t) (nl + 1 - b->pos) : (size_t) (b->last - b->pos);
            size = (c->in->last - c->in->pos) + len;

            if (size > (stream ? NGX_HTTP_LLAMA_SESSION_CONV_EVENT
                               : NGX_HTTP_LLAMA_SESSION_CONV_REPLY))
            {
                ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                              "llama_session: a reply too large to "
                              "translate for %s", c->api);
                return NGX_ERROR;
            }

            if ((size_t) (c->in->end - c->in->last) < len) {
                nb = ngx_create_temp_buf(r->pool, ngx_max(2 * size, 4096));
                if (nb == NULL) {
                    return NGX_ERROR;
                }

                nb->last = ngx_cpymem(nb->last, c->in->pos,
                                      c->in->last - c->in->pos);
                c->in = nb;
            }

            c->in->last = ngx_cpymem(c->in->last, b->pos, len);
            b->pos += len;

            if (nl == NULL) {
                continue;
            }

            /* a whole line: "data: {...}" */

            line = c->in->pos;
            end = c->in->last - 1;
            c->in->pos = c->in->start;
            c->in->last = c->in->start;

            p = end;
            if (p > line && p[-1] == '\r') {
                p--;
            }

            if (p - line > 5 && ngx_strncmp(line, "data:", 5) == 0) {
                line += 5;

                while (line < p && *line == ' ') {
                    line++;
                }

                if (c->event(r, c, line, p - line) != NGX_OK) {
                    return NGX_ERROR;
                }
            }

            continue;
        }

        if (b->last_buf) {
            c->last = 1;
        }

        c->pending = cl->next;
        ngx_free_chain(r->pool, cl);
    }

    if (!c->last) {
        return NGX_OK;
    }

    if (stream) {
        /* the stream's end: what its last event did not say yet */
        if (c->event(r, c, NULL, 0) != NGX_OK) {
            return NGX_ERROR;
        }

    } else if (c->whole(r, c, c->in->pos, c->in->last - c->in->pos)
               != NGX_OK)
    {
        return NGX_ERROR;
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
    *c->ll = cl;
    c->ll = &cl->next;

    c->in = NULL;

    return NGX_OK;
}


/* usage and timings, wherever they come */

void
ngx_http_llama_session_conv_stats(ngx_http_llama_session_conv_t *c,
    cJSON *reply)
{
    cJSON  *usage, *timings, *item;

    usage = cJSON_GetObjectItemCaseSensitive(reply, "usage");
    timings = cJSON_GetObjectItemCaseSensitive(reply, "timings");

    item = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        c->prompt_tokens = (ngx_uint_t) item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(usage, "completion_tokens");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        c->completion_tokens = (ngx_uint_t) item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(timings, "prompt_n");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        c->prompt_n = (ngx_int_t) item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(
               cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens_details"),
               "cached_tokens");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        c->cached = (ngx_int_t) item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(timings, "cache_n");
    if (c->cached < 0 && cJSON_IsNumber(item) && item->valuedouble >= 0) {
        c->cached = (ngx_int_t) item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(timings, "prompt_ms");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        c->prompt_ms = item->valuedouble;
    }

    item = cJSON_GetObjectItemCaseSensitive(timings, "predicted_ms");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
        c->predicted_ms = item->valuedouble;
    }

    if (usage == NULL) {
        /* llama-server's own counts, when the usage comes without */

        item = cJSON_GetObjectItemCaseSensitive(timings, "prompt_n");
        if (cJSON_IsNumber(item) && item->valuedouble >= 0
            && c->prompt_tokens == 0)
        {
            c->prompt_tokens = (ngx_uint_t) item->valuedouble;

            item = cJSON_GetObjectItemCaseSensitive(timings, "cache_n");
            if (cJSON_IsNumber(item) && item->valuedouble >= 0) {
                c->prompt_tokens += (ngx_uint_t) item->valuedouble;
            }
        }

        item = cJSON_GetObjectItemCaseSensitive(timings, "predicted_n");
        if (cJSON_IsNumber(item) && item->valuedouble >= 0
            && c->completion_tokens == 0)
        {
            c->completion_tokens = (ngx_uint_t) item->valuedouble;
        }
    }
}


/* appends an object (a line when nl) to the output; frees it */

ngx_int_t
ngx_http_llama_session_conv_emit(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, cJSON *json, ngx_uint_t nl)
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

    rc = ngx_http_llama_session_conv_write(r, c, (u_char *) text,
                                           ngx_strlen(text));

    if (rc == NGX_OK && nl) {
        rc = ngx_http_llama_session_conv_write(r, c, (u_char *) "\n", 1);
    }

    cJSON_free(text);

    return rc;
}


/*
 * Copies bytes of the translation into the filter's output buffers: the
 * one being filled, then free ones, then new ones (counted in nbufs; a
 * line may take several, and may go beyond NGX_HTTP_LLAMA_SESSION_CONV_
 * BUFS: the next line then waits).
 */

ngx_int_t
ngx_http_llama_session_conv_write(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len)
{
    size_t        n;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    while (len) {
        b = c->cur;

        if (b == NULL || b->last == b->end) {

            if (c->free) {
                cl = c->free;
                c->free = cl->next;
                b = cl->buf;
                b->pos = b->start;
                b->last = b->start;
                b->flush = 0;

            } else {
                b = ngx_create_temp_buf(r->pool,
                                        NGX_HTTP_LLAMA_SESSION_CONV_BUF);
                if (b == NULL) {
                    return NGX_ERROR;
                }

                b->tag = (ngx_buf_tag_t) &ngx_http_llama_session_module;

                cl = ngx_alloc_chain_link(r->pool);
                if (cl == NULL) {
                    return NGX_ERROR;
                }

                cl->buf = b;
                c->nbufs++;
            }

            cl->next = NULL;
            *c->ll = cl;
            c->ll = &cl->next;
            c->cur = b;
        }

        n = ngx_min(len, (size_t) (b->end - b->last));
        b->last = ngx_cpymem(b->last, data, n);
        data += n;
        len -= n;
    }

    return NGX_OK;
}
