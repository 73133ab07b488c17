
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Anthropic's Messages API (POST /v1/messages) on any number of slots.
 * llama-server's own /v1/messages drops "id_slot": the request would run
 * on whatever slot llama-server picks, another session's cache.  So the
 * module translates it, as llama-server itself would (server_chat_
 * convert_anthropic_to_oai(), mirrored here so that the model gets the
 * same prompt either way), into a chat completion, which pin.c pins to
 * the session's slot, and translates the reply back into Anthropic's
 * shape (convert.c's filters):
 *
 *   whole:     {"id","type":"message","role","content":[thinking, text,
 *              tool_use...],"model","stop_reason","stop_sequence","usage"}
 *   streamed:  message_start, ping, content_block_start / _delta / _stop
 *              for each block in turn (thinking_delta + signature_delta,
 *              text_delta, input_json_delta), message_delta with the
 *              stop_reason and the usage, message_stop; an error in the
 *              stream an "error" event
 *   errors:    {"type":"error","error":{"type","message"}}
 *
 * usage.input_tokens are the prompt's evaluated tokens, and
 * cache_read_input_tokens those llama-server took from the slot's cache,
 * as llama-server's own reply counts them.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_anthropic.h"
#include "ngx_http_llama_session_convert.h"
#include "ngx_http_llama_session_error.h"
#include "ngx_http_llama_session_json.h"

#include <cjson/cJSON.h>


/* the content block being streamed */

#define NGX_HTTP_LLAMA_SESSION_BLOCK_NONE      0
#define NGX_HTTP_LLAMA_SESSION_BLOCK_THINKING  1
#define NGX_HTTP_LLAMA_SESSION_BLOCK_TEXT      2
#define NGX_HTTP_LLAMA_SESSION_BLOCK_TOOL      3


typedef struct {
    ngx_uint_t                      started;    /* message_start sent */
    ngx_uint_t                      done;       /* message_stop sent */
    ngx_uint_t                      block;      /* the one open, BLOCK_* */
    ngx_uint_t                      nblocks;    /* started so far */
    ngx_int_t                       tool;       /* the open tool call's */
    char                           *stop_reason;
    u_char                          id[64];
    u_char                          model[256];
} ngx_http_llama_session_anthropic_t;


static cJSON *ngx_http_llama_session_anthropic_chat(cJSON *in);
static void ngx_http_llama_session_anthropic_billing(char *text);
static cJSON *ngx_http_llama_session_anthropic_system(cJSON *system);
static ngx_int_t ngx_http_llama_session_anthropic_message(cJSON *msg,
    cJSON *out);
static ngx_int_t ngx_http_llama_session_anthropic_tool_use(cJSON *block,
    cJSON *calls);
static ngx_int_t ngx_http_llama_session_anthropic_tool_result(cJSON *block,
    cJSON *results);
static char *ngx_http_llama_session_anthropic_join(cJSON *blocks, char *type,
    char *member);
static cJSON *ngx_http_llama_session_anthropic_image(cJSON *block);
static void ngx_http_llama_session_anthropic_params(cJSON *in, cJSON *out);
static ngx_int_t ngx_http_llama_session_anthropic_event(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len);
static ngx_int_t ngx_http_llama_session_anthropic_chunk(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, cJSON *json);
static ngx_int_t ngx_http_llama_session_anthropic_start(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, cJSON *json);
static ngx_int_t ngx_http_llama_session_anthropic_end(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c);
static ngx_int_t ngx_http_llama_session_anthropic_whole(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len);
static cJSON *ngx_http_llama_session_anthropic_error(ngx_uint_t status,
    cJSON *reply);
static ngx_int_t ngx_http_llama_session_anthropic_bare(cJSON *json);
static void ngx_http_llama_session_anthropic_usage(
    ngx_http_llama_session_conv_t *c, cJSON *usage);
static char *ngx_http_llama_session_anthropic_stop(cJSON *finish);
static void ngx_http_llama_session_anthropic_names(
    ngx_http_llama_session_anthropic_t *a, cJSON *reply);
static ngx_int_t ngx_http_llama_session_anthropic_open(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, ngx_uint_t block, cJSON *call);
static ngx_int_t ngx_http_llama_session_anthropic_close(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c);
static ngx_int_t ngx_http_llama_session_anthropic_delta(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, char *type, char *name, char *value);
static ngx_int_t ngx_http_llama_session_anthropic_sse(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, char *event, cJSON *data);
static char *ngx_http_llama_session_anthropic_str(cJSON *object, char *name);


/*
 * The body was read and the session found: the Anthropic request becomes
 * a chat completion.  NGX_OK, or NGX_DONE when an error was sent.
 */

ngx_int_t
ngx_http_llama_session_anthropic_request(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    char                                *error;
    cJSON                               *in, *out, *stream;
    ngx_http_llama_session_conv_t       *c;
    ngx_http_llama_session_anthropic_t  *a;

    in = ngx_http_llama_session_conv_parse(r, ctx, "an Anthropic", &error);

    if (in == NULL) {
        if (error == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        return ngx_http_llama_session_error(r, ctx, NGX_HTTP_BAD_REQUEST,
                                            "invalid_request_error", error, 0);
    }

    stream = cJSON_GetObjectItemCaseSensitive(in, "stream");

    out = ngx_http_llama_session_anthropic_chat(in);

    if (out == NULL) {
        cJSON_Delete(in);
        return ngx_http_llama_session_error(r, ctx, NGX_HTTP_BAD_REQUEST,
                                  "invalid_request_error",
                                  "invalid request: messages is required, "
                                  "and system, messages, tools and their "
                                  "blocks must be of their types", 0);
    }

    a = ngx_pcalloc(r->pool, sizeof(ngx_http_llama_session_anthropic_t));
    c = ngx_http_llama_session_conv_create(r, ctx, "Anthropic");

    if (a == NULL || c == NULL
        || ngx_http_llama_session_conv_request(r, ctx, out,
                                               "/v1/chat/completions")
           != NGX_OK)
    {
        cJSON_Delete(out);
        cJSON_Delete(in);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    c->stream = cJSON_IsTrue(stream);
    c->stream_type = "text/event-stream";
    c->event = ngx_http_llama_session_anthropic_event;
    c->whole = ngx_http_llama_session_anthropic_whole;
    c->data = a;

    a->tool = -1;

    cJSON_Delete(out);
    cJSON_Delete(in);

    return NGX_OK;
}


/*
 * A warm start's prime (warm.c) made in Anthropic's shape: the same
 * translation, pinned to the slot.  NULL: an error.
 */

ngx_buf_t *
ngx_http_llama_session_anthropic_prime(ngx_http_request_t *r, ngx_buf_t *b,
    ngx_uint_t slot)
{
    char       *text;
    cJSON      *in, *out;
    size_t      len;
    ngx_buf_t  *nb;

    in = ngx_http_llama_session_json_tree(b->pos, b->last - b->pos);
    out = in ? ngx_http_llama_session_anthropic_chat(in) : NULL;
    cJSON_Delete(in);

    if (out == NULL || !cJSON_AddNumberToObject(out, "id_slot", slot)) {
        cJSON_Delete(out);
        return NULL;
    }

    text = cJSON_PrintUnformatted(out);
    cJSON_Delete(out);

    if (text == NULL) {
        return NULL;
    }

    len = ngx_strlen(text);

    nb = ngx_create_temp_buf(r->pool, len);
    if (nb) {
        nb->last = ngx_cpymem(nb->last, text, len);
        nb->last_buf = 1;
        nb->last_in_chain = 1;
    }

    cJSON_free(text);

    return nb;
}


/*
 * Anthropic's request as llama-server's chat completion, member by member
 * as llama-server converts it; NULL: of the wrong shape
 */

static cJSON *
ngx_http_llama_session_anthropic_chat(cJSON *in)
{
    char   *type;
    cJSON  *out, *messages, *msg, *tools, *tool, *t, *f, *item, *oai, *tc;

    messages = cJSON_GetObjectItemCaseSensitive(in, "messages");

    if (!cJSON_IsArray(messages)) {
        return NULL;
    }

    out = cJSON_CreateObject();
    if (out == NULL) {
        return NULL;
    }

    /*
     * the model, which llama-server's own conversion leaves out: its
     * router mode routes a chat completion by it
     */

    item = cJSON_GetObjectItemCaseSensitive(in, "model");
    if (cJSON_IsString(item)) {
        cJSON_AddItemToObject(out, "model", cJSON_Duplicate(item, 1));
    }

    oai = cJSON_AddArrayToObject(out, "messages");
    if (oai == NULL) {
        goto failed;
    }

    /* the system prompt: one system message, its text blocks joined */

    item = cJSON_GetObjectItemCaseSensitive(in, "system");

    if (item && !cJSON_IsNull(item)) {
        msg = ngx_http_llama_session_anthropic_system(item);
        if (msg == NULL) {
            goto failed;
        }

        cJSON_AddItemToArray(oai, msg);
    }

    cJSON_ArrayForEach(msg, messages) {
        if (!cJSON_IsObject(msg)
            || ngx_http_llama_session_anthropic_message(msg, oai) != NGX_OK)
        {
            goto failed;
        }
    }

    /* tools: functions; tool_choice auto, any or tool */

    tools = cJSON_GetObjectItemCaseSensitive(in, "tools");

    if (cJSON_IsArray(tools)) {
        t = cJSON_AddArrayToObject(out, "tools");
        if (t == NULL) {
            goto failed;
        }

        cJSON_ArrayForEach(tool, tools) {
            item = cJSON_CreateObject();
            if (item == NULL) {
                goto failed;
            }

            cJSON_AddItemToArray(t, item);
            cJSON_AddStringToObject(item, "type", "function");
            f = cJSON_AddObjectToObject(item, "function");

            if (f == NULL) {
                goto failed;
            }

            cJSON_AddStringToObject(f, "name",
                ngx_http_llama_session_anthropic_str(tool, "name"));

            cJSON_AddStringToObject(f, "description",
                ngx_http_llama_session_anthropic_str(tool, "description"));

            item = cJSON_GetObjectItemCaseSensitive(tool, "input_schema");
            cJSON_AddItemToObject(f, "parameters",
                                  item ? cJSON_Duplicate(item, 1)
                                       : cJSON_CreateObject());
        }
    }

    tc = cJSON_GetObjectItemCaseSensitive(in, "tool_choice");
    type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(tc, "type"));

    if (cJSON_IsObject(tc) && type) {
        if (ngx_strcmp(type, "auto") == 0) {
            cJSON_AddStringToObject(out, "tool_choice", "auto");

        } else if (ngx_strcmp(type, "any") == 0
                   || ngx_strcmp(type, "tool") == 0)
        {
            cJSON_AddStringToObject(out, "tool_choice", "required");
        }
    }

    ngx_http_llama_session_anthropic_params(in, out);

    return out;

failed:

    cJSON_Delete(out);
    return NULL;
}


/*
 * Claude Code's first system block: the five characters after "cch="
 * (the request's own stamp) become "fffff", as llama-server makes them
 */

static void
ngx_http_llama_session_anthropic_billing(char *text)
{
    char    *cch;
    size_t   len;

    static char  header[] = "x-anthropic-billing-header:";

    if (ngx_strncmp(text, header, sizeof(header) - 1) != 0) {
        return;
    }

    cch = ngx_strstr(text + sizeof(header) - 1, "cch=");
    if (cch == NULL) {
        return;
    }

    len = ngx_strlen(cch);

    if (len > 4 + 5 && cch[4 + 5] == ';') {
        ngx_memset(cch + 4, 'f', 5);
    }
}


static cJSON *
ngx_http_llama_session_anthropic_system(cJSON *system)
{
    char    *text, *p;
    cJSON   *block, *msg, *t;
    size_t   len;

    if (cJSON_IsString(system)) {
        text = cJSON_GetStringValue(system);
        len = ngx_strlen(text);

    } else if (cJSON_IsArray(system)) {
        len = 0;

        cJSON_ArrayForEach(block, system) {
            t = cJSON_GetObjectItemCaseSensitive(block, "type");
            text = cJSON_GetStringValue(
                       cJSON_GetObjectItemCaseSensitive(block, "text"));

            if (cJSON_IsString(t) && ngx_strcmp(t->valuestring, "text") == 0
                && text)
            {
                len += ngx_strlen(text);
            }
        }

        text = NULL;

    } else {
        return NULL;
    }

    /* cJSON's own allocator: the string goes into the message */

    p = cJSON_malloc(len + 1);
    if (p == NULL) {
        return NULL;
    }

    if (text) {
        ngx_memcpy(p, text, len + 1);
        ngx_http_llama_session_anthropic_billing(p);

    } else {
        len = 0;

        cJSON_ArrayForEach(block, system) {
            t = cJSON_GetObjectItemCaseSensitive(block, "type");
            text = cJSON_GetStringValue(
                       cJSON_GetObjectItemCaseSensitive(block, "text"));

            if (cJSON_IsString(t) && ngx_strcmp(t->valuestring, "text") == 0
                && text)
            {
                ngx_memcpy(p + len, text, ngx_strlen(text) + 1);
                ngx_http_llama_session_anthropic_billing(p + len);
                len += ngx_strlen(text);
            }
        }

        p[len] = '\0';
    }

    msg = cJSON_CreateObject();
    t = cJSON_CreateString(p);
    cJSON_free(p);

    if (msg == NULL || t == NULL) {
        cJSON_Delete(msg);
        cJSON_Delete(t);
        return NULL;
    }

    cJSON_AddStringToObject(msg, "role", "system");
    cJSON_AddItemToObject(msg, "content", t);

    return msg;
}


/*
 * One of Anthropic's messages as chat messages: its text and image blocks
 * the content, its thinking the reasoning, its tool_use blocks tool
 * calls, and its tool_result blocks a "tool" message each, after it
 */

static ngx_int_t
ngx_http_llama_session_anthropic_message(cJSON *msg, cJSON *out)
{
    char   *role, *type, *reasoning;
    cJSON  *content, *block, *parts, *calls, *results, *m, *img;

    role = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(msg, "role"));
    content = cJSON_GetObjectItemCaseSensitive(msg, "content");

    if (content == NULL) {
        if (role && ngx_strcmp(role, "assistant") == 0) {
            return NGX_OK;
        }

        cJSON_AddItemToArray(out, cJSON_Duplicate(msg, 1));
        return NGX_OK;
    }

    if (!cJSON_IsArray(content)) {
        cJSON_AddItemToArray(out, cJSON_Duplicate(msg, 1));
        return NGX_OK;
    }

    parts = cJSON_CreateArray();
    calls = cJSON_CreateArray();
    results = cJSON_CreateArray();

    /* the reasoning of all thinking blocks, joined */

    reasoning = ngx_http_llama_session_anthropic_join(content, "thinking",
                                                      "thinking");

    if (parts == NULL || calls == NULL || results == NULL
        || reasoning == NULL)
    {
        goto failed;
    }

    cJSON_ArrayForEach(block, content) {
        type = cJSON_GetStringValue(
                   cJSON_GetObjectItemCaseSensitive(block, "type"));

        if (type == NULL) {
            continue;
        }

        if (ngx_strcmp(type, "text") == 0) {
            cJSON_AddItemToArray(parts, cJSON_Duplicate(block, 1));

        } else if (ngx_strcmp(type, "image") == 0) {
            img = ngx_http_llama_session_anthropic_image(block);
            if (img) {
                cJSON_AddItemToArray(parts, img);
            }

        } else if (ngx_strcmp(type, "tool_use") == 0) {
            if (ngx_http_llama_session_anthropic_tool_use(block, calls)
                != NGX_OK)
            {
                goto failed;
            }

        } else if (ngx_strcmp(type, "tool_result") == 0) {
            if (ngx_http_llama_session_anthropic_tool_result(block, results)
                != NGX_OK)
            {
                goto failed;
            }
        }
    }

    if (cJSON_GetArraySize(parts) || cJSON_GetArraySize(calls)
        || reasoning[0])
    {
        m = cJSON_CreateObject();
        if (m == NULL) {
            goto failed;
        }

        cJSON_AddItemToArray(out, m);
        cJSON_AddStringToObject(m, "role", role ? role : "");

        if (cJSON_GetArraySize(parts)) {
            cJSON_AddItemToObject(m, "content", parts);
            parts = NULL;

        } else {
            cJSON_AddStringToObject(m, "content", "");
        }

        if (cJSON_GetArraySize(calls)) {
            cJSON_AddItemToObject(m, "tool_calls", calls);
            calls = NULL;
        }

        if (reasoning[0]) {
            cJSON_AddStringToObject(m, "reasoning_content", reasoning);
        }
    }

    /* the tool messages after it, in order (each taken off the front) */

    while (results->child) {
        cJSON_AddItemToArray(out, cJSON_DetachItemViaPointer(results,
                                                             results->child));
    }

    cJSON_free(reasoning);
    cJSON_Delete(parts);
    cJSON_Delete(calls);
    cJSON_Delete(results);

    return NGX_OK;

failed:

    if (reasoning) {
        cJSON_free(reasoning);
    }

    cJSON_Delete(parts);
    cJSON_Delete(calls);
    cJSON_Delete(results);

    return NGX_ERROR;
}


/* a tool_use block as a tool call, its input the arguments' JSON text */

static ngx_int_t
ngx_http_llama_session_anthropic_tool_use(cJSON *block, cJSON *calls)
{
    char   *p;
    cJSON  *call, *f, *input;

    call = cJSON_CreateObject();
    if (call == NULL) {
        return NGX_ERROR;
    }

    cJSON_AddItemToArray(calls, call);

    cJSON_AddStringToObject(call, "id",
        ngx_http_llama_session_anthropic_str(block, "id"));
    cJSON_AddStringToObject(call, "type", "function");

    f = cJSON_AddObjectToObject(call, "function");
    if (f == NULL) {
        return NGX_ERROR;
    }

    cJSON_AddStringToObject(f, "name",
        ngx_http_llama_session_anthropic_str(block, "name"));

    input = cJSON_GetObjectItemCaseSensitive(block, "input");
    p = input ? cJSON_PrintUnformatted(input) : NULL;
    cJSON_AddStringToObject(f, "arguments", p ? p : "{}");

    if (p) {
        cJSON_free(p);
    }

    return NGX_OK;
}


/* a tool_result block as a "tool" message */

static ngx_int_t
ngx_http_llama_session_anthropic_tool_result(cJSON *block, cJSON *results)
{
    char        *type, *text;
    cJSON       *m, *rc, *c, *rparts, *f, *img;
    ngx_uint_t   images;

    m = cJSON_CreateObject();
    if (m == NULL) {
        return NGX_ERROR;
    }

    cJSON_AddItemToArray(results, m);
    cJSON_AddStringToObject(m, "role", "tool");

    cJSON_AddStringToObject(m, "tool_call_id",
        ngx_http_llama_session_anthropic_str(block, "tool_use_id"));

    rc = cJSON_GetObjectItemCaseSensitive(block, "content");

    if (cJSON_IsString(rc)) {
        cJSON_AddStringToObject(m, "content", rc->valuestring);
        return NGX_OK;
    }

    if (!cJSON_IsArray(rc)) {
        cJSON_AddStringToObject(m, "content", "");
        return NGX_OK;
    }

    /* text only: one string; with images: the parts */

    rparts = cJSON_CreateArray();
    if (rparts == NULL) {
        return NGX_ERROR;
    }

    images = 0;

    cJSON_ArrayForEach(c, rc) {
        type = cJSON_GetStringValue(
                   cJSON_GetObjectItemCaseSensitive(c, "type"));

        if (type && ngx_strcmp(type, "text") == 0) {
            text = cJSON_GetStringValue(
                       cJSON_GetObjectItemCaseSensitive(c, "text"));

            f = cJSON_CreateObject();
            cJSON_AddItemToArray(rparts, f);
            cJSON_AddStringToObject(f, "type", "text");
            cJSON_AddStringToObject(f, "text", text ? text : "");

        } else if (type && ngx_strcmp(type, "image") == 0) {
            images = 1;
            img = ngx_http_llama_session_anthropic_image(c);
            if (img) {
                cJSON_AddItemToArray(rparts, img);
            }
        }
    }

    if (images) {
        cJSON_AddItemToObject(m, "content", rparts);
        return NGX_OK;
    }

    cJSON_Delete(rparts);

    text = ngx_http_llama_session_anthropic_join(rc, "text", "text");
    if (text == NULL) {
        return NGX_ERROR;
    }

    cJSON_AddStringToObject(m, "content", text);
    cJSON_free(text);

    return NGX_OK;
}


/*
 * the string members "member" of the blocks of type "type", joined in
 * cJSON's allocator (the string goes into a message): counted, then
 * copied, linear however many blocks; NULL: no memory
 */

static char *
ngx_http_llama_session_anthropic_join(cJSON *blocks, char *type,
    char *member)
{
    char        *p, *t, *text;
    cJSON       *block;
    size_t       len;
    u_char      *q;
    ngx_uint_t   copy;

    p = NULL;
    q = NULL;
    len = 0;

    for (copy = 0; copy < 2; copy++) {
        cJSON_ArrayForEach(block, blocks) {
            t = ngx_http_llama_session_anthropic_str(block, "type");
            text = cJSON_GetStringValue(
                       cJSON_GetObjectItemCaseSensitive(block, member));

            if (ngx_strcmp(t, type) != 0 || text == NULL) {
                continue;
            }

            if (copy) {
                q = ngx_cpymem(q, text, ngx_strlen(text));

            } else {
                len += ngx_strlen(text);
            }
        }

        if (!copy) {
            p = cJSON_malloc(len + 1);
            if (p == NULL) {
                return NULL;
            }

            q = (u_char *) p;
        }
    }

    *q = '\0';

    return p;
}


/* an image block: a data: URL of its base64, or its URL */

static cJSON *
ngx_http_llama_session_anthropic_image(cJSON *block)
{
    char    *type, *media, *data, *p;
    cJSON   *source, *part, *url;
    size_t   len;

    source = cJSON_GetObjectItemCaseSensitive(block, "source");
    type = cJSON_GetStringValue(
               cJSON_GetObjectItemCaseSensitive(source, "type"));

    if (type == NULL) {
        return NULL;
    }

    if (ngx_strcmp(type, "base64") == 0) {
        media = cJSON_GetStringValue(
                    cJSON_GetObjectItemCaseSensitive(source, "media_type"));
        data = cJSON_GetStringValue(
                    cJSON_GetObjectItemCaseSensitive(source, "data"));
        media = media ? media : "image/jpeg";
        data = data ? data : "";

        len = sizeof("data:;base64,") - 1 + ngx_strlen(media)
              + ngx_strlen(data);

        p = cJSON_malloc(len + 1);
        if (p == NULL) {
            return NULL;
        }

        *ngx_sprintf((u_char *) p, "data:%s;base64,%s", media, data) = '\0';

    } else if (ngx_strcmp(type, "url") == 0) {
        data = cJSON_GetStringValue(
                    cJSON_GetObjectItemCaseSensitive(source, "url"));
        data = data ? data : "";
        len = ngx_strlen(data);

        p = cJSON_malloc(len + 1);
        if (p == NULL) {
            return NULL;
        }

        ngx_memcpy(p, data, len + 1);

    } else {
        return NULL;
    }

    part = cJSON_CreateObject();
    cJSON_AddStringToObject(part, "type", "image_url");
    url = cJSON_AddObjectToObject(part, "image_url");
    cJSON_AddStringToObject(url, "url", p);
    cJSON_free(p);

    return part;
}


/*
 * the request's members after its messages and tools: the stop sequences,
 * max_tokens, sampling, the thinking budget, the metadata's user
 */

static void
ngx_http_llama_session_anthropic_params(cJSON *in, cJSON *out)
{
    char        *type;
    cJSON       *item, *thinking, *budget;
    ngx_uint_t   i;

    static char  *same[] = { "temperature", "top_p", "top_k", "stream",
                             "chat_template_kwargs", NULL };

    item = cJSON_GetObjectItemCaseSensitive(in, "stop_sequences");
    if (item) {
        cJSON_AddItemToObject(out, "stop", cJSON_Duplicate(item, 1));
    }

    /* max_tokens is required in Anthropic's API; llama-server's default */

    item = cJSON_GetObjectItemCaseSensitive(in, "max_tokens");
    cJSON_AddItemToObject(out, "max_tokens",
                          item ? cJSON_Duplicate(item, 1)
                               : cJSON_CreateNumber(4096));

    for (i = 0; same[i]; i++) {
        item = cJSON_GetObjectItemCaseSensitive(in, same[i]);
        if (item) {
            cJSON_AddItemToObject(out, same[i], cJSON_Duplicate(item, 1));
        }
    }

    /*
     * a stream's first event carries the prompt's tokens, as llama-server's
     * own /v1/messages gives them in message_start (clients count their
     * context by it): llama-server puts its timings in every chunk then
     */

    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(in, "stream"))) {
        cJSON_AddTrueToObject(out, "timings_per_token");
    }

    thinking = cJSON_GetObjectItemCaseSensitive(in, "thinking");
    type = cJSON_GetStringValue(
               cJSON_GetObjectItemCaseSensitive(thinking, "type"));

    if (type && ngx_strcmp(type, "enabled") == 0) {
        budget = cJSON_GetObjectItemCaseSensitive(thinking, "budget_tokens");
        cJSON_AddNumberToObject(out, "thinking_budget_tokens",
                                cJSON_IsNumber(budget) ? budget->valuedouble
                                                       : 10000);
    }

    type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(
               cJSON_GetObjectItemCaseSensitive(in, "metadata"), "user_id"));

    if (type && type[0]) {
        cJSON_AddStringToObject(out, "__metadata_user_id", type);
    }
}


