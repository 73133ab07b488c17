
/*
 * The module's side of the differential target (fuzz/differential_fuzz.cc):
 * what the module decides from a body, in plain C types for the C++ side,
 * which parses the same body with llama-server's own JSON library.  The
 * identity harness is #included for its configuration and stubs (its
 * configuration A: the default id fields, the system prompt's hash).
 */


#define FUZZ_IDENTITY_NO_MAIN  1

#include "identity_fuzz.c"

#include "differential.h"


/*
 * The names the module looks for, by the object they are in: the top
 * level (body.c's order, then the default id fields), a message, and
 * "metadata" (metadata.session_id)
 */

static ngx_str_t  diff_top[] = {
    ngx_string("model"),
    ngx_string("system"),
    ngx_string("messages"),
    ngx_string("tools"),
    ngx_string("tool_choice"),
    ngx_string("chat_template_kwargs"),
    ngx_string("max_tokens"),
    ngx_string("max_completion_tokens"),
    ngx_string("n_predict"),
    ngx_string("session_id"),
    ngx_string("conversation_id"),
    ngx_string("chat_id"),
    ngx_string("prompt_cache_key"),
    ngx_string("metadata"),
};

static ngx_str_t  diff_message[] = {
    ngx_string("role"),
    ngx_string("content"),
};

static ngx_str_t  diff_metadata[] = {
    ngx_string("session_id"),
};

static struct {
    ngx_str_t   *names;
    ngx_uint_t   n;
} diff_sets[] = {
    { diff_top, sizeof(diff_top) / sizeof(ngx_str_t) },
    { diff_message, sizeof(diff_message) / sizeof(ngx_str_t) },
    { diff_metadata, sizeof(diff_metadata) / sizeof(ngx_str_t) },
};


const char *
diff_name(int set, int i)
{
    return (size_t) i < diff_sets[set].n
           ? (const char *) diff_sets[set].names[i].data : NULL;
}


static void
diff_copy(diff_str_t *out, u_char *data, size_t len)
{
    out->len = len < sizeof(out->data) ? len : sizeof(out->data);
    ngx_memcpy(out->data, data, out->len);
}


int
diff_identify(const unsigned char *data, size_t size, const char *uri,
    diff_decision_t *d)
{
    ngx_int_t                      rc;
    ngx_http_llama_session_ctx_t   ctx;

    ngx_memzero(d, sizeof(diff_decision_t));

    ngx_http_llama_session_last_len = 0;
    fuzz_uri.data = (u_char *) uri;
    fuzz_uri.len = ngx_strlen(uri);

    rc = fuzz_identify(&fuzz_configs[0], (u_char *) data, size, &ctx);

    d->rc = (int) rc;
    d->probe = ctx.probe;
    d->default_session = ctx.default_session;
    diff_copy(&d->model, ctx.model.data, ctx.model.len);
    diff_copy(&d->key, ctx.key, ctx.key_len);
    diff_copy(&d->id, ctx.id.data, ctx.id.len);

    fuzz_pool_reset();

    return d->rc;
}


/*
 * The spans the scanner gives for the names of set in the object at data
 * (the whole body, or an object inside it): 0 if it is not an object the
 * scanner reads, else 1 with each span as offsets (-1: no member).
 */

int
diff_object(const unsigned char *data, size_t size, int whole, int set,
    diff_span_t *spans)
{
    u_char                         *p, *end;
    ngx_uint_t                      i, n;
    ngx_http_llama_session_span_t   s[DIFF_NAMES];

    n = diff_sets[set].n;
    p = fuzz_guarded(data, size);
    end = p + size;

    if (whole) {
        if (ngx_http_llama_session_json_body(p, end, diff_sets[set].names, s,
                                             n)
            != NGX_OK)
        {
            return 0;
        }

    } else if (ngx_http_llama_session_json_object(p, end,
                                                  diff_sets[set].names, s, n)
               != end)
    {
        return 0;
    }

    for (i = 0; i < n; i++) {
        spans[i].start = s[i].start ? s[i].start - p : -1;
        spans[i].end = s[i].start ? s[i].end - p : -1;
    }

    return 1;
}


/* the elements of the array at data, as body.c walks them: their count */

int
diff_elements(const unsigned char *data, size_t size, diff_span_t *elts,
    int max)
{
    int                             n;
    u_char                         *p, *pos, *end;
    ngx_int_t                       rc;
    ngx_http_llama_session_span_t   elt;

    p = fuzz_guarded(data, size);
    end = p + size;
    pos = p;

    for (n = 0; n < max; n++) {
        rc = ngx_http_llama_session_json_next(&pos, end, &elt);

        if (rc != NGX_OK) {
            break;
        }

        elts[n].start = elt.start - p;
        elts[n].end = elt.end - p;
    }

    return n;
}


/* the roles' test of body.c: is the string span "system" as decoded? */

int
diff_string_is(const unsigned char *data, size_t size, const char *s)
{
    ngx_str_t                      name;
    ngx_http_llama_session_span_t  span;

    span.start = fuzz_guarded(data, size);
    span.end = span.start + size;
    name.data = (u_char *) s;
    name.len = ngx_strlen(s);

    return (int) ngx_http_llama_session_json_string_is(&span, &name);
}
