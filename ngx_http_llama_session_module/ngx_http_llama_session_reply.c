
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What the reply says of the prompt's cache.  A restore that llama-server
 * answers with 200 can still bring nothing: models with recurrent or
 * sliding-window layers discard a restored cache and evaluate the whole
 * prompt again.  The reply tells: llama-server's "timings" (cache_n,
 * prompt_n, prompt_ms), OpenAI's usage.prompt_tokens_details.cached_tokens,
 * Anthropic's usage.cache_read_input_tokens, in a JSON reply or in the last
 * events of a stream.  A body filter reads those figures as the buffers
 * pass, never holding or changing them, only for the replies of requests
 * that used a slot.  A restore whose reply shows less than half of the
 * restored tokens cached is ineffective; after a few in a row for one
 * backend configuration, the zone stops saving and restoring for it.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_cost.h"
#include "ngx_http_llama_session_gguf.h"
#include "ngx_http_llama_session_miss.h"
#include "ngx_http_llama_session_ram.h"
#include "ngx_http_llama_session_reply.h"
#include "ngx_http_llama_session_turn.h"


/* what the reply says of the prompt's cache, read as it passes */

typedef struct {
    u_char                          carry[NGX_HTTP_LLAMA_SESSION_CARRY];
    size_t                          carry_len;  /* a figure cut by a seam */
    ngx_int_t                       cache_n;    /* -1: not seen */
    ngx_int_t                       prompt_n;
    ngx_int_t                       cached_tokens;
    ngx_int_t                       prompt_tokens;
    ngx_int_t                       cache_read;
    ngx_int_t                       input_tokens;
    ngx_int_t                       predicted_n;
    double                          prompt_ms;
    double                          predicted_ms;
    unsigned                        done:1;
} ngx_http_llama_session_seen_t;


static ngx_int_t ngx_http_llama_session_reply_header(ngx_http_request_t *r);
static ngx_int_t ngx_http_llama_session_reply_body(ngx_http_request_t *r,
    ngx_chain_t *in);
static void ngx_http_llama_session_scan(ngx_http_llama_session_seen_t *seen,
    u_char *p, u_char *last, ngx_uint_t whole);
static void ngx_http_llama_session_reply_end(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);


static ngx_http_output_header_filter_pt  ngx_http_next_header_filter;
static ngx_http_output_body_filter_pt    ngx_http_next_body_filter;


/* the figures read, by their JSON name; the longest is 27 bytes */

typedef struct {
    ngx_str_t                       name;       /* "\"name\":" */
    size_t                          offset;     /* in what is seen */
} ngx_http_llama_session_figure_t;


static ngx_http_llama_session_figure_t  ngx_http_llama_session_figures[] = {
    { ngx_string("\"cache_n\":"),
      offsetof(ngx_http_llama_session_seen_t, cache_n) },
    { ngx_string("\"prompt_n\":"),
      offsetof(ngx_http_llama_session_seen_t, prompt_n) },
    { ngx_string("\"cached_tokens\":"),
      offsetof(ngx_http_llama_session_seen_t, cached_tokens) },
    { ngx_string("\"prompt_tokens\":"),
      offsetof(ngx_http_llama_session_seen_t, prompt_tokens) },
    { ngx_string("\"cache_read_input_tokens\":"),
      offsetof(ngx_http_llama_session_seen_t, cache_read) },
    { ngx_string("\"input_tokens\":"),
      offsetof(ngx_http_llama_session_seen_t, input_tokens) },
    { ngx_string("\"predicted_n\":"),
      offsetof(ngx_http_llama_session_seen_t, predicted_n) },
    { ngx_null_string, 0 }
};


ngx_int_t
ngx_http_llama_session_reply_init(ngx_conf_t *cf)
{
    ngx_http_next_header_filter = ngx_http_top_header_filter;
    ngx_http_top_header_filter = ngx_http_llama_session_reply_header;

    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_llama_session_reply_body;

    return NGX_OK;
}


/* a reply of a request that used a slot, 200: its figures are read */

