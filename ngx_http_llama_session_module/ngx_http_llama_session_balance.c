
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * llama_session_balance: an upstream's balancer over owners, each a
 * server {} of this nginx with "llama_session <zone>" in front of one
 * llama-server, found by the address it listens on.  A turn's home is the
 * owner nginx's "hash $llama_session_key consistent" gives it (the same
 * ring: crc32, 160 points a weight); the balancer reads the owners' zones
 * without their locks (each slot's and RAM entry's key crc, busy slots,
 * waiters, a turn's average hold) and sends the turn
 *
 *   1. to the owner that holds the session in a slot (of two, the one
 *      used last: the newer state), while its load (in flight and
 *      waiting) is under the bound, factor x the mean, or under its slots
 *      (a turn there waits for nothing);
 *   2. there anyway when its state is in that slot only (never saved):
 *      it moves only when its owner fails;
 *   3. home, for a session with no state anywhere, under the bound;
 *   4. else to the owner under the bound where its first token comes
 *      soonest: its queue (turns beyond its slots x a turn's hold / its
 *      slots) plus its preparation (nothing for a hit, llama-server's RAM
 *      for one it holds there, the file's restore at the owner's learned
 *      speed, the turns newer than the file at its prefill speed; with
 *      one store, the owners' mean speeds); of the owners within a
 *      tenth of the least, the one that holds it, else the one that has
 *      run no turn the longest (its slots' least idle: an owner where a
 *      session still talks keeps its slots for it, and the sessions that
 *      talk spread over the owners, their work with them; not at an edge,
 *      whose copy of the owners' slots is up to a poll old), else the
 *      first on the ring from home;
 *   5. with no owner under the bound, the least loaded.
 *
 * With folders per owner (a zone not shared=on) a session with a file
 * stays with the owner whose index has it but for a failure.  The pick
 * marks every other peer tried for nginx's round robin, which then takes
 * the chosen one with its own accounting (conns, fails, keepalive), as on
 * every nginx line.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_balance.h"
#include "ngx_http_llama_session_index.h"


#define NGX_HTTP_LLAMA_SESSION_BALANCE_POINTS  160

/* a restore's speed before the owner measured one: 200 MB/s */
#define NGX_HTTP_LLAMA_SESSION_BALANCE_RESTORE  (1.0 / 200000.0)

/* a turn's hold of a slot before the owner measured one */
#define NGX_HTTP_LLAMA_SESSION_BALANCE_TURN    1000

#define NGX_HTTP_LLAMA_SESSION_BALANCE_NONE    ((ngx_msec_t) -1)

/* a session's file, remote owners: not known to the edge */
#define NGX_HTTP_LLAMA_SESSION_BALANCE_UNKNOWN  -2

/* a remote owner's load, as its last reply told, counts this long at least */
#define NGX_HTTP_LLAMA_SESSION_BALANCE_FRESH   1000


enum {
    NGX_HTTP_LLAMA_SESSION_SPILL_RESTORE = 0,
    NGX_HTTP_LLAMA_SESSION_SPILL_ANY,
    NGX_HTTP_LLAMA_SESSION_SPILL_OFF
};


typedef struct {
    ngx_http_core_srv_conf_t       *cscf;
    ngx_http_llama_session_zone_t  *zone;
} ngx_http_llama_session_owner_t;


typedef struct {
    ngx_http_upstream_rr_peer_data_t   rrp;    /* first: round robin's */
    ngx_http_llama_session_balance_t  *bal;
    ngx_str_t                          key;
    uint32_t                           hash;
} ngx_http_llama_session_balance_peer_t;


/* an owner, as a pick sees it */

typedef struct {
    ngx_uint_t                      load;       /* in flight and waiting */
    ngx_uint_t                      slots;
    ngx_int_t                       slot;       /* holds the key, or -1 */
    ngx_uint_t                      held;       /* ... its tokens, 0: unknown */
    ngx_msec_t                      used;       /* ... its last turn's end */
    ngx_msec_t                      quiet;      /* ms since the owner ran
                                                   a turn: its slots' least
                                                   idle (a busy one: 0) */
    ngx_uint_t                      turn_ms;    /* a turn's hold of a slot */
    double                          restore;    /* ms a byte, 0: unknown */
    double                          prefill;    /* ms a token, 0: unknown */
    unsigned                        saved:1;    /* remote: the slot's state
                                                   is its file's */
    unsigned                        shared:1;
    unsigned                        usable:1;
    unsigned                        under:1;    /* the bound, or a slot free */
    unsigned                        ram:1;      /* in its RAM model */
} ngx_http_llama_session_view_t;


static ngx_int_t ngx_http_llama_session_balance_init(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us);
static ngx_http_llama_session_zone_t *ngx_http_llama_session_balance_zone(
    ngx_conf_t *cf, ngx_http_llama_session_main_conf_t *lmcf,
    struct sockaddr *sa, socklen_t socklen);
static ngx_int_t ngx_http_llama_session_balance_ring(ngx_conf_t *cf,
    ngx_http_llama_session_balance_t *bal, ngx_http_upstream_rr_peers_t *peers);
static int ngx_libc_cdecl ngx_http_llama_session_balance_cmp(const void *one,
    const void *two);
static ngx_int_t ngx_http_llama_session_balance_init_peer(
    ngx_http_request_t *r, ngx_http_upstream_srv_conf_t *us);
static ngx_int_t ngx_http_llama_session_balance_get(ngx_peer_connection_t *pc,
    void *data);
static void ngx_http_llama_session_balance_sent(
    ngx_http_llama_session_balance_peer_t *bp);
static void ngx_http_llama_session_balance_zone_view(
    ngx_http_llama_session_balance_peer_t *bp, ngx_uint_t i,
    ngx_http_llama_session_view_t *v);
static void ngx_http_llama_session_balance_copy_view(
    ngx_http_llama_session_balance_peer_t *bp, ngx_uint_t i, ngx_uint_t conns,
    ngx_http_llama_session_view_t *v);
static ngx_int_t ngx_http_llama_session_balance_pick(
    ngx_http_llama_session_balance_peer_t *bp, ngx_log_t *log);
static ngx_uint_t ngx_http_llama_session_balance_order(
    ngx_http_llama_session_balance_t *bal, uint32_t hash, ngx_uint_t *ring);
static ngx_int_t ngx_http_llama_session_balance_file(
    ngx_http_llama_session_balance_peer_t *bp, off_t *bytes,
    ngx_uint_t *tokens);
static void ngx_http_llama_session_balance_even(
    ngx_http_llama_session_view_t *view, ngx_uint_t n);
static ngx_msec_t ngx_http_llama_session_balance_cost(
    ngx_http_llama_session_view_t *v, ngx_uint_t i, ngx_int_t resident,
    ngx_int_t file, off_t bytes, ngx_uint_t newer);
static ngx_int_t ngx_http_llama_session_balance_take(ngx_peer_connection_t *pc,
    ngx_http_llama_session_balance_peer_t *bp, ngx_uint_t chosen);


/*
 * llama_session_balance [factor=number] [spill=restore|any|off]
 *                       [residency=on|off];
 */

char *
ngx_http_llama_session_balance(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_int_t                            n;
    ngx_str_t                           *value, name;
    ngx_uint_t                           i;
    ngx_http_upstream_srv_conf_t        *uscf;
    ngx_http_llama_session_balance_t    *bal, **bp;
    ngx_http_llama_session_main_conf_t  *lmcf;

    uscf = ngx_http_conf_get_module_srv_conf(cf, ngx_http_upstream_module);
    lmcf = ngx_http_conf_get_module_main_conf(cf,
                                              ngx_http_llama_session_module);

    if (uscf->peer.init_upstream) {
        ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                           "load balancing method redefined");
    }

    bal = ngx_pcalloc(cf->pool, sizeof(ngx_http_llama_session_balance_t));
    if (bal == NULL) {
        return NGX_CONF_ERROR;
    }

    bal->uscf = uscf;
    bal->factor = 125;
    bal->spill = NGX_HTTP_LLAMA_SESSION_SPILL_RESTORE;
    bal->residency = 1;
    bal->poll = 1000;

    value = cf->args->elts;

    for (i = 1; i < cf->args->nelts; i++) {

        if (ngx_strncmp(value[i].data, "factor=", 7) == 0) {
            n = ngx_atofp(value[i].data + 7, value[i].len - 7, 2);

            if (n < 105 || n > 400) {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid \"%V\": factor= is the load "
                                   "bound, a factor of the mean from 1.05 "
                                   "to 4", &value[i]);
                return NGX_CONF_ERROR;
            }

            bal->factor = n;
            continue;
        }

        if (ngx_strncmp(value[i].data, "spill=", 6) == 0) {
            name.data = value[i].data + 6;
            name.len = value[i].len - 6;

            if (name.len == 7
                && ngx_strncmp(name.data, "restore", 7) == 0)
            {
                bal->spill = NGX_HTTP_LLAMA_SESSION_SPILL_RESTORE;

            } else if (name.len == 3 && ngx_strncmp(name.data, "any", 3) == 0) {
                bal->spill = NGX_HTTP_LLAMA_SESSION_SPILL_ANY;

            } else if (name.len == 3 && ngx_strncmp(name.data, "off", 3) == 0) {
                bal->spill = NGX_HTTP_LLAMA_SESSION_SPILL_OFF;

            } else {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid \"%V\": spill= is \"restore\", "
                                   "\"any\" or \"off\"", &value[i]);
                return NGX_CONF_ERROR;
            }

            continue;
        }

        if (ngx_strncmp(value[i].data, "poll=", 5) == 0) {
            name.data = value[i].data + 5;
            name.len = value[i].len - 5;

            if (name.len == 3 && ngx_strncmp(name.data, "off", 3) == 0) {
                bal->poll = 0;
                continue;
            }

            bal->poll = ngx_parse_time(&name, 0);

            if (bal->poll == (ngx_msec_t) NGX_ERROR || bal->poll < 100) {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid \"%V\": poll= is how long an "
                                   "owner on another host may go unheard "
                                   "before the edge asks it, 100ms at "
                                   "least, or \"off\"", &value[i]);
                return NGX_CONF_ERROR;
            }

            continue;
        }

        if (ngx_strcmp(value[i].data, "residency=on") == 0) {
            bal->residency = 1;
            continue;
        }

        if (ngx_strcmp(value[i].data, "residency=off") == 0) {
            bal->residency = 0;
            continue;
        }

        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid parameter \"%V\"", &value[i]);
        return NGX_CONF_ERROR;
    }

    ngx_str_set(&name, "llama_session_key");

    bal->key = ngx_http_get_variable_index(cf, &name);
    if (bal->key == NGX_ERROR) {
        return NGX_CONF_ERROR;
    }

    if (lmcf->balances.elts == NULL
        && ngx_array_init(&lmcf->balances, cf->pool, 2,
                          sizeof(ngx_http_llama_session_balance_t *))
           != NGX_OK)
    {
        return NGX_CONF_ERROR;
    }

    bp = ngx_array_push(&lmcf->balances);
    if (bp == NULL) {
        return NGX_CONF_ERROR;
    }

    *bp = bal;

    uscf->peer.init_upstream = ngx_http_llama_session_balance_init;

    uscf->flags = NGX_HTTP_UPSTREAM_CREATE
                  |NGX_HTTP_UPSTREAM_WEIGHT
                  |NGX_HTTP_UPSTREAM_MAX_CONNS
                  |NGX_HTTP_UPSTREAM_MAX_FAILS
                  |NGX_HTTP_UPSTREAM_FAIL_TIMEOUT
                  |NGX_HTTP_UPSTREAM_DOWN;

    return NGX_CONF_OK;
}


