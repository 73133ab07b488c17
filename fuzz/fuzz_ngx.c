
/*
 * What the identity and replies harnesses take of nginx besides its own
 * ngx_string.c (ngx_sprintf, ngx_slprintf, ngx_snprintf, ngx_hex_dump...):
 * a pool whose every allocation is a malloc() of its own, so that
 * AddressSanitizer sees the bounds of each, freed after each input; a log
 * that formats every line as nginx does, without writing it anywhere
 * (FUZZ_NGX_LOG=1 in the environment prints them); the globals the module's
 * files refer to; and nginx functions that no fuzzed path should reach,
 * which abort.
 */


#include <sys/mman.h>

#include "fuzz_ngx.h"


#define FUZZ_GUARDED_MAX  (1024 * 1024)


volatile ngx_cycle_t            *ngx_cycle;

ngx_module_t                     ngx_http_llama_session_module;
ngx_module_t                     ngx_http_core_module;
ngx_http_output_body_filter_pt   ngx_http_top_body_filter;


static ngx_pool_t   fuzz_pool_storage;
ngx_pool_t         *fuzz_pool = &fuzz_pool_storage;

static ngx_log_t    fuzz_log_storage = {
    .log_level = NGX_LOG_DEBUG | NGX_LOG_DEBUG_ALL
};
ngx_log_t          *fuzz_log = &fuzz_log_storage;

static void       **fuzz_allocs;
static size_t       fuzz_nallocs;
static size_t       fuzz_allocs_max;

static u_char      *fuzz_guard;     /* the unmapped page */


void
fuzz_unexpected(const char *name)
{
    fprintf(stderr, "fuzz: unexpected call of %s()\n", name);
    abort();
}


static void *
fuzz_alloc(size_t size)
{
    void   *p, **a;
    size_t  n;

    if (fuzz_nallocs == fuzz_allocs_max) {
        n = fuzz_allocs_max ? 2 * fuzz_allocs_max : 64;

        a = realloc(fuzz_allocs, n * sizeof(void *));
        if (a == NULL) {
            abort();
        }

        fuzz_allocs = a;
        fuzz_allocs_max = n;
    }

    p = malloc(size ? size : 1);
    if (p == NULL) {
        abort();
    }

    fuzz_allocs[fuzz_nallocs++] = p;

    return p;
}


void
fuzz_pool_reset(void)
{
    while (fuzz_nallocs) {
        free(fuzz_allocs[--fuzz_nallocs]);
    }
}


void *
ngx_palloc(ngx_pool_t *pool, size_t size)
{
    return fuzz_alloc(size);
}


void *
ngx_pnalloc(ngx_pool_t *pool, size_t size)
{
    return fuzz_alloc(size);
}


void *
ngx_pcalloc(ngx_pool_t *pool, size_t size)
{
    return memset(fuzz_alloc(size), 0, size);
}


/* as nginx's: the caller's, freed with ngx_free() (ngx_sort(), gguf.c) */

void *
ngx_alloc(size_t size, ngx_log_t *log)
{
    void  *p;

    p = malloc(size ? size : 1);
    if (p == NULL) {
        abort();
    }

    return p;
}


/* as in src/core/ngx_buf.c */

ngx_buf_t *
ngx_create_temp_buf(ngx_pool_t *pool, size_t size)
{
    ngx_buf_t  *b;

    b = ngx_calloc_buf(pool);
    if (b == NULL) {
        return NULL;
    }

    b->start = ngx_palloc(pool, size);
    if (b->start == NULL) {
        return NULL;
    }

    b->pos = b->start;
    b->last = b->start;
    b->end = b->last + size;
    b->temporary = 1;

    return b;
}


ngx_chain_t *
ngx_alloc_chain_link(ngx_pool_t *pool)
{
    return ngx_palloc(pool, sizeof(ngx_chain_t));
}


/* formatted as ngx_log_error_core() does, into a buffer of the same size */

void
ngx_log_error_core(ngx_uint_t level, ngx_log_t *log, ngx_err_t err,
    const char *fmt, ...)
{
    u_char   errstr[NGX_MAX_ERROR_STR], *p, *last;
    va_list  args;

    last = errstr + NGX_MAX_ERROR_STR;

    p = ngx_slprintf(errstr, last, "[%ui] ", level);

    va_start(args, fmt);
    p = ngx_vslprintf(p, last, fmt, args);
    va_end(args);

    if (err) {
        p = ngx_slprintf(p, last, " (%d)", err);
    }

    if (p > last) {
        fprintf(stderr, "fuzz: a log line ran past its buffer\n");
        abort();
    }

    if (getenv("FUZZ_NGX_LOG")) {
        fprintf(stderr, "%.*s\n", (int) (p - errstr), errstr);
    }
}


