
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Every save of a session starts here (a swap, an idle save, the API).
 * Before it, when the slot's last turn is known (turn.c), the re-prime
 * makes the slot hold exactly the prefix the session's next turn will
 * share: the history and the last reply as the client sends it back,
 * rendered by the model's own template.
 *
 * Why: after a turn the slot holds the prompt and the tokens generated,
 * and the next prompt renders the reply otherwise (its end of turn; a
 * reasoning template drops the previous thinking).  A model with full
 * attention reuses the common part and evaluates the rest again; a model
 * with recurrent or hybrid memory reuses a restored slot only when the
 * next prompt extends all of it, and so never, after a restore, without
 * the re-prime (docs/models.md).
 *
 * How: POST /apply-template the turn's request with the reply and a user
 * message "1" appended, then with "2"; each render is tokenised as
 * llama-server tokenises a prompt (POST /tokenize, special tokens added
 * and parsed), and their longest common token prefix is what the next turn
 * starts with (a template that drops thinking has dropped it there as it
 * will then).  Tokens, not characters: no template's layout (newlines or
 * none between messages, as harmony's, special tokens, a channel the next
 * turn drops) moves the cut, and no cut splits a token.  POST /completion
 * {"prompt": [those tokens], "n_predict": 1, "id_slot": N,
 * "cache_prompt": true}: llama-server evaluates what the slot lacks (from
 * its own checkpoint near the prompt's end) and the one token it samples
 * is never decoded, so the slot holds exactly that prefix; then the save.
 * /tokenize runs in llama-server's HTTP thread: it never waits behind the
 * slots' work.
 *
 * Which saves: every save of a session on a model that reuses a restored
 * state only up to where the next prompt leaves it (sliding window,
 * hybrid, recurrent, unknown), a client's swap as much as an idle save;
 * never on full attention, which reuses any prefix of the slot as it is
 * (a re-prime there can only make the slot shorter than the next prompt's
 * common part, never longer).  The cut is what is certain of the next
 * request: where the history does not tell whether the client sends its
 * replies' reasoning back (no earlier assistant message), the two renders
 * differ in it (the reply without reasoning, then with), and their common
 * prefix stops before anything the choice changes; a reply with tool calls
 * is followed by their results, as a client sends them, not by a user
 * message (a template may render the reply otherwise before a user turn).
 *
 * A re-prime that fails (no turn file, a template error, a prompt too
 * long) is logged and the save goes on as it would have.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_file.h"
#include "ngx_http_llama_session_gguf.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_io.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_reprime.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_turn.h"


typedef struct {
    ngx_buf_t                      *sent;       /* the body in flight */
    ngx_buf_t                      *second;     /* the body with "2" */
    int                            *tokens;     /* the render with "1" */
    size_t                          ntokens;
    ngx_uint_t                      step;       /* the call in flight */
    ngx_int_t                       cached;     /* the completion's */
    ngx_int_t                       evaluated;
    ngx_msec_t                      start;
} ngx_http_llama_session_prefix_t;


#define NGX_HTTP_LLAMA_SESSION_PREFIX_FIRST     0   /* the render with "1" */
#define NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS1   1   /* its tokens */
#define NGX_HTTP_LLAMA_SESSION_PREFIX_SECOND    2   /* the render with "2" */
#define NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS2   3
#define NGX_HTTP_LLAMA_SESSION_PREFIX_COMPLETE  4

/* a conversation's tokens: more than any context llama-server takes */
#define NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS    (4 * 1024 * 1024)


static ngx_int_t ngx_http_llama_session_reprime_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_reprime_bodies(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t seq, u_char *data,
    size_t len, ngx_buf_t **first, ngx_buf_t **second);
static ngx_int_t ngx_http_llama_session_reprime_save(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_uint_t ngx_http_llama_session_reprime_yield(
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_reprime_reasons(cJSON *messages);
static ngx_int_t ngx_http_llama_session_prefix_next_turn(cJSON *messages,
    cJSON *reply, const char *text);
static void ngx_http_llama_session_prefix_text(cJSON *messages, int from,
    const char *text);
static ngx_int_t ngx_http_llama_session_prefix_tokenize(
    ngx_http_request_t *r, ngx_http_llama_session_ctx_t *ctx, cJSON *prompt);
static ngx_int_t ngx_http_llama_session_prefix_tokens_of(
    ngx_http_request_t *r, ngx_http_llama_session_ctx_t *ctx, int **tokens,
    size_t *n);
static ngx_int_t ngx_http_llama_session_prefix_prompt(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, int *tokens, size_t n);
static void ngx_http_llama_session_prefix_result(
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_prefix_t *pp);
static cJSON *ngx_http_llama_session_prefix_reply(
    ngx_http_llama_session_ctx_t *ctx);
static ngx_buf_t *ngx_http_llama_session_prefix_buf(ngx_http_request_t *r,
    char *text);


/*
 * Saves the session that the job's slot holds (ctx->job->out_key),
 * re-primed first when its last turn is known.  NGX_AGAIN: a call is on
 * its way (state REPRIME or SAVE); NGX_DONE: an idle save gave way to a
 * request of its session (nothing saved, the slot as it was or re-primed);
 * else an HTTP status.
 */

ngx_int_t
ngx_http_llama_session_save(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t  rc;

    ctx->job->primed = 0;

    if (ngx_http_llama_session_reprime_yield(ctx)) {
        return NGX_DONE;
    }

    rc = ngx_http_llama_session_reprime_start(r, ctx);

    if (rc == NGX_AGAIN) {
        return rc;
    }

    return ngx_http_llama_session_reprime_save(r, ctx);
}


static ngx_int_t
ngx_http_llama_session_reprime_save(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t  rc;

    if (ngx_http_llama_session_reprime_yield(ctx)) {
        return NGX_DONE;
    }

    ctx->job->reprime = NULL;

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_SAVE);

    rc = ngx_http_llama_session_call(r, ctx, NGX_HTTP_LLAMA_SESSION_CALL_SAVE,
                                     ctx->job->out_key, ctx->job->out_len);

    if (rc == NGX_AGAIN && ctx->job->own && ctx->api == NULL) {
        /* an idle save: a request of its session need not wait its reply */
        ngx_http_llama_session_lend(ctx->zone, ctx->job);
    }

    return rc;
}


/*
 * A call of the re-prime answered: the next one, or the save.  NGX_AGAIN:
 * a call is on its way; NGX_DONE: an idle save gave way; else an HTTP
 * status.
 */

ngx_int_t
ngx_http_llama_session_reprime_next(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t                         rc, cached, evaluated;
    ngx_http_llama_session_prefix_t  *pp;

    pp = ctx->job->reprime;

    /* the last render's tokens: the completion that follows waits a batch */

    if (pp && pp->step == NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS2
        && ngx_http_llama_session_reprime_yield(ctx))
    {
        return NGX_DONE;
    }

    rc = ngx_http_llama_session_prefix_next(r, ctx, "re-prime");

    if (rc == NGX_AGAIN) {
        return rc;
    }

    if (rc != NGX_OK) {
        (void) ngx_atomic_fetch_add(&ctx->zone->sh->stats.reprime_failed, 1);
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: \"%*s\" is saved without a re-prime",
                      ctx->job->out_len, ctx->job->out_key);

        return ngx_http_llama_session_reprime_save(r, ctx);
    }

    ngx_http_llama_session_prefix_tokens(ctx, &cached, &evaluated);

    (void) ngx_atomic_fetch_add(&ctx->zone->sh->stats.reprimes, 1);

    if (evaluated > 0) {
        (void) ngx_atomic_fetch_add(&ctx->zone->sh->stats.reprime_tokens,
                                    (ngx_atomic_uint_t) evaluated);
    }

    ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                  "llama_session: re-primed \"%*s\" on slot %ui of zone "
                  "\"%V\" before its save: %i tokens from the slot, %i "
                  "evaluated, in %M ms", ctx->job->out_len, ctx->job->out_key,
                  ctx->job->slot, &ctx->zone->name, cached, evaluated,
                  ngx_current_msec - pp->start);

    /* the file ends where the next turn extends it (reply.c's proof) */
    ctx->job->primed = 1;

    return ngx_http_llama_session_reprime_save(r, ctx);
}


