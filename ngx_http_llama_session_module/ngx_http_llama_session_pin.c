
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Pinning: with several slots, the request must run on the slot the
 * module chose and prepared, never on one that holds another session.
 * llama-server takes "id_slot" from the body of its inference endpoints;
 * the module adds it as the object's last member, so that a client's own
 * "id_slot" (nlohmann/json keeps the last of duplicate keys) never wins.
 *
 * Only the end of the body is looked at and rewritten: the chain that
 * proxy_pass sends is the request's own up to the closing "}", then a
 * small buffer.  A body in a temporary file stays there; its last bytes
 * are read (one small read), nothing is copied.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_pin.h"


#define NGX_HTTP_LLAMA_SESSION_TAIL  256


static ssize_t ngx_http_llama_session_tail(ngx_http_request_t *r,
    u_char *tail, size_t size, off_t end);


/*
 * NGX_OK: pinned; NGX_DECLINED: the body does not end as a JSON object
 * does (the request must not go unpinned); NGX_ERROR: an error.
 */

ngx_int_t
ngx_http_llama_session_pin(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    off_t         total, end, at, size;
    u_char        tail[NGX_HTTP_LLAMA_SESSION_TAIL], *p;
    ssize_t       n;
    ngx_buf_t    *b, *cut;
    ngx_uint_t    empty;
    ngx_chain_t  *cl, *ln, **ll, *out;

    if (r->request_body == NULL || r->request_body->bufs == NULL) {
        return NGX_DECLINED;
    }

    total = 0;

    for (cl = r->request_body->bufs; cl; cl = cl->next) {
        total += ngx_buf_size(cl->buf);
    }

    /* the closing brace: the last byte that is no white space */

    end = total;

    for ( ;; ) {
        if (end == 0) {
            return NGX_DECLINED;
        }

        n = ngx_http_llama_session_tail(r, tail, sizeof(tail), end);

        if (n == NGX_ERROR) {
            return NGX_ERROR;
        }

        p = tail + n;

        while (p > tail && (p[-1] == ' ' || p[-1] == '\t' || p[-1] == '\r'
                            || p[-1] == '\n'))
        {
            p--;
        }

        if (p > tail) {
            break;
        }

        end -= n;
    }

    if (p[-1] != '}') {
        return NGX_DECLINED;
    }

    p--;
    at = end - n + (p - tail);       /* the brace's offset in the body */

    while (p > tail && (p[-1] == ' ' || p[-1] == '\t' || p[-1] == '\r'
                        || p[-1] == '\n'))
    {
        p--;
    }

    /* an empty object takes no comma (the brace's neighbour, if in view) */
    empty = (p > tail && p[-1] == '{');

    /* the body up to the brace */

    out = NULL;
    ll = &out;
    size = 0;

    for (cl = r->request_body->bufs; cl && size < at; cl = cl->next) {

        b = ngx_calloc_buf(r->pool);
        if (b == NULL) {
            return NGX_ERROR;
        }

        ngx_memcpy(b, cl->buf, sizeof(ngx_buf_t));
        b->last_buf = 0;
        b->last_in_chain = 0;

        if (size + ngx_buf_size(b) > at) {
            if (b->in_file && !ngx_buf_in_memory(b)) {
                b->file_last = b->file_pos + (at - size);

            } else {
                b->last = b->pos + (at - size);
                b->in_file = 0;
            }
        }

        size += ngx_buf_size(b);

        ln = ngx_alloc_chain_link(r->pool);
        if (ln == NULL) {
            return NGX_ERROR;
        }

        ln->buf = b;
        ln->next = NULL;
        *ll = ln;
        ll = &ln->next;
    }

    /* then the slot, last */

    cut = ngx_create_temp_buf(r->pool, sizeof(",\"id_slot\":}") - 1
                                       + NGX_INT_T_LEN);
    if (cut == NULL) {
        return NGX_ERROR;
    }

    cut->last = ngx_sprintf(cut->last, empty ? "\"id_slot\":%ui}"
                                             : ",\"id_slot\":%ui}",
                            ctx->job->slot);
    cut->last_buf = 1;
    cut->last_in_chain = 1;

    ln = ngx_alloc_chain_link(r->pool);
    if (ln == NULL) {
        return NGX_ERROR;
    }

    ln->buf = cut;
    ln->next = NULL;
    *ll = ln;

    r->request_body->bufs = out;
    r->headers_in.content_length_n = at + (cut->last - cut->pos);

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: pinned to slot %ui, body of %O bytes",
                   ctx->job->slot, r->headers_in.content_length_n);

    return NGX_OK;
}


/* the body's bytes before "end" (at most size), from memory or its file */

static ssize_t
ngx_http_llama_session_tail(ngx_http_request_t *r, u_char *tail, size_t size,
    off_t end)
{
    off_t         from, start, stop, lo, hi;
    u_char       *p;
    ssize_t       n;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    from = end > (off_t) size ? end - (off_t) size : 0;
    p = tail;
    start = 0;

    for (cl = r->request_body->bufs; cl && start < end; cl = cl->next) {
        b = cl->buf;
        stop = start + ngx_buf_size(b);

        if (stop > from) {
            lo = ngx_max(from, start) - start;
            hi = ngx_min(stop, end) - start;

            if (ngx_buf_in_memory(b)) {
                p = ngx_cpymem(p, b->pos + lo, (size_t) (hi - lo));

            } else if (b->in_file) {
                n = ngx_read_file(b->file, p, (size_t) (hi - lo),
                                  b->file_pos + lo);

                if (n != hi - lo) {
                    ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                                  "llama_session: cannot read the end of "
                                  "the body from \"%V\"", &b->file->name);
                    return NGX_ERROR;
                }

                p += n;
            }
        }

        start = stop;
    }

    return p - tail;
}
