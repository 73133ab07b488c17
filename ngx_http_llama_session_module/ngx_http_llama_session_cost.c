
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * When a restore pays.  A restore reads the session's file (its bytes at
 * the disk's or the page cache's speed); a re-prefill evaluates its tokens
 * at the backend's prompt speed.  A GPU prefills thousands of tokens a
 * second while a cold file on a network volume reads at a few hundred MB
 * a second, and KV files are large (docs/models.md has the bytes per
 * token): there a restore can cost more than it saves.  Both rates are
 * learnt per backend configuration (its fingerprint), from what
 * llama-server reports: each reply's timings.prompt_ms over prompt_n, each
 * restore's timings.restore_ms over its bytes; a moving average of the
 * last few.  A session whose restore would take clearly longer than the
 * prefill of its tokens is re-prefilled instead, and the swap line and the
 * metrics say so.
 *
 * With a draft model (speculative decoding), a restore also costs the
 * draft's help: llama-server restores the target's context alone, and the
 * draft accepts nothing on the session's turns in that slot after it
 * (docs/models.md); a prefill feeds both.  The generation's speed is
 * learnt apart for turns whose slot was restored and for the others
 * (timings.predicted_ms over predicted_n), with the tokens a turn
 * generates, and a restore's cost counts the next turn's slower
 * generation.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_cost.h"


/* samples of each rate before the module trusts it, and the margin */

#define NGX_HTTP_LLAMA_SESSION_COST_SAMPLES  3
#define NGX_HTTP_LLAMA_SESSION_COST_MARGIN   1.5

/* the shortest prompt and the smallest file that say something of a rate */

#define NGX_HTTP_LLAMA_SESSION_COST_TOKENS   64
#define NGX_HTTP_LLAMA_SESSION_COST_BYTES    4096
#define NGX_HTTP_LLAMA_SESSION_COST_GENERATED 8

/* the rates learnt: cost_learn()'s which */

#define NGX_HTTP_LLAMA_SESSION_RATE_PREFILL  0
#define NGX_HTTP_LLAMA_SESSION_RATE_RESTORE  1
#define NGX_HTTP_LLAMA_SESSION_RATE_GEN      2    /* the draft whole */
#define NGX_HTTP_LLAMA_SESSION_RATE_LOST     3    /* after a restore */

/* after so many re-prefills in a row, one restore measures the disk again */

#define NGX_HTTP_LLAMA_SESSION_COST_PROBE    8


static void ngx_http_llama_session_cost_learn(
    ngx_http_llama_session_zone_t *zone, u_char *fp, ngx_uint_t which,
    double rate, ngx_int_t tokens);


/* a reply's prefill: tokens evaluated in ms */

void
ngx_http_llama_session_cost_prefill(ngx_http_llama_session_zone_t *zone,
    u_char *fp, ngx_int_t tokens, double ms)
{
    if (tokens < NGX_HTTP_LLAMA_SESSION_COST_TOKENS || ms <= 0) {
        return;
    }

    ngx_http_llama_session_cost_learn(zone, fp,
                                      NGX_HTTP_LLAMA_SESSION_RATE_PREFILL,
                                      ms / tokens, 0);
}


/* a turn's generation: tokens in ms, on a slot whose draft was lost or not */

void
ngx_http_llama_session_cost_generate(ngx_http_llama_session_zone_t *zone,
    u_char *fp, ngx_uint_t lost, ngx_int_t tokens, double ms)
{
    ngx_http_llama_session_sh_t  *sh;

    sh = zone->sh;

    if (tokens < NGX_HTTP_LLAMA_SESSION_COST_GENERATED || ms <= 0
        || !sh->speculative
        || ngx_memcmp(sh->speculative_fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN)
           != 0)
    {
        return;
    }

    ngx_http_llama_session_cost_learn(zone, fp,
                                      lost ? NGX_HTTP_LLAMA_SESSION_RATE_LOST
                                           : NGX_HTTP_LLAMA_SESSION_RATE_GEN,
                                      ms / tokens, tokens);
}


/* a restore: bytes read in ms */

void
ngx_http_llama_session_cost_restore(ngx_http_llama_session_zone_t *zone,
    u_char *fp, off_t bytes, double ms)
{
    if (bytes < NGX_HTTP_LLAMA_SESSION_COST_BYTES || ms <= 0) {
        return;
    }

    ngx_http_llama_session_cost_learn(zone, fp,
                                      NGX_HTTP_LLAMA_SESSION_RATE_RESTORE,
                                      ms / (double) bytes, 0);
}


