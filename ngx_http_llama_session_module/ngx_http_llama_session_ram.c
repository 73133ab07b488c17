
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The hot tier: llama-server's RAM prompt cache (--cache-ram), under
 * which the store's files are the cold tier (ram= of the zone).
 *
 * llama-server moves a conversation between a slot and its RAM cache by
 * itself, inside the slot assignment of a completion, in the same step as
 * the batch wait every request pays: when a request pinned to a slot
 * would keep less than half of what the slot holds (f_keep < 0.5), the
 * slot's state goes into RAM and the entry that best extends the request
 * (one it beats the slot with) comes out of it.  No slot action is sent
 * for that.  Nothing upstream says what the cache holds, so the zone
 * keeps a model of it from llama-server's rules (research/hot-tier.md):
 *
 *   - an entry is stored when a completion is pinned to a slot that holds
 *     another session whose state the request keeps less than half of:
 *     any other system prompt, or a shared one shorter than half of it;
 *     an empty slot looks up nothing and stores nothing (upstream 28139),
 *     nor do slot actions (a restore or an erase replaces the state);
 *   - an entry leaves when its session is pinned to such a slot again (it
 *     is moved, not copied), and oldest first when the bytes it would
 *     take, by the store's bytes per token, pass ram=;
 *   - every reply's cached tokens correct it: a swap through RAM that
 *     found nothing drops the entry, and a few in a row stop the tier for
 *     the zone until llama-server restarts (then the model starts empty).
 *
 * A session the model holds goes to a slot that holds another session
 * (never an empty one) that is idle (a pinned request to a busy slot
 * would move its state while it runs): as for a hit, a slot that ran a
 * request of the module within a second and has none running is, else
 * GET /slots says so; with no save or restore on the client's path.  Any other
 * session takes the file path of handler.c.  A session that leaves its
 * slot for RAM is not saved then (save_idle= saves it while it idles in
 * its slot) when the model knows its size; and none goes into RAM that
 * would push out an entry with turns its file lacks (ram_room_locked()).
 * Only a session that comes out of RAM may have to: that loss is counted
 * and logged.
 *
 * The cache is one for all of llama-server's conversations: a zone with
 * tenants (llama_session_namespace) cannot have ram= (module.c).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_index.h"
#include "ngx_http_llama_session_ram.h"


#define NGX_HTTP_LLAMA_SESSION_RAM_MISSES  3

/* where a session leaving its slot can go (ram_room_locked()) */
#define NGX_HTTP_LLAMA_SESSION_RAM_KEEP    0
#define NGX_HTTP_LLAMA_SESSION_RAM_SAVE    1
#define NGX_HTTP_LLAMA_SESSION_RAM_NONE    2
#define NGX_HTTP_LLAMA_SESSION_RAM_OUT     3


static ngx_int_t ngx_http_llama_session_ram_find_locked(
    ngx_http_llama_session_sh_t *sh, u_char *key, size_t len);
static ngx_uint_t ngx_http_llama_session_ram_gate(
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_slot_t *slot);
static void ngx_http_llama_session_ram_drop_locked(
    ngx_http_llama_session_sh_t *sh, ngx_http_llama_session_ram_t *e);
static ngx_uint_t ngx_http_llama_session_ram_room_locked(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_slot_t *slot,
    ngx_int_t comer);


static ngx_int_t
ngx_http_llama_session_ram_find_locked(ngx_http_llama_session_sh_t *sh,
    u_char *key, size_t len)
{
    ngx_uint_t                    i;
    ngx_http_llama_session_ram_t  *e;

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_RAM_MAX; i++) {
        e = &sh->ram[i];

        if (e->seq && e->key_len == len && len
            && ngx_memcmp(e->key, key, len) == 0)
        {
            return i;
        }
    }

    return NGX_ERROR;
}


static void
ngx_http_llama_session_ram_drop_locked(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_ram_t *e)
{
    sh->ram_bytes -= e->bytes;
    e->seq = 0;
    e->crc = 0;
}


/* does the zone's model of the RAM cache hold the session? (sched.c) */

ngx_uint_t
ngx_http_llama_session_ram_holds_locked(ngx_http_llama_session_zone_t *zone,
    u_char *key, size_t len)
{
    return zone->ram && !zone->sh->ram_off
           && ngx_http_llama_session_ram_find_locked(zone->sh, key, len)
              != NGX_ERROR;
}


/* llama-server restarted, or the router unloaded the model: RAM is empty */