/*
 * An idle save (the module's own job, not the API's) gives way to a request
 * of the session it saves before a call that waits for llama-server's
 * batch in flight: a client returning to its slot never waits for the
 * save of its own state (the slot stays changed, saved once idle again)
 */

static ngx_uint_t
ngx_http_llama_session_reprime_yield(ngx_http_llama_session_ctx_t *ctx)
{
    if (!ctx->job->own || ctx->api != NULL
        || !ngx_http_llama_session_idle_wanted(ctx->zone, ctx->job))
    {
        return 0;
    }

    ngx_log_error(NGX_LOG_INFO, ctx->job->log, 0,
                  "llama_session: \"%*s\" on slot %ui of zone \"%V\" is "
                  "not saved while idle: a request of the session came "
                  "first, it is saved once idle again",
                  ctx->job->out_len, ctx->job->out_key, ctx->job->slot,
                  &ctx->zone->name);

    return 1;
}


/*
 * The slot's turn file, read once and deleted (the conversation's text
 * stays no longer than needed): in a thread of the store's (io.c), or
 * here without threads.  The turn's reply has reached its client before
 * its file is written (in a thread of the worker that passed it,
 * store_put()): a client that goes on at once, or another session's turn
 * that needs the slot, may be here first.  The thread waits for the
 * write to end, within the zone's store_timeout= (the waiter's own
 * bound); in the event loop nothing waits.
 */