/* "llama_session <zone>" in a server {}: an owner a balancer may find */

ngx_int_t
ngx_http_llama_session_balance_owner(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_t *zone)
{
    ngx_http_llama_session_owner_t  *o;

    if (lmcf->owners.elts == NULL
        && ngx_array_init(&lmcf->owners, cf->pool, 4,
                          sizeof(ngx_http_llama_session_owner_t))
           != NGX_OK)
    {
        return NGX_ERROR;
    }

    o = ngx_array_push(&lmcf->owners);
    if (o == NULL) {
        return NGX_ERROR;
    }

    o->cscf = ngx_http_conf_get_module_srv_conf(cf, ngx_http_core_module);
    o->zone = zone;

    return NGX_OK;
}


ngx_http_llama_session_balance_t *
ngx_http_llama_session_balance_of(ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_upstream_srv_conf_t *us)
{
    ngx_uint_t                          i;
    ngx_http_llama_session_balance_t  **bal;

    bal = lmcf->balances.elts;

    for (i = 0; i < lmcf->balances.nelts; i++) {
        if (bal[i]->uscf == us) {
            return bal[i];
        }
    }

    return NULL;
}


static ngx_int_t
ngx_http_llama_session_balance_init(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us)
{
    ngx_uint_t                           i;
    ngx_http_upstream_rr_peer_t         *peer, *here, *away;
    ngx_http_upstream_rr_peers_t        *peers;
    ngx_http_llama_session_balance_t    *bal;
    ngx_http_llama_session_main_conf_t  *lmcf;

    if (ngx_http_upstream_init_round_robin(cf, us) != NGX_OK) {
        return NGX_ERROR;
    }

    us->peer.init = ngx_http_llama_session_balance_init_peer;

    lmcf = ngx_http_conf_get_module_main_conf(cf,
                                              ngx_http_llama_session_module);
    bal = ngx_http_llama_session_balance_of(lmcf, us);
    if (bal == NULL) {
        return NGX_ERROR;
    }

    peers = us->peer.data;

    if (peers->next) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "\"llama_session_balance\" in upstream \"%V\" takes no "
                      "\"backup\" servers: a failed owner's sessions go to "
                      "the other owners", &us->host);
        return NGX_ERROR;
    }

    if (peers->number > NGX_HTTP_LLAMA_SESSION_BALANCE_MAX) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "\"llama_session_balance\" in upstream \"%V\": %ui "
                      "servers, at most %uz", &us->host, peers->number,
                      NGX_HTTP_LLAMA_SESSION_BALANCE_MAX);
        return NGX_ERROR;
    }

    bal->npeers = peers->number;
    bal->zones = ngx_pcalloc(cf->pool, bal->npeers * sizeof(void *));
    bal->addrs = ngx_pcalloc(cf->pool, bal->npeers * sizeof(void *));
    bal->socklens = ngx_pcalloc(cf->pool, bal->npeers * sizeof(socklen_t));
    if (bal->zones == NULL || bal->addrs == NULL || bal->socklens == NULL) {
        return NGX_ERROR;
    }

    bal->shared = 1;
    here = NULL;
    away = NULL;

    for (peer = peers->peer, i = 0; peer; peer = peer->next, i++) {
        bal->addrs[i] = peer->sockaddr;
        bal->socklens[i] = peer->socklen;
        bal->zones[i] = ngx_http_llama_session_balance_zone(cf, lmcf,
                                                            peer->sockaddr,
                                                            peer->socklen);
        if (bal->zones[i] == NULL) {
            away = away ? away : peer;
            continue;
        }

        here = here ? here : peer;
        bal->shared &= (bal->zones[i]->shared != 0);
    }

    if (here && away) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "\"llama_session_balance\" in upstream \"%V\": "
                      "server \"%V\" (%V) has no owner zone in this "
                      "nginx, and server \"%V\" has one: the owners of an "
                      "upstream are all in this nginx (a server {} "
                      "listening there with \"llama_session <zone>\") or "
                      "all elsewhere", &us->host, &away->server, &away->name,
                      &here->server);
        return NGX_ERROR;
    }

    /* owners on other hosts: the edge keeps what they tell (told.c) */
    bal->remote = (away != NULL);

    return ngx_http_llama_session_balance_ring(cf, bal, peers);
}


