
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * What owners on other hosts tell an edge that balances them
 * (llama_session_balance, balance.c).  The edge marks the requests it
 * forwards (X-Llama-Session-Edge); an owner, a location of
 * "llama_session <zone>", answers those with what it holds:
 *
 *     X-Llama-Session-Owner: l=LOAD s=SLOTS t=TURN_MS r=US_A_MIB
 *                            p=US_A_TOKEN sh=0|1 k=CRC[+][:AGE],...
 *
 * (l: in flight and waiting but this turn; k: the crc32 of the key in each
 * slot, in hex, 0 for none, "+" when the slot's state is its file's, AGE
 * the ms since its last turn).  The edge keeps the last one of each owner
 * in a zone of its own, for the pick, and takes it out of the reply: it
 * never reaches a client.  Owners it has not heard of for poll= it asks
 * itself, from one worker: GET /health, marked, through the owner's
 * location (llama-server's health, and the owner's header with it).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_balance.h"
#include "ngx_http_llama_session_told.h"


/*
 * the edge's zone: a copy and a count of turns for each peer, and the
 * slab pool's own
 */
#define NGX_HTTP_LLAMA_SESSION_TOLD_SIZE                                      \
    (NGX_HTTP_LLAMA_SESSION_BALANCE_MAX                                       \
     * (sizeof(ngx_http_llama_session_copy_t) + sizeof(ngx_atomic_t)))
#define NGX_HTTP_LLAMA_SESSION_TOLD_SHM                                       \
    (NGX_HTTP_LLAMA_SESSION_TOLD_SIZE + 32 * 1024)

/* what an owner may say: more is taken as this much */
#define NGX_HTTP_LLAMA_SESSION_TOLD_LOAD   65536
#define NGX_HTTP_LLAMA_SESSION_TOLD_MS     3600000
#define NGX_HTTP_LLAMA_SESSION_TOLD_SPEED  1000000000

/* a poll's reply: its headers, the owner's among them */
#define NGX_HTTP_LLAMA_SESSION_TOLD_REPLY  4096


/* a poll of one owner, from the edge's first worker */

typedef struct {
    ngx_http_llama_session_balance_t  *bal;
    ngx_uint_t                         peer;
    ngx_str_t                          name;       /* its address */
    ngx_peer_connection_t              pc;
    ngx_str_t                          request;
    size_t                             sent;
    size_t                             len;        /* of the reply read */
    u_char                            *reply;
    unsigned                           busy:1;
} ngx_http_llama_session_poll_t;


typedef struct {
    ngx_event_t                        timer;
    ngx_http_llama_session_balance_t  *bal;
    ngx_http_llama_session_poll_t     *polls;     /* by peer */
} ngx_http_llama_session_poller_t;


static ngx_int_t ngx_http_llama_session_told_zone(ngx_conf_t *cf,
    ngx_http_llama_session_balance_t *bal);
static ngx_int_t ngx_http_llama_session_told_init_zone(
    ngx_shm_zone_t *shm_zone, void *data);
static ngx_int_t ngx_http_llama_session_told_header(ngx_http_request_t *r);
static ngx_int_t ngx_http_llama_session_told_tell(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone, ngx_uint_t acquired);
static void ngx_http_llama_session_told_learn(ngx_http_request_t *r,
    ngx_str_t *value);
static void ngx_http_llama_session_told_keep(
    ngx_http_llama_session_balance_t *bal, ngx_uint_t peer, ngx_str_t *name,
    u_char *p, u_char *last, ngx_uint_t reply, ngx_log_t *log);
static void ngx_http_llama_session_told_tick(ngx_event_t *ev);
static void ngx_http_llama_session_told_poll(
    ngx_http_llama_session_poll_t *poll, ngx_log_t *log);
static void ngx_http_llama_session_told_write(ngx_event_t *wev);
static void ngx_http_llama_session_told_read(ngx_event_t *rev);
static void ngx_http_llama_session_told_done(
    ngx_http_llama_session_poll_t *poll, char *failed);