typedef struct {
    u_char                          path[NGX_MAX_PATH];
    size_t                          max;
    ngx_atomic_t                   *done;       /* the slot's turn_done */
    ngx_atomic_uint_t               seq;        /* the turn to read */
    ngx_msec_t                      wait;       /* for its write, at most */
    u_char                         *data;       /* NUL-terminated */
    size_t                          len;
    ngx_err_t                       err;        /* of the open, 0: none */
    ngx_int_t                       rc;         /* NGX_BUSY: not written */
} ngx_http_llama_session_turn_read_t;


static void
ngx_http_llama_session_reprime_read(ngx_http_llama_session_io_t *io)
{
    ssize_t                              n;
    ngx_fd_t                             fd;
    ngx_file_t                           file;
    ngx_file_info_t                      fi;
    ngx_http_llama_session_turn_read_t  *tr;

    tr = io->data;

    if (ngx_http_llama_session_io_wait(tr->done, tr->seq, tr->wait)
        != NGX_OK)
    {
        tr->rc = NGX_BUSY;
        return;
    }

    tr->rc = NGX_DECLINED;

    fd = ngx_http_llama_session_file_open(tr->path,
                                          NGX_HTTP_LLAMA_SESSION_FILE_READ, 0,
                                          &io->log);
    if (fd == NGX_INVALID_FILE) {
        tr->err = ngx_errno;
        return;
    }

    if (ngx_fd_info(fd, &fi) != NGX_FILE_ERROR
        && ngx_file_size(&fi) > 0
        && ngx_file_size(&fi) <= (off_t) tr->max)
    {
        tr->len = (size_t) ngx_file_size(&fi);
        tr->data = ngx_pnalloc(io->pool, tr->len + 1);

        if (tr->data) {
            ngx_memzero(&file, sizeof(ngx_file_t));
            file.fd = fd;
            file.log = &io->log;
            file.name.data = tr->path;
            file.name.len = ngx_strlen(tr->path);

            n = ngx_read_file(&file, tr->data, tr->len, 0);

            if (n == (ssize_t) tr->len) {
                tr->data[tr->len] = '\0';
                tr->rc = NGX_OK;
            }
        }
    }

    if (ngx_close_file(fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, &io->log, ngx_errno,
                      ngx_close_file_n " \"%s\" failed", tr->path);
    }

    /* read once: the conversation's text stays no longer than needed */

    if (ngx_delete_file(tr->path) == NGX_FILE_ERROR && ngx_errno != NGX_ENOENT)
    {
        ngx_log_error(NGX_LOG_ERR, &io->log, ngx_errno,
                      ngx_delete_file_n " \"%s\" failed", tr->path);
    }
}


/*
 * NGX_AGAIN: the turn file is read in a thread (state TURN, then save()
 * again) or the first render is on its way; NGX_DECLINED: no re-prime
 */

static ngx_int_t
ngx_http_llama_session_reprime_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char                               *data;
    size_t                                len;
    ngx_int_t                             rc;
    ngx_uint_t                            seq, kind;
    ngx_buf_t                            *first, *second;
    ngx_http_llama_session_io_t          *io;
    ngx_http_llama_session_zone_t        *zone;
    ngx_http_llama_session_loc_conf_t    *llcf;
    ngx_http_llama_session_turn_read_t   *tr;

    zone = ctx->zone;
    io = ctx->job->io;

    if (io) {
        /* back from the thread that read the turn file, or its bound */

        ctx->job->io = NULL;

        if (!io->done) {
            ngx_http_llama_session_io_leave(io, r->connection->log,
                                            "the session is saved without a "
                                            "re-prime");
            return NGX_DECLINED;
        }

        goto read;
    }

    if (!zone->reprime || zone->store.len == 0 || ctx->job->out_len == 0) {
        return NGX_DECLINED;
    }

    /* the slot's last turn, if nothing ran on it since */

    ngx_shmtx_lock(&zone->shpool->mutex);

    seq = zone->sh->slots[ctx->job->slot].turn_seq;
    zone->sh->slots[ctx->job->slot].turn_seq = 0;

    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (seq == 0) {
        return NGX_DECLINED;
    }

    /*
     * full attention: the next turn reuses the slot as it is up to where
     * its prompt leaves it, which no re-prime can move further; a re-prime
     * whose render differs from the client's next request (a template's
     * date, a field the render lacks) would cut it short
     */

    kind = ngx_http_llama_session_memory_kind(zone, ctx->job->fp);

    if (kind == NGX_HTTP_LLAMA_SESSION_MEMORY_FULL) {
        ngx_http_llama_session_turn_drop(zone, ctx->job->slot, seq,
                                         r->connection->log);
        return NGX_DECLINED;
    }

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    io = ngx_http_llama_session_io_create(zone, r->connection->log,
                                 sizeof(ngx_http_llama_session_turn_read_t));
    if (io == NULL) {
        return NGX_DECLINED;
    }

    tr = io->data;
    tr->max = llcf->body_max + 4 * 1024 * 1024;
    tr->done = &zone->sh->slots[ctx->job->slot].turn_done;
    tr->seq = seq;
    (void) ngx_http_llama_session_turn_path(zone, ctx->job->slot, tr->path);

    io->work = ngx_http_llama_session_reprime_read;

    if (ngx_http_llama_session_io_threads(zone)) {
        tr->wait = zone->store_timeout;
    }

    if (tr->wait
        && ngx_http_llama_session_io_post(io, &ctx->job->wait_ev)
           == NGX_AGAIN)
    {
        ctx->job->io = io;
        ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_TURN);

        if (!ctx->job->own && ctx->api == NULL) {
            /* a client's request: the phases again when woken */
            r->read_event_handler = ngx_http_test_reading;
            r->write_event_handler = ngx_http_core_run_phases;
        }

        /* the API's step (api.c) and an idle save's (idle.c) go on alike */
        return NGX_AGAIN;
    }

    tr->wait = 0;
    io->work(io);

