
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The turn: what the re-prime before a save (reprime.c) needs of the last
 * turn a slot ran: the chat request as llama-server got it and the
 * assistant's message of its reply (content, reasoning, tool calls), read
 * from the reply as it passes, a stream's events one by one, never held
 * or changed.  When the reply is whole, both go to the slot's turn file
 * in the store, ".turn.<zone>.<slot>":
 *
 *   {"seq":N,"key":"<session>","message":{...}}\n<the request's body>
 *
 * and the slot's record takes N.  Whatever runs on the slot next (another
 * turn, a restore, a warm start, a re-prime) clears it (job_state()), so a
 * file whose N the slot does not have is never used.  The re-prime that
 * reads it deletes it: the store keeps a conversation's text only from
 * the end of its turn to its slot's next save or turn.  The file is
 * written in a thread after the reply passed: the slot's turn_done takes
 * N once the write ended, and the re-prime's read and the delete of a
 * slot that changed wait for it, in their threads (store_timeout=).  Only the requests
 * of a session in a dialect whose row keeps turns (chat completions,
 * Ollama's chat and Anthropic's translated into them), not probes, nor
 * the default session, nor Anthropic's passed to llama-server as they came
 * (llama_session_anthropic off: its /v1/messages has no template endpoint
 * of its own).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_ext.h"
#include "ngx_http_llama_session_file.h"
#include "ngx_http_llama_session_gguf.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_store.h"
#include "ngx_http_llama_session_turn.h"


#define NGX_HTTP_LLAMA_SESSION_TURN_MAX    (1024 * 1024)  /* the message */
#define NGX_HTTP_LLAMA_SESSION_TURN_WHOLE  (4 * 1024 * 1024) /* a reply */
#define NGX_HTTP_LLAMA_SESSION_TURN_EVENT  (256 * 1024)   /* one event */
#define NGX_HTTP_LLAMA_SESSION_TURN_TOOLS  16


typedef struct {
    u_char                         *data;
    size_t                          len;
    size_t                          size;
} ngx_http_llama_session_grow_t;


typedef struct {
    ngx_http_llama_session_grow_t   id;
    ngx_http_llama_session_grow_t   name;
    ngx_http_llama_session_grow_t   args;
} ngx_http_llama_session_turn_tool_t;


typedef struct {
    ngx_http_llama_session_grow_t   content;
    ngx_http_llama_session_grow_t   reasoning;

    /* a stream: the event not yet whole; else the whole reply */
    ngx_http_llama_session_grow_t   data;

    ngx_http_llama_session_turn_tool_t tools[
                                        NGX_HTTP_LLAMA_SESSION_TURN_TOOLS];
    ngx_uint_t                      ntools;

    unsigned                        stream:1;
    unsigned                        finished:1; /* a finish_reason seen */
    unsigned                        failed:1;   /* no turn from this one */
} ngx_http_llama_session_turn_t;


static ngx_int_t ngx_http_llama_session_grow(ngx_pool_t *pool,
    ngx_http_llama_session_grow_t *g, u_char *p, size_t n, size_t max);
static ngx_uint_t ngx_http_llama_session_turn_names(u_char *file,
    u_char *key, size_t len, ngx_log_t *log);
static void ngx_http_llama_session_turn_event(ngx_http_request_t *r,
    ngx_http_llama_session_turn_t *t, u_char *p, size_t len);
static ngx_int_t ngx_http_llama_session_turn_delta(ngx_http_request_t *r,
    ngx_http_llama_session_turn_t *t, cJSON *delta);
static void ngx_http_llama_session_turn_whole(ngx_http_request_t *r,
    ngx_http_llama_session_turn_t *t);
static cJSON *ngx_http_llama_session_turn_message(
    ngx_http_llama_session_turn_t *t);
static ngx_int_t ngx_http_llama_session_turn_write(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t seq, cJSON *message);


/*
 * The path of a slot's turn file, NUL-terminated, into buf (NGX_MAX_PATH);
 * the zone's name keeps only what a file name may have.
 */

u_char *
ngx_http_llama_session_turn_path(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t slot, u_char *buf)
{
    u_char      *p, *last;
    ngx_uint_t   i;

    last = buf + NGX_MAX_PATH - 32;

    p = ngx_slprintf(buf, last, "%V/.turn.", &zone->store);

    for (i = 0; i < zone->name.len && p < last; i++) {
        *p++ = (isalnum(zone->name.data[i]) || zone->name.data[i] == '-')
               ? zone->name.data[i] : '_';
    }

    p = ngx_sprintf(p, ".%ui%Z", slot);

    return buf;
}


