
/*
 * libFuzzer harness for the identity of a request: any bytes as the body
 * of a POST to an inference endpoint, through the module's own
 * ngx_http_llama_session_identify() (ngx_http_llama_session_body.c,
 * #included here so its statics are at hand): the body read from its
 * buffers, the top-level scan, the dotted id fields, their types, the id
 * cap, the system prompt's digest (cJSON and SHA-256 through OpenSSL's
 * EVP), and the key.  Three configurations per input:
 *
 *   A: the default id fields, fallback system_hash, the body in one
 *      buffer that ends right before an unmapped page;
 *   B: other fields (deeper paths), a namespace, body_max 3000, the body
 *      split across three buffers (one empty), so it is copied whole;
 *   C: 16 fields, the most the configuration allows, some of them also
 *      names the module looks for itself, fallback off.
 *
 * Each is run twice: the second run must take the worker's cached key and
 * give the same answer.  What comes out is checked: an id of 1 to 256
 * bytes, a key of [A-Za-z0-9_-] ending with "-" and 24 hex digits.
 * See fuzz/run.sh.
 */


#include "ngx_http_llama_session_body.c"

#include "fuzz_ngx.h"


#define FUZZ_BODY_SPLIT  1
#define FUZZ_NAMESPACE   2


typedef struct {
    ngx_str_t   *fields;
    ngx_uint_t   nfields;
    ngx_uint_t   fallback;
    size_t       body_max;
    ngx_uint_t   flags;
} fuzz_config_t;


static ngx_str_t  fuzz_headers[] = {
    ngx_string("x-session-id"),
    ngx_string("x-conversation-id"),
    ngx_string("session-id"),
};

static ngx_str_t  fuzz_fields_a[] = {
    ngx_string("session_id"),
    ngx_string("conversation_id"),
    ngx_string("chat_id"),
    ngx_string("prompt_cache_key"),
    ngx_string("metadata.session_id"),
};

static ngx_str_t  fuzz_fields_b[] = {
    ngx_string("user"),
    ngx_string("metadata.user_id"),
    ngx_string("extra_body.metadata.session_id"),
};

static ngx_str_t  fuzz_fields_c[NGX_HTTP_LLAMA_SESSION_FIELDS_MAX] = {
    ngx_string("model"),
    ngx_string("system"),
    ngx_string("a.b.c.d.e.f.g.h"),
    ngx_string("metadata.session_id.id"),
    ngx_string("session_id"),
    ngx_string("session_id.x"),
    ngx_string("id"),
    ngx_string("n"),
    ngx_string("options.session"),
    ngx_string("metadata.x"),
    ngx_string("metadata.y"),
    ngx_string("metadata.z.z"),
    ngx_string("conversation.id"),
    ngx_string("thread"),
    ngx_string("chat_id"),
    ngx_string("user"),
};

static fuzz_config_t  fuzz_configs[] = {
    { fuzz_fields_a, 5, NGX_HTTP_LLAMA_SESSION_FALLBACK_SYSTEM,
      16 * 1024 * 1024, 0 },
    { fuzz_fields_b, 3, NGX_HTTP_LLAMA_SESSION_FALLBACK_SYSTEM,
      3000, FUZZ_BODY_SPLIT|FUZZ_NAMESPACE },
    { fuzz_fields_c, NGX_HTTP_LLAMA_SESSION_FIELDS_MAX,
      NGX_HTTP_LLAMA_SESSION_FALLBACK_OFF, 16 * 1024 * 1024, 0 },
};


static ngx_http_complex_value_t  fuzz_namespace;

/* the request's path (the differential target sets others) */
static ngx_str_t  fuzz_uri = ngx_string("/v1/chat/completions");

/*
 * its dialect, as dialect.c's rows give it: chat completions, or
 * Anthropic's /v1/messages (its "system", canonical, max_tokens alone)
 */
static ngx_http_llama_session_dialect_t  fuzz_dialects[] = {
    { ngx_string("/chat/completions"), 0, 0,
      ngx_string("system"), ngx_string("messages"),
      "/v1/chat/completions", NGX_HTTP_LLAMA_SESSION_PRIME_CHAT,
      NULL, NULL, NULL, NULL, 0, 0, 1, 0, 0 },
    { ngx_string("/v1/messages"), 0, 0,
      ngx_string("system"), ngx_string("messages"),
      "/v1/messages", NGX_HTTP_LLAMA_SESSION_PRIME_ANTHROPIC,
      NULL, NULL, NULL, NULL, 0, 1, 0, 1, 1 }
};


/*
 * The rest of the module that identify() calls (router mode's zone choice
 * is body.c's own and finds no zone list: the request keeps its zone):
 * the messages' digests of miss.c (compiled in, fuzzed with the rest)
 * with a stand-in for nginx's MurmurHash2 that reads every byte it is given, and the slot's
 * copy of them, which identify() never makes.
 */

