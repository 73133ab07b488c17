
/*
 * libFuzzer differential target: the module and llama-server read one body.
 * The module's reading (the body scanner, ngx_http_llama_session_identify())
 * against llama-server's own JSON library (nlohmann's json.hpp from the
 * rig's llama.cpp tree, the one llama-server is built with), for any body
 * llama-server would take (a body it cannot parse runs nowhere):
 *
 *   - each member the module reads, at the top level, in each message and
 *     in "metadata", is the one llama-server takes: the last of duplicate
 *     members, keys decoded ("mod\u0065l"), a UTF-8 BOM skipped;
 *   - a message's role is "system" for both or for neither;
 *   - the model the module chooses the zone by is llama-server's "model";
 *   - the module runs the request as a probe ("default") exactly when
 *     llama-server generates 0 or 1 token: the first of n_predict,
 *     max_completion_tokens and max_tokens that is not null (max_tokens
 *     alone on /v1/messages), numbers truncated, true as 1;
 *   - the same body as llama-server understands it (its own dump: no
 *     duplicates, no escapes in keys) gets the same model, probe, id and
 *     default session (a "sys-" id, a hash that takes some members as
 *     written, may differ: the key is then another one, never a shared
 *     one).
 *
 * A body the scanner cannot read must be a "default" session without a
 * model (so router mode refuses it).  See fuzz/run.sh (target
 * differential).
 */


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include <nlohmann/json.hpp>

#include "differential.h"


using json = nlohmann::ordered_json;


static void
fail(const char *what, const std::string &detail)
{
    fprintf(stderr, "differential: %s: %s\n", what, detail.c_str());
    __builtin_trap();
}


static std::string
str(const diff_str_t &s)
{
    return std::string((const char *) s.data, s.len);
}


/* the spans of one object against llama-server's view of it */

static void
check_object(const unsigned char *base, const diff_span_t *spans, int set,
    const json &obj)
{
    for (int i = 0; diff_name(set, i); i++) {
        const char *name = diff_name(set, i);
        bool has = obj.contains(name);

        if (!has) {
            if (spans[i].start >= 0) {
                fail("a member llama-server does not see", name);
            }
            continue;
        }

        if (spans[i].start < 0) {
            fail("a member the module does not see", name);
        }

        json mine;

        try {
            mine = json::parse(base + spans[i].start, base + spans[i].end);
        } catch (...) {
            fail("the module's span is not JSON", name);
        }

        if (mine != obj.at(name)) {
            fail("the module reads another member", name);
        }
    }
}


/*
 * llama-server's token limit as its n_predict field reads it (a json
 * get<int32_t>: integers wrap, fractions truncate, other types throw;
 * below -1 is refused): 0 or 1 (a probe), -1 any other, -2 refused
 */

static int
limit(const json &j, bool messages)
{
    static const char  *chain[] = { "n_predict", "max_completion_tokens",
                                    "max_tokens" };

    for (int i = messages ? 2 : 0; i < 3; i++) {
        if (!j.contains(chain[i]) || j.at(chain[i]).is_null()) {
            continue;
        }

        const json &v = j.at(chain[i]);
        int32_t     n;

        if (v.is_number_unsigned()) {
            n = (int32_t) v.get<uint64_t>();

        } else if (v.is_number_integer()) {
            n = (int32_t) v.get<int64_t>();

        } else if (v.is_number_float()) {
            double d = v.get<double>();

            if (!(d > -2147483649.0 && d < 2147483648.0)) {
                return -2;
            }

            n = (int32_t) d;

        } else {
            return -2;
        }

        if (n < -1) {
            return -2;
        }

        return (n == 0 || n == 1) ? n : -1;
    }

    return -1;
}


static std::string
c_string(const std::string &s)
{
    /* the module's strings are C strings (cJSON): up to a NUL */
    return s.substr(0, s.find('\0'));
}