/*
 * A slot's turn file goes: the slot's content changed (job_state()), the
 * API cleared the slot.  A conversation's text stays no longer than its
 * turn can serve a re-prime.  seq: the slot's last turn, whose file may
 * still be on its way (turn_end()): it goes once written; 0: the files
 * there are.
 */

void
ngx_http_llama_session_turn_drop(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t slot, ngx_uint_t seq, ngx_log_t *log)
{
    u_char         path[NGX_MAX_PATH];
    ngx_atomic_t  *done;

    if (zone->store.len == 0) {
        return;
    }

    (void) ngx_http_llama_session_turn_path(zone, slot, path);

    done = seq ? &zone->sh->slots[slot].turn_done : NULL;

    /* in a thread of the store's */
    ngx_http_llama_session_store_remove_after(zone, path, NULL, done, seq,
                                              log);
}


/*
 * The API deleted a session (not in a slot, else it refuses): the turn
 * file of any slot that still names it goes, read and deleted in a thread
 * of the store's (turn_names()).
 */

void
ngx_http_llama_session_turn_forget(ngx_http_llama_session_zone_t *zone,
    u_char *key, size_t len, ngx_log_t *log)
{
    u_char      path[NGX_MAX_PATH];
    ngx_uint_t  i;

    if (zone->store.len == 0) {
        return;
    }

    for (i = 0; i < zone->sh->nslots; i++) {
        (void) ngx_http_llama_session_turn_path(zone, i, path);

        ngx_http_llama_session_store_remove_if(zone, path,
                                     ngx_http_llama_session_turn_names,
                                     key, len, log);
    }
}


/*
 * Does the turn file name the session?  It starts with
 * {"seq":N,"key":"<key>",...: its first bytes tell whose it is.
 */

static ngx_uint_t
ngx_http_llama_session_turn_names(u_char *file, u_char *key, size_t len,
    ngx_log_t *log)
{
    u_char    head[NGX_HTTP_LLAMA_SESSION_KEY_MAX + 64];
    u_char   *p, *last;
    ssize_t   n;
    ngx_fd_t  fd;

    fd = ngx_http_llama_session_file_open(file,
                                          NGX_HTTP_LLAMA_SESSION_FILE_READ,
                                          0, log);
    if (fd == NGX_INVALID_FILE) {
        return 0;
    }

    n = ngx_read_fd(fd, head, sizeof(head));

    if (ngx_close_file(fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, log, ngx_errno,
                      ngx_close_file_n " \"%s\" failed", file);
    }

    if (n <= 0) {
        return 0;
    }

    last = head + n;
    p = ngx_strlcasestrn(head, last, (u_char *) ",\"key\":\"", 8 - 1);

    return p != NULL && (size_t) (last - p) >= 8 + len + 1
           && ngx_strncmp(p + 8, key, len) == 0 && p[8 + len] == '"';
}


/*
 * A zone that starts anew has no turn of its slots to vouch for: the turn
 * files an earlier nginx left (a conversation's text) go.
 */

void
ngx_http_llama_session_turn_clean(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    u_char      path[NGX_MAX_PATH], tmp[NGX_MAX_PATH];
    ngx_uint_t  i;

    if (ngx_test_config) {
        /* nginx -t: the running nginx's slots have their turns */
        return;
    }

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_SLOTS_MAX; i++) {
        ngx_http_llama_session_turn_drop(zone, i, 0, log);

        (void) ngx_http_llama_session_turn_path(zone, i, path);
        ngx_snprintf(tmp, sizeof(tmp), "%s.tmp%Z", path);
        (void) ngx_delete_file(tmp);
    }
}


/* the reply's header: is this a turn to keep? */

void
ngx_http_llama_session_turn_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_str_t                      *type;
    ngx_http_llama_session_turn_t  *t;

    ctx->turn = NULL;

    /* nothing is saved on a backend where restores stopped: no turn */

    if (!ctx->zone->reprime || ctx->zone->store.len == 0 || ctx->probe
        || ngx_http_llama_session_restores_off(ctx->zone, ctx->job->fp)
        || ctx->default_session || !ctx->dialect->turn
        || ctx->key_len == 0
        || r->request_body == NULL || r->request_body->bufs == NULL)
    {
        return;
    }

    t = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_turn_t));
    if (t == NULL) {
        return;
    }

    type = &r->headers_out.content_type;

    t->stream = (type->len >= sizeof("text/event-stream") - 1
                 && ngx_strncasecmp(type->data, (u_char *) "text/event-stream",
                                    sizeof("text/event-stream") - 1) == 0);

    ctx->turn = t;
}


