
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The store's file calls off the event loop.  A store on NFS or CephFS
 * can stop answering (a hard mount waits for its server): a file call made
 * in the event loop would hold every connection of the worker, also those
 * that never needed the store.  As nginx's cache does with aio threads, a
 * look at the store or a change of it runs as a task in an nginx thread
 * pool (the zone's thread_pool=, nginx's "default" one unless named): the
 * request waits for its task, the worker serves everyone else.
 *
 * A task has a pool of its own and copies of what it needs, never the
 * request's memory, so its waiter may go on without it: after the zone's
 * store_timeout= the request goes on as if the store had nothing (fresh,
 * or unsaved), logged at warn and counted, while the call finishes in its
 * thread; then late() applies what still matters and the task's pool
 * goes.  The shared memory is never locked across a file call.  Where
 * nginx was built without threads the work runs where it is posted, as
 * before (nginx -t says so).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_io.h"
#include "ngx_http_llama_session_shm.h"


#if (NGX_THREADS)
static ngx_int_t ngx_http_llama_session_io_task(
    ngx_http_llama_session_io_t *io);
static ngx_uint_t ngx_http_llama_session_io_behind(ngx_thread_pool_t *tp);
static void ngx_http_llama_session_io_later(ngx_http_llama_session_io_t *io);
static void ngx_http_llama_session_io_drain(ngx_log_t *log);
static void ngx_http_llama_session_io_backlog_handler(ngx_event_t *ev);
static void ngx_http_llama_session_io_thread(void *data, ngx_log_t *log);
static void ngx_http_llama_session_io_event(ngx_event_t *ev);
#endif


/* thread pools run in workers only, once nginx started them */
static ngx_uint_t  ngx_http_llama_session_io_ready;


#if (NGX_THREADS)

/*
 * The backlog: tasks a pool's queue could not take (max_queue, 65536 by
 * default: a store silent for long), posted again in their order, never
 * run in the event loop; another pool's tasks pass them.  Beyond
 * NGX_HTTP_LLAMA_SESSION_IO_BACKLOG_MAX the oldest that nobody waits for
 * is given up.
 */

#define NGX_HTTP_LLAMA_SESSION_IO_BACKLOG_MAX  4096

static ngx_queue_t       ngx_http_llama_session_io_backlog;
static ngx_uint_t        ngx_http_llama_session_io_backlogged;
static ngx_msec_t        ngx_http_llama_session_io_backoff;
static ngx_event_t       ngx_http_llama_session_io_backlog_ev;
static ngx_connection_t  ngx_http_llama_session_io_backlog_conn;

#endif


void
ngx_http_llama_session_io_init_process(void)
{
    ngx_http_llama_session_io_ready = 1;

#if (NGX_THREADS)
    ngx_queue_init(&ngx_http_llama_session_io_backlog);
#endif
}


/* a worker exits: the backlog's tasks run here, as its threads end theirs */

void
ngx_http_llama_session_io_exit_process(void)
{
#if (NGX_THREADS)
    ngx_queue_t                  *q;
    ngx_http_llama_session_io_t  *io;

    if (!ngx_http_llama_session_io_ready) {
        return;
    }

    while (!ngx_queue_empty(&ngx_http_llama_session_io_backlog)) {
        q = ngx_queue_head(&ngx_http_llama_session_io_backlog);
        ngx_queue_remove(q);

        io = ngx_queue_data(q, ngx_http_llama_session_io_t, queue);

        io->work(io);

        if (io->late) {
            io->late(io);
        }

        ngx_destroy_pool(io->pool);
    }
#endif
}


/* does the zone's store have threads for its calls here? */

ngx_uint_t
ngx_http_llama_session_io_threads(ngx_http_llama_session_zone_t *zone)
{
#if (NGX_THREADS)
    return zone->tp != NULL && ngx_http_llama_session_io_ready;
#else
    return 0;
#endif
}


