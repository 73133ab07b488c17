
/*
 * The few pieces of nginx that the identity and replies harnesses need
 * besides nginx's own ngx_string.c (see fuzz/fuzz_ngx.c and fuzz/run.sh).
 */


#ifndef _FUZZ_NGX_H_INCLUDED_
#define _FUZZ_NGX_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>


/* any non-NULL pool: every allocation is a malloc() of its own */
extern ngx_pool_t  *fuzz_pool;

/* a log at debug level: every ngx_log_error() line is formatted */
extern ngx_log_t   *fuzz_log;


/* frees all that was allocated from fuzz_pool since the last call */
void fuzz_pool_reset(void);

/*
 * a copy of data whose last byte is the last before an unmapped page: a
 * read past its end faults even in code that is not instrumented (cJSON)
 */
u_char *fuzz_guarded(const u_char *data, size_t size);

/* a main request on its connection, with the harness's pool and log */
void fuzz_request(ngx_http_request_t *r, ngx_connection_t *c);

/* aborts with the name of an nginx function the harness did not expect */
void fuzz_unexpected(const char *name);


#endif /* _FUZZ_NGX_H_INCLUDED_ */