/* a buffer of the reply */

void
ngx_http_llama_session_turn_data(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_buf_t *b)
{
    u_char                         *p, *nl;
    size_t                          n;
    ngx_http_llama_session_turn_t  *t;

    t = ctx->turn;

    if (t == NULL || t->failed) {
        return;
    }

    if (!ngx_buf_in_memory(b)) {
        if (ngx_buf_size(b)) {
            /* a reply buffered to a file: not read back for this */
            t->failed = 1;
        }

        return;
    }

    if (!t->stream) {
        if (ngx_http_llama_session_grow(r->pool, &t->data, b->pos,
                                        b->last - b->pos,
                                        NGX_HTTP_LLAMA_SESSION_TURN_WHOLE)
            != NGX_OK)
        {
            t->failed = 1;
        }

        return;
    }

    /* a stream: each line whole, then its event */

    p = b->pos;

    while (p < b->last && !t->failed) {
        nl = ngx_strlchr(p, b->last, '\n');
        n = (nl ? nl : b->last) - p;

        if (ngx_http_llama_session_grow(r->pool, &t->data, p, n,
                                        NGX_HTTP_LLAMA_SESSION_TURN_EVENT)
            != NGX_OK)
        {
            t->failed = 1;
            return;
        }

        if (nl == NULL) {
            return;
        }

        ngx_http_llama_session_turn_event(r, t, t->data.data, t->data.len);
        t->data.len = 0;
        p = nl + 1;
    }
}


/* one line of the stream: "data: {...}" adds its delta */

static void
ngx_http_llama_session_turn_event(ngx_http_request_t *r,
    ngx_http_llama_session_turn_t *t, u_char *p, size_t len)
{
    cJSON  *json, *choices, *choice, *delta, *finish;

    if (len && p[len - 1] == '\r') {
        len--;
    }

    if (len < 6 || ngx_strncmp(p, "data:", 5) != 0) {
        return;
    }

    p += 5;
    len -= 5;

    while (len && *p == ' ') {
        p++;
        len--;
    }

    if (len == 0 || *p != '{') {
        /* [DONE] */
        return;
    }

    json = cJSON_ParseWithLength((char *) p, len);
    if (json == NULL) {
        t->failed = 1;
        return;
    }

    choices = cJSON_GetObjectItemCaseSensitive(json, "choices");
    choice = cJSON_GetArrayItem(choices, 0);
    delta = cJSON_GetObjectItemCaseSensitive(choice, "delta");
    finish = cJSON_GetObjectItemCaseSensitive(choice, "finish_reason");

    if (cJSON_IsObject(delta)
        && ngx_http_llama_session_turn_delta(r, t, delta) != NGX_OK)
    {
        t->failed = 1;
    }

    if (cJSON_IsString(finish)) {
        t->finished = 1;
    }

    cJSON_Delete(json);
}


/*
 * A delta (or a whole reply's message): its text, reasoning and tool
 * calls, the latter by their index, their arguments in pieces.
 */

static ngx_int_t
ngx_http_llama_session_turn_delta(ngx_http_request_t *r,
    ngx_http_llama_session_turn_t *t, cJSON *delta)
{
    size_t                               n;
    cJSON                               *item, *calls, *call, *fn, *f;
    ngx_int_t                            index;
    ngx_http_llama_session_grow_t       *g;
    ngx_http_llama_session_turn_tool_t  *tool;

    static char  *texts[] = { "content", "reasoning_content" };

    for (n = 0; n < 2; n++) {
        item = cJSON_GetObjectItemCaseSensitive(delta, texts[n]);
        g = n ? &t->reasoning : &t->content;

        if (cJSON_IsString(item)) {
            if (ngx_http_llama_session_grow(r->pool, g,
                                            (u_char *) item->valuestring,
                                            ngx_strlen(item->valuestring),
                                            NGX_HTTP_LLAMA_SESSION_TURN_MAX)
                != NGX_OK)
            {
                return NGX_ERROR;
            }
        }
    }

    calls = cJSON_GetObjectItemCaseSensitive(delta, "tool_calls");
    index = 0;

    if (!cJSON_IsArray(calls)) {
        return NGX_OK;
    }

    cJSON_ArrayForEach(call, calls) {
        item = cJSON_GetObjectItemCaseSensitive(call, "index");

        if (cJSON_IsNumber(item)) {
            index = (ngx_int_t) item->valuedouble;
        }

        if (index < 0 || index >= NGX_HTTP_LLAMA_SESSION_TURN_TOOLS) {
            return NGX_ERROR;
        }

        tool = &t->tools[index];
        t->ntools = ngx_max(t->ntools, (ngx_uint_t) index + 1);

        fn = cJSON_GetObjectItemCaseSensitive(call, "function");

        for (n = 0; n < 3; n++) {
            f = (n == 0) ? cJSON_GetObjectItemCaseSensitive(call, "id")
                : cJSON_GetObjectItemCaseSensitive(fn, n == 1 ? "name"
                                                          : "arguments");
            g = (n == 0) ? &tool->id : (n == 1) ? &tool->name : &tool->args;

            if (cJSON_IsString(f)
                && ngx_http_llama_session_grow(r->pool, g,
                                               (u_char *) f->valuestring,
                                               ngx_strlen(f->valuestring),
                                               NGX_HTTP_LLAMA_SESSION_TURN_MAX)
                   != NGX_OK)
            {
                return NGX_ERROR;
            }
        }

        if (!cJSON_IsNumber(item)) {
            /* a whole reply's calls have no index: one after the other */
            index++;
        }
    }

    return NGX_OK;
}