/* one rate learnt (which), and with a generation its tokens */

static void
ngx_http_llama_session_cost_learn(ngx_http_llama_session_zone_t *zone,
    u_char *fp, ngx_uint_t which, double rate, ngx_int_t tokens)
{
    double                        *avg;
    ngx_uint_t                    *n, restore;
    ngx_http_llama_session_cost_t *cost;

    cost = &zone->sh->cost;
    restore = (which == NGX_HTTP_LLAMA_SESSION_RATE_RESTORE);

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (ngx_memcmp(cost->fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN) != 0) {
        /* another model or configuration: its rates from the start */
        ngx_memzero(cost, sizeof(ngx_http_llama_session_cost_t));
        ngx_memcpy(cost->fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);
    }

    switch (which) {
    case NGX_HTTP_LLAMA_SESSION_RATE_PREFILL:
        avg = &cost->prefill_ms_per_token;
        n = &cost->prefill_samples;
        break;
    case NGX_HTTP_LLAMA_SESSION_RATE_RESTORE:
        avg = &cost->restore_ms_per_byte;
        n = &cost->restore_samples;
        break;
    default: /* the generation, the draft whole or lost */
        avg = &cost->gen_ms_per_token[which - NGX_HTTP_LLAMA_SESSION_RATE_GEN];
        n = &cost->gen_samples[which - NGX_HTTP_LLAMA_SESSION_RATE_GEN];
        cost->gen_tokens = (cost->gen_samples[0] + cost->gen_samples[1] == 0)
                           ? (double) tokens
                           : cost->gen_tokens * 0.75 + (double) tokens * 0.25;
    }

    /*
     * the first samples averaged, then each new one weighs a quarter; a
     * restore made to measure the disk again is taken as it is
     */

    *avg = (*n == 0 || (restore && cost->probing)) ? rate
           : (*n < 4) ? (*avg * *n + rate) / (*n + 1)
           : *avg * 0.75 + rate * 0.25;

    if (*n < 1000) {
        (*n)++;
    }

    if (restore) {
        cost->skipped = 0;
        cost->probing = 0;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * Would the session's restore (its file of bytes, holding tokens) take
 * clearly longer than their prefill?  1 then, with both estimates in ms.
 */

ngx_uint_t
ngx_http_llama_session_cost_reprefill(ngx_http_llama_session_ctx_t *ctx,
    off_t bytes, ngx_uint_t tokens, double *restore_ms, double *prefill_ms)
{
    ngx_uint_t                      known;
    ngx_http_llama_session_cost_t   cost;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;

    ngx_shmtx_lock(&zone->shpool->mutex);
    cost = zone->sh->cost;
    ngx_shmtx_unlock(&zone->shpool->mutex);

    known = (ngx_memcmp(cost.fp, ctx->job->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN)
             == 0
             && cost.prefill_samples >= NGX_HTTP_LLAMA_SESSION_COST_SAMPLES
             && cost.restore_samples >= NGX_HTTP_LLAMA_SESSION_COST_SAMPLES);

    if (!known || bytes <= 0 || tokens == 0) {
        return 0;
    }

    *restore_ms = cost.restore_ms_per_byte * (double) bytes;
    *prefill_ms = cost.prefill_ms_per_token * (double) tokens;

    /* a draft model: the next turn generates without the draft's help */

    if (zone->sh->speculative
        && ngx_memcmp(zone->sh->speculative_fp, ctx->job->fp,
                      NGX_HTTP_LLAMA_SESSION_FP_LEN) == 0
        && cost.gen_samples[0] >= NGX_HTTP_LLAMA_SESSION_COST_SAMPLES
        && cost.gen_samples[1] >= NGX_HTTP_LLAMA_SESSION_COST_SAMPLES
        && cost.gen_ms_per_token[1] > cost.gen_ms_per_token[0])
    {
        *restore_ms += (cost.gen_ms_per_token[1] - cost.gen_ms_per_token[0])
                       * cost.gen_tokens;
    }

    if (*restore_ms <= *prefill_ms * NGX_HTTP_LLAMA_SESSION_COST_MARGIN) {
        return 0;
    }

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (++zone->sh->cost.skipped > NGX_HTTP_LLAMA_SESSION_COST_PROBE) {
        /* a restore now and then: the disk may be fast again */
        zone->sh->cost.skipped = 0;
        zone->sh->cost.probing = 1;
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return 0;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return 1;
}