/* the zone of the server {} of this nginx that listens on the address */

static ngx_http_llama_session_zone_t *
ngx_http_llama_session_balance_zone(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf, struct sockaddr *sa,
    socklen_t socklen)
{
    ngx_uint_t                       p, a, s, o;
    ngx_http_conf_port_t            *port;
    ngx_http_conf_addr_t            *addr;
    ngx_http_core_srv_conf_t       **cscfp;
    ngx_http_core_main_conf_t       *cmcf;
    ngx_http_llama_session_owner_t  *owner;

    cmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_core_module);

    if (cmcf->ports == NULL || lmcf->owners.elts == NULL) {
        return NULL;
    }

    port = cmcf->ports->elts;
    owner = lmcf->owners.elts;

    for (p = 0; p < cmcf->ports->nelts; p++) {

        if (port[p].family != sa->sa_family
            || port[p].port != ngx_inet_get_port(sa))
        {
            continue;
        }

        addr = port[p].addrs.elts;

        for (a = 0; a < port[p].addrs.nelts; a++) {

            if (!addr[a].opt.wildcard
                && ngx_cmp_sockaddr(addr[a].opt.sockaddr, addr[a].opt.socklen,
                                    sa, socklen, 1)
                   != NGX_OK)
            {
                continue;
            }

            cscfp = addr[a].servers.elts;

            for (s = 0; s < addr[a].servers.nelts; s++) {
                for (o = 0; o < lmcf->owners.nelts; o++) {
                    if (owner[o].cscf == cscfp[s]) {
                        return owner[o].zone;
                    }
                }
            }
        }
    }

    return NULL;
}