static ngx_str_t  ngx_http_llama_session_told_edge =
    ngx_string("X-Llama-Session-Edge");
static ngx_str_t  ngx_http_llama_session_told_owner =
    ngx_string("X-Llama-Session-Owner");

static ngx_http_output_header_filter_pt  ngx_http_next_header_filter;


/* the edge's zone of an upstream of remote owners */

static ngx_int_t
ngx_http_llama_session_told_zone(ngx_conf_t *cf,
    ngx_http_llama_session_balance_t *bal)
{
    ngx_str_t  name;

    name.len = sizeof("llama_session_balance ") - 1 + bal->uscf->host.len;
    name.data = ngx_pnalloc(cf->pool, name.len);
    if (name.data == NULL) {
        return NGX_ERROR;
    }

    ngx_sprintf(name.data, "llama_session_balance %V", &bal->uscf->host);

    bal->copies = ngx_shared_memory_add(cf, &name,
                                        NGX_HTTP_LLAMA_SESSION_TOLD_SHM,
                                        &ngx_http_llama_session_module);
    if (bal->copies == NULL) {
        return NGX_ERROR;
    }

    bal->copies->init = ngx_http_llama_session_told_init_zone;
    bal->copies->data = bal;

    return NGX_OK;
}


/*
 * What the owners told survives a reload only if the list of servers is
 * the same (else each is heard anew)
 */

static ngx_int_t
ngx_http_llama_session_told_init_zone(ngx_shm_zone_t *shm_zone, void *data)
{
    ngx_http_llama_session_balance_t  *obal = data;

    size_t                             size;
    ngx_uint_t                         i;
    ngx_slab_pool_t                   *shpool;
    ngx_http_llama_session_balance_t  *bal;

    bal = shm_zone->data;
    size = NGX_HTTP_LLAMA_SESSION_TOLD_SIZE;

    if (obal) {
        bal->told = obal->told;
        bal->sent = obal->sent;

        for (i = 0; i < bal->npeers; i++) {
            if (i >= obal->npeers
                || ngx_cmp_sockaddr(obal->addrs[i], obal->socklens[i],
                                    bal->addrs[i], bal->socklens[i], 1)
                   != NGX_OK)
            {
                ngx_memzero(bal->told, size);
                break;
            }
        }

        return NGX_OK;
    }

    shpool = (ngx_slab_pool_t *) shm_zone->shm.addr;

    bal->told = ngx_slab_calloc(shpool, size);
    if (bal->told == NULL) {
        return NGX_ERROR;
    }

    bal->sent = (ngx_atomic_t *) (bal->told
                                  + NGX_HTTP_LLAMA_SESSION_BALANCE_MAX);

    return NGX_OK;
}


/*
 * After the upstreams' init (llama_session_balance found which are of
 * owners on other hosts): an edge's zone for each, and the header filter
 */

ngx_int_t
ngx_http_llama_session_told_filter_init(ngx_conf_t *cf)
{
    ngx_uint_t                            i;
    ngx_http_llama_session_balance_t    **bal;
    ngx_http_llama_session_main_conf_t   *lmcf;

    lmcf = ngx_http_conf_get_module_main_conf(cf,
                                              ngx_http_llama_session_module);

    if (lmcf->balances.elts) {
        bal = lmcf->balances.elts;

        for (i = 0; i < lmcf->balances.nelts; i++) {
            if (bal[i]->remote
                && ngx_http_llama_session_told_zone(cf, bal[i]) != NGX_OK)
            {
                return NGX_ERROR;
            }
        }
    }

    ngx_http_next_header_filter = ngx_http_top_header_filter;
    ngx_http_top_header_filter = ngx_http_llama_session_told_header;

    return NGX_OK;
}


/* an edge's request to an owner: marked, whatever the client sent */

