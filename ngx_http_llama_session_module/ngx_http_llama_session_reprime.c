
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
 * message "1" appended, then with "2"; their longest common prefix, cut
 * after its last newline, is what the next turn starts with (a template
 * that drops thinking has dropped it there as it will then).  POST
 * /completion {"prompt": that, "n_predict": 1, "id_slot": N,
 * "cache_prompt": true}: llama-server evaluates what the slot lacks (from
 * its own checkpoint near the prompt's end) and the one token it samples
 * is never decoded, so the slot holds exactly that prefix; then the save.
 *
 * A re-prime that fails (no turn file, a template error, a prompt too
 * long) is logged and the save goes on as it would have.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_json.h"
#include "ngx_http_llama_session_job.h"
#include "ngx_http_llama_session_reprime.h"
#include "ngx_http_llama_session_turn.h"


typedef struct {
    ngx_buf_t                      *second;     /* the render with "2" */
    ngx_str_t                       first;      /* the render with "1" */
    ngx_uint_t                      seq;        /* the turn's */
    ngx_msec_t                      start;
} ngx_http_llama_session_reprime_t;


static ngx_int_t ngx_http_llama_session_reprime_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_reprime_bodies(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, u_char *data, size_t len,
    ngx_buf_t **first, ngx_buf_t **second);
static ngx_int_t ngx_http_llama_session_reprime_prompt(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *prompt);
static void ngx_http_llama_session_reprime_result(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);
static ngx_buf_t *ngx_http_llama_session_reprime_buf(ngx_http_request_t *r,
    char *text);
static ngx_int_t ngx_http_llama_session_reprime_save(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx);


/*
 * Saves the session that the job's slot holds (ctx->job.out_key),
 * re-primed first when its last turn is known.  NGX_AGAIN: a call is on
 * its way (state REPRIME or SAVE); else an HTTP status.
 */

ngx_int_t
ngx_http_llama_session_save(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_int_t  rc;

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
    ctx->job.reprime = NULL;

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_SAVE);

    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_SAVE,
                                       ctx->job.out_key, ctx->job.out_len);
}


/* NGX_AGAIN: the first render is on its way; NGX_DECLINED: no re-prime */

static ngx_int_t
ngx_http_llama_session_reprime_start(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char                            *data, path[NGX_MAX_PATH];
    size_t                             len;
    ssize_t                            n;
    ngx_fd_t                           fd;
    ngx_int_t                          rc;
    ngx_uint_t                         seq;
    ngx_file_t                         file;
    ngx_file_info_t                    fi;
    ngx_buf_t                         *first;
    ngx_http_llama_session_zone_t     *zone;
    ngx_http_llama_session_reprime_t  *rp;
    ngx_http_llama_session_loc_conf_t *llcf;

    zone = ctx->zone;

    if (!zone->reprime || zone->store.len == 0 || ctx->job.out_len == 0) {
        return NGX_DECLINED;
    }

    /* the slot's last turn, if nothing ran on it since */

    ngx_shmtx_lock(&zone->shpool->mutex);
    seq = zone->sh->slots[ctx->job.slot].turn_seq;
    zone->sh->slots[ctx->job.slot].turn_seq = 0;
    ngx_shmtx_unlock(&zone->shpool->mutex);

    if (seq == 0) {
        return NGX_DECLINED;
    }

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    (void) ngx_http_llama_session_turn_path(zone, ctx->job.slot, path);

    fd = ngx_open_file(path, NGX_FILE_RDONLY, NGX_FILE_OPEN, 0);

    if (fd == NGX_INVALID_FILE) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, ngx_errno,
                      "llama_session: " ngx_open_file_n " \"%s\" failed, "
                      "\"%*s\" is saved without a re-prime", path,
                      ctx->job.out_len, ctx->job.out_key);
        return NGX_DECLINED;
    }

    data = NULL;
    rc = NGX_DECLINED;

    if (ngx_fd_info(fd, &fi) == NGX_FILE_ERROR
        || ngx_file_size(&fi) <= 0
        || ngx_file_size(&fi) > (off_t) (llcf->body_max + 4 * 1024 * 1024))
    {
        goto close;
    }

    len = (size_t) ngx_file_size(&fi);

    data = ngx_pnalloc(r->pool, len + 1);
    if (data == NULL) {
        goto close;
    }

    ngx_memzero(&file, sizeof(ngx_file_t));
    file.fd = fd;
    file.log = r->connection->log;
    file.name.data = path;
    file.name.len = ngx_strlen(path);

    n = ngx_read_file(&file, data, len, 0);

    if (n == (ssize_t) len) {
        data[len] = '\0';
        rc = NGX_OK;
    }