/*
 * The ring of nginx's "hash ... consistent": 160 points a weight, each
 * crc32(HOST \0 PORT PREV_HASH), sorted, the first of equal ones kept
 */

static ngx_int_t
ngx_http_llama_session_balance_ring(ngx_conf_t *cf,
    ngx_http_llama_session_balance_t *bal, ngx_http_upstream_rr_peers_t *peers)
{
    u_char                        *host, *port, c;
    size_t                         host_len, port_len;
    uint32_t                       hash, base_hash;
    ngx_str_t                     *server;
    ngx_uint_t                     npoints, i, j, k;
    ngx_http_upstream_rr_peer_t   *peer;
    union {
        uint32_t                   value;
        u_char                     byte[4];
    } prev_hash;

    npoints = peers->total_weight * NGX_HTTP_LLAMA_SESSION_BALANCE_POINTS;

    bal->points = ngx_palloc(cf->pool,
                             ngx_max(npoints, 1)
                             * sizeof(ngx_http_llama_session_point_t));
    if (bal->points == NULL) {
        return NGX_ERROR;
    }

    bal->npoints = 0;

    for (peer = peers->peer, k = 0; peer; peer = peer->next, k++) {
        server = &peer->server;

        host = server->data;
        host_len = server->len;
        port = NULL;
        port_len = 0;

        if (server->len >= 5
            && ngx_strncasecmp(server->data, (u_char *) "unix:", 5) == 0)
        {
            host = server->data + 5;
            host_len = server->len - 5;

        } else {
            for (j = 0; j < server->len; j++) {
                c = server->data[server->len - j - 1];

                if (c == ':') {
                    host_len = server->len - j - 1;
                    port = server->data + server->len - j;
                    port_len = j;
                    break;
                }

                if (c < '0' || c > '9') {
                    break;
                }
            }
        }

        ngx_crc32_init(base_hash);
        ngx_crc32_update(&base_hash, host, host_len);
        ngx_crc32_update(&base_hash, (u_char *) "", 1);
        ngx_crc32_update(&base_hash, port, port_len);

        prev_hash.value = 0;
        npoints = peer->weight * NGX_HTTP_LLAMA_SESSION_BALANCE_POINTS;

        for (j = 0; j < npoints; j++) {
            hash = base_hash;

            ngx_crc32_update(&hash, prev_hash.byte, 4);
            ngx_crc32_final(hash);

            bal->points[bal->npoints].hash = hash;
            bal->points[bal->npoints].peer = k;
            bal->npoints++;

#if (NGX_HAVE_LITTLE_ENDIAN)
            prev_hash.value = hash;
#else
            prev_hash.byte[0] = (u_char) (hash & 0xff);
            prev_hash.byte[1] = (u_char) ((hash >> 8) & 0xff);
            prev_hash.byte[2] = (u_char) ((hash >> 16) & 0xff);
            prev_hash.byte[3] = (u_char) ((hash >> 24) & 0xff);
#endif
        }
    }

    ngx_qsort(bal->points, bal->npoints,
              sizeof(ngx_http_llama_session_point_t),
              ngx_http_llama_session_balance_cmp);

    for (i = 0, j = 1; j < bal->npoints; j++) {
        if (bal->points[i].hash != bal->points[j].hash) {
            bal->points[++i] = bal->points[j];
        }
    }

    if (bal->npoints) {
        bal->npoints = i + 1;
    }

    return NGX_OK;
}