void
ngx_http_llama_session_ram_reset_locked(ngx_http_llama_session_zone_t *zone)
{
    ngx_http_llama_session_sh_t  *sh;

    sh = zone->sh;

    ngx_memzero(sh->ram, sizeof(sh->ram));
    sh->ram_bytes = 0;
    sh->ram_run = 0;
    sh->ram_off = 0;
    sh->ram_said = 0;
}


/*
 * Does llama-server look into its RAM cache when a request is pinned to
 * the slot, which holds "held" tokens of another session?  Only when the
 * request keeps less than half of them: always with another system
 * prompt; with the same one, when that prompt took less than half of the
 * last request of the session in the slot (its bytes: ram_reply).
 */

static ngx_uint_t
ngx_http_llama_session_ram_gate(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_slot_t *slot)
{
    if (slot->held == 0) {
        return 0;
    }

    if (ctx->base_len == 0 || !ctx->job->slot_has_base
        || ngx_memcmp(ctx->base_id, ctx->job->slot_base,
                      NGX_HTTP_LLAMA_SESSION_DIGEST) != 0)
    {
        return 1;
    }

    return !slot->sys_most;
}


/*
 * A swap: may the session come out of RAM into the slot?  The model
 * holds it, the slot holds another session (an empty one looks up
 * nothing), and the request keeps less than half of that.  The slot is
 * vouched for idle before ram_take (handler.c).
 */

ngx_uint_t
ngx_http_llama_session_ram_swap(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t                       i;
    ngx_uint_t                      open;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;
    sh = zone->sh;

    if (zone->ram == 0 || sh->ram_off || ctx->default_session || ctx->media
        || ctx->job->slot_state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
        || ctx->job->out_len == 0)
    {
        return 0;
    }

    ngx_shmtx_lock(&zone->shpool->mutex);

    i = ngx_http_llama_session_ram_find_locked(sh, ctx->key, ctx->key_len);
    open = ngx_http_llama_session_ram_gate(ctx, &sh->slots[ctx->job->slot]);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (i == NGX_ERROR) {
        return 0;
    }

    if (!open) {
        ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "llama_session: \"%*s\" is in RAM, but slot %ui keeps "
                       "the lookup shut", ctx->key_len, ctx->key,
                       ctx->job->slot);
        return 0;
    }

    return 1;
}


/*
 * Where the session that leaves the slot can go, by the model, as
 * llama-server stores it (oldest entries out until it fits) before it
 * looks up the one that comes ("comer", an entry, or NGX_ERROR):
 *
 *   OUT    what leaves would push the comer out: the file path;
 *   NONE   it would push out an entry with turns its file lacks: the
 *          file path, whose restore or erase stores nothing (a session
 *          out of RAM cannot: what leaves is saved first);
 *   SAVE   into RAM once saved: its turns are newer than its file, and
 *          either its size is unknown (no file of the zone gave bytes
 *          per token yet) or RAM would keep less room than one session
 *          beside it, which the next session to come out of RAM needs
 *          for what leaves its slot;
 *   KEEP   into RAM as it is.
 *
 * While RAM holds entries with turns their files lack, a session that
 * does not come out of RAM goes in only where that room stays (NONE):
 * a session in RAM unsaved is never pushed out by one stored after it.
 */