read:

    tr = io->data;

    if (tr->rc != NGX_OK) {
        if (tr->rc == NGX_BUSY) {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "llama_session: the turn file \"%s\" is still "
                          "being written, \"%*s\" is saved without a "
                          "re-prime", tr->path, ctx->job->out_len,
                          ctx->job->out_key);

        } else if (tr->err) {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, tr->err,
                          "llama_session: " ngx_open_file_n " \"%s\" failed, "
                          "\"%*s\" is saved without a re-prime", tr->path,
                          ctx->job->out_len, ctx->job->out_key);

        } else {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "llama_session: cannot read \"%s\", \"%*s\" is "
                          "saved without a re-prime", tr->path,
                          ctx->job->out_len, ctx->job->out_key);
        }

        ngx_http_llama_session_io_free(io);
        return NGX_DECLINED;
    }

    len = tr->len;
    data = ngx_pnalloc(r->pool, len + 1);

    if (data == NULL) {
        ngx_http_llama_session_io_free(io);
        return NGX_DECLINED;
    }

    ngx_memcpy(data, tr->data, len + 1);
    seq = tr->seq;
    ngx_http_llama_session_io_free(io);

    rc = ngx_http_llama_session_reprime_bodies(r, ctx, seq, data, len,
                                               &first, &second);

    ngx_pfree(r->pool, data);

    if (rc == NGX_DONE) {
        (void) ngx_atomic_fetch_add(&zone->sh->stats.reprime_media, 1);

        ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                      "llama_session: the last turn of \"%*s\" holds an "
                      "image, audio or a file: its slot is saved as it is, "
                      "without a re-prime (a render writes the media as "
                      "text)", ctx->job->out_len, ctx->job->out_key);
        return NGX_DECLINED;
    }

    if (rc != NGX_OK) {
        return NGX_DECLINED;
    }

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_REPRIME);

    return ngx_http_llama_session_prefix_start(r, ctx, first, second);
}


/*
 * The two bodies of POST /apply-template: the turn's request with its
 * reply appended.  The file is the module's own, of the session whose
 * slot the job holds: its key must be the session's, its number the
 * slot's last turn (an older one is of a turn that ran before).  NGX_DONE:
 * the turn's messages carry media, which /apply-template renders as a text
 * marker (mtmd's) and /tokenize as that text: a prime of it would cut the
 * slot at the first image.  The slot as the turn left it is what the
 * next turn extends then (a model that attends to the whole context, or
 * to a window with --swa-full, reuses it up to the last reply).
 */