ngx_int_t
ngx_http_llama_session_told_mark(ngx_http_request_t *r)
{
    ngx_table_elt_t  *h;

    h = ngx_list_push(&r->headers_in.headers);
    if (h == NULL) {
        return NGX_ERROR;
    }

    h->hash = 1;
    h->key = ngx_http_llama_session_told_edge;
    ngx_str_set(&h->value, "1");
    h->lowcase_key = (u_char *) "x-llama-session-edge";
#if (nginx_version >= 1023000)
    h->next = NULL;
#endif

    return NGX_OK;
}


static ngx_int_t
ngx_http_llama_session_told_header(ngx_http_request_t *r)
{
    ngx_uint_t                          i;
    ngx_list_part_t                    *part;
    ngx_table_elt_t                    *h;
    ngx_http_llama_session_ctx_t       *ctx;
    ngx_http_llama_session_loc_conf_t  *llcf;

    if (r != r->main) {
        return ngx_http_next_header_filter(r);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_llama_session_module);

    if (ctx && ctx->identity) {
        /* an edge: what the owner told is kept, and taken out */

        for (part = &r->headers_out.headers.part; part; part = part->next) {
            h = part->elts;

            for (i = 0; i < part->nelts; i++) {
                if (h[i].hash
                    && h[i].key.len == ngx_http_llama_session_told_owner.len
                    && ngx_strncasecmp(h[i].key.data,
                                       ngx_http_llama_session_told_owner.data,
                                       h[i].key.len)
                       == 0)
                {
                    ngx_http_llama_session_told_learn(r, &h[i].value);
                    h[i].hash = 0;
                }
            }
        }

        return ngx_http_next_header_filter(r);
    }

    llcf = ngx_http_get_module_loc_conf(r, ngx_http_llama_session_module);

    if (llcf->zone == NULL) {
        return ngx_http_next_header_filter(r);
    }

    /* an owner: an edge's request is told what this owner holds */

    for (part = &r->headers_in.headers.part; part; part = part->next) {
        h = part->elts;

        for (i = 0; i < part->nelts; i++) {
            if (h[i].key.len == ngx_http_llama_session_told_edge.len
                && ngx_strncmp(h[i].lowcase_key, "x-llama-session-edge",
                               h[i].key.len)
                   == 0)
            {
                if (ngx_http_llama_session_told_tell(r,
                        ctx && ctx->zone ? ctx->zone : llcf->zone,
                        ctx && ctx->job && ctx->job->acquired)
                    != NGX_OK)
                {
                    return NGX_ERROR;
                }

                return ngx_http_next_header_filter(r);
            }
        }
    }

    return ngx_http_next_header_filter(r);
}


static ngx_int_t
ngx_http_llama_session_told_tell(ngx_http_request_t *r,
    ngx_http_llama_session_zone_t *zone, ngx_uint_t acquired)
{
    u_char                         *p;
    size_t                          len;
    ngx_uint_t                      s, load;
    ngx_msec_t                      age;
    ngx_table_elt_t                *h;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_slot_t  *slot;

    sh = zone->sh;

    len = sizeof("l= s= t= r= p= sh=0 k=") - 1 + 5 * NGX_INT_T_LEN
          + zone->nslots * (sizeof(",ffffffff+:") - 1 + NGX_INT_T_LEN);

    p = ngx_pnalloc(r->pool, len);
    if (p == NULL) {
        return NGX_ERROR;
    }

    h = ngx_list_push(&r->headers_out.headers);
    if (h == NULL) {
        return NGX_ERROR;
    }

    h->hash = 1;
    h->key = ngx_http_llama_session_told_owner;
#if (nginx_version >= 1023000)
    h->next = NULL;
#endif
    h->value.data = p;

    /* read without the lock: a figure a moment old costs a restore */

    load = sh->nwaiters;

    for (s = 0; s < zone->nslots; s++) {
        load += sh->slots[s].busy;
    }

    /* but this turn: the edge counts its own connections to the owner */

    if (acquired && load) {
        load--;
    }

    p = ngx_sprintf(p, "l=%ui s=%ui t=%ui r=%ui p=%ui sh=%ui k=", load,
                    zone->nslots, (ngx_uint_t) sh->turn_ms,
                    (ngx_uint_t) (sh->cost.restore_samples
                                  ? sh->cost.restore_ms_per_byte * 1000.0
                                    * 1048576.0
                                  : 0),
                    (ngx_uint_t) (sh->cost.prefill_samples
                                  ? sh->cost.prefill_ms_per_token * 1000.0
                                  : 0),
                    (ngx_uint_t) (zone->shared != 0));

    for (s = 0; s < zone->nslots; s++) {
        slot = &sh->slots[s];

        if (s) {
            *p++ = ',';
        }

        if (slot->state != NGX_HTTP_LLAMA_SESSION_SLOT_SESSION
            || slot->crc == 0)
        {
            *p++ = '0';
            continue;
        }

        age = slot->busy ? 0 : ngx_current_msec - slot->last_used;

        p = ngx_sprintf(p, "%xD%s:%M", slot->crc,
                        (!slot->dirty && slot->saveable) ? "+" : "", age);
    }

    h->value.len = p - h->value.data;

    return NGX_OK;
}


