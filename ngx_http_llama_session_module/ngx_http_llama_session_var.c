
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * $llama_session_id, $llama_session_key, $llama_session_slot,
 * $llama_session_action, $llama_session_wait_ms, $llama_session_swap_ms,
 * $llama_session_cached_tokens.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_handler.h"
#include "ngx_http_llama_session_var.h"


static ngx_int_t ngx_http_llama_session_var(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data);
static ngx_int_t ngx_http_llama_session_var_id(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, ngx_str_t *id);


enum {
    NGX_HTTP_LLAMA_SESSION_VAR_ID = 0,
    NGX_HTTP_LLAMA_SESSION_VAR_KEY,
    NGX_HTTP_LLAMA_SESSION_VAR_SLOT,
    NGX_HTTP_LLAMA_SESSION_VAR_ACTION,
    NGX_HTTP_LLAMA_SESSION_VAR_WAIT_MS,
    NGX_HTTP_LLAMA_SESSION_VAR_SWAP_MS,
    NGX_HTTP_LLAMA_SESSION_VAR_CACHED
};


static ngx_http_variable_t  ngx_http_llama_session_vars[] = {

    { ngx_string("llama_session_id"), NULL, ngx_http_llama_session_var,
      NGX_HTTP_LLAMA_SESSION_VAR_ID, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("llama_session_key"), NULL, ngx_http_llama_session_var,
      NGX_HTTP_LLAMA_SESSION_VAR_KEY, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("llama_session_slot"), NULL, ngx_http_llama_session_var,
      NGX_HTTP_LLAMA_SESSION_VAR_SLOT, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("llama_session_action"), NULL, ngx_http_llama_session_var,
      NGX_HTTP_LLAMA_SESSION_VAR_ACTION, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("llama_session_wait_ms"), NULL, ngx_http_llama_session_var,
      NGX_HTTP_LLAMA_SESSION_VAR_WAIT_MS, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("llama_session_swap_ms"), NULL, ngx_http_llama_session_var,
      NGX_HTTP_LLAMA_SESSION_VAR_SWAP_MS, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("llama_session_cached_tokens"), NULL,
      ngx_http_llama_session_var, NGX_HTTP_LLAMA_SESSION_VAR_CACHED,
      NGX_HTTP_VAR_NOCACHEABLE, 0 },

      ngx_http_null_variable
};


static ngx_str_t  ngx_http_llama_session_action_names[] = {
    ngx_null_string,
    ngx_string("hit"),
    ngx_string("restore"),
    ngx_string("fresh"),
    ngx_string("bypass"),
    ngx_string("warm"),
    ngx_string("ram")
};


ngx_int_t
ngx_http_llama_session_add_variables(ngx_conf_t *cf)
{
    ngx_http_variable_t  *var, *v;

    for (v = ngx_http_llama_session_vars; v->name.len; v++) {
        var = ngx_http_add_variable(cf, &v->name, v->flags);
        if (var == NULL) {
            return NGX_ERROR;
        }

        var->get_handler = v->get_handler;
        var->data = v->data;
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_llama_session_var(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data)
{
    u_char                        *p;
    ngx_str_t                     *s;
    ngx_http_llama_session_ctx_t  *ctx;

    ctx = ngx_http_llama_session_get_ctx(r);

    if (ctx == NULL) {
        v->not_found = 1;
        return NGX_OK;
    }

    v->valid = 1;
    v->no_cacheable = 1;
    v->not_found = 0;

    switch (data) {

    case NGX_HTTP_LLAMA_SESSION_VAR_ID:
        if (ctx->id.len == 0) {
            v->not_found = 1;
            return NGX_OK;
        }

        return ngx_http_llama_session_var_id(r, v, &ctx->id);

    case NGX_HTTP_LLAMA_SESSION_VAR_KEY:
        if (ctx->key_len == 0) {
            v->not_found = 1;
            return NGX_OK;
        }

        v->data = ctx->key;
        v->len = ctx->key_len;
        return NGX_OK;

    case NGX_HTTP_LLAMA_SESSION_VAR_ACTION:
        s = &ngx_http_llama_session_action_names[ctx->action];

        if (s->len == 0) {
            v->not_found = 1;
            return NGX_OK;
        }

        v->data = s->data;
        v->len = s->len;
        return NGX_OK;

    default:
        break;
    }

    if ((data == NGX_HTTP_LLAMA_SESSION_VAR_SLOT
         && (!ctx->job->acquired
             || ctx->action == NGX_HTTP_LLAMA_SESSION_ACTION_BYPASS))
        || (data == NGX_HTTP_LLAMA_SESSION_VAR_CACHED
            && ctx->cached < 0))
    {
        v->not_found = 1;
        return NGX_OK;
    }

    p = ngx_pnalloc(r->pool, NGX_INT_T_LEN);
    if (p == NULL) {
        return NGX_ERROR;
    }

    v->data = p;

    switch (data) {

    case NGX_HTTP_LLAMA_SESSION_VAR_SLOT:
        p = ngx_sprintf(p, "%ui", ctx->job->slot);
        break;

    case NGX_HTTP_LLAMA_SESSION_VAR_WAIT_MS:
        p = ngx_sprintf(p, "%M", ctx->wait_ms);
        break;

    case NGX_HTTP_LLAMA_SESSION_VAR_CACHED:
        p = ngx_sprintf(p, "%i", ctx->cached);
        break;

    default: /* NGX_HTTP_LLAMA_SESSION_VAR_SWAP_MS */
        p = ngx_sprintf(p, "%M", ctx->swap_ms);
        break;
    }

    v->len = p - v->data;

    return NGX_OK;
}


/*
 * The id as the client gave it, but with control characters as \xHH: it
 * may come from a JSON body, and operators put it in headers and logs.
 */

static ngx_int_t
ngx_http_llama_session_var_id(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, ngx_str_t *id)
{
    u_char      *p, c;
    size_t       i, n;
    static u_char  hex[] = "0123456789abcdef";

    n = 0;

    for (i = 0; i < id->len; i++) {
        if (id->data[i] < 0x20 || id->data[i] == 0x7f) {
            n++;
        }
    }

    if (n == 0) {
        v->data = id->data;
        v->len = id->len;
        return NGX_OK;
    }

    p = ngx_pnalloc(r->pool, id->len + 3 * n);
    if (p == NULL) {
        return NGX_ERROR;
    }

    v->data = p;

    for (i = 0; i < id->len; i++) {
        c = id->data[i];

        if (c < 0x20 || c == 0x7f) {
            *p++ = '\\';
            *p++ = 'x';
            *p++ = hex[c >> 4];
            *p++ = hex[c & 0xf];

        } else {
            *p++ = c;
        }
    }

    v->len = p - v->data;

    return NGX_OK;
}