static void
check_decision(const unsigned char *data, size_t size, const json &j,
    const char *uri, bool scanned)
{
    diff_decision_t  d, canon;
    bool             messages = (strcmp(uri, "/v1/messages") == 0);

    diff_identify(data, size, uri, &d);

    if (d.rc != 0) {
        /* NGX_ABORT: an id too long, refused; nothing runs */
        return;
    }

    if (!scanned) {
        if (!d.default_session || d.model.len) {
            fail("a body the module cannot read", "is not a plain default");
        }
        return;
    }

    std::string model;

    if (j.contains("model") && j.at("model").is_string()) {
        model = c_string(j.at("model").get<std::string>());
    }

    if (model.size() <= sizeof(d.model.data) && str(d.model) != model) {
        fail("the model", str(d.model) + " against " + model);
    }

    int l = limit(j, messages);

    if (l != -2 && d.probe != (l == 0 || l == 1)) {
        fail("the probe", std::string(uri) + ": module " + std::to_string(d.probe)
             + ", llama-server's limit " + std::to_string(l));
    }

    /* the body as llama-server understands it */

    std::string dump = j.dump();

    diff_identify((const unsigned char *) dump.data(), dump.size(), uri,
                  &canon);

    if (canon.rc != d.rc || canon.probe != d.probe
        || canon.default_session != d.default_session
        || str(canon.model) != str(d.model)
        || (!d.default_session && str(d.id).compare(0, 4, "sys-") != 0
            && str(canon.id) != str(d.id)))
    {
        fail("the body as llama-server reads it",
             "decides otherwise (rc " + std::to_string(d.rc) + "/"
             + std::to_string(canon.rc) + ", probe "
             + std::to_string(d.probe) + "/" + std::to_string(canon.probe)
             + ", default " + std::to_string(d.default_session) + "/"
             + std::to_string(canon.default_session) + ", model "
             + str(d.model) + "/" + str(canon.model) + ", id " + str(d.id)
             + "/" + str(canon.id) + "): " + dump.substr(0, 300));
    }
}


extern "C" int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    json        j;
    diff_span_t top[DIFF_NAMES], fields[DIFF_NAMES], elts[64];

    try {
        j = json::parse(data, data + size);
    } catch (...) {
        return 0;       /* llama-server answers 400 or 500: nothing runs */
    }

    if (!j.is_object()) {
        return 0;
    }

    bool scanned = diff_object(data, size, 1, 0, top);

    if (scanned) {
        check_object(data, top, 0, j);

        /* the messages, as body.c walks them */

        if (top[2].start >= 0 && j.at("messages").is_array()) {
            const unsigned char *m = data + top[2].start;
            const json &arr = j.at("messages");
            int n = diff_elements(m, top[2].end - top[2].start, elts, 64);

            if ((size_t) n != std::min<size_t>(arr.size(), 64)) {
                fail("the messages", "another count");
            }

            for (int i = 0; i < n; i++) {
                const json &e = arr.at(i);

                if (!e.is_object()) {
                    continue;
                }

                if (!diff_object(m + elts[i].start,
                                 elts[i].end - elts[i].start, 0, 1, fields))
                {
                    fail("a message", "the module cannot read it");
                }

                check_object(m + elts[i].start, fields, 1, e);

                if (fields[0].start >= 0) {
                    const unsigned char *r = m + elts[i].start
                                             + fields[0].start;
                    size_t rl = fields[0].end - fields[0].start;
                    bool sys = e.at("role").is_string()
                               && e.at("role").get<std::string>() == "system";

                    if ((bool) diff_string_is(r, rl, "system") != sys) {
                        fail("a message's role", e.at("role").dump());
                    }
                }
            }
        }

        /* metadata.session_id */

        if (top[13].start >= 0 && j.at("metadata").is_object()) {
            if (!diff_object(data + top[13].start,
                             top[13].end - top[13].start, 0, 2, fields))
            {
                fail("metadata", "the module cannot read it");
            }

            check_object(data + top[13].start, fields, 2, j.at("metadata"));
        }
    }

    check_decision(data, size, j, "/v1/chat/completions", scanned);
    check_decision(data, size, j, "/v1/messages", scanned);

    return 0;
}