/* the edge: what the owner that answered told, into its copy */

static void
ngx_http_llama_session_told_learn(ngx_http_request_t *r, ngx_str_t *value)
{
    ngx_uint_t                           i;
    ngx_http_upstream_t                 *u;
    ngx_http_upstream_rr_peer_t         *peer;
    ngx_http_upstream_rr_peers_t        *peers;
    ngx_http_llama_session_balance_t    *bal;
    ngx_http_llama_session_main_conf_t  *lmcf;

    u = r->upstream;

    if (u == NULL || u->upstream == NULL || u->state == NULL
        || u->state->peer == NULL)
    {
        return;
    }

    lmcf = ngx_http_get_module_main_conf(r, ngx_http_llama_session_module);
    bal = ngx_http_llama_session_balance_of(lmcf, u->upstream);

    if (bal == NULL || !bal->remote || bal->told == NULL) {
        return;
    }

    /* the peer that answered: round robin's name of it */

    peers = u->upstream->peer.data;

    for (peer = peers->peer, i = 0; peer; peer = peer->next, i++) {
        if (u->state->peer == &peer->name) {
            ngx_http_llama_session_told_keep(bal, i, &peer->name,
                                             value->data,
                                             value->data + value->len,
                                             1, r->connection->log);
            return;
        }
    }
}


/*
 * "l=3 s=2 t=1200 r=0 p=0 sh=1 k=1a2b3c4d+:40,0" into the owner's copy:
 * what is not said stays 0; a header with no slots is not an owner's.
 * reply: told in the reply to a turn, else in a poll's
 */

