
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The types every file shares: the zone and its shared memory, the
 * configuration, and a request's context with its job (job.c has the
 * table of the job's states).  Each file's functions are in a header of
 * its own, named for it.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include <cjson/cJSON.h>


#define NGX_HTTP_LLAMA_SESSION_MAGIC       0x6c6c736dU  /* "llsm" */
#define NGX_HTTP_LLAMA_SESSION_VERSION     13

#define NGX_HTTP_LLAMA_SESSION_KEY_MAX     80
#define NGX_HTTP_LLAMA_SESSION_SAFE_MAX    32
#define NGX_HTTP_LLAMA_SESSION_HASH_HEX    24
#define NGX_HTTP_LLAMA_SESSION_SLOTS_MAX   64
#define NGX_HTTP_LLAMA_SESSION_FP_LEN      8      /* hex digits */
#define NGX_HTTP_LLAMA_SESSION_NAME_MAX    96     /* "<key>.<fp>" */
#define NGX_HTTP_LLAMA_SESSION_ID_SHOW     96
#define NGX_HTTP_LLAMA_SESSION_MODEL_SHOW  64
#define NGX_HTTP_LLAMA_SESSION_PATH_SHOW   200
#define NGX_HTTP_LLAMA_SESSION_FIELDS_MAX  16

/* the request's parts a warm start's prime is made of (ctx->p_*) */
#define NGX_HTTP_LLAMA_SESSION_PRIME_SPANS  7
#define NGX_HTTP_LLAMA_SESSION_ID_MAX      256    /* a client's id, bytes */
#define NGX_HTTP_LLAMA_SESSION_PREFIX_MAX  16     /* a model zone's name */
#define NGX_HTTP_LLAMA_SESSION_MODELS_MAX    64     /* models= */

/* the model's name percent-encoded in a query, "&autoload=false" after */
#define NGX_HTTP_LLAMA_SESSION_MODEL_ARG                                      \
    (sizeof("model=&autoload=false") + 3 * NGX_HTTP_LLAMA_SESSION_MODEL_SHOW)

/*
 * After a request that llama-server may have received but not answered
 * (its client left, the upstream failed or timed out before the reply's
 * header): llama-server may still start it, up to about a second later
 * (it tokenizes first, and notices a closed connection once a second).
 * The slot is not swapped until then.
 */
#define NGX_HTTP_LLAMA_SESSION_QUARANTINE  2000

/*
 * A hit on a slot that had no request for this long asks GET /slots
 * first: llama-server may have restarted meanwhile (its slots are empty
 * then, and the session is restored from its file instead).
 */
#define NGX_HTTP_LLAMA_SESSION_VERIFY      1000

#define NGX_HTTP_LLAMA_SESSION_FALLBACK_OFF     0
#define NGX_HTTP_LLAMA_SESSION_FALLBACK_SYSTEM  1

/* what a session without a file of its own starts from */
#define NGX_HTTP_LLAMA_SESSION_WARM_OFF         0
#define NGX_HTTP_LLAMA_SESSION_WARM_SYSTEM      1
#define NGX_HTTP_LLAMA_SESSION_WARM_HISTORY     2

#define NGX_HTTP_LLAMA_SESSION_DIGEST           8     /* bytes kept */

/* why a save ran, for the metrics */
#define NGX_HTTP_LLAMA_SESSION_SAVE_SWAP        0
#define NGX_HTTP_LLAMA_SESSION_SAVE_IDLE        1
#define NGX_HTTP_LLAMA_SESSION_SAVE_API         2
#define NGX_HTTP_LLAMA_SESSION_SAVE_UNLOAD      3     /* router mode */
#define NGX_HTTP_LLAMA_SESSION_SAVE_BASE        4     /* a warm start's */
#define NGX_HTTP_LLAMA_SESSION_SAVE_REASONS     5

/* a histogram's buckets, the last one +Inf (metrics.c has the bounds) */
#define NGX_HTTP_LLAMA_SESSION_BUCKETS          14

/* bytes of a reply kept for a figure cut between two buffers */
#define NGX_HTTP_LLAMA_SESSION_CARRY            48

/* the most JSON values of a client's body or a backend's reply parsed */
#define NGX_HTTP_LLAMA_SESSION_JSON_VALUES      100000

/* ineffective restores in a row that stop saves and restores */
#define NGX_HTTP_LLAMA_SESSION_INEFFECTIVE_MAX  3


/* what the request did to the slot, for $llama_session_action */

typedef enum {
    NGX_HTTP_LLAMA_SESSION_ACTION_NONE = 0,
    NGX_HTTP_LLAMA_SESSION_ACTION_HIT,
    NGX_HTTP_LLAMA_SESSION_ACTION_RESTORE,
    NGX_HTTP_LLAMA_SESSION_ACTION_FRESH,
    NGX_HTTP_LLAMA_SESSION_ACTION_BYPASS,
    NGX_HTTP_LLAMA_SESSION_ACTION_WARM,
    NGX_HTTP_LLAMA_SESSION_ACTION_RAM           /* from llama-server's RAM
                                                   cache (ram.c) */
} ngx_http_llama_session_action_e;


/* what a slot holds, as far as the module can vouch for it */

typedef enum {
    NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN = 0,
    NGX_HTTP_LLAMA_SESSION_SLOT_EMPTY,
    NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
} ngx_http_llama_session_slot_state_e;


/* the request's way through the module, see the handler */