/* a whole reply, not streamed, or an error: one Anthropic object */

static ngx_int_t
ngx_http_llama_session_anthropic_whole(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len)
{
    char                                *text;
    cJSON                               *json, *out, *content, *choice, *msg;
    cJSON                               *block, *call, *f, *input;
    cJSON                               *usage;
    ngx_http_llama_session_anthropic_t  *a;

    a = c->data;

    json = ngx_http_llama_session_json_tree(data, len);

    if (c->status != NGX_HTTP_OK || json == NULL) {
        out = ngx_http_llama_session_anthropic_error(c->status, json);
        cJSON_Delete(json);
        return ngx_http_llama_session_conv_emit(r, c, out, 0);
    }

    ngx_http_llama_session_conv_stats(c, json);
    ngx_http_llama_session_anthropic_names(a, json);

    choice = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(json,
                                                                 "choices"),
                                0);
    msg = cJSON_GetObjectItemCaseSensitive(choice, "message");

    out = cJSON_CreateObject();
    if (out == NULL) {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    cJSON_AddStringToObject(out, "id", (char *) a->id);
    cJSON_AddStringToObject(out, "type", "message");
    cJSON_AddStringToObject(out, "role", "assistant");
    content = cJSON_AddArrayToObject(out, "content");

    /* thinking first, then the text, then the tool calls */

    text = cJSON_GetStringValue(
               cJSON_GetObjectItemCaseSensitive(msg, "reasoning_content"));

    if (text && text[0]) {
        block = cJSON_CreateObject();
        cJSON_AddItemToArray(content, block);
        cJSON_AddStringToObject(block, "type", "thinking");
        cJSON_AddStringToObject(block, "thinking", text);
        cJSON_AddStringToObject(block, "signature", "");
    }

    text = cJSON_GetStringValue(
               cJSON_GetObjectItemCaseSensitive(msg, "content"));

    if (text && text[0]) {
        block = cJSON_CreateObject();
        cJSON_AddItemToArray(content, block);
        cJSON_AddStringToObject(block, "type", "text");
        cJSON_AddStringToObject(block, "text", text);
    }

    cJSON_ArrayForEach(call, cJSON_GetObjectItemCaseSensitive(msg,
                                                              "tool_calls"))
    {
        f = cJSON_GetObjectItemCaseSensitive(call, "function");

        block = cJSON_CreateObject();
        cJSON_AddItemToArray(content, block);
        cJSON_AddStringToObject(block, "type", "tool_use");

        cJSON_AddStringToObject(block, "id",
            ngx_http_llama_session_anthropic_str(call, "id"));

        cJSON_AddStringToObject(block, "name",
            ngx_http_llama_session_anthropic_str(f, "name"));

        text = cJSON_GetStringValue(
                   cJSON_GetObjectItemCaseSensitive(f, "arguments"));
        input = text ? ngx_http_llama_session_json_tree((u_char *) text,
                                                        ngx_strlen(text))
                     : NULL;

        if (!cJSON_IsObject(input)) {
            cJSON_Delete(input);
            input = cJSON_CreateObject();
        }

        cJSON_AddItemToObject(block, "input", input);
    }

    cJSON_AddStringToObject(out, "model", (char *) a->model);
    cJSON_AddStringToObject(out, "stop_reason",
                            ngx_http_llama_session_anthropic_stop(
                                cJSON_GetObjectItemCaseSensitive(choice,
                                                             "finish_reason")));
    cJSON_AddNullToObject(out, "stop_sequence");

    usage = cJSON_AddObjectToObject(out, "usage");
    ngx_http_llama_session_anthropic_usage(c, usage);

    cJSON_Delete(json);

    return ngx_http_llama_session_conv_emit(r, c, out, 0);
}


