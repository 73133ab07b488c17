
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * A conversation without an id is known by the messages it extends.  A
 * request that names no session (llama_session_id_fallback system_hash)
 * was given "sys-<its system prompt's digest>", and with the start of its
 * first message in the key, conversations that open alike (Qwen Code's
 * injected first exchange, an agent's fixed first task) shared one
 * session.  Now each such request's message list is summed up as chains:
 * D(i), the digest of its first i + 1 messages, from D(i - 1) and message
 * i (its hash, length and role, miss.c's, every message however many),
 * and C(i) from D(i) and the tenant, the model and the system prompt; the
 * last EXT_KEEP of them are kept while the request is read.  The zone keeps,
 * per conversation, the chains of its last two requests, each naming the
 * conversation's key.  A request belongs to the conversation whose kept
 * chain is the longest prefix of its own:
 *
 *   - a returning turn extends its previous request;
 *   - the same request again (a retry, a regenerated reply) equals it;
 *   - an edited last message extends the request before it.
 *
 * A request that extends none is a new conversation.  The first of its
 * family (same tenant, model, system prompt and first message) keeps the
 * key it always had, "sys-<16 hex>", so a client whose conversations open
 * differently sees no change, and files saved before stay found; any
 * later one of the family is "sys-<16 hex>-<16 hex of its chain>", a key
 * of its own, warm from the system prompt's base as any new conversation,
 * never from another conversation's messages.  Two new conversations that
 * run at once are two sessions, on two slots.
 *
 * The chains live in the zone's shared memory (a tree ordered by chain, a
 * least recently used queue, at most an eighth of the zone); a session's
 * .json keeps its last prompt's messages, so the zone's index at start
 * learns the last chain of each saved conversation again.  A chain lost to
 * the bound costs its conversation one re-prefill: its next request is a
 * new conversation, then known again.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_ext.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_index.h"


typedef struct {
    ngx_rbtree_node_t               node;       /* ordered by chain */
    ngx_queue_t                     lru;
    uint64_t                        chain;
    uint64_t                        parent;     /* the chain it extended,
                                                   0: none */
    uint64_t                        birth;      /* its id's suffix, 0: the
                                                   family's own id */
    uint32_t                        tenant;     /* its namespace's crc32,
                                                   0: none */
    u_char                          idk[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          key_len;
    u_char                          kind;       /* EXT_REQUEST, ... */
    u_char                          key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
} ngx_http_llama_session_ext_t;


#define NGX_HTTP_LLAMA_SESSION_EXT_REQUEST   0   /* a request's messages */
#define NGX_HTTP_LLAMA_SESSION_EXT_FAMILY    1   /* a family's first key */
#define NGX_HTTP_LLAMA_SESSION_EXT_REPLY     2   /* a reply it was given */

#define NGX_HTTP_LLAMA_SESSION_EXT_ECHO      (1024 * 1024)


static void ngx_http_llama_session_ext_init(
    ngx_http_llama_session_zone_t *zone);
static uint64_t ngx_http_llama_session_ext_mix(uint64_t x);
static uint64_t ngx_http_llama_session_ext_seed(u_char *ns, u_char *sys,
    u_char *model, size_t model_len);
static uint64_t ngx_http_llama_session_ext_chain(uint64_t seed, uint64_t d);
static void ngx_http_llama_session_ext_insert_value(ngx_rbtree_node_t *temp,
    ngx_rbtree_node_t *node, ngx_rbtree_node_t *sentinel);
static ngx_http_llama_session_ext_t *ngx_http_llama_session_ext_find(
    ngx_http_llama_session_sh_t *sh, uint64_t chain);
static ngx_http_llama_session_ext_t *ngx_http_llama_session_ext_victim(
    ngx_http_llama_session_sh_t *sh, uint32_t tenant);
static void ngx_http_llama_session_ext_add(ngx_http_llama_session_zone_t *zone,
    uint64_t chain, uint64_t parent, ngx_uint_t kind,
    ngx_http_llama_session_ext_t *who);
static ngx_int_t ngx_http_llama_session_ext_named(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_ext_t *e);
static void ngx_http_llama_session_ext_who(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_ext_t *who);
static ngx_int_t ngx_http_llama_session_ext_suffix(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, uint64_t birth);
static uint64_t ngx_http_llama_session_ext_echo(
    ngx_http_llama_session_ctx_t *ctx);
static uint64_t ngx_http_llama_session_ext_said(uint64_t seed, cJSON *msg);
static void ngx_http_llama_session_ext_free(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_ext_t *e);


/* with the zone locked: the tree, made at its first use */

static void
ngx_http_llama_session_ext_init(ngx_http_llama_session_zone_t *zone)
{
    ngx_http_llama_session_sh_t  *sh;

    sh = zone->sh;

    if (sh->ext_max) {
        return;
    }

    ngx_rbtree_init(&sh->ext_tree, &sh->ext_sentinel,
                    ngx_http_llama_session_ext_insert_value);
    ngx_queue_init(&sh->ext_lru);

    sh->ext_n = 0;
    sh->ext_max = ngx_max(zone->shm_zone->shm.size / 8 / 256, 64);
}


/*
 * The request's conversation, after its key was made from "sys-…": that
 * key (NGX_OK), another conversation's it extends (NGX_OK, ctx->key set),
 * or a key of its own: NGX_DECLINED, ctx->id extended, for the caller to
 * make the key of and record (ngx_http_llama_session_ext_record())
 */

ngx_int_t
ngx_http_llama_session_extension(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          len;
    uint64_t                        seed, family, said, *chain;
    ngx_int_t                       i;
    ngx_uint_t                      n, k, kept, taken;
    ngx_http_llama_session_ext_t   *e, *g, who;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;

    if (!ctx->ext_fallback || zone == NULL || ctx->bind
        || ctx->ext_total == 0 || !ctx->has_nsk)
    {
        return NGX_OK;
    }

    /*
     * the chains of the last EXT_KEEP prefixes (a request that extends a
     * kept one by more messages than that is a new conversation)
     */

    n = ctx->ext_total;
    kept = ngx_min(n, NGX_HTTP_LLAMA_SESSION_EXT_KEEP);

    chain = ngx_palloc(r->pool, kept * sizeof(uint64_t));
    if (chain == NULL) {
        return NGX_ERROR;
    }

    seed = ngx_http_llama_session_ext_seed(ctx->nsk, ctx->sys,
                                           ctx->model.data, ctx->model.len);

    /* chain[k]: the prefix of n - kept + k + 1 messages */

    for (k = 0; k < kept; k++) {
        chain[k] = ngx_http_llama_session_ext_chain(seed,
                       ctx->ext_d[(n - kept + k)
                                  % NGX_HTTP_LLAMA_SESSION_EXT_KEEP]);
    }

    ctx->ext_chain = chain[kept - 1];
    ctx->ext_seed = seed;

    /* the last reply it echoes, if it has one (outside the lock) */

    said = ngx_http_llama_session_ext_echo(ctx);

    ngx_shmtx_lock(&zone->shpool->mutex);

    ngx_http_llama_session_ext_init(zone);

    /* the longest request of a conversation that this one extends */

    e = NULL;

    for (i = kept - 1; i >= 0; i--) {
        e = ngx_http_llama_session_ext_find(zone->sh, chain[i]);
        if (e && e->kind == NGX_HTTP_LLAMA_SESSION_EXT_REQUEST) {
            break;
        }

        e = NULL;
    }

    if (e) {
        who = *e;

        ngx_queue_remove(&e->lru);
        ngx_queue_insert_tail(&zone->sh->ext_lru, &e->lru);

        if (i < (ngx_int_t) kept - 1) {
            /* a longer request: the one before the last is let go */

            if (e->parent) {
                g = ngx_http_llama_session_ext_find(zone->sh, e->parent);

                if (g && g->kind == NGX_HTTP_LLAMA_SESSION_EXT_REQUEST
                    && g->key_len == e->key_len
                    && ngx_memcmp(g->key, e->key, e->key_len) == 0)
                {
                    ngx_http_llama_session_ext_free(zone, g);
                }
            }

            ngx_http_llama_session_ext_add(zone, ctx->ext_chain, chain[i],
                                           NGX_HTTP_LLAMA_SESSION_EXT_REQUEST,
                                           &who);
        }

        ngx_shmtx_unlock(&zone->shpool->mutex);

        ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "llama_session: %ui messages extend %ui of a kept "
                       "conversation's", n, n - kept + (ngx_uint_t) i + 1);

        return ngx_http_llama_session_ext_named(r, ctx, &who);
    }

    /*
     * a client that rewrote its history (a reminder moved from an earlier
     * message to the last, a trimmed tool result) still echoes the reply
     * it was given last: the conversation that was given it
     */

    e = said ? ngx_http_llama_session_ext_find(zone->sh, said) : NULL;

    if (e && e->kind == NGX_HTTP_LLAMA_SESSION_EXT_REPLY && e->key_len) {
        who = *e;

        ngx_http_llama_session_ext_add(zone, ctx->ext_chain, 0,
                                       NGX_HTTP_LLAMA_SESSION_EXT_REQUEST,
                                       &who);

        ngx_shmtx_unlock(&zone->shpool->mutex);

        ngx_log_debug0(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "llama_session: a rewritten history echoes a kept "
                       "conversation's reply");

        return ngx_http_llama_session_ext_named(r, ctx, &who);
    }

    /*
     * a new conversation: the family's key if no other conversation has
     * it (none since start, nor a file), a key of its own otherwise
     */

    family = ngx_http_llama_session_ext_mix(seed
                                            ^ (uint64_t) ngx_crc32_short(
                                                  ctx->head,
                                                  NGX_HTTP_LLAMA_SESSION_DIGEST)
                                            ^ 0x66616d696c79ULL);

    taken = (ngx_http_llama_session_ext_find(zone->sh, family) != NULL);

    if (!taken) {
        /*
         * the family's file, if it has one; before the backend's
         * configuration is known (right after a start) the file cannot be
         * named, and the family's key is not given out
         */

        taken = 1;

        if (zone->sh->fp_known) {
            len = ngx_http_llama_session_file_name(name, ctx->key,
                                                 ctx->key_len, zone->sh->fp);
            taken = (ngx_http_llama_session_lookup_name(zone, name, len)
                     != NULL);
        }
    }

    if (!taken) {
        ctx->ext_birth = 0;
        ngx_http_llama_session_ext_who(ctx, &who);
        ngx_http_llama_session_ext_add(zone, family, 0,
                                       NGX_HTTP_LLAMA_SESSION_EXT_FAMILY,
                                       &who);
        ngx_http_llama_session_ext_add(zone, ctx->ext_chain, 0,
                                       NGX_HTTP_LLAMA_SESSION_EXT_REQUEST,
                                       &who);

        ngx_shmtx_unlock(&zone->shpool->mutex);

        return NGX_OK;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (ngx_http_llama_session_ext_suffix(r, ctx, ctx->ext_chain) != NGX_OK) {
        return NGX_ERROR;
    }

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: a new conversation of its family: \"%V\""
                   ", %ui messages", &ctx->id, ctx->ext_total);

    return NGX_DECLINED;
}


/* the key of a new conversation, made for the id extension() gave it */

void
ngx_http_llama_session_ext_record(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_ext_t    who;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;

    ngx_http_llama_session_ext_who(ctx, &who);

    ngx_shmtx_lock(&zone->shpool->mutex);

    ngx_http_llama_session_ext_init(zone);
    ngx_http_llama_session_ext_add(zone, ctx->ext_chain, 0,
                                   NGX_HTTP_LLAMA_SESSION_EXT_REQUEST,
                                   &who);

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/*
 * The turn is over (turn.c): the reply the conversation was given, as its
 * client will echo it in its next request
 */

void
ngx_http_llama_session_ext_reply(ngx_http_llama_session_ctx_t *ctx,
    cJSON *message)
{
    uint64_t                        said;
    ngx_http_llama_session_ext_t   *e, who;
    ngx_http_llama_session_zone_t  *zone;

    zone = ctx->zone;

    if (!ctx->ext_fallback || zone == NULL || ctx->ext_seed == 0) {
        return;
    }

    said = ngx_http_llama_session_ext_said(ctx->ext_seed, message);
    if (said == 0) {
        return;
    }

    ngx_shmtx_lock(&zone->shpool->mutex);

    ngx_http_llama_session_ext_init(zone);

    e = ngx_http_llama_session_ext_find(zone->sh, said);

    if (e && e->kind == NGX_HTTP_LLAMA_SESSION_EXT_REPLY
        && (e->key_len != ctx->key_len
            || ngx_memcmp(e->key, ctx->key, ctx->key_len) != 0))
    {
        /*
         * another conversation was given the same reply ("Done."): it
         * names neither of them, for as long as the zone keeps it
         */

        e->key_len = 0;
        ngx_queue_remove(&e->lru);
        ngx_queue_insert_tail(&zone->sh->ext_lru, &e->lru);

    } else {
        ngx_http_llama_session_ext_who(ctx, &who);
        ngx_http_llama_session_ext_add(zone, said, 0,
                                       NGX_HTTP_LLAMA_SESSION_EXT_REPLY,
                                       &who);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


/* the request's last assistant message, as its reply's digest; 0: none */

static uint64_t
ngx_http_llama_session_ext_echo(ngx_http_llama_session_ctx_t *ctx)
{
    cJSON     *msg;
    uint64_t   said;

    if (ctx->ext_reply.start == NULL
        || *ctx->ext_reply.start != '{'
        || ctx->ext_reply.end - ctx->ext_reply.start
           > NGX_HTTP_LLAMA_SESSION_EXT_ECHO)
    {
        return 0;
    }

    msg = ngx_http_llama_session_json_tree(ctx->ext_reply.start,
                                     ctx->ext_reply.end - ctx->ext_reply.start);
    if (msg == NULL) {
        return 0;
    }

    said = ngx_http_llama_session_ext_said(ctx->ext_seed, msg);

    cJSON_Delete(msg);

    return said;
}


/*
 * What an assistant's message said: its text (a string, or the text of
 * its parts) without white space, which clients trim, and its tool calls'
 * ids, which llama-server makes at random; 0: nothing
 */

static uint64_t
ngx_http_llama_session_ext_said(uint64_t seed, cJSON *msg)
{
    char      *s;
    cJSON     *content, *part, *call, *id;
    uint32_t   crc;
    uint64_t   len;

    len = 0;
    ngx_crc32_init(crc);

    content = cJSON_GetObjectItemCaseSensitive(msg, "content");

    if (cJSON_IsString(content)) {
        for (s = content->valuestring; *s; s++) {
            if (*s != ' ' && *s != '\t' && *s != '\n' && *s != '\r') {
                ngx_crc32_update(&crc, (u_char *) s, 1);
                len++;
            }
        }

    } else if (cJSON_IsArray(content)) {
        cJSON_ArrayForEach(part, content) {
            s = cJSON_GetStringValue(
                    cJSON_GetObjectItemCaseSensitive(part, "text"));

            for ( /* void */ ; s && *s; s++) {
                if (*s != ' ' && *s != '\t' && *s != '\n' && *s != '\r') {
                    ngx_crc32_update(&crc, (u_char *) s, 1);
                    len++;
                }
            }
        }
    }

    cJSON_ArrayForEach(call,
                       cJSON_GetObjectItemCaseSensitive(msg, "tool_calls"))
    {
        id = cJSON_GetObjectItemCaseSensitive(call, "id");

        if (cJSON_IsString(id) && id->valuestring[0]) {
            ngx_crc32_update(&crc, (u_char *) "\0", 1);
            ngx_crc32_update(&crc, (u_char *) id->valuestring,
                             ngx_strlen(id->valuestring));
            len += 1 + ngx_strlen(id->valuestring);
        }
    }

    if (len == 0) {
        return 0;
    }

    ngx_crc32_final(crc);

    return ngx_http_llama_session_ext_mix(seed
               ^ ngx_http_llama_session_ext_mix(((uint64_t) crc << 32)
                                                ^ len ^ 0x7265706c79ULL));
}


/* a saved session's last chain, from a .json's messages; 0: none */

uint64_t
ngx_http_llama_session_ext_saved(u_char *ns, u_char *sys, u_char *model,
    size_t model_len, u_char *msgs, size_t len)
{
    u_char                        buf[NGX_HTTP_LLAMA_SESSION_MSGS_MAX
                                      * sizeof(ngx_http_llama_session_msg_t)
                                      + 3];
    uint64_t                      d;
    ngx_str_t                     src, out;
    ngx_uint_t                    i, n;
    ngx_http_llama_session_msg_t  m;

    if (len == 0 || ngx_base64_decoded_length(len) > sizeof(buf)) {
        return 0;
    }

    src.data = msgs;
    src.len = len;
    out.data = buf;

    if (ngx_decode_base64(&out, &src) != NGX_OK
        || out.len == 0
        || out.len % sizeof(ngx_http_llama_session_msg_t))
    {
        return 0;
    }

    n = out.len / sizeof(ngx_http_llama_session_msg_t);

    d = NGX_HTTP_LLAMA_SESSION_EXT_D0;

    for (i = 0; i < n; i++) {
        /* the buffer is not aligned for the record */
        ngx_memcpy(&m, buf + i * sizeof(ngx_http_llama_session_msg_t),
                   sizeof(ngx_http_llama_session_msg_t));
        d = ngx_http_llama_session_ext_step(d, &m);
    }

    return ngx_http_llama_session_ext_chain(
               ngx_http_llama_session_ext_seed(ns, sys, model, model_len), d);
}


/* a saved session's last chain, as its .json has it (16 hex); 0: none */

uint64_t
ngx_http_llama_session_ext_parse(u_char *hex, size_t len)
{
    ngx_int_t  hi, lo;

    if (len != 16) {
        return 0;
    }

    hi = ngx_hextoi(hex, 8);
    lo = ngx_hextoi(hex + 8, 8);

    if (hi == NGX_ERROR || lo == NGX_ERROR) {
        return 0;
    }

    return ((uint64_t) hi << 32) | (uint64_t) lo;
}


/*
 * The zone's index at start, the zone locked: a saved conversation's last
 * request; its id ("sys-<16 hex>", or with "-<16 hex>" of its own) and its
 * digest as its .json says
 */

void
ngx_http_llama_session_ext_index(ngx_http_llama_session_zone_t *zone,
    uint64_t chain, u_char *key, size_t len, u_char *id, size_t id_len,
    u_char *idk, u_char *ns)
{
    u_char                        *p;
    ngx_int_t                      n;
    ngx_http_llama_session_ext_t   who;

    if (chain == 0 || len > NGX_HTTP_LLAMA_SESSION_KEY_MAX) {
        return;
    }

    ngx_memzero(&who, sizeof(ngx_http_llama_session_ext_t));
    who.key_len = (u_char) len;
    ngx_memcpy(who.key, key, len);
    who.tenant = ngx_crc32_short(ns, NGX_HTTP_LLAMA_SESSION_DIGEST);
    ngx_memcpy(who.idk, idk, NGX_HTTP_LLAMA_SESSION_DIGEST);

    /* "sys-" 16 hex digits, then "-" 16 of its own */

    if (id_len == 4 + 16 + 1 + 16 && id[4 + 16] == '-') {
        p = id + 4 + 16 + 1;

        n = ngx_hextoi(p, 8);
        if (n == NGX_ERROR) {
            return;
        }

        who.birth = (uint64_t) n << 32;

        n = ngx_hextoi(p + 8, 8);
        if (n == NGX_ERROR) {
            return;
        }

        who.birth |= (uint64_t) n;
    }

    ngx_http_llama_session_ext_init(zone);

    if (ngx_http_llama_session_ext_find(zone->sh, chain) == NULL) {
        ngx_http_llama_session_ext_add(zone, chain, 0,
                                       NGX_HTTP_LLAMA_SESSION_EXT_REQUEST,
                                       &who);
    }
}


/* what a kept entry names: the request's conversation */

static void
ngx_http_llama_session_ext_who(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_ext_t *who)
{
    who->key_len = (u_char) ngx_min(ctx->key_len,
                                    NGX_HTTP_LLAMA_SESSION_KEY_MAX);
    ngx_memcpy(who->key, ctx->key, who->key_len);
    who->birth = ctx->ext_birth;
    ngx_memcpy(who->idk, ctx->idk, NGX_HTTP_LLAMA_SESSION_DIGEST);
    who->tenant = ctx->has_nsk
                  ? ngx_crc32_short(ctx->nsk, NGX_HTTP_LLAMA_SESSION_DIGEST)
                  : 0;
}


/*
 * The request is the kept conversation "who": its key, and its id (the
 * family's, or with its own suffix) and the id's digest, as the API and
 * $llama_session_id show it
 */

static ngx_int_t
ngx_http_llama_session_ext_named(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_ext_t *who)
{
    ctx->key_len = who->key_len;
    ngx_memcpy(ctx->key, who->key, who->key_len);
    ctx->ext_birth = who->birth;
    ngx_memcpy(ctx->idk, who->idk, NGX_HTTP_LLAMA_SESSION_DIGEST);

    if (who->birth == 0) {
        return NGX_OK;
    }

    return ngx_http_llama_session_ext_suffix(r, ctx, who->birth);
}


/* "sys-<16 hex>" and "-<16 hex>" of the conversation's own */

static ngx_int_t
ngx_http_llama_session_ext_suffix(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, uint64_t birth)
{
    u_char  *p, *last;

    p = ngx_pnalloc(r->pool, ctx->id.len + 1 + 16);
    if (p == NULL) {
        return NGX_ERROR;
    }

    last = ngx_cpymem(p, ctx->id.data, ctx->id.len);
    last = ngx_sprintf(last, "-%016uxL", birth);

    ctx->id.data = p;
    ctx->id.len = last - p;
    ctx->ext_birth = birth;

    return NGX_OK;
}


/* splitmix64's finalizer */

static uint64_t
ngx_http_llama_session_ext_mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;

    return x;
}


static uint64_t
ngx_http_llama_session_ext_seed(u_char *ns, u_char *sys, u_char *model,
    size_t model_len)
{
    uint64_t  a, b;

    /* the model as the zone's records keep it */

    model_len = ngx_min(model_len, NGX_HTTP_LLAMA_SESSION_MODEL_SHOW);

    ngx_memcpy(&a, ns, sizeof(uint64_t));
    ngx_memcpy(&b, sys, sizeof(uint64_t));

    return ngx_http_llama_session_ext_mix(
               ngx_http_llama_session_ext_mix(a)
               ^ ngx_http_llama_session_ext_mix(b + 1)
               ^ ngx_http_llama_session_ext_mix(
                     ((uint64_t) ngx_murmur_hash2(model, model_len) << 32)
                     + model_len + 2));
}


uint64_t
ngx_http_llama_session_ext_step(uint64_t prev,
    ngx_http_llama_session_msg_t *m)
{
    uint64_t  x;

    x = ngx_http_llama_session_ext_mix(prev + 0x9e3779b97f4a7c15ULL)
        ^ (((uint64_t) m->len << 32) | m->hash);

    x = ngx_http_llama_session_ext_mix(x ^ ((uint64_t) m->role << 56));

    /* 0 means "none" */

    return x ? x : 1;
}


/* a prefix's chain: its digest (ext_step()) under the request's seed */

static uint64_t
ngx_http_llama_session_ext_chain(uint64_t seed, uint64_t d)
{
    uint64_t  x;

    x = ngx_http_llama_session_ext_mix(seed ^ d);

    return x ? x : 1;
}


static void
ngx_http_llama_session_ext_insert_value(ngx_rbtree_node_t *temp,
    ngx_rbtree_node_t *node, ngx_rbtree_node_t *sentinel)
{
    ngx_rbtree_node_t            **p;
    ngx_http_llama_session_ext_t  *e, *t;

    e = (ngx_http_llama_session_ext_t *) node;

    for ( ;; ) {
        t = (ngx_http_llama_session_ext_t *) temp;

        p = (e->chain < t->chain) ? &temp->left : &temp->right;

        if (*p == sentinel) {
            break;
        }

        temp = *p;
    }

    *p = node;
    node->parent = temp;
    node->left = sentinel;
    node->right = sentinel;
    ngx_rbt_red(node);
}


static ngx_http_llama_session_ext_t *
ngx_http_llama_session_ext_find(ngx_http_llama_session_sh_t *sh,
    uint64_t chain)
{
    ngx_rbtree_node_t             *node, *sentinel;
    ngx_http_llama_session_ext_t  *e;

    node = sh->ext_tree.root;
    sentinel = sh->ext_tree.sentinel;

    while (node != sentinel) {
        e = (ngx_http_llama_session_ext_t *) node;

        if (chain == e->chain) {
            return e;
        }

        node = (chain < e->chain) ? node->left : node->right;
    }

    return NULL;
}


/* with the zone locked; a chain kept already names the new key */

static void
ngx_http_llama_session_ext_add(ngx_http_llama_session_zone_t *zone,
    uint64_t chain, uint64_t parent, ngx_uint_t kind,
    ngx_http_llama_session_ext_t *who)
{
    ngx_http_llama_session_sh_t   *sh;
    ngx_http_llama_session_ext_t  *e;

    sh = zone->sh;

    e = ngx_http_llama_session_ext_find(sh, chain);

    if (e == NULL) {
        if (sh->ext_n >= sh->ext_max && !ngx_queue_empty(&sh->ext_lru)) {
            ngx_http_llama_session_ext_free(zone,
                      ngx_http_llama_session_ext_victim(sh, who->tenant));
        }

        e = ngx_slab_alloc_locked(zone->shpool,
                                  sizeof(ngx_http_llama_session_ext_t));

        if (e == NULL && !ngx_queue_empty(&sh->ext_lru)) {
            ngx_http_llama_session_ext_free(zone,
                      ngx_http_llama_session_ext_victim(sh, who->tenant));

            e = ngx_slab_alloc_locked(zone->shpool,
                                      sizeof(ngx_http_llama_session_ext_t));
        }

        if (e == NULL) {
            /* the conversation is new again on its next request */
            return;
        }

        e->chain = chain;
        ngx_rbtree_insert(&sh->ext_tree, &e->node);
        sh->ext_n++;

    } else {
        ngx_queue_remove(&e->lru);
    }

    ngx_queue_insert_tail(&sh->ext_lru, &e->lru);

    e->parent = parent;
    e->kind = (u_char) kind;
    e->birth = who->birth;
    e->tenant = who->tenant;
    ngx_memcpy(e->idk, who->idk, NGX_HTTP_LLAMA_SESSION_DIGEST);
    e->key_len = who->key_len;
    ngx_memcpy(e->key, who->key, who->key_len);
}


/*
 * The entry that goes for a new one of "tenant": the least recently used,
 * unless one of the tenant's own is among the next ones; a tenant that
 * fills the table with new conversations then pushes out its own, not
 * the other tenants' (review 4)
 */

#define NGX_HTTP_LLAMA_SESSION_EXT_LOOK  16

static ngx_http_llama_session_ext_t *
ngx_http_llama_session_ext_victim(ngx_http_llama_session_sh_t *sh,
    uint32_t tenant)
{
    ngx_uint_t                     n;
    ngx_queue_t                   *q;
    ngx_http_llama_session_ext_t  *e;

    for (q = ngx_queue_head(&sh->ext_lru), n = 0;
         q != ngx_queue_sentinel(&sh->ext_lru)
         && n < NGX_HTTP_LLAMA_SESSION_EXT_LOOK;
         q = ngx_queue_next(q), n++)
    {
        e = ngx_queue_data(q, ngx_http_llama_session_ext_t, lru);

        if (e->tenant == tenant) {
            return e;
        }
    }

    return ngx_queue_data(ngx_queue_head(&sh->ext_lru),
                          ngx_http_llama_session_ext_t, lru);
}


static void
ngx_http_llama_session_ext_free(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_ext_t *e)
{
    ngx_rbtree_delete(&zone->sh->ext_tree, &e->node);
    ngx_queue_remove(&e->lru);
    zone->sh->ext_n--;

    ngx_slab_free_locked(zone->shpool, e);
}