static ngx_int_t
ngx_http_llama_session_reprime_bodies(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t seq, u_char *data,
    size_t len, ngx_buf_t **first, ngx_buf_t **second)
{
    u_char                         *nl;
    cJSON                          *head, *body, *key, *message, *messages;
    cJSON                          *alt, *v, *n;
    ngx_int_t                       rc, sent;
    ngx_http_llama_session_span_t   span;

    static ngx_str_t  messages_name = ngx_string("messages");

    nl = ngx_strlchr(data, data + len, '\n');
    if (nl == NULL) {
        return NGX_DECLINED;
    }

    if (ngx_http_llama_session_json_body(nl + 1, data + len, &messages_name,
                                         &span, 1)
        == NGX_OK
        && ngx_http_llama_session_json_media(span.start, span.end))
    {
        return NGX_DONE;
    }

    head = cJSON_ParseWithLength((char *) data, nl - data);
    body = ngx_http_llama_session_json_tree(nl + 1, data + len - nl - 1);

    n = cJSON_GetObjectItemCaseSensitive(head, "seq");
    key = cJSON_GetObjectItemCaseSensitive(head, "key");
    message = cJSON_DetachItemFromObjectCaseSensitive(head, "message");
    messages = cJSON_GetObjectItemCaseSensitive(body, "messages");

    rc = NGX_DECLINED;

    if (!cJSON_IsNumber(n) || n->valuedouble != (double) seq
        || !cJSON_IsString(key) || !cJSON_IsObject(message)
        || !cJSON_IsArray(messages)
        || ngx_strlen(key->valuestring) != ctx->job->out_len
        || ngx_strncmp(key->valuestring, ctx->job->out_key, ctx->job->out_len)
           != 0)
    {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: the turn file of slot %ui is not of "
                      "\"%*s\"'s last turn, it is saved without a re-prime",
                      ctx->job->slot, ctx->job->out_len, ctx->job->out_key);
        cJSON_Delete(message);

    } else {
        /*
         * the reply's reasoning goes back as the client sent its earlier
         * replies': most send none (OpenAI's API has no such field,
         * DeepSeek's refuses it), others the message as they got it.
         * Where the history has no earlier reply to tell, the first
         * render has the reply without its reasoning, the second with
         * it: their common prefix ends before anything that differs (a
         * template that renders reasoning in the history, Nemotron 3's
         * "<think></think>" for none, diverges right after "<think>")
         */

        alt = NULL;
        v = cJSON_GetObjectItemCaseSensitive(message, "reasoning_content");
        sent = ngx_http_llama_session_reprime_reasons(messages);

        if (cJSON_IsString(v) && v->valuestring[0] != '\0' && sent == -1) {
            alt = cJSON_Duplicate(message, 1);
        }

        if (sent != 1) {
            cJSON_DeleteItemFromObjectCaseSensitive(message,
                                                    "reasoning_content");
        }

        rc = ngx_http_llama_session_prefix_bodies(r, body, message, alt,
                                                  first, second);
    }

    cJSON_Delete(head);
    cJSON_Delete(body);

    return rc;
}


/*
 * Does the client send its replies' reasoning back?  1: an assistant
 * message of the history carries it; 0: assistant messages do, none with
 * it; -1: the history has none to tell.
 */

static ngx_int_t
ngx_http_llama_session_reprime_reasons(cJSON *messages)
{
    cJSON      *m, *v;
    ngx_int_t   sent;

    sent = -1;

    cJSON_ArrayForEach(m, messages) {
        v = cJSON_GetObjectItemCaseSensitive(m, "role");

        if (!cJSON_IsString(v) || ngx_strcmp(v->valuestring, "assistant") != 0)
        {
            continue;
        }

        sent = 0;

        v = cJSON_GetObjectItemCaseSensitive(m, "reasoning_content");

        if (v == NULL) {
            v = cJSON_GetObjectItemCaseSensitive(m, "reasoning");
        }

        if (cJSON_IsString(v) && v->valuestring[0] != '\0') {
            return 1;
        }
    }

    return sent;
}


/*
 * The prefix prime, for the re-prime and for a warm start's base: the
 * bodies of the two renders of a chat request's body (the caller's,
 * changed), its messages followed by the reply, if any, and the next
 * turn: the reply's tool calls' results, else a user message, whose text
 * is "1", then "2".  The second render has alt in the reply's place, if
 * given.  reply and alt become the body's (alt freed when not used).
 */

ngx_int_t
ngx_http_llama_session_prefix_bodies(ngx_http_request_t *r, cJSON *body,
    cJSON *reply, cJSON *alt, ngx_buf_t **first, ngx_buf_t **second)
{
    int     at, from;
    cJSON  *messages;

    *first = NULL;
    *second = NULL;

    messages = cJSON_GetObjectItemCaseSensitive(body, "messages");

    if (!cJSON_IsArray(messages)) {
        cJSON_Delete(reply);
        cJSON_Delete(alt);
        return NGX_DECLINED;
    }

    at = cJSON_GetArraySize(messages);

    if (reply) {
        cJSON_AddItemToArray(messages, reply);
    }

    from = cJSON_GetArraySize(messages);

    if (ngx_http_llama_session_prefix_next_turn(messages, reply, "1")
        != NGX_OK)
    {
        cJSON_Delete(alt);
        return NGX_ERROR;
    }

    *first = ngx_http_llama_session_prefix_buf(r,
                                               cJSON_PrintUnformatted(body));

    if (reply && alt) {
        if (!cJSON_ReplaceItemInArray(messages, at, alt)) {
            cJSON_Delete(alt);
            return NGX_ERROR;
        }

    } else {
        cJSON_Delete(alt);
    }

    ngx_http_llama_session_prefix_text(messages, from, "2");

    *second = ngx_http_llama_session_prefix_buf(r,
                                                cJSON_PrintUnformatted(body));

    return (*first && *second) ? NGX_OK : NGX_ERROR;
}


/*
 * The next turn after the reply, as a client sends it: a "tool" message
 * for each of the reply's tool calls (with its id), else a user message
 */

