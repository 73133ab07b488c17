
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What the model's file says of its memory, and so of what a slot file
 * can bring back (docs/models.md):
 *
 *   full       every layer attends to the whole context: a restored slot
 *              is reused up to where the next prompt differs;
 *   swa        sliding-window attention (Gemma 3 and 4, gpt-oss, Llama
 *              4's chunks): a save keeps only the window, a restore is
 *              reused only with llama-server's --swa-full;
 *   hybrid     recurrent or convolution layers beside attention
 *   recurrent  (Qwen3-Next, LFM2, Granite 4, Nemotron-H; Mamba, RWKV):
 *              a restore is reused only when the next prompt extends the
 *              whole saved sequence, which the re-prime before each save
 *              makes so (reprime.c).
 *
 * llama-server does not report it: the GGUF's metadata does, where nginx
 * can read the file that GET /props names (the same host).  Only the
 * header's keys are read (tokenizer's included: another tool may write
 * the model's after them), at most 16 MB a pass, of a file that
 * llama-server has in the page cache.  GGUF is little-endian, as the
 * hosts llama-server runs on (a big-endian file fails the version check).
 * A file that is not the backend's model (another
 * host's path) is told by its embedding size, which /v1/models reports.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_file.h"
#include "ngx_http_llama_session_gguf.h"


#define NGX_HTTP_LLAMA_SESSION_GGUF_BUF   65536
#define NGX_HTTP_LLAMA_SESSION_GGUF_READ  (16 * 1024 * 1024)
#define NGX_HTTP_LLAMA_SESSION_GGUF_KEY   256


/* the file as it is read, and what its keys said */

typedef struct {
    ngx_fd_t                          fd;
    off_t                             offset;   /* of buf[0] in the file */
    size_t                            pos;
    size_t                            len;
    off_t                             read;     /* bytes read in all */
    ngx_http_llama_session_memory_t  *mem;
    size_t                            alen;
    u_char                            arch[NGX_HTTP_LLAMA_SESSION_ARCH_MAX];
    unsigned                          early:1;  /* a model's key before
                                                   general.architecture */
    unsigned                          recurrent:1;
    unsigned                          attention:1;
    unsigned                          heads_seen:1;
    u_char                            buf[NGX_HTTP_LLAMA_SESSION_GGUF_BUF];
} ngx_http_llama_session_gguf_t;


static ngx_int_t ngx_http_llama_session_gguf_get(
    ngx_http_llama_session_gguf_t *g, void *dst, size_t n);
static ngx_int_t ngx_http_llama_session_gguf_skip(
    ngx_http_llama_session_gguf_t *g, uint32_t type, ngx_uint_t depth);
static ngx_int_t ngx_http_llama_session_gguf_uint(
    ngx_http_llama_session_gguf_t *g, uint32_t type, uint64_t *v);
static ngx_int_t ngx_http_llama_session_gguf_pass(
    ngx_http_llama_session_gguf_t *g, uint64_t nkv);
static ngx_int_t ngx_http_llama_session_gguf_value(
    ngx_http_llama_session_gguf_t *g, u_char *key, size_t klen, uint32_t type);
static ngx_int_t ngx_http_llama_session_gguf_heads(
    ngx_http_llama_session_gguf_t *g, uint32_t type);
static void ngx_http_llama_session_gguf_kind(ngx_http_llama_session_gguf_t *g);
static ngx_uint_t ngx_http_llama_session_gguf_has(
    ngx_http_llama_session_gguf_t *g, u_char *key, size_t len, char *name);


/* the bytes of a scalar of each type, 0: not a scalar */

static size_t  ngx_http_llama_session_gguf_size[] = {
    1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8
};

#define NGX_HTTP_LLAMA_SESSION_GGUF_F32     6
#define NGX_HTTP_LLAMA_SESSION_GGUF_STRING  8
#define NGX_HTTP_LLAMA_SESSION_GGUF_ARRAY   9
#define NGX_HTTP_LLAMA_SESSION_GGUF_F64     12
#define NGX_HTTP_LLAMA_SESSION_GGUF_TYPES   13


/* architectures whose memory llama.cpp sets in its code, not in keys */

static struct {
    char                           *arch;
    ngx_uint_t                      kind;
    uint32_t                        window;
} ngx_http_llama_session_gguf_archs[] = {
    { "mamba", NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT, 0 },
    { "mamba2", NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT, 0 },
    { "rwkv6", NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT, 0 },
    { "rwkv6qwen2", NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT, 0 },
    { "rwkv7", NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT, 0 },
    { "arwkv7", NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT, 0 },
    { "llama4", NGX_HTTP_LLAMA_SESSION_MEMORY_SWA, 8192 },
    { NULL, 0, 0 }
};


static char  *ngx_http_llama_session_memory_names[] = {
    "unknown", "full", "swa", "hybrid", "recurrent"
};


char *
ngx_http_llama_session_memory_name(ngx_uint_t kind)
{
    return ngx_http_llama_session_memory_names[
               kind <= NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT ? kind : 0];
}


/* the memory of the backend of fingerprint fp, as far as it is known */

ngx_uint_t
ngx_http_llama_session_memory_kind(ngx_http_llama_session_zone_t *zone,
    u_char *fp)
{
    ngx_uint_t                    kind;
    ngx_http_llama_session_sh_t  *sh;

    sh = zone->sh;

    ngx_shmtx_lock(&zone->shpool->mutex);

    kind = (sh->memory_known
            && ngx_memcmp(sh->memory_fp, fp, NGX_HTTP_LLAMA_SESSION_FP_LEN)
               == 0)
           ? sh->memory.kind : NGX_HTTP_LLAMA_SESSION_MEMORY_UNKNOWN;

    ngx_shmtx_unlock(&zone->shpool->mutex);

    return kind;
}


/*
 * Reads the memory of the model at path (NUL-terminated) into mem.
 * NGX_OK: known; NGX_DECLINED: no such file here, or not a GGUF that
 * says (logged at info); NGX_ERROR: a read failed (logged).
 */

ngx_int_t
ngx_http_llama_session_gguf_memory(ngx_log_t *log, u_char *path,
    ngx_http_llama_session_memory_t *mem)
{
    u_char                          magic[4];
    off_t                           kv;
    uint32_t                        version;
    uint64_t                        ntensors, nkv;
    ngx_int_t                       rc;
    ngx_http_llama_session_gguf_t  *g;

    ngx_memzero(mem, sizeof(ngx_http_llama_session_memory_t));

    g = ngx_alloc(sizeof(ngx_http_llama_session_gguf_t), log);
    if (g == NULL) {
        return NGX_ERROR;
    }

    ngx_memzero(g, offsetof(ngx_http_llama_session_gguf_t, buf));
    g->mem = mem;

    /* follows links (hub caches), never blocks, a regular file only */

    g->fd = ngx_http_llama_session_file_open(path,
                                             NGX_HTTP_LLAMA_SESSION_FILE_MODEL,
                                             0, log);

    if (g->fd == NGX_INVALID_FILE) {
        ngx_log_error(NGX_LOG_INFO, log, ngx_errno,
                      "llama_session: cannot read the model's file \"%s\" "
                      "here, its memory is not known", path);
        ngx_free(g);
        return NGX_DECLINED;
    }

    rc = NGX_DECLINED;

    if (ngx_http_llama_session_gguf_get(g, magic, 4) != NGX_OK
        || ngx_strncmp(magic, "GGUF", 4) != 0
        || ngx_http_llama_session_gguf_get(g, &version, 4) != NGX_OK
        || (version != 2 && version != 3)
        || ngx_http_llama_session_gguf_get(g, &ntensors, 8) != NGX_OK
        || ngx_http_llama_session_gguf_get(g, &nkv, 8) != NGX_OK)
    {
        goto done;
    }

    /*
     * The keys wherever they stand: the model's keys ("<arch>.…") may come
     * before general.architecture (a file another tool wrote, or merged),
     * then the pairs are read a second time, from the first; and after the
     * tokenizer's.  Every pass is bounded (GGUF_READ); a read that fails
     * once the architecture is known ends the scan with what it found.
     */

    kv = g->offset + (off_t) g->pos;

    if (ngx_http_llama_session_gguf_pass(g, nkv) == NGX_OK
        && g->early && g->alen)
    {
        g->offset = kv;
        g->pos = 0;
        g->len = 0;
        g->read = 0;

        (void) ngx_http_llama_session_gguf_pass(g, nkv);
    }

    if (g->alen) {
        ngx_http_llama_session_gguf_kind(g);
        rc = NGX_OK;
    }

done:

    if (rc != NGX_OK) {
        ngx_log_error(NGX_LOG_INFO, log, 0,
                      "llama_session: \"%s\" is not a GGUF file this module "
                      "can read, the model's memory is not known", path);
    }

    if (ngx_close_file(g->fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, log, ngx_errno,
                      ngx_close_file_n " \"%s\" failed", path);
    }

    ngx_free(g);

    return rc;
}


/*
 * The nkv key-value pairs once, knowing at most the architecture;
 * NGX_OK: all read, else the scan ends
 */

static ngx_int_t
ngx_http_llama_session_gguf_pass(ngx_http_llama_session_gguf_t *g,
    uint64_t nkv)
{
    u_char    key[NGX_HTTP_LLAMA_SESSION_GGUF_KEY];
    uint32_t  type;
    uint64_t  klen, i;

    g->recurrent = 0;
    g->attention = 0;
    g->heads_seen = 0;
    g->mem->window = 0;
    g->mem->n_embd = 0;

    for (i = 0; i < nkv; i++) {

        if (ngx_http_llama_session_gguf_get(g, &klen, 8) != NGX_OK
            || klen == 0 || klen >= NGX_HTTP_LLAMA_SESSION_GGUF_KEY
            || ngx_http_llama_session_gguf_get(g, key, klen) != NGX_OK
            || ngx_http_llama_session_gguf_get(g, &type, 4) != NGX_OK
            || type >= NGX_HTTP_LLAMA_SESSION_GGUF_TYPES
            || ngx_http_llama_session_gguf_value(g, key, klen, type)
               != NGX_OK)
        {
            return NGX_DECLINED;
        }
    }

    return NGX_OK;
}


/*
 * The value of a key: the architecture, or a key of the architecture
 * that tells its memory; any other one is skipped
 */

static ngx_int_t
ngx_http_llama_session_gguf_value(ngx_http_llama_session_gguf_t *g,
    u_char *key, size_t klen, uint32_t type)
{
    uint64_t  slen, v;

    if (klen == sizeof("general.architecture") - 1
        && ngx_strncmp(key, "general.architecture", klen) == 0
        && type == NGX_HTTP_LLAMA_SESSION_GGUF_STRING
        && g->alen == 0)
    {
        if (ngx_http_llama_session_gguf_get(g, &slen, 8) != NGX_OK
            || slen == 0 || slen >= NGX_HTTP_LLAMA_SESSION_ARCH_MAX
            || ngx_http_llama_session_gguf_get(g, g->arch, slen) != NGX_OK)
        {
            return NGX_DECLINED;
        }

        g->alen = (size_t) slen;
        return NGX_OK;
    }

    if (g->alen == 0
        && !(klen >= 8 && ngx_strncmp(key, "general.", 8) == 0)
        && !(klen >= 10 && ngx_strncmp(key, "tokenizer.", 10) == 0))
    {
        /* perhaps a model's key before its architecture */
        g->early = 1;
    }

    if (g->alen == 0 || klen <= g->alen + 1
        || ngx_strncmp(key, g->arch, g->alen) != 0 || key[g->alen] != '.')
    {
        return ngx_http_llama_session_gguf_skip(g, type, 0);
    }

    if (ngx_http_llama_session_gguf_has(g, key, klen, "ssm.")
        || ngx_http_llama_session_gguf_has(g, key, klen, "shortconv.")
        || ngx_http_llama_session_gguf_has(g, key, klen, "wkv."))
    {
        g->recurrent = 1;
    }

    if (ngx_http_llama_session_gguf_has(g, key, klen,
                                        "attention.sliding_window") == 2
        && type != NGX_HTTP_LLAMA_SESSION_GGUF_ARRAY)
    {
        if (ngx_http_llama_session_gguf_uint(g, type, &v) != NGX_OK) {
            return NGX_DECLINED;
        }

        g->mem->window = (uint32_t) ngx_min(v, 0x7fffffff);
        return NGX_OK;
    }

    if (ngx_http_llama_session_gguf_has(g, key, klen, "embedding_length") == 2
        && type != NGX_HTTP_LLAMA_SESSION_GGUF_ARRAY)
    {
        if (ngx_http_llama_session_gguf_uint(g, type, &v) != NGX_OK) {
            return NGX_DECLINED;
        }

        g->mem->n_embd = v;
        return NGX_OK;
    }

    if (ngx_http_llama_session_gguf_has(g, key, klen,
                                        "attention.head_count") == 2
        || ngx_http_llama_session_gguf_has(g, key, klen,
                                           "attention.head_count_kv") == 2)
    {
        return ngx_http_llama_session_gguf_heads(g, type);
    }

    return ngx_http_llama_session_gguf_skip(g, type, 0);
}


/* a head count, a number or one per layer: does any layer attend? */

static ngx_int_t
ngx_http_llama_session_gguf_heads(ngx_http_llama_session_gguf_t *g,
    uint32_t type)
{
    uint32_t  etype;
    uint64_t  n, v;

    g->heads_seen = 1;

    n = 1;
    etype = type;

    if (type == NGX_HTTP_LLAMA_SESSION_GGUF_ARRAY
        && (ngx_http_llama_session_gguf_get(g, &etype, 4) != NGX_OK
            || ngx_http_llama_session_gguf_get(g, &n, 8) != NGX_OK
            || etype >= NGX_HTTP_LLAMA_SESSION_GGUF_TYPES
            || ngx_http_llama_session_gguf_size[etype] == 0
            || n > 65536))
    {
        return NGX_DECLINED;
    }

    while (n--) {
        if (ngx_http_llama_session_gguf_uint(g, etype, &v) != NGX_OK) {
            return NGX_DECLINED;
        }

        g->attention |= (v > 0);
    }

    return NGX_OK;
}


/* the memory's kind, from the keys and, for a few, the architecture */

static void
ngx_http_llama_session_gguf_kind(ngx_http_llama_session_gguf_t *g)
{
    ngx_uint_t                        i;
    ngx_http_llama_session_memory_t  *mem;

    mem = g->mem;

    ngx_memcpy(mem->arch, g->arch, g->alen);
    mem->arch[g->alen] = '\0';

    if (g->recurrent) {
        mem->kind = (g->attention || !g->heads_seen)
                    ? NGX_HTTP_LLAMA_SESSION_MEMORY_HYBRID
                    : NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT;

    } else if (mem->window) {
        mem->kind = NGX_HTTP_LLAMA_SESSION_MEMORY_SWA;

    } else {
        mem->kind = NGX_HTTP_LLAMA_SESSION_MEMORY_FULL;
    }

    for (i = 0; ngx_http_llama_session_gguf_archs[i].arch; i++) {
        if (ngx_strcmp(mem->arch, ngx_http_llama_session_gguf_archs[i].arch)
            == 0)
        {
            mem->kind = ngx_http_llama_session_gguf_archs[i].kind;

            if (mem->window == 0) {
                mem->window = ngx_http_llama_session_gguf_archs[i].window;
            }

            break;
        }
    }
}


/* is key "<arch>.<name>": 2 exactly, 1 as a prefix of it, else 0 */

static ngx_uint_t
ngx_http_llama_session_gguf_has(ngx_http_llama_session_gguf_t *g,
    u_char *key, size_t len, char *name)
{
    size_t  nlen;

    nlen = ngx_strlen(name);

    if (len < g->alen + 1 + nlen
        || ngx_strncmp(key + g->alen + 1, name, nlen) != 0)
    {
        return 0;
    }

    return (len == g->alen + 1 + nlen) ? 2 : 1;
}


static ngx_int_t
ngx_http_llama_session_gguf_get(ngx_http_llama_session_gguf_t *g, void *dst,
    size_t n)
{
    u_char   *p;
    size_t    k;
    ssize_t   got;

    p = dst;

    while (n) {
        if (g->pos == g->len) {
            if (g->read >= NGX_HTTP_LLAMA_SESSION_GGUF_READ) {
                return NGX_DECLINED;
            }

            g->offset += g->len;

            got = pread(g->fd, g->buf, NGX_HTTP_LLAMA_SESSION_GGUF_BUF,
                        g->offset);

            if (got <= 0) {
                return NGX_DECLINED;
            }

            g->pos = 0;
            g->len = (size_t) got;
            g->read += got;
        }

        k = ngx_min(n, g->len - g->pos);

        if (p) {
            p = ngx_cpymem(p, g->buf + g->pos, k);
        }

        g->pos += k;
        n -= k;
    }

    return NGX_OK;
}


/* a value not looked at; an array of arrays only once deep */

static ngx_int_t
ngx_http_llama_session_gguf_skip(ngx_http_llama_session_gguf_t *g,
    uint32_t type, ngx_uint_t depth)
{
    uint32_t  etype;
    uint64_t  n, len;

    if (type == NGX_HTTP_LLAMA_SESSION_GGUF_STRING) {
        if (ngx_http_llama_session_gguf_get(g, &len, 8) != NGX_OK
            || len > NGX_HTTP_LLAMA_SESSION_GGUF_READ)
        {
            return NGX_DECLINED;
        }

        return ngx_http_llama_session_gguf_get(g, NULL, (size_t) len);
    }

    if (type != NGX_HTTP_LLAMA_SESSION_GGUF_ARRAY) {
        return ngx_http_llama_session_gguf_get(g, NULL,
                                       ngx_http_llama_session_gguf_size[type]);
    }

    if (depth > 1
        || ngx_http_llama_session_gguf_get(g, &etype, 4) != NGX_OK
        || ngx_http_llama_session_gguf_get(g, &n, 8) != NGX_OK
        || etype >= NGX_HTTP_LLAMA_SESSION_GGUF_TYPES
        || n > NGX_HTTP_LLAMA_SESSION_GGUF_READ)
    {
        return NGX_DECLINED;
    }

    if (ngx_http_llama_session_gguf_size[etype]) {
        return ngx_http_llama_session_gguf_get(g, NULL,
                                  (size_t) n
                                  * ngx_http_llama_session_gguf_size[etype]);
    }

    while (n--) {
        if (ngx_http_llama_session_gguf_skip(g, etype, depth + 1) != NGX_OK) {
            return NGX_DECLINED;
        }
    }

    return NGX_OK;
}


/* an integer (or a bool) of any width; a float or a string is not */

static ngx_int_t
ngx_http_llama_session_gguf_uint(ngx_http_llama_session_gguf_t *g,
    uint32_t type, uint64_t *v)
{
    u_char    b[8];
    size_t    size;
    uint64_t  x;

    size = (type < NGX_HTTP_LLAMA_SESSION_GGUF_TYPES)
           ? ngx_http_llama_session_gguf_size[type] : 0;

    if (size == 0) {
        return NGX_DECLINED;
    }

    if (type == NGX_HTTP_LLAMA_SESSION_GGUF_F32
        || type == NGX_HTTP_LLAMA_SESSION_GGUF_F64)
    {
        *v = 0;
        return ngx_http_llama_session_gguf_get(g, NULL, size);
    }

    if (ngx_http_llama_session_gguf_get(g, b, size) != NGX_OK) {
        return NGX_DECLINED;
    }

    x = 0;

    while (size--) {
        x = (x << 8) | b[size];
    }

    /* a negative signed value counts as none */

    if ((type == 1 && (x & 0x80)) || (type == 3 && (x & 0x8000))
        || (type == 5 && (x & 0x80000000)) || (type == 11 && (x >> 63)))
    {
        x = 0;
    }

    *v = x;

    return NGX_OK;
}


/*
 * Once per backend configuration (its fingerprint): the model's memory,
 * kept in the zone for the API and the metrics, and what it means for
 * the zone said once, with the fix.
 */

void
ngx_http_llama_session_memory_learn(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char                           path[NGX_HTTP_LLAMA_SESSION_PATH_SHOW + 1];
    ngx_log_t                       *log;
    ngx_uint_t                       level;
    ngx_http_llama_session_sh_t     *sh;
    ngx_http_llama_session_zone_t   *zone;
    ngx_http_llama_session_memory_t  mem;

    zone = ctx->zone;
    sh = zone->sh;
    log = r->connection->log;

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (sh->memory_known
        && ngx_memcmp(sh->memory_fp, ctx->job->fp,
                      NGX_HTTP_LLAMA_SESSION_FP_LEN) == 0)
    {
        ngx_shmtx_unlock(&zone->shpool->mutex);
        return;
    }

    /* once: another worker that learns it too finds it known */
    sh->memory_known = 1;
    ngx_memcpy(sh->memory_fp, ctx->job->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);
    ngx_memzero(&sh->memory, sizeof(ngx_http_llama_session_memory_t));

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (ctx->job->props_model.len == 0
        || ctx->job->props_model.len >= NGX_HTTP_LLAMA_SESSION_PATH_SHOW)
    {
        return;
    }

    ngx_memcpy(path, ctx->job->props_model.data, ctx->job->props_model.len);
    path[ctx->job->props_model.len] = '\0';

    if (ngx_http_llama_session_gguf_memory(log, path, &mem) != NGX_OK) {
        return;
    }

    if (ctx->job->props_n_embd && mem.n_embd != ctx->job->props_n_embd) {
        ngx_log_error(NGX_LOG_INFO, log, 0,
                      "llama_session: \"%s\" here is not the model of zone "
                      "\"%V\" (embedding %uL, llama-server's %uL), its "
                      "memory is not known", path, &zone->name, mem.n_embd,
                      ctx->job->props_n_embd);
        return;
    }

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (ngx_memcmp(sh->memory_fp, ctx->job->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN)
        == 0)
    {
        sh->memory = mem;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    level = NGX_LOG_NOTICE;

    switch (mem.kind) {

    case NGX_HTTP_LLAMA_SESSION_MEMORY_SWA:
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: the model of zone \"%V\" (%s) has "
                      "sliding-window attention (%uD tokens): its slot "
                      "files keep only the window and help only when "
                      "llama-server runs with --swa-full; without it the "
                      "zone stops saving and restoring after three "
                      "re-primed restores in a row that bring nothing, "
                      "until llama-server restarts", &zone->name, mem.arch,
                      mem.window);
        break;

    case NGX_HTTP_LLAMA_SESSION_MEMORY_HYBRID:
    case NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT:
        if (!zone->reprime) {
            level = NGX_LOG_WARN;
        }

        ngx_log_error(level, log, 0,
                      "llama_session: the model of zone \"%V\" (%s) has %s "
                      "memory: a restore is reused only when the next prompt "
                      "extends all of it, %s", &zone->name, mem.arch,
                      ngx_http_llama_session_memory_name(mem.kind),
                      zone->reprime
                      ? "which the re-prime before each save makes so"
                      : "and the zone has reprime=off: set reprime=on");
        break;

    default:
        ngx_log_error(NGX_LOG_NOTICE, log, 0,
                      "llama_session: the model of zone \"%V\" (%s) has "
                      "full attention", &zone->name, mem.arch);
    }
}