ngx_http_llama_session_io_t *
ngx_http_llama_session_io_create(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log, size_t size)
{
    ngx_pool_t                   *pool;
    ngx_http_llama_session_io_t  *io;

    pool = ngx_create_pool(ngx_max(1024, size + 512), log);
    if (pool == NULL) {
        return NULL;
    }

    io = ngx_pcalloc(pool, sizeof(ngx_http_llama_session_io_t));
    if (io == NULL) {
        ngx_destroy_pool(pool);
        return NULL;
    }

    if (size) {
        io->data = ngx_pcalloc(pool, size);
        if (io->data == NULL) {
            ngx_destroy_pool(pool);
            return NULL;
        }
    }

    io->pool = pool;
    io->zone = zone;

    /* the request's connection may be gone when the call ends */
    io->log = *log;
    io->log.handler = NULL;
    io->log.data = NULL;
    io->log.action = NULL;
    pool->log = &io->log;

    return io;
}


/*
 * Runs io->work in the zone's thread pool and wakes "wake" when it is
 * done, or after the zone's store_timeout=, whichever comes first (the
 * waiter tells by io->done); wake NULL: nobody waits, the task cleans up
 * after itself.  NGX_AGAIN: posted, or in the backlog when the pool's
 * queue is full; NGX_OK: done here (no threads); NGX_ERROR: not run.
 */

ngx_int_t
ngx_http_llama_session_io_post(ngx_http_llama_session_io_t *io,
    ngx_event_t *wake)
{
#if (NGX_THREADS)
    ngx_int_t  rc;

    if (ngx_http_llama_session_io_threads(io->zone)) {
        io->start = ngx_current_msec;

        rc = ngx_http_llama_session_io_task(io);

        if (rc == NGX_ERROR) {
            return NGX_ERROR;
        }

        if (rc == NGX_BUSY) {
            /*
             * the pool's queue is full: later, its waiter waits as long;
             * not given up there, "left" is not set yet
             */
            ngx_http_llama_session_io_later(io);
        }

        io->wake = wake;

        if (wake == NULL) {
            io->left = 1;
            return NGX_AGAIN;
        }

        if (wake->timer_set) {
            ngx_del_timer(wake);
        }

        ngx_add_timer(wake, io->zone->store_timeout);

        return NGX_AGAIN;
    }
#endif

    io->work(io);
    io->done = 1;

    return NGX_OK;
}


/*
 * Is the waiter's call still running, within its bound?  Its wake event
 * is set (the bound's timer) or posted until the call is done or the
 * bound passed.
 */

ngx_uint_t
ngx_http_llama_session_io_pending(ngx_http_llama_session_io_t *io,
    ngx_event_t *wake)
{
    return io != NULL && !io->done && (wake->timer_set || wake->posted);
}


/*
 * The waiter goes on without the call (its bound passed: "what" says what
 * it does instead; or its request ended: NULL); the call finishes in its
 * thread and is cleaned up then.
 */

void
ngx_http_llama_session_io_leave(ngx_http_llama_session_io_t *io,
    ngx_log_t *log, const char *what)
{
    if (what) {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: the store of zone \"%V\" did not "
                      "answer within store_timeout=%M (%M ms): %s",
                      &io->zone->name, io->zone->store_timeout,
                      ngx_current_msec - io->start, what);

        ngx_http_llama_session_stat(&io->zone->sh->stats.store_timeouts);

        io->late_log = 1;
    }

    io->wake = NULL;

    if (io->done) {
        ngx_destroy_pool(io->pool);
        return;
    }

    io->left = 1;
}


void
ngx_http_llama_session_io_free(ngx_http_llama_session_io_t *io)
{
    ngx_destroy_pool(io->pool);
}


/*
 * In a task's thread: waits for a write that another thread runs (maybe
 * another worker's) to end, as it says by *done reaching seq, for max ms
 * at most.  NGX_OK: it ended; NGX_BUSY: not within max.
 */