static ngx_uint_t
ngx_http_llama_session_ram_room_locked(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_slot_t *slot, ngx_int_t comer)
{
    off_t                          bytes, total;
    ngx_int_t                      own;
    ngx_uint_t                     n, used, after, oldest, dirty;
    ngx_http_llama_session_sh_t   *sh;
    ngx_http_llama_session_ram_t  *e;

    sh = zone->sh;

    bytes = (off_t) slot->held * (off_t) sh->bytes_per_token / 256;

    if (bytes > zone->ram) {
        /* llama-server skips a state larger than its whole cache */
        return slot->dirty ? NGX_HTTP_LLAMA_SESSION_RAM_SAVE
                           : NGX_HTTP_LLAMA_SESSION_RAM_KEEP;
    }

    /* its own older entry makes room (ram_leave) */

    own = slot->saveable
          ? ngx_http_llama_session_ram_find_locked(sh, slot->key,
                                                   slot->key_len)
          : NGX_ERROR;

    total = sh->ram_bytes - (own != NGX_ERROR ? sh->ram[own].bytes : 0);
    used = (own != NGX_ERROR) ? (ngx_uint_t) -1 : 0;

    for (n = 0; n < NGX_HTTP_LLAMA_SESSION_RAM_MAX; n++) {
        used += (sh->ram[n].seq != 0);
    }

    after = 0;

    while (total + bytes > zone->ram
           || used == NGX_HTTP_LLAMA_SESSION_RAM_MAX)
    {
        oldest = NGX_HTTP_LLAMA_SESSION_RAM_MAX;

        for (n = 0; n < NGX_HTTP_LLAMA_SESSION_RAM_MAX; n++) {
            e = &sh->ram[n];

            if (e->seq > after && (ngx_int_t) n != own
                && (oldest == NGX_HTTP_LLAMA_SESSION_RAM_MAX
                    || e->seq < sh->ram[oldest].seq))
            {
                oldest = n;
            }
        }

        if (oldest == NGX_HTTP_LLAMA_SESSION_RAM_MAX) {
            break;
        }

        if ((ngx_int_t) oldest == comer) {
            return NGX_HTTP_LLAMA_SESSION_RAM_OUT;
        }

        e = &sh->ram[oldest];

        if (e->dirty && e->key_len) {
            return NGX_HTTP_LLAMA_SESSION_RAM_NONE;
        }

        after = e->seq;
        total -= e->bytes;
        used--;
    }

    /* what stays: the entries after the last pushed out, but the comer */

    dirty = 0;

    for (n = 0; n < NGX_HTTP_LLAMA_SESSION_RAM_MAX; n++) {
        e = &sh->ram[n];

        if (e->seq > after && (ngx_int_t) n != own) {
            if ((ngx_int_t) n == comer) {
                total -= e->bytes;

            } else {
                dirty |= (e->dirty && e->key_len);
            }
        }
    }

    if (total + 2 * bytes <= zone->ram) {
        return (slot->dirty && sh->bytes_per_token == 0)
               ? NGX_HTTP_LLAMA_SESSION_RAM_SAVE
               : NGX_HTTP_LLAMA_SESSION_RAM_KEEP;
    }

    if (dirty && comer == NGX_ERROR) {
        return NGX_HTTP_LLAMA_SESSION_RAM_NONE;
    }

    return slot->dirty ? NGX_HTTP_LLAMA_SESSION_RAM_SAVE
                       : NGX_HTTP_LLAMA_SESSION_RAM_KEEP;
}


/*
 * The slot is idle (GET /slots said so, or it ran a request of the
 * module within a second): the session comes out of the model
 * (llama-server moves its entry into the slot); save_pending stays for
 * a leaving session that RAM may not keep.  0: the entry went meanwhile,
 * or what leaves would push it out: the file path.  "unsaved": the
 * session that leaves gets no save before, so only where RAM keeps it as
 * it is (no look at the slot first either: handler.c's fast path).
 */

ngx_uint_t
ngx_http_llama_session_ram_take(ngx_http_llama_session_ctx_t *ctx,
    ngx_uint_t unsaved)
{
    ngx_int_t                     i;
    ngx_uint_t                    room;
    ngx_http_llama_session_sh_t  *sh;

    sh = ctx->zone->sh;

    ngx_shmtx_lock(&ctx->zone->shpool->mutex);

    i = ngx_http_llama_session_ram_find_locked(sh, ctx->key, ctx->key_len);

    if (i == NGX_ERROR || sh->ram_off) {
        ngx_shmtx_unlock(&ctx->zone->shpool->mutex);
        return 0;
    }

    room = ngx_http_llama_session_ram_room_locked(ctx->zone,
                                                &sh->slots[ctx->job->slot], i);

    if (room == NGX_HTTP_LLAMA_SESSION_RAM_OUT
        || (unsaved && room != NGX_HTTP_LLAMA_SESSION_RAM_KEEP
            && (room != NGX_HTTP_LLAMA_SESSION_RAM_NONE
                || ctx->job->save_pending)))
    {
        /*
         * what leaves would push it out of RAM first, or needs a save
         * the caller does not make: the file path
         */
        ngx_shmtx_unlock(&ctx->zone->shpool->mutex);
        return 0;
    }

    /* its entry goes once what leaves went in (ram_leave()) */
    ctx->job->ram_tokens = sh->ram[i].tokens;

    if (room == NGX_HTTP_LLAMA_SESSION_RAM_KEEP) {
        ctx->job->save_pending = 0;
    }

    ngx_shmtx_unlock(&ctx->zone->shpool->mutex);

    ctx->action = NGX_HTTP_LLAMA_SESSION_ACTION_RAM;
    ctx->job->load_file = 0;

    return 1;
}


/*
 * A session without a file takes a slot that holds another: with the RAM
 * tier no erase, the request runs on the slot as it is and llama-server
 * moves what it held to RAM (it reuses no more of it than the tokens both
 * share); no save either, but of a session RAM may not keep.
 */