static ngx_int_t
ngx_http_llama_session_prefix_next_turn(cJSON *messages, cJSON *reply,
    const char *text)
{
    cJSON       *calls, *call, *id, *m;
    ngx_uint_t   n;

    n = 0;
    calls = cJSON_GetObjectItemCaseSensitive(reply, "tool_calls");

    cJSON_ArrayForEach(call, calls) {
        id = cJSON_GetObjectItemCaseSensitive(call, "id");

        if (!cJSON_IsString(id)) {
            continue;
        }

        m = cJSON_CreateObject();
        if (m == NULL) {
            return NGX_ERROR;
        }

        cJSON_AddItemToArray(messages, m);

        if (cJSON_AddStringToObject(m, "role", "tool") == NULL
            || cJSON_AddStringToObject(m, "tool_call_id", id->valuestring)
               == NULL
            || cJSON_AddStringToObject(m, "content", text) == NULL)
        {
            return NGX_ERROR;
        }

        n++;
    }

    if (n) {
        return NGX_OK;
    }

    m = cJSON_CreateObject();
    if (m == NULL) {
        return NGX_ERROR;
    }

    cJSON_AddItemToArray(messages, m);

    if (cJSON_AddStringToObject(m, "role", "user") == NULL
        || cJSON_AddStringToObject(m, "content", text) == NULL)
    {
        return NGX_ERROR;
    }

    return NGX_OK;
}


/* the next turn's messages, from index from on, get the text */

static void
ngx_http_llama_session_prefix_text(cJSON *messages, int from,
    const char *text)
{
    int     i, n;
    cJSON  *m, *content;

    n = cJSON_GetArraySize(messages);

    for (i = from; i < n; i++) {
        m = cJSON_GetArrayItem(messages, i);
        content = cJSON_CreateString(text);

        if (content == NULL
            || !cJSON_ReplaceItemInObjectCaseSensitive(m, "content", content))
        {
            cJSON_Delete(content);
        }
    }
}


/* starts the first render; NGX_AGAIN: on its way, else an HTTP status */

ngx_int_t
ngx_http_llama_session_prefix_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_buf_t *first, ngx_buf_t *second)
{
    ngx_http_llama_session_prefix_t  *pp;

    pp = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_prefix_t));
    if (pp == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    pp->second = second;
    pp->step = NGX_HTTP_LLAMA_SESSION_PREFIX_FIRST;
    pp->cached = -1;
    pp->evaluated = -1;
    pp->start = ngx_current_msec;

    ctx->job->reprime = pp;
    ctx->job->call_body = first;
    pp->sent = first;

    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_APPLY,
                                       NULL, 0);
}


/*
 * A call of the prefix prime answered.  NGX_AGAIN: the next is on its
 * way; NGX_OK: the slot holds the prefix; NGX_DECLINED: it failed
 * (logged, "what" says whose), the slot holds what it held or a prefix
 * of it.
 */