close:

    if (ngx_close_file(fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, r->connection->log, ngx_errno,
                      ngx_close_file_n " \"%s\" failed", path);
    }

    if (rc != NGX_OK) {
        if (data) {
            ngx_pfree(r->pool, data);
        }

        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: cannot read \"%s\", \"%*s\" is saved "
                      "without a re-prime", path, ctx->job.out_len,
                      ctx->job.out_key);
        return NGX_DECLINED;
    }

    rp = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_reprime_t));
    if (rp == NULL) {
        return NGX_DECLINED;
    }

    rp->seq = seq;
    rp->start = ngx_current_msec;

    rc = ngx_http_llama_session_reprime_bodies(r, ctx, data, len, &first,
                                               &rp->second);

    ngx_pfree(r->pool, data);

    if (rc != NGX_OK) {
        return NGX_DECLINED;
    }

    ctx->job.reprime = rp;
    ctx->job.call_body = first;

    ngx_http_llama_session_job_state(ctx, NGX_HTTP_LLAMA_SESSION_ST_REPRIME);

    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_APPLY,
                                       NULL, 0);
}


/*
 * The two bodies of POST /apply-template: the turn's request with its
 * reply and a user message appended.  The file is the module's own, of
 * the session whose slot the job holds: its key must be the session's.
 */

static ngx_int_t
ngx_http_llama_session_reprime_bodies(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, u_char *data, size_t len,
    ngx_buf_t **first, ngx_buf_t **second)
{
    u_char  *nl;
    char    *text;
    cJSON   *head, *body, *key, *message, *messages, *user, *content;

    *first = NULL;
    *second = NULL;

    nl = ngx_strlchr(data, data + len, '\n');
    if (nl == NULL) {
        return NGX_DECLINED;
    }

    head = cJSON_ParseWithLength((char *) data, nl - data);
    body = ngx_http_llama_session_json_tree(nl + 1, data + len - nl - 1);

    key = cJSON_GetObjectItemCaseSensitive(head, "key");
    message = cJSON_DetachItemFromObjectCaseSensitive(head, "message");
    messages = cJSON_GetObjectItemCaseSensitive(body, "messages");

    if (!cJSON_IsString(key) || !cJSON_IsObject(message)
        || !cJSON_IsArray(messages)
        || ngx_strlen(key->valuestring) != ctx->job.out_len
        || ngx_strncmp(key->valuestring, ctx->job.out_key, ctx->job.out_len)
           != 0)
    {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: the turn file of slot %ui is not of "
                      "\"%*s\", it is saved without a re-prime",
                      ctx->job.slot, ctx->job.out_len, ctx->job.out_key);
        goto failed;
    }

    cJSON_AddItemToArray(messages, message);
    message = NULL;

    user = cJSON_CreateObject();
    if (user == NULL) {
        goto failed;
    }

    cJSON_AddItemToArray(messages, user);

    content = cJSON_CreateString("1");

    if (cJSON_AddStringToObject(user, "role", "user") == NULL
        || content == NULL)
    {
        cJSON_Delete(content);
        goto failed;
    }

    cJSON_AddItemToObject(user, "content", content);

    text = cJSON_PrintUnformatted(body);
    *first = ngx_http_llama_session_reprime_buf(r, text);

    content = cJSON_CreateString("2");

    if (content == NULL
        || !cJSON_ReplaceItemInObjectCaseSensitive(user, "content", content))
    {
        cJSON_Delete(content);
        goto failed;
    }

    text = cJSON_PrintUnformatted(body);
    *second = ngx_http_llama_session_reprime_buf(r, text);

    if (*first == NULL || *second == NULL) {
        goto failed;
    }

    cJSON_Delete(head);
    cJSON_Delete(body);

    return NGX_OK;