u_char *
fuzz_guarded(const u_char *data, size_t size)
{
    u_char  *p, *start;
    size_t   page;

    if (size > FUZZ_GUARDED_MAX) {
        p = ngx_pnalloc(fuzz_pool, size);
        return memcpy(p, data, size);
    }

    if (fuzz_guard == NULL) {
        page = (size_t) sysconf(_SC_PAGESIZE);

        start = mmap(NULL, FUZZ_GUARDED_MAX + page, PROT_READ|PROT_WRITE,
                     MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
        if (start == MAP_FAILED) {
            abort();
        }

        fuzz_guard = start + FUZZ_GUARDED_MAX;

        if (mprotect(fuzz_guard, page, PROT_NONE) != 0) {
            abort();
        }
    }

    p = fuzz_guard - size;

    if (size) {
        memcpy(p, data, size);
    }

    return p;
}


/* not on any fuzzed path */

ssize_t
ngx_read_file(ngx_file_t *file, u_char *buf, size_t size, off_t offset)
{
    fuzz_unexpected("ngx_read_file");
    return NGX_ERROR;
}


/* arrays in the harness's pool (ngx_array.c's, without the pool's tricks) */

ngx_array_t *
ngx_array_create(ngx_pool_t *p, ngx_uint_t n, size_t size)
{
    ngx_array_t  *a;

    a = ngx_palloc(p, sizeof(ngx_array_t));
    if (a == NULL) {
        return NULL;
    }

    a->elts = ngx_palloc(p, n * size);
    if (a->elts == NULL) {
        return NULL;
    }

    a->nelts = 0;
    a->size = size;
    a->nalloc = n;
    a->pool = p;

    return a;
}


void *
ngx_array_push(ngx_array_t *a)
{
    void  *elts;

    if (a->nelts == a->nalloc) {
        elts = ngx_palloc(a->pool, 2 * a->nalloc * a->size);
        if (elts == NULL) {
            return NULL;
        }

        ngx_memcpy(elts, a->elts, a->nelts * a->size);
        a->elts = elts;
        a->nalloc *= 2;
    }

    return (u_char *) a->elts + a->size * a->nelts++;
}


/* the body filters' chains: the harnesses call no filter */

ngx_int_t
ngx_chain_add_copy(ngx_pool_t *pool, ngx_chain_t **chain, ngx_chain_t *in)
{
    fuzz_unexpected("ngx_chain_add_copy");
    return NGX_ERROR;
}


void
ngx_chain_update_chains(ngx_pool_t *p, ngx_chain_t **free,
    ngx_chain_t **busy, ngx_chain_t **out, ngx_buf_tag_t tag)
{
    fuzz_unexpected("ngx_chain_update_chains");
}


/* no harness has a body in a file: nothing is written */

ssize_t
ngx_write_file(ngx_file_t *file, u_char *buf, size_t size, off_t offset)
{
    fuzz_unexpected("ngx_write_file");
    return NGX_ERROR;
}


/* the pool's memory goes at fuzz_pool_reset(), all of it */

ngx_int_t
ngx_pfree(ngx_pool_t *pool, void *p)
{
    return NGX_DECLINED;
}


/* the harnesses' requests have no arguments */

ngx_int_t
ngx_http_arg(ngx_http_request_t *r, u_char *name, size_t len,
    ngx_str_t *value)
{
    return NGX_DECLINED;
}


ngx_uint_t
ngx_hash_key(u_char *data, size_t len)
{
    fuzz_unexpected("ngx_hash_key");
    return 0;
}


void *
ngx_list_push(ngx_list_t *list)
{
    fuzz_unexpected("ngx_list_push");
    return NULL;
}


ngx_int_t
ngx_http_subrequest(ngx_http_request_t *r, ngx_str_t *uri, ngx_str_t *args,
    ngx_http_request_t **psr, ngx_http_post_subrequest_t *ps,
    ngx_uint_t flags)
{
    fuzz_unexpected("ngx_http_subrequest");
    return NGX_ERROR;
}


void
fuzz_request(ngx_http_request_t *r, ngx_connection_t *c)
{
    ngx_memzero(c, sizeof(ngx_connection_t));
    c->log = fuzz_log;

    ngx_memzero(r, sizeof(ngx_http_request_t));
    r->main = r;
    r->pool = fuzz_pool;
    r->connection = c;
}