ngx_int_t
ngx_http_llama_session_prefix_next(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, char *what)
{
    int                              *tokens;
    cJSON                            *json, *prompt;
    size_t                            ntokens, common;
    ngx_int_t                         rc;
    ngx_uint_t                        call;
    ngx_http_llama_session_prefix_t  *pp;

    pp = ctx->job->reprime;

    if (pp == NULL) {
        return NGX_DECLINED;
    }

    /* the body answered goes (a conversation's size: its own allocation) */

    if (pp->sent) {
        ngx_pfree(r->pool, pp->sent->start);
        pp->sent = NULL;
    }

    call = (pp->step == NGX_HTTP_LLAMA_SESSION_PREFIX_COMPLETE)
           ? NGX_HTTP_LLAMA_SESSION_CALL_COMPLETE
           : (pp->step == NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS1
              || pp->step == NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS2)
             ? NGX_HTTP_LLAMA_SESSION_CALL_TOKENIZE
             : NGX_HTTP_LLAMA_SESSION_CALL_APPLY;

    if (ctx->job->call_status != NGX_HTTP_OK) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: the %s on slot %ui failed: %V "
                      "answered %i \"%*s\"", what, ctx->job->slot,
                      ngx_http_llama_session_call_name(call),
                      ctx->job->call_status,
                      ctx->job->call_reply
                      ? ngx_min(ctx->job->call_reply->last
                                - ctx->job->call_reply->pos, 200) : 0,
                      ctx->job->call_reply ? ctx->job->call_reply->pos
                                          : (u_char *) "");
        return NGX_DECLINED;
    }

    switch (pp->step) {

    case NGX_HTTP_LLAMA_SESSION_PREFIX_COMPLETE:
        ngx_http_llama_session_prefix_result(ctx, pp);
        return NGX_OK;

    case NGX_HTTP_LLAMA_SESSION_PREFIX_FIRST:
    case NGX_HTTP_LLAMA_SESSION_PREFIX_SECOND:

        /* a render: its tokens are asked */

        json = ngx_http_llama_session_prefix_reply(ctx);
        prompt = cJSON_GetObjectItemCaseSensitive(json, "prompt");

        if (!cJSON_IsString(prompt)) {
            cJSON_Delete(json);
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "llama_session: POST /apply-template gave the %s "
                          "no prompt", what);
            return NGX_DECLINED;
        }

        rc = ngx_http_llama_session_prefix_tokenize(r, ctx, prompt);
        cJSON_Delete(json);

        if (rc != NGX_OK) {
            return NGX_DECLINED;
        }

        pp->step++;
        pp->sent = ctx->job->call_body;

        return ngx_http_llama_session_call(r, ctx,
                                        NGX_HTTP_LLAMA_SESSION_CALL_TOKENIZE,
                                        NULL, 0);

    case NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS1:

        /* the first render's tokens: kept, the second render is asked */

        if (ngx_http_llama_session_prefix_tokens_of(r, ctx, &pp->tokens,
                                                    &pp->ntokens)
            != NGX_OK)
        {
            ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                          "llama_session: POST /tokenize gave the %s no "
                          "tokens", what);
            return NGX_DECLINED;
        }

        pp->step = NGX_HTTP_LLAMA_SESSION_PREFIX_SECOND;
        ctx->job->call_body = pp->second;
        pp->sent = pp->second;

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_APPLY,
                                           NULL, 0);

    default: /* NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS2 */
        break;
    }

    /* the second render's tokens: what both share is the next turn's */

    if (ngx_http_llama_session_prefix_tokens_of(r, ctx, &tokens, &ntokens)
        != NGX_OK)
    {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: POST /tokenize gave the %s no tokens",
                      what);
        return NGX_DECLINED;
    }

    for (common = 0;
         common < pp->ntokens && common < ntokens
         && pp->tokens[common] == tokens[common];
         common++)
    {
        /* void */
    }

    ngx_pfree(r->pool, tokens);

    if (common == 0) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: the template renders no common "
                      "token for the %s", what);
        return NGX_DECLINED;
    }

    if (ngx_http_llama_session_prefix_prompt(r, ctx, pp->tokens, common)
        != NGX_OK)
    {
        return NGX_DECLINED;
    }

    ngx_pfree(r->pool, pp->tokens);
    pp->tokens = NULL;
    pp->ntokens = 0;

    pp->step = NGX_HTTP_LLAMA_SESSION_PREFIX_COMPLETE;
    pp->sent = ctx->job->call_body;

    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_COMPLETE,
                                       NULL, 0);
}


/*
 * POST /tokenize's body for a render: its tokens as llama-server makes a
 * prompt's (special tokens added and parsed), the model's in router mode
 */

static ngx_int_t
ngx_http_llama_session_prefix_tokenize(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, cJSON *prompt)
{
    cJSON  *json;

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_ERROR;
    }

    if (cJSON_AddItemReferenceToObject(json, "content", prompt) == 0
        || cJSON_AddBoolToObject(json, "add_special", 1) == NULL
        || cJSON_AddBoolToObject(json, "parse_special", 1) == NULL
        || (ctx->zone->model.len
            && cJSON_AddStringToObject(json, "model",
                                       (char *) ctx->zone->model.data)
               == NULL))
    {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    ctx->job->call_body = ngx_http_llama_session_prefix_buf(r,
                                                cJSON_PrintUnformatted(json));
    cJSON_Delete(json);

    return ctx->job->call_body ? NGX_OK : NGX_ERROR;
}


/*
 * POST /tokenize's reply, {"tokens":[...]}: the tokens, in the pool.  A
 * conversation's tokens are more values than a cJSON tree of a backend's
 * reply may hold (JSON_VALUES), and cost it 64 bytes each: the list is
 * scanned here, numbers only (with_pieces objects are refused).
 */

static ngx_str_t  ngx_http_llama_session_tokens_name = ngx_string("tokens");