static void
ngx_http_llama_session_told_keep(ngx_http_llama_session_balance_t *bal,
    ngx_uint_t peer, ngx_str_t *name, u_char *p, u_char *last,
    ngx_uint_t reply, ngx_log_t *log)
{
    u_char                         *start, *key, *value, *end;
    ngx_int_t                       n;
    ngx_uint_t                      s;
    ngx_http_llama_session_copy_t   copy;

    if (peer >= bal->npeers) {
        return;
    }

    ngx_memzero(&copy, sizeof(ngx_http_llama_session_copy_t));

    copy.heard = ngx_current_msec ? ngx_current_msec : 1;

    /*
     * the turns this edge sent the owner that its load counts: all but
     * the one it answers (the owner leaves that out, as the edge counts it
     * among its connections); a turn sent meanwhile is counted twice
     */

    copy.sent = bal->sent[peer] - (reply ? 1 : 0);

    start = p;

    while (p < last) {
        while (p < last && *p == ' ') {
            p++;
        }

        key = p;

        while (p < last && *p != '=' && *p != ' ') {
            p++;
        }

        if (p == last || *p != '=') {
            break;
        }

        end = p++;
        value = p;

        while (p < last && *p != ' ') {
            p++;
        }

        if (end - key == 1 && *key == 'k') {
            for (s = 0; value < p && s < NGX_HTTP_LLAMA_SESSION_SLOTS_MAX;
                 s++)
            {
                for (end = value;
                     end < p && ((*end >= '0' && *end <= '9')
                                 || (*end >= 'a' && *end <= 'f'));
                     end++)
                {
                    /* void */
                }

                n = ngx_hextoi(value, end - value);
                copy.crc[s] = (n == NGX_ERROR) ? 0 : (uint32_t) n;

                if (end < p && *end == '+') {
                    copy.saved[s] = 1;
                    end++;
                }

                copy.used[s] = copy.heard;

                if (end < p && *end == ':') {
                    for (value = ++end; end < p && *end != ','; end++) {
                        /* void */
                    }

                    n = ngx_atoi(value, end - value);

                    if (n != NGX_ERROR) {
                        copy.used[s] -= ngx_min((ngx_msec_t) n, copy.heard);
                    }
                }

                while (end < p && *end != ',') {
                    end++;
                }

                value = (end < p) ? end + 1 : p;
            }

            continue;
        }

        n = ngx_atoi(value, p - value);

        if (n == NGX_ERROR) {
            continue;
        }

        if (end - key == 2 && key[0] == 's' && key[1] == 'h') {
            copy.shared = (n != 0);
            continue;
        }

        if (end - key != 1) {
            continue;
        }

        switch (*key) {

        case 'l':
            copy.load = ngx_min(n, NGX_HTTP_LLAMA_SESSION_TOLD_LOAD);
            break;

        case 's':
            copy.slots = ngx_min((ngx_uint_t) n,
                                 NGX_HTTP_LLAMA_SESSION_SLOTS_MAX);
            break;

        case 't':
            copy.turn_ms = ngx_min(n, NGX_HTTP_LLAMA_SESSION_TOLD_MS);
            break;

        case 'r':
            copy.restore = ngx_min(n, NGX_HTTP_LLAMA_SESSION_TOLD_SPEED);
            break;

        case 'p':
            copy.prefill = ngx_min(n, NGX_HTTP_LLAMA_SESSION_TOLD_SPEED);
            break;
        }
    }

    if (copy.slots == 0) {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session_balance: owner %V told \"%*s\", not "
                      "what an owner of this module tells", name,
                      (size_t) (last - start), start);
        return;
    }

    bal->told[peer] = copy;
}


/*
 * The polls: the edge's first worker asks each owner it has not heard of
 * for poll= (none answered through it meanwhile); the others read what it
 * learns in the zone
 */

