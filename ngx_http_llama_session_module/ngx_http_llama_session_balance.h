
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Routing across owners by where a session's state is and how loaded each
 * owner is: the functions of ngx_http_llama_session_balance.c, and what
 * remote owners tell an edge (ngx_http_llama_session_told.c).
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_BALANCE_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_BALANCE_H_INCLUDED_


#include "ngx_http_llama_session.h"


/* the peers of an upstream: a bit each in one word */
#define NGX_HTTP_LLAMA_SESSION_BALANCE_MAX     (8 * sizeof(uintptr_t))


/*
 * A remote owner as it last told the edge (told.c), in the edge's shared
 * memory, written without a lock: a torn copy costs a restore, never a
 * wrong reply (the owner decides its slots)
 */

typedef struct {
    ngx_msec_t                      heard;      /* its last reply, 0: never */
    ngx_uint_t                      load;       /* in flight and waiting */
    ngx_uint_t                      slots;
    ngx_uint_t                      turn_ms;
    ngx_uint_t                      restore;    /* us a MiB, 0: unknown */
    ngx_uint_t                      prefill;    /* us a token, 0: unknown */
    ngx_uint_t                      shared;     /* its store is shared=on */
    uint32_t                        crc[NGX_HTTP_LLAMA_SESSION_SLOTS_MAX];
    u_char                          saved[NGX_HTTP_LLAMA_SESSION_SLOTS_MAX];
    ngx_msec_t                      used[NGX_HTTP_LLAMA_SESSION_SLOTS_MAX];
    ngx_atomic_uint_t               sent;       /* the edge's turns to it
                                                   that its load counts */
} ngx_http_llama_session_copy_t;


typedef struct {
    uint32_t                        hash;
    ngx_uint_t                      peer;
} ngx_http_llama_session_point_t;


typedef struct {
    ngx_http_upstream_srv_conf_t   *uscf;
    ngx_uint_t                      factor;     /* of the mean, x 100 */
    ngx_uint_t                      spill;
    ngx_uint_t                      residency;  /* off: bounded loads */
    ngx_int_t                       key;        /* $llama_session_key */
    ngx_uint_t                      npeers;
    ngx_http_llama_session_zone_t **zones;      /* by peer */
    struct sockaddr               **addrs;      /* ... and its address */
    socklen_t                      *socklens;
    ngx_uint_t                      shared;     /* every zone shared=on */
    ngx_uint_t                      remote;     /* owners elsewhere */
    ngx_shm_zone_t                 *copies;     /* ... and what they told: */
    ngx_http_llama_session_copy_t  *told;       /* by peer, in shared memory */
    ngx_atomic_t                   *sent;       /* ... the turns sent it */
    ngx_msec_t                      poll;       /* the owners not heard of */
    ngx_uint_t                      npoints;
    ngx_http_llama_session_point_t *points;
} ngx_http_llama_session_balance_t;


char *ngx_http_llama_session_balance(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
ngx_int_t ngx_http_llama_session_balance_owner(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_t *zone);
ngx_http_llama_session_balance_t *ngx_http_llama_session_balance_of(
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_upstream_srv_conf_t *us);


#endif /* _NGX_HTTP_LLAMA_SESSION_BALANCE_H_INCLUDED_ */