static int ngx_libc_cdecl
ngx_http_llama_session_balance_cmp(const void *one, const void *two)
{
    const ngx_http_llama_session_point_t  *a = one;
    const ngx_http_llama_session_point_t  *b = two;

    return (a->hash < b->hash) ? -1 : (a->hash > b->hash);
}


static ngx_int_t
ngx_http_llama_session_balance_init_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us)
{
    ngx_http_variable_value_t              *vv;
    ngx_http_llama_session_main_conf_t     *lmcf;
    ngx_http_llama_session_balance_peer_t  *bp;

    bp = ngx_palloc(r->pool, sizeof(ngx_http_llama_session_balance_peer_t));
    if (bp == NULL) {
        return NGX_ERROR;
    }

    r->upstream->peer.data = &bp->rrp;

    if (ngx_http_upstream_init_round_robin_peer(r, us) != NGX_OK) {
        return NGX_ERROR;
    }

    r->upstream->peer.get = ngx_http_llama_session_balance_get;

    lmcf = ngx_http_get_module_main_conf(r, ngx_http_llama_session_module);
    bp->bal = ngx_http_llama_session_balance_of(lmcf, us);

    ngx_str_null(&bp->key);
    bp->hash = 0;

    vv = ngx_http_get_indexed_variable(r, bp->bal->key);

    if (vv && !vv->not_found && vv->len) {
        bp->key.data = vv->data;
        bp->key.len = vv->len;
        bp->hash = ngx_crc32_long(vv->data, vv->len);
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_llama_session_balance_get(ngx_peer_connection_t *pc, void *data)
{
    ngx_http_llama_session_balance_peer_t  *bp = data;

    ngx_int_t  rc, chosen;

    if (bp->key.len == 0 || bp->rrp.peers->single
        || bp->rrp.peers->number != bp->bal->npeers)
    {
        /* no session (or a list this nginx changed): round robin */
        return ngx_http_upstream_get_round_robin_peer(pc, &bp->rrp);
    }

    chosen = ngx_http_llama_session_balance_pick(bp, pc->log);

    if (chosen == NGX_DECLINED) {
        rc = ngx_http_upstream_get_round_robin_peer(pc, &bp->rrp);

    } else {
        rc = ngx_http_llama_session_balance_take(pc, bp, (ngx_uint_t) chosen);
    }

    if (rc == NGX_OK && bp->bal->sent) {
        ngx_http_llama_session_balance_sent(bp);
    }

    return rc;
}


/* an edge counts the turns it sends each owner (copy_view) */

static void
ngx_http_llama_session_balance_sent(ngx_http_llama_session_balance_peer_t *bp)
{
    ngx_uint_t                     i;
    ngx_http_upstream_rr_peer_t   *peer;
    ngx_http_upstream_rr_peers_t  *peers;

    peers = bp->rrp.peers;

    ngx_http_upstream_rr_peers_rlock(peers);

    for (peer = peers->peer, i = 0; peer; peer = peer->next, i++) {
        if (peer == bp->rrp.current) {
            (void) ngx_atomic_fetch_add(&bp->bal->sent[i], 1);
            break;
        }
    }

    ngx_http_upstream_rr_peers_unlock(peers);
}


/*
 * An owner of this nginx: its zone, read without its lock; a stale view
 * costs a restore, never a wrong reply (the owner decides its slots)
 */

static void
ngx_http_llama_session_balance_zone_view(
    ngx_http_llama_session_balance_peer_t *bp, ngx_uint_t i,
    ngx_http_llama_session_view_t *v)
{
    ngx_uint_t                         s, k;
    ngx_msec_int_t                     idle;
    ngx_http_llama_session_sh_t       *sh;
    ngx_http_llama_session_ram_t      *e;
    ngx_http_llama_session_zone_t     *zone;
    ngx_http_llama_session_balance_t  *bal;

    bal = bp->bal;
    zone = bal->zones[i];
    sh = zone->sh;

    v->slots = zone->nslots;
    v->load = sh->nwaiters;
    v->turn_ms = sh->turn_ms;
    v->restore = sh->cost.restore_samples ? sh->cost.restore_ms_per_byte : 0;
    v->prefill = sh->cost.prefill_samples ? sh->cost.prefill_ms_per_token
                                          : 0;
    v->shared = (zone->shared != 0);

    /*
     * how long the owner has run no turn: its slots' least idle, a free
     * one never used (another worker's clock may be a little ahead);
     * bounded loads alone read no slot's content: ties go by the ring
     */

    v->quiet = bal->residency ? NGX_MAX_INT32_VALUE : 0;

    for (s = 0; s < v->slots; s++) {
        v->load += sh->slots[s].busy;

        if (sh->slots[s].busy) {
            v->quiet = 0;

        } else if (sh->slots[s].state == NGX_HTTP_LLAMA_SESSION_SLOT_SESSION) {
            idle = (ngx_msec_int_t) (ngx_current_msec
                                     - sh->slots[s].last_used);

            v->quiet = ngx_min(v->quiet, (ngx_msec_t) ngx_max(idle, 0));
        }

        if (bal->residency && bp->hash && sh->slots[s].crc == bp->hash) {
            v->slot = s;
            v->held = sh->slots[s].held;
            v->used = sh->slots[s].last_used;
        }
    }

    if (bal->residency && bp->hash && zone->ram && v->slot == -1) {
        for (k = 0; k < NGX_HTTP_LLAMA_SESSION_RAM_MAX; k++) {
            e = &sh->ram[k];

            if (e->seq && e->crc == bp->hash) {
                v->ram = 1;
                break;
            }
        }
    }
}


/*
 * An owner on another host: as its last reply through this edge told; its
 * load counts for a turn's hold (a second at least), with the turns this
 * edge sent it since, of its connections to it (conns); then only those
 * connections do
 */

static void
ngx_http_llama_session_balance_copy_view(
    ngx_http_llama_session_balance_peer_t *bp, ngx_uint_t i, ngx_uint_t conns,
    ngx_http_llama_session_view_t *v)
{
    ngx_uint_t                      s, since;
    ngx_msec_int_t                  age;
    ngx_http_llama_session_copy_t  *c;

    c = &bp->bal->told[i];

    /* never heard: one slot, free, over one store, as the edge supposes */

    v->slots = 1;
    v->shared = 1;

    if (c->heard == 0) {
        return;
    }

    v->slots = ngx_max(c->slots, 1);
    v->turn_ms = c->turn_ms;
    v->restore = c->restore / 1000.0 / 1048576.0;
    v->prefill = c->prefill / 1000.0;
    v->shared = (c->shared != 0);

    age = (ngx_msec_int_t) (ngx_current_msec - c->heard);

    if (age < (ngx_msec_int_t) ngx_max(c->turn_ms,
                                       NGX_HTTP_LLAMA_SESSION_BALANCE_FRESH))
    {
        since = bp->bal->sent[i] - c->sent;
        v->load = c->load + ngx_min(since, conns);
    }

    if (!bp->bal->residency || bp->hash == 0) {
        return;
    }

    for (s = 0; s < v->slots && s < NGX_HTTP_LLAMA_SESSION_SLOTS_MAX; s++) {
        if (c->crc[s] == bp->hash) {
            v->slot = s;
            v->saved = (c->saved[s] != 0);
            v->used = c->used[s];
            break;
        }
    }
}


/* the owner for the turn, by the rules of the file's comment */

static ngx_int_t
ngx_http_llama_session_balance_pick(ngx_http_llama_session_balance_peer_t *bp,
    ngx_log_t *log)
{
    off_t                              bytes;
    time_t                             now;
    uintptr_t                          m;
    ngx_int_t                          resident, ram, file, best;
    ngx_msec_t                         cost[NGX_HTTP_LLAMA_SESSION_BALANCE_MAX];
    ngx_msec_t                         least;
    ngx_uint_t                         i, k, n, live, sum, bound, tokens,
                                       newer, shared;
    ngx_uint_t                         ring[NGX_HTTP_LLAMA_SESSION_BALANCE_MAX];
    ngx_http_upstream_rr_peer_t       *peer;
    ngx_http_upstream_rr_peers_t      *peers;
    ngx_http_llama_session_view_t      view[NGX_HTTP_LLAMA_SESSION_BALANCE_MAX];
    ngx_http_llama_session_view_t     *v;
    ngx_http_llama_session_balance_t  *bal;

    bal = bp->bal;
    peers = bp->rrp.peers;
    now = ngx_time();

    live = 0;
    sum = 0;
    resident = -1;
    ram = -1;
    shared = 1;

    ngx_http_upstream_rr_peers_rlock(peers);

    for (peer = peers->peer, i = 0; peer; peer = peer->next, i++) {
        v = &view[i];
        ngx_memzero(v, sizeof(ngx_http_llama_session_view_t));
        v->slot = -1;

        m = (uintptr_t) 1 << i % (8 * sizeof(uintptr_t));

        if ((bp->rrp.tried[i / (8 * sizeof(uintptr_t))] & m)
            || peer->down
            || (peer->max_fails && peer->fails >= peer->max_fails
                && now - peer->checked <= peer->fail_timeout)
            || (peer->max_conns && peer->conns >= peer->max_conns)
            || ngx_cmp_sockaddr(peer->sockaddr, peer->socklen,
                                bal->addrs[i], peer->socklen, 1)
               != NGX_OK)
        {
            continue;
        }

        if (bal->remote) {
            ngx_http_llama_session_balance_copy_view(bp, i, peer->conns, v);

        } else {
            ngx_http_llama_session_balance_zone_view(bp, i, v);
        }

        /* turns this nginx sent that the owner has not counted yet */
        v->load = ngx_max(v->load, (ngx_uint_t) peer->conns);

        v->usable = 1;
        live++;
        sum += v->load;
        shared &= v->shared;

        /* in two slots (an owner back, its zone not told yet): the one
         * used last holds the newer state */

        if (v->slot != -1
            && (resident == -1
                || (ngx_msec_int_t) (v->used - view[resident].used) > 0))
        {
            resident = i;
        }

        if (v->ram && ram == -1) {
            ram = i;
        }
    }

    ngx_http_upstream_rr_peers_unlock(peers);

    if (live == 0) {
        return NGX_DECLINED;
    }

    n = ngx_http_llama_session_balance_order(bal, bp->hash, ring);

    /*
     * bound: ceil(factor x (load + this turn) / owners); an owner with a
     * slot free is under it too, or a nearly idle fleet would move a hit
     * off an owner of two slots running one turn
     */

    bound = (bal->factor * (sum + 1) + 100 * live - 1) / (100 * live);

    for (i = 0; i < bal->npeers; i++) {
        view[i].under = view[i].usable
                        && (view[i].load < bound
                            || view[i].load < view[i].slots);
    }

    if (bal->spill == NGX_HTTP_LLAMA_SESSION_SPILL_OFF) {
        /* nginx's consistent hash: the first live owner from home */
        for (k = 0; k < n; k++) {
            if (view[ring[k]].usable) {
                return ring[k];
            }
        }

        return NGX_DECLINED;
    }

    if (resident != -1 && view[resident].under) {
        ngx_log_debug3(NGX_LOG_DEBUG_HTTP, log, 0,
                       "llama_session balance: \"%V\" in a slot of peer %i, "
                       "load %ui", &bp->key, resident, view[resident].load);
        return resident;
    }

    if (!bal->remote) {
        file = ngx_http_llama_session_balance_file(bp, &bytes, &tokens);

    } else {
        /* remote owners: the slot's state is saved, or it is not known */
        bytes = 0;
        tokens = 0;
        file = (resident == -1) ? NGX_HTTP_LLAMA_SESSION_BALANCE_UNKNOWN
                                : view[resident].saved ? resident
                                                       : NGX_DECLINED;
    }

    if (resident != -1
        && (file == NGX_DECLINED
            || (bal->spill == NGX_HTTP_LLAMA_SESSION_SPILL_RESTORE
                && !shared)))
    {
        /* its state is in that slot only (or in its owner's folder) */
        return resident;
    }

    if (file >= 0 && !shared
        && bal->spill == NGX_HTTP_LLAMA_SESSION_SPILL_RESTORE
        && view[file].usable)
    {
        /* folders per owner: the file restores with its owner only */
        return file;
    }

    if (resident == -1 && ram == -1 && file == NGX_DECLINED
        && view[ring[0]].under)
    {
        /* no state anywhere: home */
        return ring[0];
    }

    /* the soonest first token among the owners under the bound */

    if (shared) {
        ngx_http_llama_session_balance_even(view, bal->npeers);
    }

    newer = 0;

    if (resident != -1 && file >= 0 && view[resident].held > tokens) {
        newer = view[resident].held - tokens;
    }

    least = NGX_HTTP_LLAMA_SESSION_BALANCE_NONE;

    for (k = 0; k < n; k++) {
        i = ring[k];
        cost[i] = NGX_HTTP_LLAMA_SESSION_BALANCE_NONE;

        if (!view[i].usable
            || ((ngx_int_t) i != resident && !view[i].under))
        {
            continue;
        }

        cost[i] = ngx_http_llama_session_balance_cost(&view[i], i, resident,
                                                      file, bytes, newer);
        least = ngx_min(least, cost[i]);
    }

    best = NGX_DECLINED;

    if (least != NGX_HTTP_LLAMA_SESSION_BALANCE_NONE) {
        /*
         * of the owners as soon, the one that holds it; else, of owners
         * in this nginx, the one quiet the longest (a session that talks
         * keeps its owner: two that talk on one owner would make it the
         * busiest); then the first from home.  An edge's copy of the
         * owners' slots is up to a poll old: every turn of a poll would
         * go to the one owner it saw quiet
         */

        for (k = 0; k < n; k++) {
            i = ring[k];

            if (cost[i] != NGX_HTTP_LLAMA_SESSION_BALANCE_NONE
                && cost[i] <= least + least / 10
                && (best == NGX_DECLINED
                    || (ngx_int_t) i == resident
                    || (best != resident && !bal->remote
                        && view[i].quiet > view[best].quiet)))
            {
                best = i;
            }
        }

    } else {
        /* none under the bound: the least loaded, from home */
        for (k = 0; k < n; k++) {
            i = ring[k];

            if (view[i].usable
                && (best == NGX_DECLINED || view[i].load < view[best].load))
            {
                best = i;
            }
        }
    }

    ngx_log_debug5(NGX_LOG_DEBUG_HTTP, log, 0,
                   "llama_session balance: \"%V\" home %ui resident %i "
                   "file %i: peer %i", &bp->key, ring[0], resident, file,
                   best);

    return best;
}


/* the peers in the ring's order from the key's home: how many */

static ngx_uint_t
ngx_http_llama_session_balance_order(ngx_http_llama_session_balance_t *bal,
    uint32_t hash, ngx_uint_t *ring)
{
    uintptr_t   seen;
    ngx_uint_t  i, j, k, n, p;

    if (bal->npoints == 0) {
        for (n = 0; n < bal->npeers; n++) {
            ring[n] = n;
        }

        return n;
    }

    /* the first point at or after the hash, as nginx's hash finds it */

    i = 0;
    j = bal->npoints;

    while (i < j) {
        k = (i + j) / 2;

        if (hash > bal->points[k].hash) {
            i = k + 1;

        } else {
            j = k;
        }
    }

    seen = 0;
    n = 0;

    for (k = 0; k < bal->npoints && n < bal->npeers; k++) {
        p = bal->points[(i + k) % bal->npoints].peer;

        if (!(seen & ((uintptr_t) 1 << p))) {
            seen |= (uintptr_t) 1 << p;
            ring[n++] = p;
        }
    }

    return n;
}


/*
 * Has the session a file, as the owners' indexes know it: the peer whose
 * zone knows it (its bytes and tokens), or NGX_DECLINED
 */

static ngx_int_t
ngx_http_llama_session_balance_file(ngx_http_llama_session_balance_peer_t *bp,
    off_t *bytes, ngx_uint_t *tokens)
{
    ngx_uint_t                        i;
    ngx_http_llama_session_zone_t    *zone;
    ngx_http_llama_session_balance_t *bal;

    bal = bp->bal;

    *bytes = 0;
    *tokens = 0;

    for (i = 0; i < bal->npeers; i++) {
        zone = bal->zones[i];

        if (zone->sh->fp_known
            && ngx_http_llama_session_file_size(zone, zone->sh->fp,
                                                bp->key.data, bp->key.len,
                                                bytes, tokens)
               == NGX_OK)
        {
            return i;
        }
    }

    return NGX_DECLINED;
}


/*
 * One store: a file restores as fast on any owner of a model, the speeds
 * each learned differing by their noise, which would decide between owners
 * of equal queues; their mean for all, so that the ring's order does (a
 * session's spills land on the same owners)
 */

static void
ngx_http_llama_session_balance_even(ngx_http_llama_session_view_t *view,
    ngx_uint_t n)
{
    double      restore, prefill;
    ngx_uint_t  i, nr, np;

    restore = 0;
    prefill = 0;
    nr = 0;
    np = 0;

    for (i = 0; i < n; i++) {
        if (view[i].usable && view[i].restore > 0) {
            restore += view[i].restore;
            nr++;
        }

        if (view[i].usable && view[i].prefill > 0) {
            prefill += view[i].prefill;
            np++;
        }
    }

    for (i = 0; i < n; i++) {
        view[i].restore = nr ? restore / nr : 0;
        view[i].prefill = np ? prefill / np : 0;
    }
}


/*
 * ms to the turn's first token on owner i, but for its own prefill; newer:
 * the tokens its slot elsewhere holds beyond its file
 */

static ngx_msec_t
ngx_http_llama_session_balance_cost(ngx_http_llama_session_view_t *v,
    ngx_uint_t i, ngx_int_t resident, ngx_int_t file, off_t bytes,
    ngx_uint_t newer)
{
    double  ms;

    ms = 0;

    /* the turns ahead of it beyond its slots, a turn's hold each */

    if (v->load + 1 > v->slots) {
        ms += (double) (v->load + 1 - v->slots)
              * (v->turn_ms ? v->turn_ms : NGX_HTTP_LLAMA_SESSION_BALANCE_TURN)
              / v->slots;
    }

    if ((ngx_int_t) i == resident || v->ram || file == NGX_DECLINED) {
        /* a hit, out of llama-server's RAM, or a prefill anywhere */
        return (ngx_msec_t) ms;
    }

    ms += (double) bytes * (v->restore ? v->restore
                                       : NGX_HTTP_LLAMA_SESSION_BALANCE_RESTORE);

    if (newer && v->prefill) {
        ms += (double) newer * v->prefill;
    }

    return (ngx_msec_t) ms;
}


/*
 * nginx's round robin takes the chosen peer with its own accounting: every
 * other one is marked tried for that call only
 */

static ngx_int_t
ngx_http_llama_session_balance_take(ngx_peer_connection_t *pc,
    ngx_http_llama_session_balance_peer_t *bp, ngx_uint_t chosen)
{
    ngx_int_t   rc;
    uintptr_t  *tried, marked;

    tried = &bp->rrp.tried[0];

    /* at most NGX_HTTP_LLAMA_SESSION_BALANCE_MAX peers: one word */
    marked = ~*tried & ~((uintptr_t) 1 << chosen);

    if (bp->bal->npeers < NGX_HTTP_LLAMA_SESSION_BALANCE_MAX) {
        marked &= ((uintptr_t) 1 << bp->bal->npeers) - 1;
    }

    *tried |= marked;

    rc = ngx_http_upstream_get_round_robin_peer(pc, &bp->rrp);

    *tried &= ~marked;

    if (rc == NGX_BUSY) {
        /* it failed meanwhile: round robin among the others */
        rc = ngx_http_upstream_get_round_robin_peer(pc, &bp->rrp);
    }

    return rc;
}