/*
 * The reply is whole (its last buffer): the turn goes to the slot's file,
 * and the slot's record takes its number while the request still holds
 * the slot.
 */

void
ngx_http_llama_session_turn_end(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    cJSON                          *message;
    ngx_uint_t                      seq;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_turn_t  *t;
    ngx_http_llama_session_zone_t  *zone;

    t = ctx->turn;
    ctx->turn = NULL;

    if (t == NULL || t->failed || !ctx->job->acquired || ctx->job->released) {
        return;
    }

    if (!t->stream) {
        ngx_http_llama_session_turn_whole(r, t);
    }

    if (!t->finished) {
        /* cut short: the slot holds what the next turn will not send */
        return;
    }

    message = ngx_http_llama_session_turn_message(t);
    if (message == NULL) {
        return;
    }

    /* a conversation without an id: known again by this reply (ext.c) */
    ngx_http_llama_session_ext_reply(ctx, message);

    zone = ctx->zone;
    sh = zone->sh;

    if (ngx_http_llama_session_memory_kind(zone, ctx->job->fp)
        == NGX_HTTP_LLAMA_SESSION_MEMORY_FULL)
    {
        /* full attention: no re-prime reads it (reprime.c), no file */
        cJSON_Delete(message);
        return;
    }

    seq = ngx_atomic_fetch_add(&sh->turn_next, 1) + 1;

    if (ngx_http_llama_session_turn_write(r, ctx, seq, message) != NGX_OK) {
        cJSON_Delete(message);
        return;
    }

    cJSON_Delete(message);

    /* the request holds the slot: only its holder touches turn_seq */
    sh->slots[ctx->job->slot].turn_seq = seq;

    ngx_log_debug3(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "llama_session: turn %ui of \"%*s\" kept for its re-prime",
                   seq, ctx->key_len, ctx->key);
}


/* a whole reply, kept as it came: its message, as a stream's deltas */

static void
ngx_http_llama_session_turn_whole(ngx_http_request_t *r,
    ngx_http_llama_session_turn_t *t)
{
    cJSON  *json, *choices, *message;

    json = cJSON_ParseWithLength((char *) t->data.data, t->data.len);
    choices = cJSON_GetObjectItemCaseSensitive(json, "choices");
    message = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(choices, 0),
                                               "message");

    if (cJSON_IsObject(message)
        && ngx_http_llama_session_turn_delta(r, t, message) == NGX_OK)
    {
        t->finished = 1;
    }

    cJSON_Delete(json);

    if (t->data.data) {
        ngx_pfree(r->pool, t->data.data);
        ngx_memzero(&t->data, sizeof(ngx_http_llama_session_grow_t));
    }
}


/* the assistant's message as the next turn will send it back */

