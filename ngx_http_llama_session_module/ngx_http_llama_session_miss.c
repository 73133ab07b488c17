
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Why a prompt missed the cache.  A client that rewrites its history (a
 * timestamp in the system prompt, a trimmed tool result, an edited
 * message) silently loses the cache: llama-server reuses only the prompt's
 * prefix that is the same as the slot's.  Each request's messages are kept
 * in a few bytes each (a hash of the message, its content's length, hashes
 * of its content's first 64, 512 and 4096 bytes); the slot keeps the
 * session's last prompt, and a save puts it into the session's .json.
 * When a reply shows a large miss (less than half of the previous prompt's
 * tokens from the cache), the error log says at info where the prompt
 * first differs from the previous one:
 *
 *   12 messages, the previous prompt had 11: the first 10 are the same,
 *   message 11 (user) is the same for its first 512 of 1300 bytes (was 900)
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_ext.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_miss.h"
#include "ngx_http_llama_session_sched.h"


static void ngx_http_llama_session_msg(ngx_http_llama_session_msg_t *m,
    ngx_http_llama_session_span_t *elt, ngx_http_llama_session_span_t *role,
    ngx_http_llama_session_span_t *content);
static const char *ngx_http_llama_session_role(u_char role);


static size_t  ngx_http_llama_session_cuts[NGX_HTTP_LLAMA_SESSION_PREFIXES] =
    { 64, 512, 4096 };


/*
 * The prompt's messages: Anthropic's system first, then "messages".  The
 * first MSGS_MAX of them are kept (what a later miss is explained by); of
 * every one, however many, the digest of the prefix it ends (ext.c: a
 * conversation without an id is known by the messages it extends), the
 * last EXT_KEEP of them kept; memory bound whatever the body holds
 */

ngx_int_t
ngx_http_llama_session_msgs(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_span_t *system,
    ngx_http_llama_session_span_t *messages)
{
    u_char                         *pos;
    uint64_t                        d, *dp;
    ngx_str_t                       names[2];
    ngx_uint_t                      first, total;
    ngx_array_t                     a, ds;
    ngx_http_llama_session_span_t   elt, fields[2];
    ngx_http_llama_session_msg_t    m, *mp;

    static ngx_str_t  role = ngx_string("role");
    static ngx_str_t  content = ngx_string("content");

    if ((system == NULL || system->start == NULL)
        && (messages == NULL || messages->start == NULL
            || *messages->start != '['))
    {
        return NGX_OK;
    }

    if (ngx_array_init(&a, r->pool, 16, sizeof(ngx_http_llama_session_msg_t))
        != NGX_OK
        || ngx_array_init(&ds, r->pool, 16, sizeof(uint64_t)) != NGX_OK)
    {
        return NGX_ERROR;
    }

    d = NGX_HTTP_LLAMA_SESSION_EXT_D0;
    total = 0;
    first = 1;

    names[0] = role;
    names[1] = content;

    pos = messages && messages->start && *messages->start == '['
          ? messages->start : NULL;

    for ( ;; ) {
        if (first && system && system->start) {
            ngx_http_llama_session_msg(&m, system, NULL, system);
            m.role = 's';

        } else {
            if (pos == NULL
                || ngx_http_llama_session_json_next(&pos, messages->end, &elt)
                   != NGX_OK)
            {
                break;
            }

            ngx_memzero(fields, sizeof(fields));

            if (*elt.start == '{') {
                (void) ngx_http_llama_session_json_object(elt.start, elt.end,
                                                          names, fields, 2);
            }

            ngx_http_llama_session_msg(&m, &elt, &fields[0], &fields[1]);

            if (m.role == 'a') {
                /* the reply the client echoes: what ext.c knows it by */
                ctx->ext_reply = elt;
            }
        }

        first = 0;

        if (a.nelts < NGX_HTTP_LLAMA_SESSION_MSGS_MAX) {
            mp = ngx_array_push(&a);
            if (mp == NULL) {
                return NGX_ERROR;
            }

            *mp = m;
        }

        d = ngx_http_llama_session_ext_step(d, &m);

        if (ds.nelts < NGX_HTTP_LLAMA_SESSION_EXT_KEEP) {
            dp = ngx_array_push(&ds);
            if (dp == NULL) {
                return NGX_ERROR;
            }

            *dp = d;

        } else {
            /* a ring of the last EXT_KEEP */
            ((uint64_t *) ds.elts)[total % NGX_HTTP_LLAMA_SESSION_EXT_KEEP]
                = d;
        }

        total++;
    }

    ctx->msgs = a.elts;
    ctx->nmsgs = a.nelts;
    ctx->ext_d = ds.elts;
    ctx->ext_total = total;

    return NGX_OK;
}


static void
ngx_http_llama_session_msg(ngx_http_llama_session_msg_t *m,
    ngx_http_llama_session_span_t *elt, ngx_http_llama_session_span_t *role,
    ngx_http_llama_session_span_t *content)
{
    size_t      len;
    ngx_uint_t  k;

    ngx_memzero(m, sizeof(ngx_http_llama_session_msg_t));

    m->hash = ngx_murmur_hash2(elt->start, elt->end - elt->start);

    if (role && role->start && role->end - role->start > 2
        && *role->start == '"')
    {
        m->role = role->start[1];
    }

    if (content == NULL || content->start == NULL) {
        return;
    }

    len = content->end - content->start;
    m->len = (uint32_t) ngx_min(len, 0xffffffff);

    for (k = 0; k < NGX_HTTP_LLAMA_SESSION_PREFIXES; k++) {
        m->prefix[k] = ngx_murmur_hash2(content->start,
                                        ngx_min(len,
                                          ngx_http_llama_session_cuts[k]));
    }
}


/*
 * The reply is over (reply.c): explain a large miss against the session's
 * previous prompt, then keep this prompt as the slot's last one.  1: the
 * client changed or dropped a message the previous prompt had (the prompt
 * does not extend it); 0: it did not, or nothing tells.
 */

ngx_uint_t
ngx_http_llama_session_miss(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_int_t cached, ngx_int_t evaluated)
{
    u_char                        *p, *last, text[512];
    size_t                         same;
    ngx_uint_t                     i, k, total, expected, changed;
    ngx_http_llama_session_msg_t  *a, *b;

    total = (evaluated >= 0) ? (ngx_uint_t) (cached + evaluated) : 0;
    changed = 0;

    if (ctx->prev && ctx->nprev && ctx->nmsgs) {
        for (i = 0; i < ctx->nprev && i < ctx->nmsgs; i++) {
            if (ctx->prev[i].hash != ctx->msgs[i].hash) {
                break;
            }
        }

        changed = (i < ctx->nprev);
    }

    if (ctx->prev && ctx->nprev && ctx->nmsgs && ctx->prev_tokens && total) {

        expected = ngx_min(ctx->prev_tokens, total);

        if ((ngx_uint_t) cached * 2 < expected) {

            for (i = 0; i < ctx->nprev && i < ctx->nmsgs; i++) {
                if (ctx->prev[i].hash != ctx->msgs[i].hash) {
                    break;
                }
            }

            p = text;
            last = text + sizeof(text);

            if (i == ctx->nprev && i <= ctx->nmsgs) {
                p = ngx_slprintf(p, last, "the previous %ui are all the "
                                 "same: the client did not change them (a "
                                 "backend restart, or a model that does not "
                                 "reuse a restored cache?)", ctx->nprev);

            } else if (i == ctx->nmsgs) {
                p = ngx_slprintf(p, last, "the prompt is the previous one cut "
                                 "short after %ui messages", i);

            } else {
                a = &ctx->prev[i];
                b = &ctx->msgs[i];

                p = ngx_slprintf(p, last, "the first %ui are the same, "
                                 "message %ui (%s) ", i, i + 1,
                                 ngx_http_llama_session_role(b->role));

                if (a->role != b->role) {
                    p = ngx_slprintf(p, last, "was a %s message",
                                     ngx_http_llama_session_role(a->role));

                } else {
                    same = 0;

                    for (k = 0; k < NGX_HTTP_LLAMA_SESSION_PREFIXES; k++) {
                        if (a->len < ngx_http_llama_session_cuts[k]
                            || b->len < ngx_http_llama_session_cuts[k]
                            || a->prefix[k] != b->prefix[k])
                        {
                            break;
                        }

                        same = ngx_http_llama_session_cuts[k];
                    }

                    if (same) {
                        p = ngx_slprintf(p, last, "is the same for its "
                                         "first %uz of %uD bytes (was %uD)",
                                         same, b->len, a->len);

                    } else if (a->len == b->len) {
                        p = ngx_slprintf(p, last, "differs in its first "
                                         "%uz bytes (%uD bytes)",
                                         ngx_min((size_t) b->len,
                                                 ngx_http_llama_session_cuts[0]),
                                         b->len);

                    } else {
                        p = ngx_slprintf(p, last, "differs in its first "
                                         "%uz bytes (%uD bytes, was %uD)",
                                         ngx_http_llama_session_cuts[0],
                                         b->len, a->len);
                    }
                }
            }

            ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                          "llama_session: session \"%*s\" missed the cache: "
                          "%i of %ui prompt tokens from it where %ui were "
                          "expected; %ui messages, the previous prompt had "
                          "%ui: %*s", ctx->key_len, ctx->key, cached, total,
                          expected, ctx->nmsgs, ctx->nprev, p - text, text);
        }
    }

    if (ctx->msgs && total && !ctx->default_session) {
        ngx_http_llama_session_slot_msgs(ctx->zone, ctx->job->slot, ctx->key,
                                         ctx->key_len, ctx->msgs,
                                         ngx_min(ctx->nmsgs,
                                              NGX_HTTP_LLAMA_SESSION_MSGS_MAX),
                                         ctx->ext_chain, total);
    }

    return changed;
}