static ngx_int_t
ngx_http_llama_session_prefix_tokens_of(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, int **tokens, size_t *n)
{
    int                            *t;
    u_char                         *p, *end;
    size_t                          i, max;
    uint64_t                        v;
    ngx_buf_t                      *b;
    ngx_http_llama_session_span_t   list;

    b = ctx->job->call_reply;

    if (b == NULL
        || ngx_http_llama_session_json_object(b->pos, b->last,
                                   &ngx_http_llama_session_tokens_name, &list,
                                   1)
           == NULL
        || list.start == NULL || *list.start != '[')
    {
        return NGX_DECLINED;
    }

    /* at most one token per two bytes of the list ("1,") */

    max = (size_t) (list.end - list.start) / 2 + 1;

    if (max > NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS) {
        max = NGX_HTTP_LLAMA_SESSION_PREFIX_TOKENS;
    }

    t = ngx_palloc(r->pool, max * sizeof(int));
    if (t == NULL) {
        return NGX_ERROR;
    }

    p = list.start + 1;
    end = list.end - 1;     /* its "]" */
    i = 0;

    for ( ;; ) {
        while (p < end && (*p == ' ' || *p == '\t' || *p == '\r'
                           || *p == '\n'))
        {
            p++;
        }

        if (p == end) {
            break;
        }

        if (*p < '0' || *p > '9' || i == max) {
            ngx_pfree(r->pool, t);
            return NGX_DECLINED;
        }

        for (v = 0; p < end && *p >= '0' && *p <= '9'; p++) {
            v = v * 10 + (*p - '0');

            if (v > 0x7fffffff) {
                /* no token id */
                ngx_pfree(r->pool, t);
                return NGX_DECLINED;
            }
        }

        t[i++] = (int) v;

        while (p < end && (*p == ' ' || *p == '\t' || *p == '\r'
                           || *p == '\n'))
        {
            p++;
        }

        if (p < end) {
            if (*p != ',') {
                ngx_pfree(r->pool, t);
                return NGX_DECLINED;
            }

            p++;
        }
    }

    if (i == 0) {
        ngx_pfree(r->pool, t);
        return NGX_DECLINED;
    }

    *tokens = t;
    *n = i;

    return NGX_OK;
}


/* what the completion took from the slot, and evaluated; -1: not said */

void
ngx_http_llama_session_prefix_tokens(ngx_http_llama_session_ctx_t *ctx,
    ngx_int_t *cached, ngx_int_t *evaluated)
{
    ngx_http_llama_session_prefix_t  *pp;

    pp = ctx->job->reprime;

    *cached = pp ? pp->cached : -1;
    *evaluated = pp ? pp->evaluated : -1;
}


/* POST /completion's body: the prefix's tokens, on the job's slot, one token */

static ngx_int_t
ngx_http_llama_session_prefix_prompt(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, int *tokens, size_t n)
{
    char   *text;
    cJSON  *json, *p;

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_ERROR;
    }

    if (cJSON_AddNumberToObject(json, "n_predict", 1) == NULL
        || cJSON_AddBoolToObject(json, "cache_prompt", 1) == NULL
        || cJSON_AddNumberToObject(json, "id_slot", ctx->job->slot) == NULL
        || cJSON_AddBoolToObject(json, "stream", 0) == NULL
        || (ctx->zone->model.len
            && cJSON_AddStringToObject(json, "model",
                                       (char *) ctx->zone->model.data)
               == NULL))
    {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    /* the tokens as they are: llama-server adds nothing to a token list */

    p = cJSON_CreateIntArray(tokens, (int) n);
    if (p == NULL) {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    cJSON_AddItemToObject(json, "prompt", p);

    text = cJSON_PrintUnformatted(json);
    cJSON_Delete(json);

    ctx->job->call_body = ngx_http_llama_session_prefix_buf(r, text);

    return ctx->job->call_body ? NGX_OK : NGX_ERROR;
}


/* the completion's reply: what it took from the slot, and evaluated */

static void
ngx_http_llama_session_prefix_result(ngx_http_llama_session_ctx_t *ctx,
    ngx_http_llama_session_prefix_t *pp)
{
    cJSON  *json, *timings, *cached, *evaluated;

    json = ngx_http_llama_session_prefix_reply(ctx);

    timings = cJSON_GetObjectItemCaseSensitive(json, "timings");
    cached = cJSON_GetObjectItemCaseSensitive(timings, "cache_n");
    evaluated = cJSON_GetObjectItemCaseSensitive(timings, "prompt_n");

    if (cJSON_IsNumber(cached) && cached->valuedouble >= 0
        && cached->valuedouble < 1e12)
    {
        pp->cached = (ngx_int_t) cached->valuedouble;
    }

    if (cJSON_IsNumber(evaluated) && evaluated->valuedouble >= 0
        && evaluated->valuedouble < 1e12)
    {
        pp->evaluated = (ngx_int_t) evaluated->valuedouble;
    }

    cJSON_Delete(json);
}


/* the reply of the call, parsed; NULL: none, or not JSON */

static cJSON *
ngx_http_llama_session_prefix_reply(ngx_http_llama_session_ctx_t *ctx)
{
    ngx_buf_t  *b;

    b = ctx->job->call_reply;

    return b ? ngx_http_llama_session_json_tree(b->pos, b->last - b->pos)
             : NULL;
}


/* a body of a call from cJSON's text, which is freed */

static ngx_buf_t *
ngx_http_llama_session_prefix_buf(ngx_http_request_t *r, char *text)
{
    size_t      len;
    ngx_buf_t  *b;

    if (text == NULL) {
        return NULL;
    }

    len = ngx_strlen(text);

    b = ngx_create_temp_buf(r->pool, len);

    if (b) {
        b->last = ngx_cpymem(b->last, text, len);
    }

    cJSON_free(text);

    return b;
}