ngx_int_t
ngx_http_llama_session_told_init_process(ngx_cycle_t *cycle)
{
    u_char                               *p;
    ngx_uint_t                            i, k;
    ngx_http_llama_session_poll_t        *poll;
    ngx_http_llama_session_poller_t      *poller;
    ngx_http_llama_session_balance_t    **bal;
    ngx_http_llama_session_main_conf_t   *lmcf;

    if (ngx_process != NGX_PROCESS_WORKER && ngx_process != NGX_PROCESS_SINGLE)
    {
        return NGX_OK;
    }

    if (ngx_worker != 0) {
        return NGX_OK;
    }

    lmcf = ngx_http_cycle_get_module_main_conf(cycle,
                                               ngx_http_llama_session_module);

    if (lmcf == NULL || lmcf->balances.elts == NULL) {
        return NGX_OK;
    }

    bal = lmcf->balances.elts;

    for (i = 0; i < lmcf->balances.nelts; i++) {

        if (!bal[i]->remote || bal[i]->poll == 0) {
            continue;
        }

        poller = ngx_pcalloc(cycle->pool,
                             sizeof(ngx_http_llama_session_poller_t));
        if (poller == NULL) {
            return NGX_ERROR;
        }

        poller->bal = bal[i];
        poller->polls = ngx_pcalloc(cycle->pool, bal[i]->npeers
                                    * sizeof(ngx_http_llama_session_poll_t));
        if (poller->polls == NULL) {
            return NGX_ERROR;
        }

        for (k = 0; k < bal[i]->npeers; k++) {
            poll = &poller->polls[k];
            poll->bal = bal[i];
            poll->peer = k;

            poll->name.data = ngx_pnalloc(cycle->pool, NGX_SOCKADDR_STRLEN);
            poll->reply = ngx_pnalloc(cycle->pool,
                                      NGX_HTTP_LLAMA_SESSION_TOLD_REPLY);
            poll->request.data = ngx_pnalloc(cycle->pool,
                                             sizeof("GET /health HTTP/1.0"
                                                    CRLF "Host: " CRLF
                                                    "X-Llama-Session-Edge: 1"
                                                    CRLF CRLF) - 1
                                             + NGX_SOCKADDR_STRLEN);
            if (poll->name.data == NULL || poll->reply == NULL
                || poll->request.data == NULL)
            {
                return NGX_ERROR;
            }

            poll->name.len = ngx_sock_ntop(bal[i]->addrs[k],
                                           bal[i]->socklens[k],
                                           poll->name.data,
                                           NGX_SOCKADDR_STRLEN, 1);

            p = ngx_sprintf(poll->request.data,
                            "GET /health HTTP/1.0" CRLF "Host: %V" CRLF
                            "X-Llama-Session-Edge: 1" CRLF CRLF,
                            &poll->name);
            poll->request.len = p - poll->request.data;
        }

        poller->timer.handler = ngx_http_llama_session_told_tick;
        poller->timer.data = poller;
        poller->timer.log = cycle->log;
        poller->timer.cancelable = 1;

        ngx_add_timer(&poller->timer, bal[i]->poll);
    }

    return NGX_OK;
}


static void
ngx_http_llama_session_told_tick(ngx_event_t *ev)
{
    ngx_http_llama_session_poller_t *poller = ev->data;

    ngx_uint_t                          k;
    ngx_http_llama_session_copy_t      *c;
    ngx_http_llama_session_balance_t   *bal;

    if (ngx_exiting || ngx_quit || ngx_terminate) {
        return;
    }

    bal = poller->bal;

    for (k = 0; k < bal->npeers; k++) {
        c = &bal->told[k];

        if (poller->polls[k].busy
            || (c->heard && ngx_current_msec - c->heard < bal->poll))
        {
            continue;
        }

        ngx_http_llama_session_told_poll(&poller->polls[k], ev->log);
    }

    ngx_add_timer(ev, bal->poll);
}


static void
ngx_http_llama_session_told_poll(ngx_http_llama_session_poll_t *poll,
    ngx_log_t *log)
{
    ngx_int_t          rc;
    ngx_connection_t  *c;

    ngx_memzero(&poll->pc, sizeof(ngx_peer_connection_t));

    poll->pc.sockaddr = poll->bal->addrs[poll->peer];
    poll->pc.socklen = poll->bal->socklens[poll->peer];
    poll->pc.name = &poll->name;
    poll->pc.get = ngx_event_get_peer;
    poll->pc.log = log;
    poll->pc.log_error = NGX_ERROR_INFO;

    rc = ngx_event_connect_peer(&poll->pc);

    if (rc == NGX_ERROR || rc == NGX_BUSY || rc == NGX_DECLINED) {
        /* logged at info by nginx: an owner down is the failure's to say */
        return;
    }

    c = poll->pc.connection;
    c->data = poll;
    c->read->handler = ngx_http_llama_session_told_read;
    c->write->handler = ngx_http_llama_session_told_write;

    poll->busy = 1;
    poll->sent = 0;
    poll->len = 0;

    ngx_add_timer(c->read, ngx_max(poll->bal->poll, 1000));

    if (rc == NGX_OK) {
        ngx_http_llama_session_told_write(c->write);

    } else {
        ngx_add_timer(c->write, ngx_max(poll->bal->poll, 1000));
    }
}


