
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The API dialects: which protocol a request speaks, chosen once, when
 * the request starts, by the end of its path (trailing slashes aside)
 * and the location's switches.  The core asks the request's row, never
 * the path again:
 *
 *   identify   the body's members that hold the system prompt and the
 *              conversation, the canonical system (canon.c), the limit
 *   request    how it becomes a chat request (Ollama's, Anthropic's),
 *              before the slot
 *   prime      the warm start's body shape and endpoint (warm.c)
 *   turn       whether its reply is kept for the re-prime (turn.c)
 *   error      its error shape (error.c)
 *   pin        whether llama-server keeps its "id_slot"
 *
 * A new dialect is one file of its own and one row here.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_dialect.h"
#include "ngx_http_llama_session_anthropic.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_ollama.h"


#define ngx_http_llama_session_chat_members                                  \
    ngx_string("system"), ngx_string("messages")


/*
 * The rows, the first whose path end and switch match: "/chat/completions"
 * before "/completions"; a switched row before the one that takes the
 * same path when its switch is off.
 */

static ngx_http_llama_session_dialect_t  ngx_http_llama_session_dialects[] = {

    /* OpenAI's chat completions: llama-server's own */
    { ngx_string("/chat/completions"), 0, 0,
      ngx_http_llama_session_chat_members,
      "/v1/chat/completions", NGX_HTTP_LLAMA_SESSION_PRIME_CHAT,
      NULL, NULL, NULL, NULL, 0, 0, 1, 0, 0 },

    /* Anthropic's Messages API, translated (llama_session_anthropic on) */
    { ngx_string("/v1/messages"), NGX_HTTP_LLAMA_SESSION_GATE_ANTHROPIC, 0,
      ngx_http_llama_session_chat_members,
      "/v1/chat/completions", NGX_HTTP_LLAMA_SESSION_PRIME_ANTHROPIC,
      ngx_http_llama_session_anthropic_request,
      ngx_http_llama_session_anthropic_prime,
      NULL, ngx_http_llama_session_anthropic_error_type, 0, 0, 1, 1, 1 },

    /* llama-server's own /v1/messages: it drops "id_slot" */
    { ngx_string("/v1/messages"), 0, 0, ngx_http_llama_session_chat_members,
      "/v1/messages", NGX_HTTP_LLAMA_SESSION_PRIME_ANTHROPIC,
      NULL, NULL, NULL, NULL, 0, 1, 0, 1, 1 },

    /* the Responses API: "instructions", and the leading "input" items */
    { ngx_string("/responses"), 0, 0,
      ngx_string("instructions"), ngx_string("input"),
      "/v1/responses", NGX_HTTP_LLAMA_SESSION_PRIME_RESPONSES,
      NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0 },

    /* Ollama's API (llama_session_ollama on), translated */
    { ngx_string("/api/chat"), NGX_HTTP_LLAMA_SESSION_GATE_OLLAMA,
      NGX_HTTP_LLAMA_SESSION_OLLAMA_CHAT, ngx_http_llama_session_chat_members,
      "/v1/chat/completions", NGX_HTTP_LLAMA_SESSION_PRIME_CHAT,
      ngx_http_llama_session_ollama_request, NULL,
      ngx_http_llama_session_ollama_error, NULL, 0, 0, 1, 0, 0 },

    { ngx_string("/api/generate"), NGX_HTTP_LLAMA_SESSION_GATE_OLLAMA,
      NGX_HTTP_LLAMA_SESSION_OLLAMA_GENERATE,
      ngx_http_llama_session_chat_members, NULL, 0,
      ngx_http_llama_session_ollama_request, NULL,
      ngx_http_llama_session_ollama_error, NULL, 0, 0, 0, 0, 0 },

    { ngx_string("/api/embed"), NGX_HTTP_LLAMA_SESSION_GATE_OLLAMA,
      NGX_HTTP_LLAMA_SESSION_OLLAMA_EMBED,
      ngx_http_llama_session_chat_members, NULL, 0,
      ngx_http_llama_session_ollama_request, NULL,
      ngx_http_llama_session_ollama_error, NULL, 1, 0, 0, 0, 0 },

    /* llama-server's endpoints, as they come (older builds alias Ollama's) */
    { ngx_string("/completion"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0 },
    { ngx_string("/completions"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0 },
    { ngx_string("/infill"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0 },
    { ngx_string("/api/chat"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0 },
    { ngx_string("/api/generate"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0 },

    /* they use the slot but carry no conversation: "default" */
    { ngx_string("/embedding"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 1, 0, 0, 0, 0 },
    { ngx_string("/embeddings"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 1, 0, 0, 0, 0 },
    { ngx_string("/rerank"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 1, 0, 0, 0, 0 },
    { ngx_string("/reranking"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 1, 0, 0, 0, 0 },
    { ngx_string("/api/embed"), 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 1, 0, 0, 0, 0 },

    /* a form, not JSON: llama-server drops "id_slot" */
    { ngx_string("/audio/transcriptions"), 0, 0,
      ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 1, 1, 0, 0, 0 },

    /* any other path: llama_session_endpoints of the operator's own */
    { ngx_null_string, 0, 0, ngx_http_llama_session_chat_members,
      NULL, 0, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0 }
};


/* the paths of the rows: llama_session_endpoints' default */

static ngx_str_t  ngx_http_llama_session_dialect_paths[
    sizeof(ngx_http_llama_session_dialects)
    / sizeof(ngx_http_llama_session_dialect_t)];


ngx_http_llama_session_dialect_t *
ngx_http_llama_session_dialect(ngx_http_request_t *r,
    ngx_http_llama_session_loc_conf_t *llcf)
{
    ngx_http_llama_session_dialect_t  *d;

    for (d = ngx_http_llama_session_dialects; d->suffix.len; d++) {

        if (!ngx_http_llama_session_path_ends(r, &d->suffix)) {
            continue;
        }

        switch (d->gate) {

        case NGX_HTTP_LLAMA_SESSION_GATE_ANTHROPIC:
            if (!llcf->anthropic || llcf->zone == NULL
                || r->method != NGX_HTTP_POST)
            {
                continue;
            }

            break;

        case NGX_HTTP_LLAMA_SESSION_GATE_OLLAMA:
            if (llcf->ollama != 1 || r->method != NGX_HTTP_POST) {
                continue;
            }

            break;
        }

        return d;
    }

    /* the last row: no dialect of its own */
    return d;
}


ngx_str_t *
ngx_http_llama_session_dialect_endpoints(void)
{
    ngx_uint_t                         i, n, j;
    ngx_http_llama_session_dialect_t  *d;

    if (ngx_http_llama_session_dialect_paths[0].len) {
        return ngx_http_llama_session_dialect_paths;
    }

    n = 0;

    for (d = ngx_http_llama_session_dialects; d->suffix.len; d++) {

        for (j = 0; j < n; j++) {
            if (ngx_http_llama_session_dialect_paths[j].len == d->suffix.len
                && ngx_strncmp(ngx_http_llama_session_dialect_paths[j].data,
                               d->suffix.data, d->suffix.len)
                   == 0)
            {
                break;
            }
        }

        if (j == n) {
            ngx_http_llama_session_dialect_paths[n++] = d->suffix;
        }
    }

    for (i = n; i < sizeof(ngx_http_llama_session_dialect_paths)
                    / sizeof(ngx_str_t); i++)
    {
        ngx_str_null(&ngx_http_llama_session_dialect_paths[i]);
    }

    return ngx_http_llama_session_dialect_paths;
}