ngx_uint_t
ngx_http_llama_session_ram_fresh(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t                      room;
    ngx_http_llama_session_slot_t  *slot;

    if (ctx->zone->ram == 0 || ctx->zone->sh->ram_off
        || !ctx->job->ram_leaving || ctx->job->slot_tokens <= 0)
    {
        return 0;
    }

    slot = &ctx->zone->sh->slots[ctx->job->slot];

    if (!slot->saveable || !ngx_http_llama_session_ram_gate(ctx, slot)) {
        return 0;
    }

    ngx_shmtx_lock(&ctx->zone->shpool->mutex);
    room = ngx_http_llama_session_ram_room_locked(ctx->zone, slot,
                                                  NGX_ERROR);
    ngx_shmtx_unlock(&ctx->zone->shpool->mutex);

    if (room == NGX_HTTP_LLAMA_SESSION_RAM_NONE) {
        /* the file path: saved if need be, then erased */
        return 0;
    }

    if (room == NGX_HTTP_LLAMA_SESSION_RAM_KEEP) {
        ctx->job->save_pending = 0;
    }

    return 1;
}


/*
 * A completion is pinned to the slot, which still holds the session that
 * leaves it: its state goes into RAM when the request keeps less than
 * half of it, oldest entries out first to make room; then the session
 * that comes out of RAM (ram_take()) leaves it, as in llama-server.
 */