ngx_int_t
ngx_http_llama_session_io_wait(ngx_atomic_t *done, ngx_atomic_uint_t seq,
    ngx_msec_t max)
{
    ngx_msec_t  waited;

    for (waited = 0; *done < seq; waited += 2) {
        if (waited >= max) {
            return NGX_BUSY;
        }

        ngx_msleep(2);
    }

    ngx_memory_barrier();

    return NGX_OK;
}


#if (NGX_THREADS)

/*
 * io's task to the zone's pool, after the backlog's: NGX_OK: posted;
 * NGX_BUSY: the queue is full, or the backlog not empty
 */

static ngx_int_t
ngx_http_llama_session_io_task(ngx_http_llama_session_io_t *io)
{
    ngx_thread_task_t  *task;

    if (io->task == NULL) {
        task = ngx_thread_task_alloc(io->pool, 0);
        if (task == NULL) {
            return NGX_ERROR;
        }

        task->ctx = io;
        task->handler = ngx_http_llama_session_io_thread;
        task->event.handler = ngx_http_llama_session_io_event;
        task->event.data = io;
        task->event.log = &io->log;

        io->task = task;

        if (ngx_http_llama_session_io_behind(io->zone->tp)) {
            /* the pool's changes keep their order */
            return NGX_BUSY;
        }
    }

    if (ngx_thread_task_post(io->zone->tp, io->task) != NGX_OK) {
        return NGX_BUSY;
    }

    return NGX_OK;
}


/* does the backlog hold a task of that pool? */

static ngx_uint_t
ngx_http_llama_session_io_behind(ngx_thread_pool_t *tp)
{
    ngx_queue_t                  *q;
    ngx_http_llama_session_io_t  *io;

    if (ngx_http_llama_session_io_backlogged == 0) {
        return 0;
    }

    for (q = ngx_queue_head(&ngx_http_llama_session_io_backlog);
         q != ngx_queue_sentinel(&ngx_http_llama_session_io_backlog);
         q = ngx_queue_next(q))
    {
        io = ngx_queue_data(q, ngx_http_llama_session_io_t, queue);

        if (io->zone->tp == tp) {
            return 1;
        }
    }

    return 0;
}


static void
ngx_http_llama_session_io_later(ngx_http_llama_session_io_t *io)
{
    ngx_queue_t                  *q;
    ngx_http_llama_session_io_t  *old;

    if (ngx_http_llama_session_io_backlogged == 0) {
        ngx_log_error(NGX_LOG_WARN, &io->log, 0,
                      "llama_session: the thread pool of zone \"%V\"'s "
                      "store has a full queue: its calls wait in the worker "
                      "and are posted again as it drains", &io->zone->name);

        ngx_http_llama_session_io_backoff = 1000;
    }

    ngx_queue_insert_tail(&ngx_http_llama_session_io_backlog, &io->queue);
    ngx_http_llama_session_io_backlogged++;

    if (ngx_http_llama_session_io_backlogged
        > NGX_HTTP_LLAMA_SESSION_IO_BACKLOG_MAX)
    {
        for (q = ngx_queue_head(&ngx_http_llama_session_io_backlog);
             q != ngx_queue_sentinel(&ngx_http_llama_session_io_backlog);
             q = ngx_queue_next(q))
        {
            old = ngx_queue_data(q, ngx_http_llama_session_io_t, queue);

            if (old->left) {
                ngx_log_error(NGX_LOG_ERR, &old->log, 0,
                              "llama_session: %ui calls on zone \"%V\"'s "
                              "store wait in the worker, the oldest is "
                              "given up: the store did not answer for %M ms",
                              ngx_http_llama_session_io_backlogged,
                              &old->zone->name,
                              ngx_current_msec - old->start);

                ngx_queue_remove(q);
                ngx_http_llama_session_io_backlogged--;
                ngx_destroy_pool(old->pool);
                break;
            }
        }
    }

    if (!ngx_http_llama_session_io_backlog_ev.timer_set) {
        ngx_http_llama_session_io_backlog_ev.handler =
                                    ngx_http_llama_session_io_backlog_handler;
        ngx_http_llama_session_io_backlog_ev.log = ngx_cycle->log;
        ngx_http_llama_session_io_backlog_ev.data =
                                    &ngx_http_llama_session_io_backlog_conn;
        ngx_http_llama_session_io_backlog_ev.cancelable = 1;
        ngx_http_llama_session_io_backlog_conn.fd = (ngx_socket_t) -1;

        ngx_add_timer(&ngx_http_llama_session_io_backlog_ev,
                      ngx_http_llama_session_io_backoff);
    }
}


