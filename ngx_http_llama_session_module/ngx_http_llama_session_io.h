
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The store's file calls off the event loop: the functions of
 * ngx_http_llama_session_io.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_IO_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_IO_H_INCLUDED_


#include "ngx_http_llama_session.h"


typedef struct ngx_http_llama_session_io_s  ngx_http_llama_session_io_t;

typedef void (*ngx_http_llama_session_io_pt)(ngx_http_llama_session_io_t *io);


struct ngx_http_llama_session_io_s {
    ngx_pool_t                     *pool;       /* its own: it may outlive
                                                   its waiter */
    ngx_log_t                       log;        /* a copy, for the same */
    ngx_http_llama_session_zone_t  *zone;
    ngx_http_llama_session_io_pt    work;       /* the file calls, in a
                                                   thread */
    ngx_http_llama_session_io_pt    late;       /* in the event loop, once
                                                   done after its waiter
                                                   went on; NULL: nothing */
    ngx_event_t                    *wake;       /* the waiter's; NULL once
                                                   it went on */
    ngx_msec_t                      start;
    void                           *data;       /* the call's, in pool */
#if (NGX_THREADS)
    ngx_thread_task_t              *task;
#endif
    ngx_queue_t                     queue;      /* in the backlog (io.c) */
    unsigned                        done:1;
    unsigned                        left:1;     /* no waiter (any more) */
    unsigned                        late_log:1; /* its waiter went on
                                                   for its bound */
};


void ngx_http_llama_session_io_init_process(void);
void ngx_http_llama_session_io_exit_process(void);
ngx_uint_t ngx_http_llama_session_io_threads(
    ngx_http_llama_session_zone_t *zone);
ngx_http_llama_session_io_t *ngx_http_llama_session_io_create(
    ngx_http_llama_session_zone_t *zone, ngx_log_t *log, size_t size);
ngx_int_t ngx_http_llama_session_io_post(ngx_http_llama_session_io_t *io,
    ngx_event_t *wake);
ngx_uint_t ngx_http_llama_session_io_pending(ngx_http_llama_session_io_t *io,
    ngx_event_t *wake);
void ngx_http_llama_session_io_leave(ngx_http_llama_session_io_t *io,
    ngx_log_t *log, const char *what);
void ngx_http_llama_session_io_free(ngx_http_llama_session_io_t *io);
ngx_int_t ngx_http_llama_session_io_wait(ngx_atomic_t *done,
    ngx_atomic_uint_t seq, ngx_msec_t max);


#endif /* _NGX_HTTP_LLAMA_SESSION_IO_H_INCLUDED_ */