void
ngx_http_llama_session_ram_leave(ngx_http_llama_session_ctx_t *ctx)
{
    off_t                           bytes;
    ngx_int_t                       i;
    ngx_uint_t                      n, oldest, free;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_ram_t   *e, *o;
    ngx_http_llama_session_zone_t  *zone;
    ngx_http_llama_session_slot_t  *slot;
    u_char                          lost[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
    size_t                          lost_len;

    ctx->job->ram_leaving = 0;

    zone = ctx->zone;
    sh = zone->sh;

    if (zone->ram == 0 || sh->ram_off) {
        return;
    }

    /* the job holds the slot: nobody else writes it */

    slot = &sh->slots[ctx->job->slot];
    bytes = (off_t) slot->held * (off_t) sh->bytes_per_token / 256;
    lost_len = 0;

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
        || !ngx_http_llama_session_ram_gate(ctx, slot)
        || bytes > zone->ram)
    {
        /* nothing stored (llama-server skips a state larger than it all) */
        goto comer;
    }

    i = slot->saveable
        ? ngx_http_llama_session_ram_find_locked(sh, slot->key, slot->key_len)
        : NGX_ERROR;

    if (i != NGX_ERROR) {
        ngx_http_llama_session_ram_drop_locked(sh, &sh->ram[i]);
    }

    /* oldest first, until it fits; with every entry taken, the oldest */

    for ( ;; ) {
        oldest = NGX_HTTP_LLAMA_SESSION_RAM_MAX;
        free = NGX_HTTP_LLAMA_SESSION_RAM_MAX;

        for (n = 0; n < NGX_HTTP_LLAMA_SESSION_RAM_MAX; n++) {
            e = &sh->ram[n];

            if (e->seq == 0) {
                free = n;

            } else if (oldest == NGX_HTTP_LLAMA_SESSION_RAM_MAX
                       || e->seq < sh->ram[oldest].seq)
            {
                oldest = n;
            }
        }

        if (oldest == NGX_HTTP_LLAMA_SESSION_RAM_MAX
            || (free != NGX_HTTP_LLAMA_SESSION_RAM_MAX
                && sh->ram_bytes + bytes <= zone->ram))
        {
            break;
        }

        o = &sh->ram[oldest];

        if (o->dirty && o->key_len && lost_len == 0) {
            lost_len = o->key_len;
            ngx_memcpy(lost, o->key, lost_len);
            sh->stats.ram_lost++;
        }

        sh->stats.ram_evicted++;
        ngx_http_llama_session_ram_drop_locked(sh, o);
    }

    e = &sh->ram[free == NGX_HTTP_LLAMA_SESSION_RAM_MAX ? oldest : free];

    e->seq = ++sh->ram_seq;
    e->tokens = slot->held;
    e->bytes = bytes;
    e->dirty = slot->dirty;
    e->key_len = slot->saveable ? slot->key_len : 0;
    ngx_memcpy(e->key, slot->key, e->key_len);
    e->crc = e->key_len ? slot->crc : 0;

    sh->ram_bytes += bytes;
    sh->stats.ram_stored++;

comer:

    if (ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_RAM) {
        i = ngx_http_llama_session_ram_find_locked(sh, ctx->key,
                                                   ctx->key_len);
        if (i != NGX_ERROR) {
            ngx_http_llama_session_ram_drop_locked(sh, &sh->ram[i]);
        }
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (lost_len) {
        ngx_log_error(NGX_LOG_INFO, ctx->job->log, 0,
                      "llama_session: \"%*s\" left llama-server's RAM cache "
                      "of zone \"%V\" (oldest first) with turns its file "
                      "lacks: its next turn restores the file and prefills "
                      "the rest; a shorter save_idle= saves more sessions "
                      "before they leave their slot",
                      lost_len, lost, &zone->name);
    }
}


/*
 * The reply's figures: the tokens the slot holds now, and whether a swap
 * through RAM found the session there.  A few in a row that did not stop
 * the tier: llama-server runs without --cache-ram, with -sps 0, or
 * evicts otherwise than the zone thinks.
 */

void
ngx_http_llama_session_ram_reply(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_int_t cached, ngx_int_t evaluated,
    ngx_int_t predicted)
{
    off_t                           body;
    ngx_int_t                       expected;
    ngx_uint_t                      stop;
    ngx_chain_t                    *cl;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *zone;
    ngx_http_llama_session_slot_t  *slot;

    zone = ctx->zone;

    if (zone->ram == 0 || ctx->default_session) {
        return;
    }

    sh = zone->sh;
    slot = &sh->slots[ctx->job->slot];

    /* its system prompt's share of the body: the gate's estimate */

    body = 0;

    if (r->request_body) {
        for (cl = r->request_body->bufs; cl; cl = cl->next) {
            body += ngx_buf_size(cl->buf);
        }
    }

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (slot->state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
        && slot->key_len == ctx->key_len
        && ngx_memcmp(slot->key, ctx->key, ctx->key_len) == 0)
    {
        slot->held = cached + ngx_max(evaluated, 0) + ngx_max(predicted, 0);
        slot->sys_most = ((off_t) ctx->sys_len * 2 >= body);
    }

    if (ctx->action != NGX_HTTP_LLAMA_SESSION_ACTION_RAM) {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return;
    }

    /* the prompt may be shorter than what RAM held (a cut history) */

    expected = ctx->job->ram_tokens;

    if (evaluated >= 0 && cached + evaluated - 1 < expected) {
        expected = cached + evaluated - 1;
    }

    if (cached * 2 >= expected) {
        sh->ram_run = 0;
        sh->stats.ram_hits++;
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return;
    }

    sh->stats.ram_misses++;

    stop = !sh->ram_off && ++sh->ram_run >= NGX_HTTP_LLAMA_SESSION_RAM_MISSES;

    if (stop) {
        sh->ram_off = 1;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                  "llama_session: \"%*s\" was not in llama-server's RAM "
                  "cache as zone \"%V\" expected: the reply shows %i of its "
                  "~%ui tokens cached", ctx->key_len, ctx->key, &zone->name,
                  cached, ctx->job->ram_tokens);

    if (stop) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: %d sessions in a row were not in "
                      "llama-server's RAM cache where zone \"%V\" expected "
                      "them: does llama-server run with --cache-ram (as "
                      "ram=), -sps above 0 and --no-cache-idle-slots? The "
                      "zone restores from its files until llama-server "
                      "restarts", NGX_HTTP_LLAMA_SESSION_RAM_MISSES,
                      &zone->name);
    }
}


/* the zone's first contact with llama-server: which tiers, and why */

void
ngx_http_llama_session_ram_tiers(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    ngx_uint_t  said;

    ngx_shmtx_lock(&zone->shpool->mutex);

    said = zone->sh->ram_said;
    zone->sh->ram_said = 1;

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (said) {
        return;
    }

    if (zone->ram) {
        ngx_log_error(NGX_LOG_NOTICE, log, 0,
                      "llama_session: zone \"%V\" runs two tiers: "
                      "llama-server's RAM cache (ram=%O bytes, as its "
                      "--cache-ram; -sps above 0, --no-cache-idle-slots) "
                      "takes the sessions that leave a slot, %s",
                      &zone->name, zone->ram,
                      zone->store.len ? "the store's files the rest"
                                      : "llama-server's slot files the rest");
        return;
    }

    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                  "llama_session: zone \"%V\" runs one tier, its slot "
                  "files (no ram=%s): llama-server runs with --cache-ram 0 "
                  "-sps 0", &zone->name,
                  zone->has_tenants ? "; its tenants share no RAM cache"
                                    : "");
}