/*
 * the backlog posted again, in its order, each pool's tasks until its
 * queue is full (of at most 8 pools full at once, the rest next time):
 * as soon as one of our tasks ends (its pool has room), else by the timer
 * (a pool that other modules' tasks fill)
 */

static void
ngx_http_llama_session_io_drain(ngx_log_t *log)
{
    ngx_uint_t                    i, n;
    ngx_queue_t                  *q, *next;
    ngx_thread_pool_t            *full[8];
    ngx_http_llama_session_io_t  *io;

    n = 0;

    for (q = ngx_queue_head(&ngx_http_llama_session_io_backlog);
         q != ngx_queue_sentinel(&ngx_http_llama_session_io_backlog);
         q = next)
    {
        next = ngx_queue_next(q);
        io = ngx_queue_data(q, ngx_http_llama_session_io_t, queue);

        for (i = 0; i < n && full[i] != io->zone->tp; i++) {
            /* void */
        }

        if (i < n) {
            continue;
        }

        if (ngx_thread_task_post(io->zone->tp, io->task) != NGX_OK) {
            if (n == 8) {
                break;
            }

            full[n++] = io->zone->tp;
            continue;
        }

        ngx_queue_remove(q);
        ngx_http_llama_session_io_backlogged--;
    }

    if (ngx_http_llama_session_io_backlogged) {
        return;
    }

    if (ngx_http_llama_session_io_backlog_ev.timer_set) {
        ngx_del_timer(&ngx_http_llama_session_io_backlog_ev);
    }

    ngx_log_error(NGX_LOG_INFO, log, 0,
                  "llama_session: the calls that waited in the worker for a "
                  "store's thread pool are posted");
}


static void
ngx_http_llama_session_io_backlog_handler(ngx_event_t *ev)
{
    ngx_http_llama_session_io_drain(ev->log);

    if (ngx_http_llama_session_io_backlogged) {
        /* each try logs the pool's overflow: less often */
        ngx_http_llama_session_io_backoff =
                       ngx_min(2 * ngx_http_llama_session_io_backoff, 60000);
        ngx_add_timer(ev, ngx_http_llama_session_io_backoff);
    }
}


static void
ngx_http_llama_session_io_thread(void *data, ngx_log_t *log)
{
    ngx_http_llama_session_io_t  *io = data;

    io->work(io);
}


static void
ngx_http_llama_session_io_event(ngx_event_t *ev)
{
    ngx_event_t                  *wake;
    ngx_http_llama_session_io_t  *io;

    io = ev->data;
    io->done = 1;

    if (ngx_http_llama_session_io_backlogged) {
        ngx_http_llama_session_io_drain(ev->log);
    }

    if (io->left) {
        if (io->late_log) {
            ngx_log_error(NGX_LOG_INFO, &io->log, 0,
                          "llama_session: the store of zone \"%V\" "
                          "answered after %M ms, its request went on "
                          "without it", &io->zone->name,
                          ngx_current_msec - io->start);
        }

        if (io->late) {
            io->late(io);
        }

        ngx_destroy_pool(io->pool);
        return;
    }

    wake = io->wake;

    if (wake == NULL) {
        return;
    }

    if (wake->timer_set) {
        ngx_del_timer(wake);
    }

    if (!wake->posted) {
        ngx_post_event(wake, &ngx_posted_events);
    }
}

#endif