static ngx_int_t
ngx_http_llama_session_reply_header(ngx_http_request_t *r)
{
    ngx_http_llama_session_ctx_t   *ctx;
    ngx_http_llama_session_seen_t  *seen;

    if (r != r->main) {
        return ngx_http_next_header_filter(r);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx && ctx->job->acquired && !ctx->identity && ctx->api == NULL
        && ctx->job->state == NGX_HTTP_LLAMA_SESSION_ST_PROXY
        && r->headers_out.status == NGX_HTTP_OK)
    {
        seen = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_seen_t));
        if (seen == NULL) {
            return NGX_ERROR;
        }

        seen->cache_n = -1;
        seen->prompt_n = -1;
        seen->cached_tokens = -1;
        seen->prompt_tokens = -1;
        seen->cache_read = -1;
        seen->input_tokens = -1;
        seen->prompt_ms = -1;
        seen->predicted_n = -1;
        seen->predicted_ms = -1;

        ctx->reply = seen;

        /* a chat turn's message is kept for the re-prime (turn.c) */
        ngx_http_llama_session_turn_start(r, ctx);
    }

    return ngx_http_next_header_filter(r);
}


static ngx_int_t
ngx_http_llama_session_reply_body(ngx_http_request_t *r, ngx_chain_t *in)
{
    u_char                         *p;
    u_char                          joined[2 * NGX_HTTP_LLAMA_SESSION_CARRY];
    size_t                          n, head;
    ngx_buf_t                      *b;
    ngx_chain_t                    *cl;
    ngx_http_llama_session_ctx_t   *ctx;
    ngx_http_llama_session_seen_t  *seen;

    if (r != r->main || in == NULL) {
        return ngx_http_next_body_filter(r, in);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    seen = ctx ? ctx->reply : NULL;

    if (seen == NULL || seen->done) {
        return ngx_http_next_body_filter(r, in);
    }

    for (cl = in; cl; cl = cl->next) {
        b = cl->buf;

        if (ctx->turn) {
            ngx_http_llama_session_turn_data(r, ctx, b);
        }

        if (ngx_buf_in_memory(b) && b->last > b->pos) {

            /* a name or number cut between two buffers: the seam first */

            n = b->last - b->pos;
            head = ngx_min(n, NGX_HTTP_LLAMA_SESSION_CARRY);

            if (seen->carry_len) {
                p = ngx_cpymem(joined, seen->carry, seen->carry_len);
                p = ngx_cpymem(p, b->pos, head);
                ngx_http_llama_session_scan(seen, joined, p, 0);
            }

            ngx_http_llama_session_scan(seen, b->pos, b->last, 0);

            /* the tail, for the seam with the next buffer */

            if (n >= NGX_HTTP_LLAMA_SESSION_CARRY) {
                ngx_memcpy(seen->carry,
                           b->last - NGX_HTTP_LLAMA_SESSION_CARRY,
                           NGX_HTTP_LLAMA_SESSION_CARRY);
                seen->carry_len = NGX_HTTP_LLAMA_SESSION_CARRY;

            } else if (seen->carry_len + n <= NGX_HTTP_LLAMA_SESSION_CARRY) {
                ngx_memcpy(seen->carry + seen->carry_len, b->pos, n);
                seen->carry_len += n;

            } else {
                ngx_memmove(seen->carry,
                            seen->carry + seen->carry_len
                            - (NGX_HTTP_LLAMA_SESSION_CARRY - n),
                            NGX_HTTP_LLAMA_SESSION_CARRY - n);
                ngx_memcpy(seen->carry + NGX_HTTP_LLAMA_SESSION_CARRY - n,
                           b->pos, n);
                seen->carry_len = NGX_HTTP_LLAMA_SESSION_CARRY;
            }
        }

        if (b->last_buf) {
            /* a number at the very end has no byte after it */
            ngx_http_llama_session_scan(seen, seen->carry,
                                        seen->carry + seen->carry_len, 1);
            ngx_http_llama_session_reply_end(r, ctx);
            ngx_http_llama_session_turn_end(r, ctx);
            break;
        }
    }

    return ngx_http_next_body_filter(r, in);
}


/*
 * Looks for the figures' names in p..last and keeps the last value of
 * each.  Inside a JSON string a quote is escaped, so "name": only matches
 * a member.  A number that reaches last is left for the seam, unless the
 * data is whole.
 */

static void
ngx_http_llama_session_scan(ngx_http_llama_session_seen_t *seen, u_char *p,
    u_char *last, ngx_uint_t whole)
{
    u_char                           *q;
    double                            ms, frac, *msf;
    ngx_str_t                        *name;
    ngx_int_t                         v, *field;
    ngx_http_llama_session_figure_t  *f;

    static ngx_str_t  prompt_ms = ngx_string("\"prompt_ms\":");
    static ngx_str_t  predicted_ms = ngx_string("\"predicted_ms\":");

    for ( ;; ) {
        p = ngx_strlchr(p, last, '"');
        if (p == NULL) {
            return;
        }

        name = (last - p >= (ssize_t) prompt_ms.len
                && ngx_strncmp(p, prompt_ms.data, prompt_ms.len) == 0)
               ? &prompt_ms
               : (last - p >= (ssize_t) predicted_ms.len
                  && ngx_strncmp(p, predicted_ms.data, predicted_ms.len)
                     == 0)
                 ? &predicted_ms : NULL;

        if (name) {
            msf = (name == &prompt_ms) ? &seen->prompt_ms
                                       : &seen->predicted_ms;
            q = p + name->len;

            while (q < last && *q == ' ') {
                q++;
            }

            ms = 0;

            while (q < last && *q >= '0' && *q <= '9' && ms < 1e12) {
                ms = ms * 10 + (*q++ - '0');
            }

            if (q < last && *q == '.') {
                q++;

                for (frac = 0.1; q < last && *q >= '0' && *q <= '9';
                     frac /= 10)
                {
                    ms += (*q++ - '0') * frac;
                }
            }

            if (q < last || whole) {
                *msf = ms;
            }

            p++;
            continue;
        }

        for (f = ngx_http_llama_session_figures; f->name.len; f++) {
            if (last - p < (ssize_t) f->name.len
                || ngx_strncmp(p, f->name.data, f->name.len) != 0)
            {
                continue;
            }

            q = p + f->name.len;

            while (q < last && *q == ' ') {
                q++;
            }

            if (q == last || *q < '0' || *q > '9') {
                break;
            }

            v = 0;

            while (q < last && *q >= '0' && *q <= '9') {
                if (v > 100000000) {
                    break;
                }

                v = v * 10 + (*q++ - '0');
            }

            if (q < last || whole) {
                field = (ngx_int_t *) ((u_char *) seen + f->offset);
                *field = v;
            }

            break;
        }

        p++;
    }
}


/*
 * The reply is over: how much of the prompt came from the cache, what it
 * saved, and whether a restore helped.
 */

static void
ngx_http_llama_session_reply_end(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t                          cached, evaluated, expected;
    ngx_uint_t                         kind, swa, stop, changed;
    ngx_http_llama_session_sh_t       *sh;
    ngx_http_llama_session_zone_t     *zone;
    ngx_http_llama_session_seen_t     *seen;
    ngx_http_llama_session_metrics_t  *m;

    seen = ctx->reply;
    seen->done = 1;

    /* llama-server's own figures first, then OpenAI's, then Anthropic's */

    if (seen->cache_n >= 0) {
        cached = seen->cache_n;
        evaluated = seen->prompt_n;

    } else if (seen->cached_tokens >= 0) {
        cached = seen->cached_tokens;
        evaluated = (seen->prompt_tokens >= cached)
                    ? seen->prompt_tokens - cached : -1;

    } else if (seen->cache_read >= 0) {
        cached = seen->cache_read;
        evaluated = seen->input_tokens;

    } else {
        /* a reply without figures (a stream without usage): unknown */
        ctx->cached = -1;
        return;
    }

    ctx->cached = cached;

    zone = ctx->zone;
    sh = zone->sh;
    m = &sh->metrics;

    (void) ngx_atomic_fetch_add(&m->tokens_cached, cached);

    if (evaluated >= 0) {
        (void) ngx_atomic_fetch_add(&m->tokens_evaluated, evaluated);

        if (seen->prompt_n > 0 && seen->prompt_ms > 0 && cached > 0) {
            /* what the cached tokens would have cost at this prompt speed */
            (void) ngx_atomic_fetch_add(&m->prefill_saved_us,
                                        (ngx_atomic_uint_t)
                                        (seen->prompt_ms * 1000 * cached
                                         / seen->prompt_n));
        }
    }

    changed = ngx_http_llama_session_miss(r, ctx, cached, evaluated);

    /* what the slot holds now; did RAM hold the session? */
    ngx_http_llama_session_ram_reply(r, ctx, cached, evaluated,
                                     seen->predicted_n);

    if (seen->prompt_n > 0 && seen->prompt_ms > 0) {
        /* the backend's prompt speed, for when a restore pays (cost.c) */
        ngx_http_llama_session_cost_prefill(zone, ctx->job->fp,
                                            seen->prompt_n,
                                            seen->prompt_ms);
    }

    if (seen->predicted_n > 0 && seen->predicted_ms > 0) {
        /* a draft model's help, whole or lost to a restore (cost.c) */
        ngx_http_llama_session_cost_generate(zone, ctx->job->fp,
                                     zone->sh->slots[ctx->job->slot].draft_lost,
                                     seen->predicted_n, seen->predicted_ms);
    }

    if (ctx->action != NGX_HTTP_LLAMA_SESSION_ACTION_RESTORE
        || ctx->job->loaded_tokens < 8)
    {
        return;
    }

    /* the prompt may be shorter than what was restored (a cut history) */

    expected = ctx->job->loaded_tokens;

    if (evaluated >= 0 && cached + evaluated - 1 < expected) {
        expected = cached + evaluated - 1;
    }

    if (cached * 2 >= expected) {
        (void) ngx_atomic_fetch_add(&sh->stats.effective, 1);

        ngx_shmtx_lock(&zone->shpool->mutex);
        sh->ineffective_run = 0;
        ngx_shmtx_unlock(&zone->shpool->mutex);

        return;
    }

    (void) ngx_atomic_fetch_add(&sh->stats.ineffective, 1);

    ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                  "llama_session: the restore of \"%*s\" (%ui tokens) was "
                  "ineffective: the reply shows %i tokens from the cache",
                  ctx->key_len, ctx->key, ctx->job->loaded_tokens, cached);

    /*
     * A miss tells of the backend only when the prompt is known to extend
     * all that was restored: its messages those of the session's last
     * prompt (miss.c), and the file either of a model that reuses any
     * prefix (full attention) or re-primed before its save (it ends where
     * the next turn goes on).  Any other miss may be the client's doing
     * or a reply rendered otherwise than generated (a state that runs
     * past the next prompt is nothing to a sliding window or a recurrent
     * layer): counted, never a stop.  A few such in a row stop saves and
     * restores (one could still be a client that sent its last reply
     * back changed); on sliding-window attention, all of them bringing
     * nothing says llama-server runs without --swa-full (its files keep
     * the window, and it needs what lies before).  A restart of
     * llama-server starts restores again (sched.c).
     */

    kind = ngx_http_llama_session_memory_kind(zone, ctx->job->fp);

    if (changed
        || (kind != NGX_HTTP_LLAMA_SESSION_MEMORY_FULL
            && !ctx->job->loaded_primed))
    {
        return;
    }

    swa = (cached == 0 && kind == NGX_HTTP_LLAMA_SESSION_MEMORY_SWA);

    ngx_shmtx_lock(&zone->shpool->mutex);

    stop = !sh->restores_off
           && ++sh->ineffective_run >= NGX_HTTP_LLAMA_SESSION_INEFFECTIVE_MAX;

    if (stop) {
        sh->restores_off = 1;
        ngx_memcpy(sh->restores_off_fp, ctx->job->fp,
                   NGX_HTTP_LLAMA_SESSION_FP_LEN);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (stop && swa) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: the model of zone \"%V\" has "
                      "sliding-window attention and %d restores in a row "
                      "brought nothing: llama-server runs without "
                      "--swa-full, and "
                      "its slot files keep only the window; the zone stops "
                      "saving and restoring for backend %*s and keeps "
                      "sessions resident until llama-server restarts; "
                      "start it with --swa-full for restores that work",
                      &zone->name, NGX_HTTP_LLAMA_SESSION_INEFFECTIVE_MAX,
                      (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN, ctx->job->fp);

    } else if (stop) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: %d restores in a row in zone \"%V\" "
                      "brought nothing (the model discards a restored cache: "
                      "recurrent or sliding-window layers?): the zone stops "
                      "saving and restoring for backend %*s until the model, "
                      "its configuration or llama-server changes",
                      NGX_HTTP_LLAMA_SESSION_INEFFECTIVE_MAX, &zone->name,
                      (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN, ctx->job->fp);
    }
}