uint32_t
ngx_murmur_hash2(u_char *data, size_t len)
{
    uint32_t  h;

    for (h = (uint32_t) len; len--; data++) {
        h = h * 31 + *data;
    }

    return h;
}


void
ngx_http_llama_session_slot_msgs(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t n, u_char *key, size_t len, ngx_http_llama_session_msg_t *msgs,
    ngx_uint_t nmsgs, ngx_uint_t prompt_tokens)
{
    fuzz_unexpected("ngx_http_llama_session_slot_msgs");
}


/* identity by extension (ext.c) needs a zone: the harness has none */

ngx_int_t
ngx_http_llama_session_extension(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    return NGX_OK;
}


void
ngx_http_llama_session_ext_record(ngx_http_llama_session_ctx_t *ctx)
{
    fuzz_unexpected("ngx_http_llama_session_ext_record");
}


/* models= zones (models.c): the harness has no zone */

ngx_uint_t
ngx_http_llama_session_model_valid(u_char *model, size_t len)
{
    fuzz_unexpected("ngx_http_llama_session_model_valid");
    return 0;
}


ngx_http_llama_session_zone_t *
ngx_http_llama_session_models_find(ngx_http_llama_session_zone_t *lead,
    u_char *model, size_t len)
{
    fuzz_unexpected("ngx_http_llama_session_models_find");
    return NULL;
}


/* the only complex value the harness configures: llama_session_namespace */

ngx_int_t
ngx_http_complex_value(ngx_http_request_t *r, ngx_http_complex_value_t *val,
    ngx_str_t *value)
{
    if (val != &fuzz_namespace) {
        fuzz_unexpected("ngx_http_complex_value");
    }

    ngx_str_set(value, "tenant-a");

    return NGX_OK;
}


static void
fuzz_check(ngx_int_t rc, ngx_http_llama_session_ctx_t *ctx)
{
    u_char  c;
    size_t  i, n;

    if (rc == NGX_ABORT) {
        /* only an id too long is the client's error */
        return;
    }

    if (rc != NGX_OK) {
        fprintf(stderr, "fuzz: identify returned %d\n", (int) rc);
        __builtin_trap();
    }

    if (ctx->nmsgs > NGX_HTTP_LLAMA_SESSION_MSGS_MAX
        || (ctx->nmsgs && ctx->msgs == NULL))
    {
        fprintf(stderr, "fuzz: %u messages\n", (unsigned) ctx->nmsgs);
        __builtin_trap();
    }

    if (ctx->id.len == 0 || ctx->id.len > NGX_HTTP_LLAMA_SESSION_ID_MAX
        || ctx->source.len == 0
        || ctx->key_len == 0 || ctx->key_len > NGX_HTTP_LLAMA_SESSION_KEY_MAX)
    {
        fprintf(stderr, "fuzz: id %zu, source %zu, key %zu bytes\n",
                ctx->id.len, ctx->source.len, ctx->key_len);
        __builtin_trap();
    }

    for (i = 0; i < ctx->key_len; i++) {
        c = ctx->key[i];

        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
              || (c >= '0' && c <= '9') || c == '-' || c == '_'))
        {
            fprintf(stderr, "fuzz: byte %02x in the key\n", c);
            __builtin_trap();
        }
    }

    if (ctx->default_session) {
        return;
    }

    /* "<up to 32 of the id>-<24 hex digits>" */

    n = NGX_HTTP_LLAMA_SESSION_HASH_HEX;

    if (ctx->key_len < n + 2
        || ctx->key_len > NGX_HTTP_LLAMA_SESSION_SAFE_MAX + 1 + n
        || ctx->key[ctx->key_len - n - 1] != '-')
    {
        fprintf(stderr, "fuzz: key \"%.*s\"\n", (int) ctx->key_len,
                ctx->key);
        __builtin_trap();
    }

    for (i = ctx->key_len - n; i < ctx->key_len; i++) {
        c = ctx->key[i];

        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
            __builtin_trap();
        }
    }

    if (ctx->source.len == sizeof("system_hash") - 1
        && ngx_strncmp(ctx->source.data, "system_hash", ctx->source.len) == 0)
    {
        if (ctx->id.len != sizeof("sys-") - 1 + 16
            || ngx_strncmp(ctx->id.data, "sys-", 4) != 0)
        {
            __builtin_trap();
        }

        return;
    }

    /* else "body:<one of the configured fields>" */

    if (ctx->source.len <= sizeof("body:") - 1
        || ngx_strncmp(ctx->source.data, "body:", 5) != 0)
    {
        fprintf(stderr, "fuzz: source \"%.*s\"\n", (int) ctx->source.len,
                ctx->source.data);
        __builtin_trap();
    }
}


