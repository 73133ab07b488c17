
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What the module rewrites in a request body before it reads it
 * (llama_session_canonical, on by default): the parts of a system prompt
 * that a client makes different per conversation or per request while
 * the prompt is otherwise the same, so that conversations share their
 * system prompt's cache and base.
 *
 *   Claude Code's first system block of an Anthropic Messages request
 *   (/v1/messages), {"type":"text","text":"x-anthropic-billing-header:
 *   cc_version=2.1.197.6c5; cc_entrypoint=sdk-cli; cch=1a2b3;"}: the
 *   version's fourth part differs per conversation and cch= per request.
 *   Each of their characters becomes "0" (cc_version=2.1.197.000;
 *   cch=00000;): the same length, so the body's size, its buffers and its
 *   temporary file keep their shape, and what the module hashes and what
 *   llama-server gets are the same text.
 *
 * Only that block: the first element of the top-level "system" array, a
 * text block whose text starts with the header.  The same line anywhere
 * else (a user's message that quotes it, a later system block, another
 * endpoint) is the client's text and reaches llama-server as it came.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_canon.h"
#include "ngx_http_llama_session_json.h"


#define NGX_HTTP_LLAMA_SESSION_CANON_SPAN  512   /* the header's line */


static ngx_uint_t ngx_http_llama_session_canon_zero(u_char *p, u_char *last,
    ngx_uint_t dots);
static ngx_int_t ngx_http_llama_session_canon_back(ngx_http_request_t *r,
    ngx_str_t *body, size_t lo, size_t hi);


static ngx_str_t  ngx_http_llama_session_billing =
    ngx_string("x-anthropic-billing-header:");


static ngx_str_t  ngx_http_llama_session_canon_names[] = {
    ngx_string("type"),
    ngx_string("text")
};

static ngx_str_t  ngx_http_llama_session_canon_text = ngx_string("text");


/*
 * system: the span of the body's top-level "system" of a Messages request.
 * NGX_OK: rewritten (or nothing to rewrite); NGX_ERROR: the body's file.
 */

ngx_int_t
ngx_http_llama_session_canon(ngx_http_request_t *r, ngx_str_t *body,
    ngx_http_llama_session_span_t *system)
{
    u_char                         *p, *pos, *end, *v;
    size_t                          lo, hi;
    ngx_uint_t                      changed;
    ngx_http_llama_session_span_t   first, values[2];

    if (system->start == NULL || *system->start != '[') {
        return NGX_OK;
    }

    /* the first block: a text block whose text starts with the header */

    pos = system->start;

    if (ngx_http_llama_session_json_next(&pos, system->end, &first) != NGX_OK
        || ngx_http_llama_session_json_object(first.start, first.end,
                                   ngx_http_llama_session_canon_names, values,
                                   2)
           == NULL
        || !ngx_http_llama_session_json_string_is(&values[0],
                                            &ngx_http_llama_session_canon_text)
        || values[1].start == NULL || *values[1].start != '"'
        || (size_t) (values[1].end - values[1].start)
           < ngx_http_llama_session_billing.len + 2
        || ngx_strncasecmp(values[1].start + 1,
                           ngx_http_llama_session_billing.data,
                           ngx_http_llama_session_billing.len)
           != 0)
    {
        return NGX_OK;
    }

    /* the header's line: up to the end of its JSON string or an escape */

    p = values[1].start + 1;
    end = ngx_min(p + NGX_HTTP_LLAMA_SESSION_CANON_SPAN, values[1].end - 1);

    for (v = p; v < end && *v != '"' && *v != '\\'; v++) { /* void */ }

    end = v;
    changed = 0;

    v = ngx_strlcasestrn(p, end, (u_char *) "cc_version=", 11 - 1);

    if (v) {
        changed |= ngx_http_llama_session_canon_zero(v + 11, end, 3);
    }

    v = ngx_strlcasestrn(p, end, (u_char *) "cch=", 4 - 1);

    if (v) {
        changed |= ngx_http_llama_session_canon_zero(v + 4, end, 0);
    }

    if (!changed) {
        return NGX_OK;
    }

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: canonical billing header \"%*s\"",
                   (size_t) (end - p), p);

    lo = p - body->data;
    hi = end - body->data;

    return ngx_http_llama_session_canon_back(r, body, lo, hi);
}


/*
 * After "dots" dots (the version's first three parts), the characters of
 * the value up to its ";" become "0".  Returns 1 if any did.
 */

static ngx_uint_t
ngx_http_llama_session_canon_zero(u_char *p, u_char *last, ngx_uint_t dots)
{
    ngx_uint_t  changed;

    while (dots && p < last && *p != ';' && *p != ' ') {
        if (*p++ == '.') {
            dots--;
        }
    }

    if (dots) {
        return 0;
    }

    changed = 0;

    for ( /* void */ ; p < last && *p != ';' && *p != ' '; p++) {
        if (((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z')
             || (*p >= 'A' && *p <= 'Z')) && *p != '0')
        {
            *p = '0';
            changed = 1;
        }
    }

    return changed;
}


/*
 * The body read was a copy (several buffers, or nginx's temporary file):
 * the bytes lo..hi go back where proxy_pass reads them from.
 */

static ngx_int_t
ngx_http_llama_session_canon_back(ngx_http_request_t *r, ngx_str_t *body,
    size_t lo, size_t hi)
{
    off_t         at, size, from, to;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    cl = r->request_body->bufs;

    if (cl->next == NULL && ngx_buf_in_memory(cl->buf)
        && cl->buf->pos == body->data)
    {
        /* the body itself was rewritten */
        return NGX_OK;
    }

    at = 0;

    for ( /* void */ ; cl; cl = cl->next) {
        b = cl->buf;
        size = ngx_buf_size(b);

        from = ngx_max(at, (off_t) lo);
        to = ngx_min(at + size, (off_t) hi);

        if (from < to) {
            if (ngx_buf_in_memory(b)) {
                ngx_memcpy(b->pos + (from - at), body->data + from,
                           to - from);

            } else if (b->in_file
                       && ngx_write_file(b->file, body->data + from,
                                         to - from,
                                         b->file_pos + (from - at))
                          != to - from)
            {
                ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                              "llama_session: cannot rewrite the billing "
                              "header in \"%V\"", &b->file->name);
                return NGX_ERROR;
            }
        }

        at += size;
    }

    return NGX_OK;
}