static cJSON *
ngx_http_llama_session_turn_message(ngx_http_llama_session_turn_t *t)
{
    cJSON                               *m, *calls, *call, *fn;
    ngx_uint_t                           i;
    ngx_http_llama_session_turn_tool_t  *tool;

    m = cJSON_CreateObject();
    if (m == NULL) {
        return NULL;
    }

    if (cJSON_AddStringToObject(m, "role", "assistant") == NULL) {
        goto failed;
    }

    /* cJSON's strings end at a NUL: the grown buffers have one after */

    if (cJSON_AddStringToObject(m, "content", t->content.len
                                ? (char *) t->content.data : "")
        == NULL)
    {
        goto failed;
    }

    if (t->reasoning.len
        && cJSON_AddStringToObject(m, "reasoning_content",
                                   (char *) t->reasoning.data)
           == NULL)
    {
        goto failed;
    }

    if (t->ntools == 0) {
        return m;
    }

    calls = cJSON_AddArrayToObject(m, "tool_calls");
    if (calls == NULL) {
        goto failed;
    }

    for (i = 0; i < t->ntools; i++) {
        tool = &t->tools[i];

        call = cJSON_CreateObject();
        if (call == NULL) {
            goto failed;
        }

        cJSON_AddItemToArray(calls, call);

        fn = cJSON_CreateObject();
        if (fn == NULL) {
            goto failed;
        }

        cJSON_AddItemToObject(call, "function", fn);

        if ((tool->id.len
             && cJSON_AddStringToObject(call, "id", (char *) tool->id.data)
                == NULL)
            || cJSON_AddStringToObject(call, "type", "function") == NULL
            || cJSON_AddStringToObject(fn, "name", tool->name.len
                                       ? (char *) tool->name.data : "")
               == NULL
            || cJSON_AddStringToObject(fn, "arguments", tool->args.len
                                       ? (char *) tool->args.data : "{}")
               == NULL)
        {
            goto failed;
        }
    }

    return m;

failed:

    cJSON_Delete(m);
    return NULL;
}


/* the turn file, written aside and renamed: a crash leaves the old one */

static ngx_int_t
ngx_http_llama_session_turn_write(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_uint_t seq, cJSON *message)
{
    u_char      path[NGX_MAX_PATH], tmp[NGX_MAX_PATH], *head, *p;
    char       *text;
    size_t      hlen;
    ngx_int_t   rc;
    ngx_str_t   body, parts[2];
    ngx_log_t  *log;
    ngx_http_llama_session_slot_t      *slot;
    ngx_http_llama_session_loc_conf_t  *llcf;

    log = r->connection->log;
    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    if (ngx_http_llama_session_read_body(r, llcf->body_max, &body) != NGX_OK) {
        return NGX_DECLINED;
    }

    text = cJSON_PrintUnformatted(message);
    if (text == NULL) {
        return NGX_ERROR;
    }

    hlen = sizeof("{\"seq\":,\"key\":\"\",\"message\":}\n") - 1
           + NGX_INT_T_LEN + ctx->key_len + ngx_strlen(text);

    head = ngx_pnalloc(r->pool, hlen);
    if (head == NULL) {
        cJSON_free(text);
        return NGX_ERROR;
    }

    /* the key has only [A-Za-z0-9_-@]: nothing to escape */

    p = ngx_sprintf(head, "{\"seq\":%ui,\"key\":\"%*s\",\"message\":%s}\n",
                    seq, ctx->key_len, ctx->key, text);

    cJSON_free(text);

    (void) ngx_http_llama_session_turn_path(ctx->zone, ctx->job->slot, path);
    ngx_snprintf(tmp, sizeof(tmp), "%s.tmp%Z", path);

    /*
     * written in a thread of the store's (store_put()), the request not
     * waiting: a name left by a crash or planted (a link, a FIFO) is
     * removed first, the file is written whole, then takes its name
     */

    parts[0].data = head;
    parts[0].len = p - head;
    parts[1] = body;

    slot = &ctx->zone->sh->slots[ctx->job->slot];

    rc = ngx_http_llama_session_store_put(ctx->zone, path, tmp, parts, 2,
                                          0640, &slot->turn_done, seq, log);

    if (body.data != r->request_body->bufs->buf->pos) {
        ngx_pfree(r->pool, body.data);
    }

    ngx_pfree(r->pool, head);

    if (rc != NGX_OK) {
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: cannot write \"%s\", the session's "
                      "next save is not re-primed", path);
    }

    return rc;
}


/* appends n bytes, NUL-terminated; max: the most it may hold */

static ngx_int_t
ngx_http_llama_session_grow(ngx_pool_t *pool,
    ngx_http_llama_session_grow_t *g, u_char *p, size_t n, size_t max)
{
    u_char  *data;
    size_t   size;

    if (g->len + n + 1 > max) {
        return NGX_DECLINED;
    }

    if (g->len + n + 1 > g->size) {
        size = ngx_max(g->size * 2, 256);

        while (size < g->len + n + 1) {
            size *= 2;
        }

        data = ngx_pnalloc(pool, size);
        if (data == NULL) {
            return NGX_ERROR;
        }

        if (g->len) {
            ngx_memcpy(data, g->data, g->len);
        }

        if (g->data) {
            ngx_pfree(pool, g->data);
        }

        g->data = data;
        g->size = size;
    }

    ngx_memcpy(g->data + g->len, p, n);
    g->len += n;
    g->data[g->len] = '\0';

    return NGX_OK;
}
