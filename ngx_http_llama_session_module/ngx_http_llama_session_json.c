
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * A scanner for request bodies: it finds the spans of a few members of a
 * JSON object without building a tree, skipping everything else (long
 * prompts, histories, images) with memchr().  The few values the module
 * needs are decoded from their spans by cJSON.  Pure functions over
 * bytes, so they can be fuzzed alone; and the one way to a cJSON tree of
 * untrusted JSON, counted first.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_json.h"


#define NGX_HTTP_LLAMA_SESSION_JSON_DEPTH  512


static u_char *
ngx_http_llama_session_json_ws(u_char *p, u_char *end)
{
    while (p < end
           && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
    {
        p++;
    }

    return p;
}


/* p at the opening quote; returns the byte after the closing one */

static u_char *
ngx_http_llama_session_json_string(u_char *p, u_char *end)
{
    u_char  *q, *b;

    p++;

    for ( ;; ) {
        q = memchr(p, '"', end - p);
        if (q == NULL) {
            return NULL;
        }

        /* escaped if an odd number of backslashes stand before it */

        for (b = q; b > p && b[-1] == '\\'; b--) { /* void */ }

        if (((q - b) & 1) == 0) {
            return q + 1;
        }

        p = q + 1;
    }
}


/* skips one value at p (no leading space); NULL if it is not JSON */

u_char *
ngx_http_llama_session_json_skip(u_char *p, u_char *end)
{
    u_char      c, *start, close[NGX_HTTP_LLAMA_SESSION_JSON_DEPTH];
    ngx_uint_t  depth;

    if (p >= end) {
        return NULL;
    }

    c = *p;

    if (c == '"') {
        return ngx_http_llama_session_json_string(p, end);
    }

    if (c != '{' && c != '[') {
        /* a number, true, false or null: at least one byte of one */

        start = p;

        while (p < end
               && ((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z')
                   || *p == '-' || *p == '+' || *p == '.' || *p == 'E'))
        {
            p++;
        }

        if (p == start) {
            return NULL;
        }

        return (p == end || *p == ',' || *p == '}' || *p == ']' || *p == ' '
                || *p == '\n' || *p == '\r' || *p == '\t')
               ? p : NULL;
    }

    /* an object or an array: brackets must pair */

    depth = 0;

    while (p < end) {
        c = *p;

        switch (c) {

        case '"':
            p = ngx_http_llama_session_json_string(p, end);
            if (p == NULL) {
                return NULL;
            }
            continue;

        case '{':
        case '[':
            if (depth == NGX_HTTP_LLAMA_SESSION_JSON_DEPTH) {
                return NULL;
            }

            close[depth++] = (c == '{') ? '}' : ']';
            break;

        case '}':
        case ']':
            if (depth == 0 || close[--depth] != c) {
                return NULL;
            }

            if (depth == 0) {
                return p + 1;
            }

            break;

        default:
            break;
        }

        p++;
    }

    return NULL;
}


/*
 * Does the key between key and kend (no quotes) name name?  Escapes are
 * decoded as llama-server's JSON library decodes them ("mod\u0065l" is
 * "model"); the names are ASCII, so an escape of anything else matches
 * nothing.
 */

static ngx_uint_t
ngx_http_llama_session_json_key_is(u_char *key, u_char *kend, ngx_str_t *name)
{
    u_char      c, h, *n, *last;
    ngx_int_t   code;
    ngx_uint_t  i;

    if (memchr(key, '\\', kend - key) == NULL) {
        return (size_t) (kend - key) == name->len
               && ngx_strncmp(key, name->data, name->len) == 0;
    }

    n = name->data;
    last = name->data + name->len;

    while (key < kend) {
        c = *key++;

        if (c == '\\') {
            if (key >= kend) {
                return 0;
            }

            c = *key++;

            switch (c) {
            case '"': case '\\': case '/':
                break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;

            case 'u':
                if (kend - key < 4) {
                    return 0;
                }

                /* four hex digits (by hand: the scanner needs no libc) */

                code = 0;

                for (i = 0; i < 4; i++) {
                    h = key[i] | 0x20;

                    if (key[i] >= '0' && key[i] <= '9') {
                        code = code * 16 + (key[i] - '0');

                    } else if (h >= 'a' && h <= 'f') {
                        code = code * 16 + (h - 'a' + 10);

                    } else {
                        return 0;
                    }
                }

                key += 4;

                if (code == 0 || code > 0x7f) {
                    return 0;
                }

                c = (u_char) code;
                break;

            default:
                return 0;
            }
        }

        if (n == last || *n++ != c) {
            return 0;
        }
    }

    return n == last;
}


/* is the span a JSON string whose decoded value is s (ASCII)? */

ngx_uint_t
ngx_http_llama_session_json_string_is(ngx_http_llama_session_span_t *span,
    ngx_str_t *s)
{
    if (span->start == NULL || span->end - span->start < 2
        || *span->start != '"' || span->end[-1] != '"')
    {
        return 0;
    }

    return ngx_http_llama_session_json_key_is(span->start + 1, span->end - 1,
                                              s);
}


/*
 * Scans the object at p (its '{'): for each of the n names, the span of
 * the member of that name that llama-server takes: the last one, keys
 * compared as decoded.  Returns the byte after the object, or NULL if it
 * is not a well-formed object.
 */

u_char *
ngx_http_llama_session_json_object(u_char *p, u_char *end, ngx_str_t *names,
    ngx_http_llama_session_span_t *values, ngx_uint_t n)
{
    u_char      *key, *kend, *v;
    ngx_uint_t   i;

    for (i = 0; i < n; i++) {
        values[i].start = NULL;
        values[i].end = NULL;
    }

    if (p >= end || *p != '{') {
        return NULL;
    }

    p = ngx_http_llama_session_json_ws(p + 1, end);

    if (p < end && *p == '}') {
        return p + 1;
    }

    for ( ;; ) {
        if (p >= end || *p != '"') {
            return NULL;
        }

        key = p + 1;
        p = ngx_http_llama_session_json_string(p, end);
        if (p == NULL) {
            return NULL;
        }

        kend = p - 1;

        p = ngx_http_llama_session_json_ws(p, end);
        if (p >= end || *p != ':') {
            return NULL;
        }

        p = ngx_http_llama_session_json_ws(p + 1, end);

        v = p;
        p = ngx_http_llama_session_json_skip(p, end);
        if (p == NULL) {
            return NULL;
        }

        for (i = 0; i < n; i++) {
            /* nlohmann's json keeps the last of duplicate members */

            if (ngx_http_llama_session_json_key_is(key, kend, &names[i])) {
                values[i].start = v;
                values[i].end = p;
            }
        }

        p = ngx_http_llama_session_json_ws(p, end);

        if (p < end && *p == ',') {
            p = ngx_http_llama_session_json_ws(p + 1, end);
            continue;
        }

        if (p < end && *p == '}') {
            return p + 1;
        }

        return NULL;
    }
}


/*
 * The next element of the array whose '[' or last element ended at *pos:
 * NGX_OK with its span, NGX_DONE at the end, NGX_ERROR if malformed.
 */

ngx_int_t
ngx_http_llama_session_json_next(u_char **pos, u_char *end,
    ngx_http_llama_session_span_t *elt)
{
    u_char  *p;

    p = ngx_http_llama_session_json_ws(*pos, end);

    if (p >= end) {
        return NGX_ERROR;
    }

    if (*p == '[' || *p == ',') {
        p = ngx_http_llama_session_json_ws(p + 1, end);
    }

    if (p < end && *p == ']') {
        *pos = p + 1;
        return NGX_DONE;
    }

    elt->start = p;
    elt->end = ngx_http_llama_session_json_skip(p, end);

    if (elt->end == NULL || elt->end <= elt->start) {
        return NGX_ERROR;
    }

    *pos = elt->end;

    return NGX_OK;
}


/*
 * Is the whole body one JSON object?  A UTF-8 BOM before it is skipped, as
 * llama-server's parser skips it.
 */

ngx_int_t
ngx_http_llama_session_json_body(u_char *p, u_char *end, ngx_str_t *names,
    ngx_http_llama_session_span_t *values, ngx_uint_t n)
{
    if (end - p >= 3 && p[0] == 0xef && p[1] == 0xbb && p[2] == 0xbf) {
        p += 3;
    }

    p = ngx_http_llama_session_json_ws(p, end);

    p = ngx_http_llama_session_json_object(p, end, names, values, n);
    if (p == NULL) {
        return NGX_ERROR;
    }

    return ngx_http_llama_session_json_ws(p, end) == end ? NGX_OK : NGX_ERROR;
}


/*
 * How many JSON values a text has (a client's body, a backend's reply),
 * counted before cJSON builds a tree of them: one per array or object and per member or element after the
 * first (commas), strings skipped.  Stops counting past the limit.
 */

ngx_uint_t
ngx_http_llama_session_json_values(u_char *p, size_t len)
{
    u_char      *last;
    ngx_uint_t   n;

    n = 1;
    last = p + len;

    while (p < last && n <= NGX_HTTP_LLAMA_SESSION_JSON_VALUES) {

        switch (*p++) {

        case '"':
            while (p < last && *p != '"') {
                if (*p == '\\') {
                    p++;
                }

                p++;
            }

            p++;
            break;

        case '[':
        case '{':
        case ',':
            n++;
            break;

        default:
            break;
        }
    }

    return n;
}


/*
 * A tree of untrusted JSON (a client's, a backend's): counted first, as
 * cJSON's tree costs some 64 bytes a value; NULL past
 * NGX_HTTP_LLAMA_SESSION_JSON_VALUES values or if it is not JSON.
 */

cJSON *
ngx_http_llama_session_json_tree(u_char *p, size_t len)
{
    if (ngx_http_llama_session_json_values(p, len)
        > NGX_HTTP_LLAMA_SESSION_JSON_VALUES)
    {
        return NULL;
    }

    return cJSON_ParseWithLength((const char *) p, len);
}


/*
 * Does a "messages" array (p at its '[') carry an image, audio or a file:
 * a content part of such a type (OpenAI's, the Responses API's,
 * Anthropic's), or Ollama's "images"?  llama-server's template writes
 * such a part as a marker (mtmd's "<__media__>") that only its own
 * tokeniser of the request turns into the media's chunks.  A part that
 * does not scan is none.
 */

ngx_uint_t
ngx_http_llama_session_json_media(u_char *p, u_char *end)
{
    u_char                         *pos, *ppos;
    ngx_uint_t                      i;
    ngx_str_t                       names[2], type;
    ngx_http_llama_session_span_t   msg, part, fields[2], kind;

    static ngx_str_t  types[] = {
        ngx_string("image_url"), ngx_string("input_image"),
        ngx_string("image"), ngx_string("input_audio"),
        ngx_string("audio"), ngx_string("file"), ngx_string("input_file"),
        ngx_string("document"), ngx_string("video_url")
    };

    if (p == NULL || p >= end || *p != '[') {
        return 0;
    }

    ngx_str_set(&names[0], "content");
    ngx_str_set(&names[1], "images");
    ngx_str_set(&type, "type");

    pos = p;

    while (ngx_http_llama_session_json_next(&pos, end, &msg) == NGX_OK) {

        if (*msg.start != '{'
            || ngx_http_llama_session_json_object(msg.start, msg.end, names,
                                                  fields, 2)
               == NULL)
        {
            continue;
        }

        /* Ollama's "images": [base64, ...], one or more */

        if (fields[1].start && *fields[1].start == '['
            && ngx_http_llama_session_json_next(&fields[1].start,
                                                fields[1].end, &part)
               == NGX_OK)
        {
            return 1;
        }

        if (fields[0].start == NULL || *fields[0].start != '[') {
            continue;
        }

        ppos = fields[0].start;

        while (ngx_http_llama_session_json_next(&ppos, fields[0].end, &part)
               == NGX_OK)
        {
            if (*part.start != '{'
                || ngx_http_llama_session_json_object(part.start, part.end,
                                                      &type, &kind, 1)
                   == NULL)
            {
                continue;
            }

            for (i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
                if (ngx_http_llama_session_json_string_is(&kind, &types[i])) {
                    return 1;
                }
            }
        }
    }

    return 0;
}