static const char *
ngx_http_llama_session_role(u_char role)
{
    switch (role) {
    case 's':
        return "system";
    case 'u':
        return "user";
    case 'a':
        return "assistant";
    case 't':
        return "tool";
    case 'd':
        return "developer";
    default:
        return "?";
    }
}


/* a prompt's messages as base64 for a .json; the length, or 0 */

ngx_int_t
ngx_http_llama_session_msgs_encode(u_char *dst, size_t size,
    ngx_http_llama_session_msg_t *msgs, ngx_uint_t n)
{
    ngx_str_t  src, out;

    src.data = (u_char *) msgs;
    src.len = n * sizeof(ngx_http_llama_session_msg_t);

    if (ngx_base64_encoded_length(src.len) + 1 > size) {
        return 0;
    }

    out.data = dst;
    ngx_encode_base64(&out, &src);
    dst[out.len] = '\0';

    return out.len;
}


ngx_int_t
ngx_http_llama_session_msgs_decode(ngx_pool_t *pool, u_char *text,
    size_t len, ngx_http_llama_session_msg_t **msgs, ngx_uint_t *n)
{
    ngx_str_t  src, out;

    if (len == 0
        || ngx_base64_decoded_length(len)
           > NGX_HTTP_LLAMA_SESSION_MSGS_MAX
             * sizeof(ngx_http_llama_session_msg_t) + 2)
    {
        return NGX_DECLINED;
    }

    out.data = ngx_palloc(pool, ngx_base64_decoded_length(len));
    if (out.data == NULL) {
        return NGX_ERROR;
    }

    src.data = text;
    src.len = len;

    if (ngx_decode_base64(&out, &src) != NGX_OK
        || out.len % sizeof(ngx_http_llama_session_msg_t)
        || out.len > NGX_HTTP_LLAMA_SESSION_MSGS_MAX
                     * sizeof(ngx_http_llama_session_msg_t))
    {
        return NGX_DECLINED;
    }

    *msgs = (ngx_http_llama_session_msg_t *) out.data;
    *n = out.len / sizeof(ngx_http_llama_session_msg_t);

    return NGX_OK;
}
