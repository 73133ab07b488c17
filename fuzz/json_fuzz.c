
/*
 * libFuzzer harness for the body scanner (ngx_http_llama_session_json.c):
 * any bytes as a request body, looking for the members the module asks
 * for, then walking "messages" as the module does.  See fuzz/run.sh.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_json.h"


int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    u_char                         *p, *end, *pos;
    ngx_str_t                       names[4], sub;
    ngx_uint_t                      i;
    ngx_http_llama_session_span_t   spans[4], elt, fields[2];

    p = (u_char *) data;
    end = p + size;

    ngx_str_set(&names[0], "model");
    ngx_str_set(&names[1], "system");
    ngx_str_set(&names[2], "messages");
    ngx_str_set(&names[3], "metadata");

    if (ngx_http_llama_session_json_body(p, end, names, spans, 4) != NGX_OK) {
        return 0;
    }

    for (i = 0; i < 4; i++) {
        if (spans[i].start
            && (spans[i].start < p || spans[i].end > end
                || spans[i].end <= spans[i].start))
        {
            __builtin_trap();
        }
    }

    if (spans[3].start) {
        ngx_str_set(&sub, "session_id");
        (void) ngx_http_llama_session_json_object(spans[3].start, spans[3].end,
                                                  &sub, fields, 1);
    }

    /* images, audio or files in the messages (the re-prime's test) */
    (void) ngx_http_llama_session_json_media(spans[2].start, spans[2].end);

    if (spans[2].start && *spans[2].start == '[') {
        ngx_str_set(&names[0], "role");
        ngx_str_set(&names[1], "content");

        pos = spans[2].start;

        while (ngx_http_llama_session_json_next(&pos, spans[2].end, &elt)
               == NGX_OK)
        {
            if (elt.start < spans[2].start || elt.end > spans[2].end) {
                __builtin_trap();
            }

            if (*elt.start == '{') {
                (void) ngx_http_llama_session_json_object(elt.start, elt.end,
                                                          names, fields, 2);
            }
        }
    }

    return 0;
}