/*
 * One SSE event of llama-server's chat stream: Anthropic's events for its
 * chunk, for the error it reports, or at the stream's end its last ones
 */

static ngx_int_t
ngx_http_llama_session_anthropic_event(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, u_char *data, size_t len)
{
    cJSON                               *json, *err;
    ngx_int_t                            rc;
    ngx_http_llama_session_anthropic_t  *a;

    a = c->data;

    if (a->done) {
        return NGX_OK;
    }

    if (data == NULL || (len == 6 && ngx_strncmp(data, "[DONE]", 6) == 0)) {
        return ngx_http_llama_session_anthropic_end(r, c);
    }

    json = ngx_http_llama_session_json_tree(data, len);

    if (json == NULL) {
        return NGX_OK;
    }

    err = cJSON_GetObjectItemCaseSensitive(json, "error");

    if (err == NULL) {
        rc = ngx_http_llama_session_anthropic_chunk(r, c, json);
        cJSON_Delete(json);
        return rc;
    }

    /* llama-server failed the request in its stream */

    if (ngx_http_llama_session_anthropic_close(r, c) != NGX_OK) {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    a->done = 1;

    err = ngx_http_llama_session_anthropic_error(
              NGX_HTTP_INTERNAL_SERVER_ERROR, json);
    cJSON_Delete(json);

    return ngx_http_llama_session_anthropic_sse(r, c, "error", err);
}


/*
 * A chunk of the stream.  Each content kind is a block of its own, opened
 * when its first delta comes and closed when another kind's does (a tool
 * call when the next one starts), as Anthropic streams them: one block at
 * a time.
 */

static ngx_int_t
ngx_http_llama_session_anthropic_chunk(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, cJSON *json)
{
    char                                *text;
    cJSON                               *choice, *delta, *calls, *call;
    cJSON                               *index, *f;
    ngx_int_t                            i;
    ngx_uint_t                           k;
    ngx_http_llama_session_anthropic_t  *a;

    static struct {
        char                            *member;
        ngx_uint_t                       block;
        char                            *delta;
        char                            *field;
    } kinds[] = {
        { "reasoning_content", NGX_HTTP_LLAMA_SESSION_BLOCK_THINKING,
          "thinking_delta", "thinking" },
        { "content", NGX_HTTP_LLAMA_SESSION_BLOCK_TEXT, "text_delta",
          "text" }
    };

    a = c->data;

    ngx_http_llama_session_conv_stats(c, json);

    if (!a->started) {
        if (ngx_http_llama_session_anthropic_bare(json) == NGX_OK) {
            /*
             * llama-server's first chunk names the role alone; the
             * prompt's figures come with the next one (timings_per_token):
             * so does message_start
             */

            return NGX_OK;
        }

        if (ngx_http_llama_session_anthropic_start(r, c, json) != NGX_OK) {
            return NGX_ERROR;
        }
    }

    choice = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(json,
                                                                 "choices"),
                                0);
    delta = cJSON_GetObjectItemCaseSensitive(choice, "delta");

    /* the reasoning, then the text: each a block of its own */

    for (k = 0; k < 2; k++) {
        text = cJSON_GetStringValue(
                   cJSON_GetObjectItemCaseSensitive(delta, kinds[k].member));

        if (text && text[0]
            && ((a->block != kinds[k].block
                 && ngx_http_llama_session_anthropic_open(r, c,
                                                    kinds[k].block, NULL)
                    != NGX_OK)
                || ngx_http_llama_session_anthropic_delta(r, c,
                                                    kinds[k].delta,
                                                    kinds[k].field, text)
                   != NGX_OK))
        {
            return NGX_ERROR;
        }
    }

    /* the tool calls: a block each, its arguments input_json_delta */

    calls = cJSON_GetObjectItemCaseSensitive(delta, "tool_calls");

    cJSON_ArrayForEach(call, calls) {
        index = cJSON_GetObjectItemCaseSensitive(call, "index");
        f = cJSON_GetObjectItemCaseSensitive(call, "function");

        i = cJSON_IsNumber(index) ? index->valueint : a->tool;

        if (a->block != NGX_HTTP_LLAMA_SESSION_BLOCK_TOOL || i != a->tool) {
            if (ngx_http_llama_session_anthropic_open(r, c,
                                      NGX_HTTP_LLAMA_SESSION_BLOCK_TOOL, call)
                != NGX_OK)
            {
                return NGX_ERROR;
            }

            a->tool = i;
        }

        text = cJSON_GetStringValue(
                   cJSON_GetObjectItemCaseSensitive(f, "arguments"));

        if (text && text[0]
            && ngx_http_llama_session_anthropic_delta(r, c,
                                                      "input_json_delta",
                                                      "partial_json", text)
               != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    f = cJSON_GetObjectItemCaseSensitive(choice, "finish_reason");

    if (cJSON_IsString(f)) {
        a->stop_reason = ngx_http_llama_session_anthropic_stop(f);
    }

    return NGX_OK;
}


/* message_start, with the prompt's usage, and a ping */

static ngx_int_t
ngx_http_llama_session_anthropic_start(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, cJSON *json)
{
    cJSON                               *start, *message, *usage, *ping;
    ngx_http_llama_session_anthropic_t  *a;

    a = c->data;

    ngx_http_llama_session_anthropic_names(a, json);

    start = cJSON_CreateObject();
    cJSON_AddStringToObject(start, "type", "message_start");
    message = cJSON_AddObjectToObject(start, "message");
    cJSON_AddStringToObject(message, "id", (char *) a->id);
    cJSON_AddStringToObject(message, "type", "message");
    cJSON_AddStringToObject(message, "role", "assistant");
    cJSON_AddArrayToObject(message, "content");
    cJSON_AddStringToObject(message, "model", (char *) a->model);
    cJSON_AddNullToObject(message, "stop_reason");
    cJSON_AddNullToObject(message, "stop_sequence");
    usage = cJSON_AddObjectToObject(message, "usage");
    ngx_http_llama_session_anthropic_usage(c, usage);

    a->started = 1;

    ping = cJSON_CreateObject();
    cJSON_AddStringToObject(ping, "type", "ping");

    if (ngx_http_llama_session_anthropic_sse(r, c, "message_start", start)
        != NGX_OK)
    {
        cJSON_Delete(ping);
        return NGX_ERROR;
    }

    return ngx_http_llama_session_anthropic_sse(r, c, "ping", ping);
}


/* the stream's end: the last block closed, the stop and the usage */

static ngx_int_t
ngx_http_llama_session_anthropic_end(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c)
{
    cJSON                               *ev, *delta, *usage;
    ngx_http_llama_session_anthropic_t  *a;

    a = c->data;

    if (!a->started) {
        /* nothing came: an error, not an empty message */
        a->done = 1;

        return ngx_http_llama_session_anthropic_sse(r, c, "error",
                   ngx_http_llama_session_anthropic_error(
                       NGX_HTTP_BAD_GATEWAY, NULL));
    }

    if (ngx_http_llama_session_anthropic_close(r, c) != NGX_OK) {
        return NGX_ERROR;
    }

    a->done = 1;

    ev = cJSON_CreateObject();
    cJSON_AddStringToObject(ev, "type", "message_delta");
    delta = cJSON_AddObjectToObject(ev, "delta");
    cJSON_AddStringToObject(delta, "stop_reason",
                            a->stop_reason ? a->stop_reason : "end_turn");
    cJSON_AddNullToObject(delta, "stop_sequence");
    usage = cJSON_AddObjectToObject(ev, "usage");
    ngx_http_llama_session_anthropic_usage(c, usage);

    if (ngx_http_llama_session_anthropic_sse(r, c, "message_delta", ev)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    ev = cJSON_CreateObject();
    cJSON_AddStringToObject(ev, "type", "message_stop");

    return ngx_http_llama_session_anthropic_sse(r, c, "message_stop", ev);
}


/* opens a content block (closing the one open) */

static ngx_int_t
ngx_http_llama_session_anthropic_open(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, ngx_uint_t block, cJSON *call)
{
    cJSON                               *ev, *cb;
    ngx_http_llama_session_anthropic_t  *a;

    a = c->data;

    if (ngx_http_llama_session_anthropic_close(r, c) != NGX_OK) {
        return NGX_ERROR;
    }

    ev = cJSON_CreateObject();
    cJSON_AddStringToObject(ev, "type", "content_block_start");
    cJSON_AddNumberToObject(ev, "index", a->nblocks);
    cb = cJSON_AddObjectToObject(ev, "content_block");

    switch (block) {

    case NGX_HTTP_LLAMA_SESSION_BLOCK_THINKING:
        cJSON_AddStringToObject(cb, "type", "thinking");
        cJSON_AddStringToObject(cb, "thinking", "");
        cJSON_AddStringToObject(cb, "signature", "");
        break;

    case NGX_HTTP_LLAMA_SESSION_BLOCK_TEXT:
        cJSON_AddStringToObject(cb, "type", "text");
        cJSON_AddStringToObject(cb, "text", "");
        break;

    default: /* NGX_HTTP_LLAMA_SESSION_BLOCK_TOOL */
        cJSON_AddStringToObject(cb, "type", "tool_use");
        cJSON_AddStringToObject(cb, "id",
            ngx_http_llama_session_anthropic_str(call, "id"));
        cJSON_AddStringToObject(cb, "name",
            ngx_http_llama_session_anthropic_str(
                cJSON_GetObjectItemCaseSensitive(call, "function"), "name"));
        cJSON_AddObjectToObject(cb, "input");
        break;
    }

    a->block = block;

    return ngx_http_llama_session_anthropic_sse(r, c, "content_block_start",
                                                ev);
}


/* closes the block open, if any (a thinking block with its signature) */

static ngx_int_t
ngx_http_llama_session_anthropic_close(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c)
{
    cJSON                               *ev;
    ngx_http_llama_session_anthropic_t  *a;

    a = c->data;

    if (a->block == NGX_HTTP_LLAMA_SESSION_BLOCK_NONE) {
        return NGX_OK;
    }

    if (a->block == NGX_HTTP_LLAMA_SESSION_BLOCK_THINKING
        && ngx_http_llama_session_anthropic_delta(r, c, "signature_delta",
                                                  "signature", "")
           != NGX_OK)
    {
        return NGX_ERROR;
    }

    ev = cJSON_CreateObject();
    cJSON_AddStringToObject(ev, "type", "content_block_stop");
    cJSON_AddNumberToObject(ev, "index", a->nblocks);

    a->block = NGX_HTTP_LLAMA_SESSION_BLOCK_NONE;
    a->nblocks++;

    return ngx_http_llama_session_anthropic_sse(r, c, "content_block_stop",
                                                ev);
}


/* a content_block_delta of the block open */

static ngx_int_t
ngx_http_llama_session_anthropic_delta(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, char *type, char *name, char *value)
{
    cJSON                               *ev, *delta;
    ngx_http_llama_session_anthropic_t  *a;

    a = c->data;

    ev = cJSON_CreateObject();
    cJSON_AddStringToObject(ev, "type", "content_block_delta");
    cJSON_AddNumberToObject(ev, "index", a->nblocks);
    delta = cJSON_AddObjectToObject(ev, "delta");
    cJSON_AddStringToObject(delta, "type", type);
    cJSON_AddStringToObject(delta, name, value);

    return ngx_http_llama_session_anthropic_sse(r, c, "content_block_delta",
                                                ev);
}


/* "event: NAME\ndata: {...}\n\n"; frees data */

static ngx_int_t
ngx_http_llama_session_anthropic_sse(ngx_http_request_t *r,
    ngx_http_llama_session_conv_t *c, char *event, cJSON *data)
{
    u_char  line[64];

    if (data == NULL) {
        return NGX_ERROR;
    }

    if (ngx_http_llama_session_conv_write(r, c, line,
                              ngx_snprintf(line, sizeof(line),
                                           "event: %s\ndata: ", event)
                              - line)
        != NGX_OK
        || ngx_http_llama_session_conv_emit(r, c, data, 1) != NGX_OK)
    {
        return NGX_ERROR;
    }

    return ngx_http_llama_session_conv_write(r, c, (u_char *) "\n", 1);
}


/*
 * Anthropic's error: {"type":"error","error":{"type","message"}}, with
 * llama-server's message if it has one
 */

static cJSON *
ngx_http_llama_session_anthropic_error(ngx_uint_t status, cJSON *reply)
{
    char   *message;
    cJSON  *out, *err, *m;

    err = cJSON_GetObjectItemCaseSensitive(reply, "error");
    m = cJSON_IsObject(err) ? cJSON_GetObjectItemCaseSensitive(err, "message")
                            : err;
    message = cJSON_GetStringValue(m);

    out = cJSON_CreateObject();
    cJSON_AddStringToObject(out, "type", "error");
    err = cJSON_AddObjectToObject(out, "error");
    cJSON_AddStringToObject(err, "type",
                          ngx_http_llama_session_anthropic_error_type(status));
    cJSON_AddStringToObject(err, "message",
                            message ? message
                            : (reply == NULL && status == NGX_HTTP_OK)
                              ? "the model server's reply is not JSON"
                              : "the model server failed the request");

    return out;
}


/*
 * A chunk that says nothing but the role: no timings, no end, no text,
 * reasoning nor tool call.  NGX_OK: bare
 */

static ngx_int_t
ngx_http_llama_session_anthropic_bare(cJSON *json)
{
    char   *text;
    cJSON  *choice, *delta, *end;

    if (cJSON_GetObjectItemCaseSensitive(json, "timings")) {
        return NGX_DECLINED;
    }

    choice = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(json,
                                                                 "choices"),
                                0);

    end = cJSON_GetObjectItemCaseSensitive(choice, "finish_reason");
    if (end && !cJSON_IsNull(end)) {
        return NGX_DECLINED;
    }

    delta = cJSON_GetObjectItemCaseSensitive(choice, "delta");

    if (!cJSON_IsObject(delta)
        || cJSON_GetObjectItemCaseSensitive(delta, "tool_calls"))
    {
        return NGX_DECLINED;
    }

    text = cJSON_GetStringValue(
               cJSON_GetObjectItemCaseSensitive(delta, "content"));
    if (text && text[0]) {
        return NGX_DECLINED;
    }

    text = cJSON_GetStringValue(
               cJSON_GetObjectItemCaseSensitive(delta, "reasoning_content"));
    if (text && text[0]) {
        return NGX_DECLINED;
    }

    return NGX_OK;
}


/* usage: evaluated, from the cache, generated */

static void
ngx_http_llama_session_anthropic_usage(ngx_http_llama_session_conv_t *c,
    cJSON *usage)
{
    ngx_uint_t  cached, input;

    cached = c->cached > 0 ? (ngx_uint_t) c->cached : 0;

    input = c->prompt_n >= 0 ? (ngx_uint_t) c->prompt_n
            : (c->prompt_tokens >= cached) ? c->prompt_tokens - cached : 0;

    cJSON_AddNumberToObject(usage, "input_tokens", input);
    cJSON_AddNumberToObject(usage, "cache_creation_input_tokens", 0);
    cJSON_AddNumberToObject(usage, "cache_read_input_tokens", cached);
    cJSON_AddNumberToObject(usage, "output_tokens", c->completion_tokens);
}


/* a string member of an object, or "" (missing, of another type) */

static char *
ngx_http_llama_session_anthropic_str(cJSON *object, char *name)
{
    char  *value;

    value = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(object,
                                                                  name));

    return value ? value : "";
}


/* the stop_reason of a finish_reason */

static char *
ngx_http_llama_session_anthropic_stop(cJSON *finish)
{
    char  *f;

    f = cJSON_GetStringValue(finish);

    if (f == NULL) {
        return "end_turn";
    }

    if (ngx_strcmp(f, "tool_calls") == 0) {
        return "tool_use";
    }

    if (ngx_strcmp(f, "length") == 0) {
        return "max_tokens";
    }

    return "end_turn";
}


/* the message's id ("msg_" + llama-server's) and model, from the reply */

static void
ngx_http_llama_session_anthropic_names(ngx_http_llama_session_anthropic_t *a,
    cJSON *reply)
{
    char  *id, *model;

    id = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(reply, "id"));
    model = cJSON_GetStringValue(
                cJSON_GetObjectItemCaseSensitive(reply, "model"));

    if (id && ngx_strncmp(id, "chatcmpl-", 9) == 0) {
        id += 9;
    }

    *ngx_snprintf(a->id, sizeof(a->id) - 1, "msg_%s", id ? id : "") = '\0';
    *ngx_snprintf(a->model, sizeof(a->model) - 1, "%s",
                  model ? model : "") = '\0';
}


/* Anthropic's error type of an HTTP status */

char *
ngx_http_llama_session_anthropic_error_type(ngx_uint_t status)
{
    switch (status) {

    case NGX_HTTP_BAD_REQUEST:
    case NGX_HTTP_NOT_IMPLEMENTED:
        return "invalid_request_error";

    case NGX_HTTP_UNAUTHORIZED:
        return "authentication_error";

    case NGX_HTTP_FORBIDDEN:
        return "permission_error";

    case NGX_HTTP_NOT_FOUND:
        return "not_found_error";

    case NGX_HTTP_REQUEST_ENTITY_TOO_LARGE:
        return "request_too_large";

    case NGX_HTTP_TOO_MANY_REQUESTS:
        return "rate_limit_error";

    case NGX_HTTP_SERVICE_UNAVAILABLE:
        return "overloaded_error";

    default:
        return "api_error";
    }
}