typedef enum {
    NGX_HTTP_LLAMA_SESSION_ST_BODY = 0,
    NGX_HTTP_LLAMA_SESSION_ST_ACQUIRE,
    NGX_HTTP_LLAMA_SESSION_ST_ROUTER,   /* router mode: the model is up */
    NGX_HTTP_LLAMA_SESSION_ST_PROPS,
    NGX_HTTP_LLAMA_SESSION_ST_CHECK,
    NGX_HTTP_LLAMA_SESSION_ST_PAUSE,    /* until GET /slots again */
    NGX_HTTP_LLAMA_SESSION_ST_SAVE,
    NGX_HTTP_LLAMA_SESSION_ST_LOAD,
    NGX_HTTP_LLAMA_SESSION_ST_WARM,
    NGX_HTTP_LLAMA_SESSION_ST_PROXY,
    NGX_HTTP_LLAMA_SESSION_ST_DONE,
    NGX_HTTP_LLAMA_SESSION_ST_OLLAMA,   /* GET /v1/models for Ollama's */
    NGX_HTTP_LLAMA_SESSION_ST_BIND,     /* models=: the router lists it */
    NGX_HTTP_LLAMA_SESSION_ST_REPRIME,  /* before a save (reprime.c) */
    NGX_HTTP_LLAMA_SESSION_ST_LOOK,     /* at the store, in a thread */
    NGX_HTTP_LLAMA_SESSION_ST_TURN      /* the slot's turn file, read in
                                           a thread (reprime.c) */
} ngx_http_llama_session_state_e;


/* the model's memory (gguf.c): what a slot file can bring back */

#define NGX_HTTP_LLAMA_SESSION_MEMORY_UNKNOWN   0
#define NGX_HTTP_LLAMA_SESSION_MEMORY_FULL      1
#define NGX_HTTP_LLAMA_SESSION_MEMORY_SWA       2
#define NGX_HTTP_LLAMA_SESSION_MEMORY_HYBRID    3
#define NGX_HTTP_LLAMA_SESSION_MEMORY_RECURRENT 4

#define NGX_HTTP_LLAMA_SESSION_ARCH_MAX         32

typedef struct {
    uint64_t                        n_embd;
    uint32_t                        window;     /* SWA: tokens */
    u_char                          kind;
    u_char                          arch[NGX_HTTP_LLAMA_SESSION_ARCH_MAX];
} ngx_http_llama_session_memory_t;


/* what GET /slots said of a slot (job.c) */

typedef enum {
    NGX_HTTP_LLAMA_SESSION_SLOTS_IDLE = 0,      /* slot_tokens: what it holds,
                                                   -1: not proven */
    NGX_HTTP_LLAMA_SESSION_SLOTS_BUSY,          /* a task runs on it */
    NGX_HTTP_LLAMA_SESSION_SLOTS_RESTARTED,     /* its task id went back, or
                                                   the slot is gone */
    NGX_HTTP_LLAMA_SESSION_SLOTS_NO_API,        /* 501: --no-slots */
    NGX_HTTP_LLAMA_SESSION_SLOTS_MODEL_GONE,    /* router mode: 400, the
                                                   model is not running */
    NGX_HTTP_LLAMA_SESSION_SLOTS_ERROR          /* no answer, or none to
                                                   read */
} ngx_http_llama_session_slots_e;


/* slot calls */

typedef enum {
    NGX_HTTP_LLAMA_SESSION_CALL_NONE = 0,
    NGX_HTTP_LLAMA_SESSION_CALL_GET,
    NGX_HTTP_LLAMA_SESSION_CALL_SAVE,
    NGX_HTTP_LLAMA_SESSION_CALL_RESTORE,
    NGX_HTTP_LLAMA_SESSION_CALL_ERASE,
    NGX_HTTP_LLAMA_SESSION_CALL_PROPS,
    NGX_HTTP_LLAMA_SESSION_CALL_MODELS,
    NGX_HTTP_LLAMA_SESSION_CALL_PRIME,
    NGX_HTTP_LLAMA_SESSION_CALL_ROUTER,         /* the router's GET /models */
    NGX_HTTP_LLAMA_SESSION_CALL_RPROPS,         /* the router's GET /props */
    NGX_HTTP_LLAMA_SESSION_CALL_LOAD,           /* POST /models/load */
    NGX_HTTP_LLAMA_SESSION_CALL_UNLOAD,         /* POST /models/unload */
    NGX_HTTP_LLAMA_SESSION_CALL_APPLY,          /* POST /apply-template */
    NGX_HTTP_LLAMA_SESSION_CALL_COMPLETE,       /* the re-prime's */
    NGX_HTTP_LLAMA_SESSION_CALL_TOKENIZE        /* POST /tokenize */
} ngx_http_llama_session_call_e;


/* the steps of a warm start, see warm.c */

typedef enum {
    NGX_HTTP_LLAMA_SESSION_WARM_NONE = 0,
    NGX_HTTP_LLAMA_SESSION_WARM_RESTORE,        /* the base's file */
    NGX_HTTP_LLAMA_SESSION_WARM_ERASE,          /* before a prime */
    NGX_HTTP_LLAMA_SESSION_WARM_PRIME,          /* the system prompt alone */
    NGX_HTTP_LLAMA_SESSION_WARM_SAVE,           /* that, as the base */
    NGX_HTTP_LLAMA_SESSION_WARM_CLEAN           /* erase after a failure */
} ngx_http_llama_session_warm_e;


/*
 * A message of a prompt, in a few bytes: what tells where a prompt first
 * differs from the session's previous one (miss.c)
 */

#define NGX_HTTP_LLAMA_SESSION_MSGS_MAX         128
#define NGX_HTTP_LLAMA_SESSION_EXT_KEEP         4096  /* prefixes a request
                                                         may extend, from
                                                         its end */
#define NGX_HTTP_LLAMA_SESSION_PREFIXES         3     /* 64, 512, 4096 */
#define NGX_HTTP_LLAMA_SESSION_META_MAX         8192  /* a .json, bytes */

typedef struct {
    uint32_t                        hash;       /* the whole message */
    uint32_t                        len;        /* its content's bytes */
    uint32_t                        prefix[NGX_HTTP_LLAMA_SESSION_PREFIXES];
    u_char                          role;       /* its first letter */
    u_char                          pad[3];
} ngx_http_llama_session_msg_t;


/* shared memory */