failed:

    cJSON_Delete(message);
    cJSON_Delete(head);
    cJSON_Delete(body);

    return NGX_DECLINED;
}


/* a body of a call from cJSON's text, which is freed */

static ngx_buf_t *
ngx_http_llama_session_reprime_buf(ngx_http_request_t *r, char *text)
{
    size_t      len;
    ngx_buf_t  *b;

    if (text == NULL) {
        return NULL;
    }

    len = ngx_strlen(text);

    b = ngx_create_temp_buf(r->pool, len);

    if (b) {
        b->last = ngx_cpymem(b->pos, text, len);
    }

    cJSON_free(text);

    return b;
}


/*
 * A call of the re-prime answered: the next one, or the save.  NGX_AGAIN:
 * a call is on its way; else an HTTP status.
 */

ngx_int_t
ngx_http_llama_session_reprime_next(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    cJSON                             *json, *prompt;
    ngx_str_t                          common;
    ngx_http_llama_session_reprime_t  *rp;

    rp = ctx->job.reprime;

    if (rp == NULL) {
        return ngx_http_llama_session_reprime_save(r, ctx);
    }

    if (ctx->job.call_status == 0) {
        /* llama-server did not answer: the save will tell what it is */
        goto failed;
    }

    if (ctx->job.call_status != NGX_HTTP_OK) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: the re-prime of \"%*s\" failed: %V "
                      "answered %i \"%*s\"; it is saved as it is",
                      ctx->job.out_len, ctx->job.out_key,
                      ngx_http_llama_session_call_name(ctx->job.call),
                      ctx->job.call_status,
                      ctx->job.call_reply
                      ? ngx_min(ctx->job.call_reply->last
                                - ctx->job.call_reply->pos, 200) : 0,
                      ctx->job.call_reply ? ctx->job.call_reply->pos
                                          : (u_char *) "");
        goto failed;
    }

    if (ctx->job.call == NGX_HTTP_LLAMA_SESSION_CALL_COMPLETE) {
        ngx_http_llama_session_reprime_result(r, ctx);
        return ngx_http_llama_session_reprime_save(r, ctx);
    }

    json = ctx->job.call_reply
           ? ngx_http_llama_session_json_tree(ctx->job.call_reply->pos,
                                  ctx->job.call_reply->last
                                  - ctx->job.call_reply->pos)
           : NULL;

    prompt = cJSON_GetObjectItemCaseSensitive(json, "prompt");

    if (!cJSON_IsString(prompt)) {
        cJSON_Delete(json);
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: POST /apply-template gave no prompt, "
                      "\"%*s\" is saved without a re-prime",
                      ctx->job.out_len, ctx->job.out_key);
        goto failed;
    }

    if (rp->first.data == NULL) {
        /* the first render: keep it, the second is asked */

        rp->first.len = ngx_strlen(prompt->valuestring);
        rp->first.data = ngx_pnalloc(r->pool, rp->first.len);

        if (rp->first.data == NULL) {
            cJSON_Delete(json);
            goto failed;
        }

        ngx_memcpy(rp->first.data, prompt->valuestring, rp->first.len);
        cJSON_Delete(json);

        ctx->job.call_body = rp->second;

        return ngx_http_llama_session_call(r, ctx,
                                           NGX_HTTP_LLAMA_SESSION_CALL_APPLY,
                                           NULL, 0);
    }

    /* the second: what both share, up to its last newline */

    common.data = rp->first.data;
    common.len = 0;

    while (common.len < rp->first.len
           && prompt->valuestring[common.len] != '\0'
           && prompt->valuestring[common.len] == (char) rp->first.data[
                                                                common.len])
    {
        common.len++;
    }

    cJSON_Delete(json);

    while (common.len && common.data[common.len - 1] != '\n') {
        common.len--;
    }

    if (common.len == 0) {
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "llama_session: the template renders no common line "
                      "for \"%*s\", it is saved without a re-prime",
                      ctx->job.out_len, ctx->job.out_key);
        goto failed;
    }

    if (ngx_http_llama_session_reprime_prompt(r, ctx, &common) != NGX_OK) {
        goto failed;
    }

    ngx_pfree(r->pool, rp->first.data);
    ngx_str_null(&rp->first);

    return ngx_http_llama_session_call(r, ctx,
                                       NGX_HTTP_LLAMA_SESSION_CALL_COMPLETE,
                                       NULL, 0);