static ngx_int_t
fuzz_identify(fuzz_config_t *conf, u_char *data, size_t size,
    ngx_http_llama_session_ctx_t *ctx)
{
    size_t                              k;
    ngx_buf_t                          *b;
    ngx_uint_t                          i, n;
    ngx_array_t                         headers, fields;
    ngx_chain_t                        *cl, **ll;
    ngx_connection_t                    c;
    ngx_http_request_t                  r;
    ngx_http_request_body_t             rb;
    ngx_http_llama_session_loc_conf_t   llcf;
    void                               *loc_conf[1];

    ngx_memzero(&llcf, sizeof(ngx_http_llama_session_loc_conf_t));

    headers.elts = fuzz_headers;
    headers.nelts = sizeof(fuzz_headers) / sizeof(ngx_str_t);
    headers.size = sizeof(ngx_str_t);
    headers.nalloc = headers.nelts;
    headers.pool = fuzz_pool;

    fields = headers;
    fields.elts = conf->fields;
    fields.nelts = conf->nfields;
    fields.nalloc = conf->nfields;

    llcf.id_headers = &headers;
    llcf.id_fields = &fields;
    llcf.fallback = conf->fallback;
    llcf.body_max = conf->body_max;
    llcf.namespace = (conf->flags & FUZZ_NAMESPACE) ? &fuzz_namespace : NULL;
    llcf.enable = 1;
    llcf.canonical = 1;

    loc_conf[0] = &llcf;

    fuzz_request(&r, &c);
    r.uri = fuzz_uri;
    r.loc_conf = loc_conf;
    r.method = NGX_HTTP_POST;

    /* no header: an empty list */
    r.headers_in.headers.last = &r.headers_in.headers.part;
    r.headers_in.headers.size = sizeof(ngx_table_elt_t);
    r.headers_in.headers.pool = fuzz_pool;

    /* the body, in memory, as ngx_http_read_client_request_body() left it */

    ngx_memzero(&rb, sizeof(ngx_http_request_body_t));
    r.request_body = &rb;

    n = (conf->flags & FUZZ_BODY_SPLIT) ? 3 : 1;
    ll = &rb.bufs;

    for (i = 0; i < n; i++) {
        b = ngx_calloc_buf(fuzz_pool);
        cl = ngx_alloc_chain_link(fuzz_pool);

        if (n == 1) {
            b->pos = fuzz_guarded(data, size);
            b->last = b->pos + size;

        } else {
            /* halves, an empty buffer between them */
            k = (i == 0) ? size / 2 : (i == 1) ? 0 : size - size / 2;

            b->pos = ngx_pnalloc(fuzz_pool, k);
            b->last = ngx_cpymem(b->pos, data + (i ? size / 2 : 0), k);
        }

        b->start = b->pos;
        b->end = b->last;
        b->memory = 1;
        b->last_buf = (i == n - 1);

        cl->buf = b;
        cl->next = NULL;
        *ll = cl;
        ll = &cl->next;
    }

    ngx_memzero(ctx, sizeof(ngx_http_llama_session_ctx_t));
    ctx->request = &r;
    ctx->dialect = &fuzz_dialects[fuzz_uri.len >= 9
                                  && ngx_strncmp(fuzz_uri.data + fuzz_uri.len
                                                 - 9, "/messages", 9) == 0];
    ctx->job = ngx_pcalloc(fuzz_pool, sizeof(ngx_http_llama_session_job_t));
    ctx->warm = ngx_pcalloc(fuzz_pool, sizeof(ngx_http_llama_session_warm_t));
    ctx->job->slot_tokens = -1;
    ctx->job->slot_task = -1;

    return ngx_http_llama_session_identify(&r, ctx);
}


#ifndef FUZZ_IDENTITY_NO_MAIN

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ngx_int_t                      rc, rc2;
    ngx_uint_t                     i;
    ngx_http_llama_session_ctx_t   ctx, ctx2;

    /* the worker's cache of the last key starts empty for every input */
    ngx_http_llama_session_last_len = 0;

    for (i = 0; i < sizeof(fuzz_configs) / sizeof(fuzz_config_t); i++) {

        rc = fuzz_identify(&fuzz_configs[i], (u_char *) data, size, &ctx);
        fuzz_check(rc, &ctx);

        /* again: the key from the cache, the same answer */

        rc2 = fuzz_identify(&fuzz_configs[i], (u_char *) data, size, &ctx2);
        fuzz_check(rc2, &ctx2);

        if (rc != rc2
            || (rc == NGX_OK
                && (ctx.id.len != ctx2.id.len
                    || ngx_memcmp(ctx.id.data, ctx2.id.data, ctx.id.len)
                       != 0
                    || ctx.key_len != ctx2.key_len
                    || ngx_memcmp(ctx.key, ctx2.key, ctx.key_len) != 0)))
        {
            fprintf(stderr, "fuzz: configuration %u: a second identify "
                    "differs\n", (unsigned) i);
            __builtin_trap();
        }

        fuzz_pool_reset();
    }

    return 0;
}

#endif /* FUZZ_IDENTITY_NO_MAIN */