typedef struct {
    u_char                          key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
    u_short                         key_len;
    u_char                          state;
    u_char                          dirty;      /* changed since last save */
    u_char                          saveable;   /* not "default" */
    u_char                          busy;       /* a request holds it */
    u_char                          lent;       /* its idle save's call is
                                                   on its way: a request of
                                                   its session may take it */
    ngx_uint_t                      taken;      /* grants, the holder's is
                                                   the last */
    ngx_pid_t                       owner;
    uint32_t                        crc;        /* crc32 of key, 0: none;
                                                   read without the lock
                                                   (balance.c) */
    uint64_t                        owner_start; /* tells a reused pid */
    ngx_msec_t                      taken_at;
    ngx_msec_t                      checked_at; /* owner last checked */
    ngx_msec_t                      free_since;
    ngx_msec_t                      quiet_until; /* a request may still come
                                                    in llama-server until */
    ngx_atomic_uint_t               batch;      /* tickets of the session
                                                   swapped in that may still
                                                   go before the next swap */
    ngx_uint_t                      batch_left; /* how many of them wait */
    u_short                         batch_len;
    u_char                          batch_key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
    ngx_msec_t                      last_used;
    time_t                          used_at;
    ngx_int_t                       task;       /* last id_task seen, -1 */
    u_char                          has_base;   /* base[] is its prefix's */
    u_char                          base[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          saving_base; /* a base's save runs */
    u_char                          media;      /* its session has media */
    u_char                          draft_lost; /* restored on a draft
                                                   model: the draft's own
                                                   context is not */
    u_char                          has_ns;     /* ns[] is its tenant's */
    u_char                          ns[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          saving[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          sys_most;   /* its system prompt is
                                                   half its body or more */
    ngx_uint_t                      held;       /* tokens, by its last
                                                   reply; 0: unknown */

    /*
     * the last prompt of the session in it (its first MSGS_MAX messages),
     * and its tokens (miss.c); the chain of all its messages (ext.c), 0:
     * none
     */
    ngx_http_llama_session_msg_t   *msgs;       /* slab, NULL: none */
    ngx_uint_t                      nmsgs;
    ngx_uint_t                      prompt_tokens;
    uint64_t                        chain;

    /*
     * the last turn it ran, in the store's turn file (turn.c), 0: none;
     * only the slot's holder reads or writes it
     */
    ngx_uint_t                      turn_seq;

    /*
     * the last turn whose file's write ended, written or not: set by the
     * writer's thread (store_put()), waited for by the re-prime's read
     */
    ngx_atomic_t                    turn_done;
} ngx_http_llama_session_slot_t;


/*
 * A session the zone thinks llama-server's RAM cache holds (ram.c), in the
 * zone's model of that cache: at most 64 (the oldest leaves the model
 * first, and its session is restored from its file, however large ram=)
 */

#define NGX_HTTP_LLAMA_SESSION_RAM_MAX  64

typedef struct {
    ngx_uint_t                      seq;        /* when it went in, 0: free */
    ngx_uint_t                      tokens;
    off_t                           bytes;      /* by the files' bytes per
                                                   token, 0: unknown */
    u_short                         key_len;    /* 0: "default" */
    u_char                          dirty;      /* newer than its file */
    uint32_t                        crc;        /* crc32 of key, 0: none
                                                   (balance.c) */
    u_char                          key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
} ngx_http_llama_session_ram_t;


/* a waiting request: reserved at the zone's start, never slab-allocated */

typedef struct {
    ngx_queue_t                     queue;      /* waiters or free list */
    ngx_atomic_uint_t               ticket;     /* 0: free */
    ngx_pid_t                       pid;
    uint64_t                        start;
    u_short                         key_len;
    u_char                          key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
} ngx_http_llama_session_waiter_t;


/*
 * Which store file (shared=on): the one a zone took a session in from, or
 * saved it to; another owner's save makes another file (a rename), so a
 * file of another identity is newer.  uniq 0: there was no file.
 */

typedef struct {
    ngx_file_uniq_t                 uniq;
    off_t                           size;
    time_t                          mtime;
} ngx_http_llama_session_fid_t;


/*
 * What a look at the store, in a thread (io.c), found of the session's
 * file and its .json, for the request's decisions that need them (store.c)
 */

typedef struct {
    ngx_int_t                       rc;         /* NGX_OK: a regular file;
                                                   NGX_DECLINED: none;
                                                   NGX_ERROR: the store did
                                                   not answer */
    ngx_http_llama_session_fid_t    fid;
    u_char                         *meta;       /* its .json, NULL: none */
    size_t                          meta_len;
    off_t                           avail;      /* free on the store's file
                                                   system; NGX_MAX_OFF_T_VALUE:
                                                   unknown */
    ngx_int_t                       base_rc;    /* its warm start's base's
                                                   file, as rc above */
    ngx_http_llama_session_fid_t    base_fid;
    u_char                          fp[NGX_HTTP_LLAMA_SESSION_FP_LEN];
                                                /* the names' fingerprint */
    unsigned                        valid:1;
} ngx_http_llama_session_disk_t;


/* a session's state for one backend configuration: "<key>.<fp>" */

typedef struct {
    ngx_rbtree_node_t               node;       /* key: crc32 of the name */
    ngx_queue_t                     lru;        /* sh->lru or sh->nofile */
    ngx_uint_t                      seq;        /* sh->seq when saved */
    u_char                          name_len;
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    u_char                          saved;      /* a file exists */
    u_char                          id_len;
    u_char                          id[NGX_HTTP_LLAMA_SESSION_ID_SHOW];
    u_char                          model_len;
    u_char                          model[NGX_HTTP_LLAMA_SESSION_MODEL_SHOW];
    off_t                           bytes;
    ngx_uint_t                      tokens;
    time_t                          saved_at;
    time_t                          used_at;
    u_char                          has_idk;
    u_char                          has_sys;
    u_char                          has_ns;
    u_char                          is_base;    /* a warm start's base */
    u_char                          primed;     /* re-primed before its
                                                   save: the next turn
                                                   extends all of it */
    u_short                         base_uses;  /* sessions it started */
    u_char                          idk[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          sys[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          ns[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          has_seen;   /* shared=on: seen known */
    u_char                          has_meta;   /* ... and meta */
    ngx_http_llama_session_fid_t    seen;       /* the file its slot state
                                                   came from or went to */
    ngx_http_llama_session_fid_t    meta;       /* its .json as the zone
                                                   left it: another owner's
                                                   use changes it */
} ngx_http_llama_session_node_t;


typedef struct {
    ngx_atomic_uint_t               requests;
    ngx_atomic_uint_t               hits;
    ngx_atomic_uint_t               restores;
    ngx_atomic_uint_t               fresh;
    ngx_atomic_uint_t               bypass;
    ngx_atomic_uint_t               swaps;
    ngx_atomic_uint_t               saves;
    ngx_atomic_uint_t               save_errors;
    ngx_atomic_uint_t               restore_errors;
    ngx_atomic_uint_t               wait_timeouts;
    ngx_atomic_uint_t               backend_errors;
    ngx_atomic_uint_t               evictions;
    ngx_atomic_uint_t               idle_saves;
    ngx_atomic_uint_t               restarts;
    ngx_atomic_uint_t               queue_full;
    ngx_atomic_uint_t               forgotten;  /* records recycled */
    ngx_atomic_uint_t               refused;
    ngx_atomic_uint_t               warm;       /* started from a base */
    ngx_atomic_uint_t               bases;      /* bases saved */
    ngx_atomic_uint_t               probes;     /* run as "default" */
    ngx_atomic_uint_t               unloads;    /* router: by the module */
    ngx_atomic_uint_t               model_lost; /* router: behind its back */
    ngx_atomic_uint_t               effective;  /* restores the reply used */
    ngx_atomic_uint_t               ineffective; /* ... and did not */
    ngx_atomic_uint_t               reprimes;   /* before a save */
    ngx_atomic_uint_t               reprime_failed;
    ngx_atomic_uint_t               reprime_media; /* skipped: media */
    ngx_atomic_uint_t               media_unsaved; /* saves refused */
    ngx_atomic_uint_t               reprime_tokens; /* evaluated by them */
    ngx_atomic_uint_t               reprefills; /* a restore cost more */
    ngx_atomic_uint_t               newer_saves; /* shared=on: not kept */
    ngx_atomic_uint_t               newer_hits; /* ... restored instead */
    ngx_atomic_uint_t               store_timeouts; /* went on without it */
    ngx_atomic_uint_t               ram_hits;   /* swaps through RAM */
    ngx_atomic_uint_t               ram_misses; /* ... that found nothing */
    ngx_atomic_uint_t               ram_stored; /* sessions that went in */
    ngx_atomic_uint_t               ram_evicted;
    ngx_atomic_uint_t               ram_lost;   /* ... newer than the file */
    ngx_atomic_uint_t               idle_lent;  /* hits behind an idle save */
} ngx_http_llama_session_stats_t;


#define NGX_HTTP_LLAMA_SESSION_MEDIA_SAID  64


typedef struct {
    ngx_atomic_uint_t               bucket[NGX_HTTP_LLAMA_SESSION_BUCKETS];
    ngx_atomic_uint_t               sum_us;
} ngx_http_llama_session_hist_t;


/* what a restore and a prefill cost on a backend (cost.c) */

typedef struct {
    u_char                          fp[NGX_HTTP_LLAMA_SESSION_FP_LEN];
    ngx_uint_t                      prefill_samples;
    ngx_uint_t                      restore_samples;
    double                          prefill_ms_per_token;
    double                          restore_ms_per_byte;
    ngx_uint_t                      skipped;    /* re-prefills in a row */
    ngx_uint_t                      probing;    /* a restore to measure */

    /*
     * a draft model: the generation's ms a token with the draft's context
     * whole [0] and after a restore [1], and the tokens a turn generates
     */
    ngx_uint_t                      gen_samples[2];
    double                          gen_ms_per_token[2];
    double                          gen_tokens;
} ngx_http_llama_session_cost_t;


/* for the metrics (metrics.c), kept with the stats */

typedef struct {
    ngx_atomic_uint_t               saved[NGX_HTTP_LLAMA_SESSION_SAVE_REASONS];
    ngx_atomic_uint_t               save_failed[
                                        NGX_HTTP_LLAMA_SESSION_SAVE_REASONS];
    ngx_atomic_uint_t               bytes_saved;
    ngx_atomic_uint_t               bytes_restored;
    ngx_atomic_uint_t               tokens_cached;    /* from the replies */
    ngx_atomic_uint_t               tokens_evaluated;
    ngx_atomic_uint_t               prefill_saved_us; /* an estimate */
    ngx_http_llama_session_hist_t   wait;
    ngx_http_llama_session_hist_t   swap;
    ngx_http_llama_session_hist_t   save;
    ngx_http_llama_session_hist_t   restore;
} ngx_http_llama_session_metrics_t;


typedef struct {
    uint32_t                        magic;
    uint32_t                        version;
    ngx_uint_t                      nslots;
    ngx_atomic_uint_t               next_ticket;
    ngx_uint_t                      nwaiters;
    ngx_uint_t                      waiters_max;
    ngx_queue_t                     waiters;
    ngx_queue_t                     free_waiters;
    ngx_http_llama_session_waiter_t *waiter_pool;
    ngx_rbtree_t                    rbtree;
    ngx_rbtree_node_t               sentinel;
    ngx_queue_t                     lru;        /* records with a file */
    ngx_queue_t                     nofile;     /* records without */
    ngx_uint_t                      nsessions;
    ngx_uint_t                      seq;        /* saves recorded */
    ngx_uint_t                      files;      /* saved, any configuration */
    off_t                           bytes;
    ngx_uint_t                      base_files; /* of them, bases */
    off_t                           base_bytes;
    ngx_uint_t                      bases_unused; /* saved, never used */
    u_char                          fp_known;
    u_char                          fp[NGX_HTTP_LLAMA_SESSION_FP_LEN];
    ngx_uint_t                      n_ctx;
    ngx_uint_t                      total_slots;
    u_short                         model_path_len;
    u_char                          model_path[
                                        NGX_HTTP_LLAMA_SESSION_PATH_SHOW];
    ngx_http_llama_session_stats_t  stats;
    ngx_http_llama_session_metrics_t metrics;

    /*
     * restores that llama-server answers but the model does not use (the
     * reply shows no cached tokens): after a few in a row, saves and
     * restores stop for that backend configuration
     */
    u_char                          evicting_full; /* said once */
    u_char                          speculative_said;
    u_char                          speculative; /* for speculative_fp */
    u_char                          speculative_fp[
                                        NGX_HTTP_LLAMA_SESSION_FP_LEN];
    ngx_uint_t                      ineffective_run;
    u_char                          restores_off;
    u_char                          restores_off_fp[
                                        NGX_HTTP_LLAMA_SESSION_FP_LEN];

    /*
     * llama-server refused to save a slot that holds media (501), for the
     * configuration media_refused_fp; the sessions it was said of, by a
     * hash of their keys, the last NGX_HTTP_LLAMA_SESSION_MEDIA_SAID
     */
    u_char                          media_refused;
    u_char                          media_refused_fp[
                                        NGX_HTTP_LLAMA_SESSION_FP_LEN];
    uint32_t                        media_said[
                                        NGX_HTTP_LLAMA_SESSION_MEDIA_SAID];
    ngx_uint_t                      media_said_next;

    /* the model's memory, for the configuration memory_fp (gguf.c) */
    u_char                          memory_known;
    u_char                          memory_fp[NGX_HTTP_LLAMA_SESSION_FP_LEN];
    ngx_http_llama_session_memory_t memory;
    ngx_atomic_uint_t               turn_next;  /* turn files written */
    ngx_atomic_uint_t               bytes_per_token; /* times 256, of the
                                                   files saved: a save's
                                                   size, ahead */
    ngx_http_llama_session_cost_t   cost;
    ngx_atomic_uint_t               turn_ms;    /* a client's hold of a
                                                   slot, averaged: what a
                                                   turn waits per turn
                                                   ahead (balance.c) */

    /* router mode: this zone's model */
    ngx_msec_t                      model_used; /* its last request */
    ngx_pid_t                       unloading;  /* a request unloads it */
    uint64_t                        unloading_start;
    ngx_uint_t                      unloading_seq;

    /* router mode, in the group's first zone: one model switch at a time */
    ngx_pid_t                       switch_pid;
    uint64_t                        switch_start;
    ngx_uint_t                      switch_seq;
    ngx_uint_t                      switch_next;
    ngx_uint_t                      router_max; /* max_instances, 0: none */
    u_char                          router_known;

    /*
     * a zone of models= (models.c): the router's model it was given when
     * first asked for, for good; written under the set's first zone's
     * lock, "bound" last
     */
    u_char                          bound;
    u_char                          bound_len;
    u_char                          bound_model[
                                        NGX_HTTP_LLAMA_SESSION_MODEL_SHOW];
    u_short                         bound_arg_len;
    u_char                          bound_arg[NGX_HTTP_LLAMA_SESSION_MODEL_ARG];

    /*
     * configurations that used the zone (a reload adds one), and the one
     * whose workers run: an exiting worker of an older one is reloaded,
     * not stopped (idle.c)
     */
    ngx_uint_t                      cycles;
    ngx_uint_t                      live_cycle;

    /* conversations without an id, by the messages they extend (ext.c) */
    ngx_rbtree_t                    ext_tree;
    ngx_rbtree_node_t               ext_sentinel;
    ngx_queue_t                     ext_lru;
    ngx_uint_t                      ext_n;
    ngx_uint_t                      ext_max;

    /* the zone's model of llama-server's RAM cache (ram.c) */
    ngx_http_llama_session_ram_t    ram[NGX_HTTP_LLAMA_SESSION_RAM_MAX];
    ngx_uint_t                      ram_seq;
    off_t                           ram_bytes;
    ngx_uint_t                      ram_run;    /* misses in a row */
    u_char                          ram_off;    /* ... stopped the tier */
    u_char                          ram_said;   /* its tiers logged */

    ngx_http_llama_session_slot_t   slots[NGX_HTTP_LLAMA_SESSION_SLOTS_MAX];
} ngx_http_llama_session_sh_t;


typedef struct ngx_http_llama_session_zone_s  ngx_http_llama_session_zone_t;

struct ngx_http_llama_session_zone_s {
    ngx_str_t                       name;
    ngx_uint_t                      nslots;
    ngx_uint_t                      waiters_max;
    ngx_str_t                       store;      /* empty: not visible */
    ngx_uint_t                      max_files;  /* 0: no limit */
    off_t                           max_size;   /* 0: no limit */
    off_t                           min_free;   /* -1: none, room for the
                                                   file a save writes */
#if (NGX_THREADS)
    ngx_thread_pool_t              *tp;         /* the store's file calls,
                                                   NULL: in the event loop */
#endif
    ngx_msec_t                      store_timeout; /* the bound on them */
    ngx_msec_t                      save_idle;  /* 0: off */
    off_t                           ram;        /* llama-server's RAM cache,
                                                   the hot tier; 0: none */
    ngx_uint_t                      has_tenants; /* a location of the zone
                                                   has a namespace */
    ngx_uint_t                      reprime;    /* reprime=on */
    ngx_uint_t                      shared;     /* shared=on: the store is
                                                   the owners' of a model */
    ngx_str_t                       tmp;        /* a save's temporary
                                                   file's suffix: ".tmp",
                                                   shared: ".<crc>.tmp" */
    ngx_str_t                       old;        /* a previous file's, set
                                                   aside: ".old", shared:
                                                   ".<crc>.old" */
    ngx_event_t                     idle_ev;    /* this worker's */
    ngx_http_core_loc_conf_t       *log_conf;   /* the first location with
                                                   the zone: its error_log
                                                   is the idle saver's */
    ngx_http_conf_ctx_t            *conf_ctx;   /* ... and its server and
                                                   location, where the
                                                   module's own requests
                                                   run (job.c) */
    ngx_uint_t                      idle_busy;
    ngx_msec_t                      idle_backoff;
    ngx_msec_t                      idle_next;
    ngx_msec_t                      reaped;     /* the folder looked at */
    ngx_uint_t                      syncing;    /* ... in a thread now */
    off_t                           avail;      /* free on its file system,
                                                   as last seen in a thread;
                                                   0: not yet */
    ngx_uint_t                      generation; /* sh->cycles at start */
    uint64_t                        stop_tried; /* slots, at a stop */
    unsigned                        stop_failed:1; /* a save at stop */
    ngx_shm_zone_t                 *shm_zone;
    ngx_cycle_t                    *cycle;      /* of the configuration */
    ngx_http_llama_session_sh_t    *sh;
    ngx_slab_pool_t                *shpool;

    /* deletes a file of the store (store.c), for index.c's full index */
    ngx_int_t                     (*unlink)(ngx_http_llama_session_zone_t *zone,
                                      u_char *name, size_t len,
                                      ngx_log_t *log);

    /*
     * router mode (model=): the model every slot call names, its name
     * percent-encoded for a query, the prefix of its sessions' keys
     * ("<zone>@") in the store folder its group shares, and the group:
     * the zones of one router (one store), the first one leading
     */
    ngx_str_t                       model;
    ngx_str_t                       model_arg;
    ngx_str_t                       prefix;
    ngx_http_llama_session_zone_t  *group;
    ngx_http_llama_session_zone_t  *group_next;

    /*
     * models=N: the set's zones ("<name>.1" to "<name>.N"), each given
     * the first model asked for that no other one drives (models.c); the
     * first one leads, the location and the API name it
     */
    ngx_http_llama_session_zone_t  *models;
    ngx_http_llama_session_zone_t  *models_next;
    ngx_uint_t                      models_index; /* 1 to N */
    ngx_str_t                       models_name;  /* "<name>" */
};


/* a zone in front of llama-server's router: model= or models= */
#define ngx_http_llama_session_by_router(zone)                                 \
    ((zone)->model.len || (zone)->models)


/* a file the zone gave up, to delete outside the lock */

typedef struct {
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          len;
    off_t                           bytes;
} ngx_http_llama_session_evicted_t;


/* configuration */

typedef struct {
    ngx_array_t                     zones;      /* zone pointers */
    ngx_array_t                     owners;     /* servers with a zone
                                                   (balance.c) */
    ngx_array_t                     balances;   /* upstreams balanced */
} ngx_http_llama_session_main_conf_t;


typedef struct {
    ngx_http_llama_session_zone_t  *zone;       /* NULL: off */
    ngx_array_t                    *zones;      /* router mode: by model */
    ngx_http_llama_session_zone_t  *api_zone;   /* llama_session_api */
    ngx_str_t                       slots_uri;
    ngx_array_t                    *metrics;    /* zone pointers, or none:
                                                   all */
    ngx_array_t                    *id_headers; /* ngx_str_t, lowercase */
    ngx_array_t                    *id_fields;  /* ngx_str_t, a.b paths */
    ngx_array_t                    *endpoints;  /* ngx_str_t, "/a/b" */
    ngx_uint_t                      fallback;
    ngx_http_complex_value_t       *namespace;
    ngx_msec_t                      wait_timeout;
    size_t                          body_max;
    ngx_uint_t                      warm;
    size_t                          warm_min;   /* system prompt, bytes */
    ngx_flag_t                      enable;
    ngx_flag_t                      ollama;
    ngx_flag_t                      canonical;  /* canon.c */
    ngx_flag_t                      anthropic;  /* anthropic.c */
} ngx_http_llama_session_loc_conf_t;


/* a span of JSON text: a value of a request body */

typedef struct {
    u_char                         *start;
    u_char                         *end;
} ngx_http_llama_session_span_t;


/*
 * A slot job (job.c): the slot held, the job's state, the sessions it
 * moves, the slot call in flight and its reply, and what GET /slots
 * proved of the slot.  A client's request, an API call and an idle save
 * each have one in their context; job.c's file comment has the table of
 * its states and of what each may touch.
 */

typedef struct {
    ngx_uint_t                      state;      /* ngx_http_llama_session_
                                                   state_e */
    ngx_log_t                      *log;

    /* its place in the scheduler (sched.c) */
    ngx_uint_t                      slot;
    ngx_uint_t                      taken;      /* the slot's grant it got */
    ngx_atomic_uint_t               ticket;
    ngx_http_llama_session_waiter_t *waiter;   /* its place in the zone */
    ngx_event_t                     wait_ev;
    ngx_queue_t                     local;      /* this worker's waiters */

    /* the backend's configuration: part of every file name */
    u_char                          fp[NGX_HTTP_LLAMA_SESSION_FP_LEN];

    /* the session that leaves the slot on a swap */
    u_char                          out_key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
    size_t                          out_len;

    /* its previous file, moved aside by the save, deleted at the end */
    u_char                          old_name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          old_len;

    /* the slot call in flight and its reply (call.c) */
    ngx_uint_t                      call;
    ngx_str_t                       call_uri;
    ngx_int_t                       call_status;
    ngx_buf_t                      *call_reply;
    ngx_buf_t                      *capture;    /* reused across calls */
    ngx_buf_t                      *call_body;  /* a prime's (warm.c), a
                                                   re-prime's (reprime.c) */
    ngx_buf_t                      *call_sent;  /* the body of the call in
                                                   flight, for its retry */
    u_char                         *call_sent_pos;
    u_char                         *call_key;   /* its session */
    size_t                          call_key_len;
    ngx_http_request_t             *call_sr;    /* its subrequest */
    void                           *reprime;    /* reprime.c's steps */
    ngx_uint_t                      polls;
    ngx_msec_t                      quiet_until;
    double                          est_restore_ms; /* cost.c's, when */
    double                          est_prefill_ms; /* reprefill */

    /* GET /props, until GET /v1/models completes the fingerprint */
    ngx_str_t                       props_text;
    ngx_str_t                       props_model;
    ngx_uint_t                      props_n_ctx;
    ngx_uint_t                      props_slots;
    uint64_t                        props_n_embd; /* /v1/models, 0: none */

    /* what the slot holds: the zone's word, then GET /slots's */
    u_char                          slot_base[NGX_HTTP_LLAMA_SESSION_DIGEST];
    ngx_int_t                       slot_tokens; /* -1: unknown */
    ngx_int_t                       slot_task;   /* -1: none */
    ngx_uint_t                      slot_state;

    /* from the replies, for the swap log line */
    ngx_uint_t                      saved_tokens;
    off_t                           saved_bytes;
    double                          save_ms;
    ngx_uint_t                      loaded_tokens;
    off_t                           loaded_bytes;
    double                          load_ms;
    ngx_uint_t                      loaded_primed; /* the file restored
                                                   was re-primed */

    unsigned                        own:1;      /* the module's own request
                                                   (an idle save), no
                                                   client's */
    unsigned                        client:1;   /* a client's: the slot's
                                                   last use */
    unsigned                        queued:1;
    unsigned                        acquired:1;
    unsigned                        released:1;
    unsigned                        slot_has_base:1;
    unsigned                        call_done:1;
    unsigned                        call_timed_out:1; /* proxy_read_timeout */
    unsigned                        call_inflight:1;
    unsigned                        call_retried:1; /* sent again, once */
    unsigned                        faces_router:1; /* a plain zone before
                                                   llama-server's router */
    unsigned                        speculative:1; /* the slot has a draft
                                                   model (GET /slots) */
    unsigned                        call_then:1; /* this erase is followed
                                                   by the restore asked */
    unsigned                        erased:1;   /* the restore's erase is
                                                   done */
    unsigned                        save_pending:1;
    unsigned                        save_failed:1;
    unsigned                        media_refused:1; /* the save: 501 */
    unsigned                        superseded:1; /* shared=on: the store
                                                   held a newer state */
    unsigned                        stale:1;    /* shared=on: the hit's
                                                   slot state was older */
    unsigned                        stale_verify:1; /* and that hit was to
                                                   check the slot first */
    unsigned                        load_file:1;
    unsigned                        restarted:1;
    unsigned                        slots_checked:1; /* GET /slots vouched */
    unsigned                        quarantine:1;
    unsigned                        reprefill:1; /* no restore: cost.c */
    unsigned                        primed:1;   /* the save in progress
                                                   was re-primed */
    unsigned                        slot_recent:1; /* the slot ran a
                                                   request within a second */
    unsigned                        ram:1;      /* the swap comes out of
                                                   RAM once GET /slots
                                                   vouches (handler.c) */
    unsigned                        ram_leaving:1; /* the slot still holds
                                                   the session that leaves */
    ngx_uint_t                      ram_tokens; /* what RAM held of it */

    /* the store call it waits for (io.c), and what the look found */
    void                           *io;
    ngx_uint_t                      look_next;  /* where the request goes
                                                   on: plan() or files() */
    ngx_uint_t                      store_silent; /* a call on the store
                                                   outlived its bound: no
                                                   more for this request */
    ngx_http_llama_session_disk_t   disk;

    /* a failed save's look at the disk (store_room_after()): 0, 1 on its way,
       2 done; the free space it found */
    ngx_uint_t                      room;
    off_t                           room_avail;
} ngx_http_llama_session_job_t;


/* a warm start's steps and what they found (warm.c) */

typedef struct {
    ngx_uint_t                      warm_step;
    ngx_uint_t                      base_tokens;
    ngx_int_t                       base_cached; /* the prime's cache_n */
    off_t                           base_bytes;
    double                          base_ms;

    unsigned                        trimmed:1;
    unsigned                        history:1;
    unsigned                        base_built:1;
    unsigned                        base_file:1;
    unsigned                        prefix:1;   /* the prefix prime */
} ngx_http_llama_session_warm_t;


/* router mode: the model's switch (router.c) */

typedef struct {
    ngx_http_llama_session_zone_t  *victim;
    ngx_uint_t                      switch_seq;
    ngx_uint_t                      router_polls;
    ngx_uint_t                      lost;       /* changed sessions lost */

    unsigned                        routed:1;
    unsigned                        switching:1; /* holds the group's turn */
    unsigned                        load_sent:1;
    unsigned                        unload_sent:1;
    unsigned                        model_reset:1;
    unsigned                        rerouted:1;
} ngx_http_llama_session_route_t;


typedef struct ngx_http_llama_session_ctx_s  ngx_http_llama_session_ctx_t;


/*
 * An API dialect (dialect.c's table): chosen once, when the request starts;
 * what the core asks of the protocol a request speaks
 */

#define NGX_HTTP_LLAMA_SESSION_GATE_ANTHROPIC   1  /* llama_session_anthropic */
#define NGX_HTTP_LLAMA_SESSION_GATE_OLLAMA      2  /* llama_session_ollama */

#define NGX_HTTP_LLAMA_SESSION_PRIME_CHAT       1
#define NGX_HTTP_LLAMA_SESSION_PRIME_ANTHROPIC  2
#define NGX_HTTP_LLAMA_SESSION_PRIME_RESPONSES  3

typedef struct {
    ngx_str_t                       suffix;     /* the path's end */
    ngx_uint_t                      gate;       /* the location's switch */
    ngx_uint_t                      kind;       /* its own file's kind */

    /* the body's members of the system prompt and the conversation */
    ngx_str_t                       system;
    ngx_str_t                       messages;

    /* the warm start's prime: its path and shape, NULL: no prime */
    char                           *prime;
    ngx_uint_t                      prime_shape;

    /* it becomes a chat request (before the slot) */
    ngx_int_t                     (*request)(ngx_http_request_t *r,
                                      ngx_http_llama_session_ctx_t *ctx);
    /* the prime, translated as the request was */
    ngx_buf_t                    *(*prime_filter)(ngx_http_request_t *r,
                                      ngx_buf_t *b, ngx_uint_t slot);
    /* its own error reply; or the error types, in Anthropic's envelope */
    ngx_int_t                     (*error)(ngx_http_request_t *r,
                                      ngx_http_llama_session_ctx_t *ctx,
                                      ngx_uint_t status, char *message);
    char                         *(*error_type)(ngx_uint_t status);

    unsigned                        no_session:1; /* uses a slot, carries
                                                   no conversation */
    unsigned                        unpinned:1; /* llama-server drops
                                                   "id_slot" */
    unsigned                        turn:1;     /* its replies are kept for
                                                   the re-prime (turn.c) */
    unsigned                        canon:1;    /* Anthropic's system
                                                   (canon.c) */
    unsigned                        max_tokens:1; /* its limit is max_tokens
                                                   alone */
} ngx_http_llama_session_dialect_t;


/* a request */

struct ngx_http_llama_session_ctx_s {
    ngx_http_request_t             *request;
    ngx_http_llama_session_zone_t  *zone;
    ngx_http_llama_session_dialect_t *dialect;  /* the API it speaks */
    ngx_http_llama_session_job_t   *job;        /* its slot job (job.c) */
    ngx_http_llama_session_warm_t  *warm;       /* warm.c's */

    ngx_str_t                       id;         /* as the client gave it */
    ngx_str_t                       source;     /* where it came from */
    char                           *refuse_why; /* for the log */
    unsigned                        has_nsk:1;  /* nsk[] is known */
    ngx_str_t                       model;
    u_char                          key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
    size_t                          key_len;

    /*
     * the request's prefix: its system prompt (and tools), and the first
     * message after it; the spans of the body a prime is made of
     */
    u_char                          sys[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          head[NGX_HTTP_LLAMA_SESSION_DIGEST];
    size_t                          sys_len;    /* 0: none */

    /* ext.c's: its messages, their start, its last assistant message */
    uint64_t                        ext_chain;
    uint64_t                        ext_seed;
    uint64_t                        ext_birth;
    ngx_http_llama_session_span_t   ext_reply;

    /* SHA-256(namespace \0 model \0 id): what the API finds an id by */
    u_char                          nsk[NGX_HTTP_LLAMA_SESSION_DIGEST];
                                                /* its namespace's digest */
    u_char                          idk[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          base_key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
    size_t                          base_len;   /* 0: no base */
    u_char                          base_id[NGX_HTTP_LLAMA_SESSION_DIGEST];
    ngx_http_llama_session_span_t   p_model;
    ngx_http_llama_session_span_t   p_system;   /* the dialect's system
                                                   member */
    ngx_http_llama_session_span_t   p_leading;  /* system messages or
                                                   Responses' input items */
    ngx_http_llama_session_span_t   p_tools;
    ngx_http_llama_session_span_t   p_tool_choice;
    ngx_http_llama_session_span_t   p_kwargs;   /* chat_template_kwargs */
    ngx_http_llama_session_span_t   p_reasoning; /* Responses' reasoning */

    ngx_uint_t                      action;
    ngx_int_t                       status;     /* to finish with */

    ngx_msec_t                      start;
    ngx_msec_t                      deadline;
    ngx_msec_t                      wait_ms;
    ngx_msec_t                      swap_start;
    ngx_msec_t                      swap_ms;
    ngx_msec_t                      delay;


    /* a refusal to send, from the states before the slot */
    ngx_uint_t                      fail_status;
    char                           *fail_type;
    char                           *fail_message;

    unsigned                        default_session:1;
    unsigned                        ext_fallback:1; /* "sys-…": ext.c */
    unsigned                        id_own:1;   /* the module's id, not a
                                                   client's */
    unsigned                        use_default:1;
    unsigned                        refuse:1;
    unsigned                        waiting:1;
    unsigned                        swapped:1;
    unsigned                        has_head:1;
    unsigned                        verify:1;   /* a hit, checked first */
    unsigned                        learn_slots:1; /* slots=auto */
    unsigned                        identity:1; /* llama_session identity */
    unsigned                        probe:1;
    unsigned                        bind:1;     /* models=: not bound yet */
    unsigned                        media:1;    /* an image in messages */

    /* what the reply says of the prompt's cache (reply.c's) */
    void                           *reply;
    ngx_int_t                       cached;     /* the result, -1: unknown */

    /* the body in one piece, as identify read it (NULL data: none) */
    ngx_str_t                       body;
    unsigned                        body_copied:1; /* from its file */
    unsigned                        spans_off:1;   /* p_*: offsets */

    /* the prompt's messages, and the session's previous prompt (miss.c) */
    ngx_http_llama_session_msg_t   *msgs;       /* the first MSGS_MAX */
    ngx_uint_t                      nmsgs;
    uint64_t                       *ext_d;      /* the digests of every
                                                   message's prefix, the last
                                                   EXT_KEEP of them (ext.c) */
    ngx_uint_t                      ext_total;  /* messages in all */
    ngx_http_llama_session_msg_t   *prev;
    ngx_uint_t                      nprev;
    ngx_uint_t                      prev_tokens;

    /* the reply's translation for Ollama's or Anthropic's API (convert.c) */
    void                           *conv;

    ngx_http_llama_session_route_t *route;      /* router.c's */
    unsigned                        hit_dirty:1; /* before the hit took it */

    void                           *turn;       /* the reply kept, turn.c */
    void                           *api;        /* the management API's */
};


extern ngx_module_t  ngx_http_llama_session_module;


#endif /* _NGX_HTTP_LLAMA_SESSION_H_INCLUDED_ */