failed:

    (void) ngx_atomic_fetch_add(&ctx->zone->sh->stats.reprime_failed, 1);

    return ngx_http_llama_session_reprime_save(r, ctx);
}


/* POST /completion's body: the prefix, on the job's slot, one token */

static ngx_int_t
ngx_http_llama_session_reprime_prompt(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, ngx_str_t *prompt)
{
    char   *text;
    cJSON  *json, *p;

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_ERROR;
    }

    p = cJSON_CreateStringReference("");

    if (p == NULL
        || cJSON_AddNumberToObject(json, "n_predict", 1) == NULL
        || cJSON_AddBoolToObject(json, "cache_prompt", 1) == NULL
        || cJSON_AddNumberToObject(json, "id_slot", ctx->job.slot) == NULL
        || cJSON_AddBoolToObject(json, "stream", 0) == NULL
        || (ctx->zone->model.len
            && cJSON_AddStringToObject(json, "model",
                                       (char *) ctx->zone->model.data)
               == NULL))
    {
        cJSON_Delete(p);
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    /* the prompt: a NUL-terminated copy, as cJSON wants it */

    p->valuestring = (char *) ngx_pnalloc(r->pool, prompt->len + 1);
    if (p->valuestring == NULL) {
        cJSON_Delete(p);
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    ngx_memcpy(p->valuestring, prompt->data, prompt->len);
    p->valuestring[prompt->len] = '\0';

    cJSON_AddItemToObject(json, "prompt", p);

    text = cJSON_PrintUnformatted(json);
    cJSON_Delete(json);

    ctx->job.call_body = ngx_http_llama_session_reprime_buf(r, text);

    return ctx->job.call_body ? NGX_OK : NGX_ERROR;
}


/* the re-prime's reply: what it cost, for the log and the metrics */

static void
ngx_http_llama_session_reprime_result(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    cJSON                             *json, *timings, *cached, *evaluated;
    ngx_int_t                          c, e;
    ngx_http_llama_session_reprime_t  *rp;

    rp = ctx->job.reprime;

    json = ctx->job.call_reply
           ? ngx_http_llama_session_json_tree(ctx->job.call_reply->pos,
                                  ctx->job.call_reply->last
                                  - ctx->job.call_reply->pos)
           : NULL;

    timings = cJSON_GetObjectItemCaseSensitive(json, "timings");
    cached = cJSON_GetObjectItemCaseSensitive(timings, "cache_n");
    evaluated = cJSON_GetObjectItemCaseSensitive(timings, "prompt_n");

    c = cJSON_IsNumber(cached) ? (ngx_int_t) cached->valuedouble : -1;
    e = cJSON_IsNumber(evaluated) ? (ngx_int_t) evaluated->valuedouble : -1;

    cJSON_Delete(json);

    (void) ngx_atomic_fetch_add(&ctx->zone->sh->stats.reprimes, 1);

    if (e > 0) {
        (void) ngx_atomic_fetch_add(&ctx->zone->sh->stats.reprime_tokens,
                                    (ngx_atomic_uint_t) e);
    }

    ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                  "llama_session: re-primed \"%*s\" on slot %ui of zone "
                  "\"%V\" before its save: %i tokens from the slot, %i "
                  "evaluated, in %M ms", ctx->job.out_len, ctx->job.out_key,
                  ctx->job.slot, &ctx->zone->name, c, e,
                  ngx_current_msec - rp->start);
}