static void
ngx_http_llama_session_told_write(ngx_event_t *wev)
{
    ssize_t                         n;
    ngx_connection_t               *c;
    ngx_http_llama_session_poll_t  *poll;

    c = wev->data;
    poll = c->data;

    if (wev->timedout) {
        ngx_http_llama_session_told_done(poll, "timed out connecting");
        return;
    }

    while (poll->sent < poll->request.len) {
        n = c->send(c, poll->request.data + poll->sent,
                    poll->request.len - poll->sent);

        if (n == NGX_ERROR) {
            ngx_http_llama_session_told_done(poll, "could not send");
            return;
        }

        if (n == NGX_AGAIN) {
            if (ngx_handle_write_event(wev, 0) != NGX_OK) {
                ngx_http_llama_session_told_done(poll, "could not send");
            }

            return;
        }

        poll->sent += n;
    }

    if (wev->timer_set) {
        ngx_del_timer(wev);
    }
}


static void
ngx_http_llama_session_told_read(ngx_event_t *rev)
{
    u_char                         *p, *last;
    ssize_t                         n;
    ngx_connection_t               *c;
    ngx_http_llama_session_poll_t  *poll;

    c = rev->data;
    poll = c->data;

    if (rev->timedout) {
        ngx_http_llama_session_told_done(poll, "timed out");
        return;
    }

    for ( ;; ) {
        n = c->recv(c, poll->reply + poll->len,
                    NGX_HTTP_LLAMA_SESSION_TOLD_REPLY - poll->len);

        if (n == NGX_AGAIN) {
            if (ngx_handle_read_event(rev, 0) != NGX_OK) {
                ngx_http_llama_session_told_done(poll, "could not read");
            }

            return;
        }

        if (n == NGX_ERROR) {
            ngx_http_llama_session_told_done(poll, "could not read");
            return;
        }

        poll->len += n;

        if (n == 0 || poll->len == NGX_HTTP_LLAMA_SESSION_TOLD_REPLY
            || ngx_strlcasestrn(poll->reply, poll->reply + poll->len,
                                (u_char *) CRLF CRLF, 4 - 1)
               != NULL)
        {
            break;
        }
    }

    /* the owner's header, among the reply's */

    last = poll->reply + poll->len;
    p = ngx_strlcasestrn(poll->reply, last,
                         (u_char *) CRLF "x-llama-session-owner:",
                         sizeof(CRLF "x-llama-session-owner:") - 1 - 1);

    if (p == NULL) {
        ngx_http_llama_session_told_done(poll, "its reply had no "
                                         "X-Llama-Session-Owner (is it a "
                                         "location of llama_session?)");
        return;
    }

    p += sizeof(CRLF "x-llama-session-owner:") - 1;

    while (p < last && *p == ' ') {
        p++;
    }

    last = ngx_strlcasestrn(p, last, (u_char *) CRLF, 2 - 1);

    if (last == NULL) {
        ngx_http_llama_session_told_done(poll, "its reply was cut");
        return;
    }

    ngx_http_llama_session_told_keep(poll->bal, poll->peer, &poll->name, p,
                                     last, 0, c->log);

    ngx_http_llama_session_told_done(poll, NULL);
}


static void
ngx_http_llama_session_told_done(ngx_http_llama_session_poll_t *poll,
    char *failed)
{
    if (failed) {
        ngx_log_error(NGX_LOG_INFO, poll->pc.connection->log, 0,
                      "llama_session_balance: the poll of owner %V %s",
                      &poll->name, failed);
    }

    ngx_close_connection(poll->pc.connection);
    poll->pc.connection = NULL;
    poll->busy = 0;
}
