
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Directives, configuration and registration.  The request's way through
 * the module starts in ngx_http_llama_session_handler.c.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_api.h"
#include "ngx_http_llama_session_balance.h"
#include "ngx_http_llama_session_body.h"
#include "ngx_http_llama_session_call.h"
#include "ngx_http_llama_session_handler.h"
#include "ngx_http_llama_session_idle.h"
#include "ngx_http_llama_session_io.h"
#include "ngx_http_llama_session_metrics.h"
#include "ngx_http_llama_session_convert.h"
#include "ngx_http_llama_session_dialect.h"
#include "ngx_http_llama_session_models.h"
#include "ngx_http_llama_session_ollama.h"
#include "ngx_http_llama_session_reply.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_store.h"
#include "ngx_http_llama_session_told.h"
#include "ngx_http_llama_session_turn.h"
#include "ngx_http_llama_session_var.h"


/* llama_session_zone's parameters, as read */

typedef struct {
    ngx_http_llama_session_zone_t   zone;       /* those a zone takes as is */
    ngx_str_t                       name;       /* zone=name:size */
    ssize_t                         size;
    ngx_str_t                       model;      /* model=: the one model
                                                   of the router it drives */
    ngx_uint_t                      models;     /* models=: any of them, up
                                                   to N */
    ngx_str_t                       thread_pool; /* thread_pool=name */
} ngx_http_llama_session_zone_conf_t;


typedef struct ngx_http_llama_session_zone_param_s
    ngx_http_llama_session_zone_param_t;

typedef ngx_int_t (*ngx_http_llama_session_zone_parse_pt)(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg);

/*
 * a parameter: "name=" and its parser; for a number or a size, its field
 * in the zone_conf_t, its bounds and the message when it is not one
 */

struct ngx_http_llama_session_zone_param_s {
    ngx_str_t                              name;
    ngx_http_llama_session_zone_parse_pt   parse;
    size_t                                 offset;
    ngx_int_t                              min;
    ngx_int_t                              max;
    char                                  *invalid;
};


static ngx_int_t ngx_http_llama_session_init(ngx_conf_t *cf);
static ngx_int_t ngx_http_llama_session_zone_start(ngx_shm_zone_t *shm_zone,
    void *data);
static ngx_int_t ngx_http_llama_session_init_process(ngx_cycle_t *cycle);
static void ngx_http_llama_session_exit_process(ngx_cycle_t *cycle);
static void *ngx_http_llama_session_create_main_conf(ngx_conf_t *cf);
static void *ngx_http_llama_session_create_loc_conf(ngx_conf_t *cf);
static void ngx_http_llama_session_tenants(
    ngx_http_llama_session_loc_conf_t *llcf);
static char *ngx_http_llama_session_merge_loc_conf(ngx_conf_t *cf,
    void *parent, void *child);
static char *ngx_http_llama_session_zone(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static ngx_int_t ngx_http_llama_session_zone_check(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_conf_t *zc);
static ngx_int_t ngx_http_llama_session_zone_routed(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_conf_t *zc);
static char *ngx_http_llama_session_zone_models(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_conf_t *zc);
static ngx_int_t ngx_http_llama_session_model_zone(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_t *zone, ngx_str_t *model);
static char *ngx_http_llama_session(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_llama_session_slots_uri(ngx_conf_t *cf,
    ngx_command_t *cmd, void *conf);
static char *ngx_http_llama_session_list(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_llama_session_endpoints(ngx_conf_t *cf,
    ngx_command_t *cmd, void *conf);
static char *ngx_http_llama_session_zone_add(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_t *tz, ngx_str_t *name, size_t size,
    ngx_str_t *model);
static ngx_int_t ngx_http_llama_session_old_zone(ngx_conf_t *cf,
    ngx_str_t *name, size_t size, ngx_http_llama_session_zone_t *tz,
    ngx_uint_t routed);
static char *ngx_http_llama_session_warm_conf(ngx_conf_t *cf,
    ngx_command_t *cmd, void *conf);


static ngx_conf_enum_t  ngx_http_llama_session_fallbacks[] = {
    { ngx_string("system_hash"), NGX_HTTP_LLAMA_SESSION_FALLBACK_SYSTEM },
    { ngx_string("off"), NGX_HTTP_LLAMA_SESSION_FALLBACK_OFF },
    { ngx_null_string, 0 }
};


static ngx_command_t  ngx_http_llama_session_commands[] = {

    { ngx_string("llama_session_zone"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_1MORE,
      ngx_http_llama_session_zone,
      NGX_HTTP_MAIN_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("llama_session_balance"),
      NGX_HTTP_UPS_CONF|NGX_CONF_ANY,
      ngx_http_llama_session_balance,
      0,
      0,
      NULL },

    { ngx_string("llama_session"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_1MORE,
      ngx_http_llama_session,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("llama_session_slots_uri"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_http_llama_session_slots_uri,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, slots_uri),
      NULL },

    { ngx_string("llama_session_id_headers"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_1MORE,
      ngx_http_llama_session_list,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, id_headers),
      NULL },

    { ngx_string("llama_session_id_fields"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_1MORE,
      ngx_http_llama_session_list,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, id_fields),
      NULL },

    { ngx_string("llama_session_id_fallback"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_enum_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, fallback),
      &ngx_http_llama_session_fallbacks },

    { ngx_string("llama_session_namespace"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_http_set_complex_value_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, namespace),
      NULL },

    { ngx_string("llama_session_wait_timeout"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_msec_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, wait_timeout),
      NULL },

    { ngx_string("llama_session_canonical"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_FLAG,
      ngx_conf_set_flag_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, canonical),
      NULL },

    { ngx_string("llama_session_anthropic"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_FLAG,
      ngx_conf_set_flag_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, anthropic),
      NULL },

    { ngx_string("llama_session_ollama"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_FLAG,
      ngx_conf_set_flag_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, ollama),
      NULL },

    { ngx_string("llama_session_metrics"),
      NGX_HTTP_LOC_CONF|NGX_CONF_ANY,
      ngx_http_llama_session_metrics,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("llama_session_api"),
      NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_http_llama_session_api,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("llama_session_endpoints"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_1MORE,
      ngx_http_llama_session_endpoints,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, endpoints),
      NULL },

    { ngx_string("llama_session_warm"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE12,
      ngx_http_llama_session_warm_conf,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("llama_session_body_max"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_size_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_llama_session_loc_conf_t, body_max),
      NULL },

      ngx_null_command
};


static ngx_http_module_t  ngx_http_llama_session_module_ctx = {
    ngx_http_llama_session_add_variables,  /* preconfiguration */
    ngx_http_llama_session_init,           /* postconfiguration */

    ngx_http_llama_session_create_main_conf, /* create main configuration */
    NULL,                                  /* init main configuration */

    NULL,                                  /* create server configuration */
    NULL,                                  /* merge server configuration */

    ngx_http_llama_session_create_loc_conf, /* create location configuration */
    ngx_http_llama_session_merge_loc_conf  /* merge location configuration */
};


ngx_module_t  ngx_http_llama_session_module = {
    NGX_MODULE_V1,
    &ngx_http_llama_session_module_ctx,    /* module context */
    ngx_http_llama_session_commands,       /* module directives */
    NGX_HTTP_MODULE,                       /* module type */
    NULL,                                  /* init master */
    NULL,                                  /* init module */
    ngx_http_llama_session_init_process,   /* init process */
    NULL,                                  /* init thread */
    NULL,                                  /* exit thread */
    ngx_http_llama_session_exit_process,   /* exit process */
    NULL,                                  /* exit master */
    NGX_MODULE_V1_PADDING
};


static ngx_str_t  ngx_http_llama_session_default_headers[] = {
    ngx_string("x-session-id"),
    ngx_string("x-conversation-id"),
    ngx_string("session-id"),
    ngx_string("conversation-id"),
    ngx_string("x-openwebui-chat-id"),
    ngx_string("x-claude-code-session-id"),
    ngx_string("x-session-affinity"),
    ngx_string("x-dynamo-session-id"),
    ngx_string("session_id"),
    ngx_null_string
};


static ngx_str_t  ngx_http_llama_session_default_fields[] = {
    ngx_string("session_id"),
    ngx_string("conversation_id"),
    ngx_string("chat_id"),
    ngx_string("prompt_cache_key"),
    ngx_string("metadata.session_id"),
    ngx_null_string
};


static void *
ngx_http_llama_session_create_main_conf(ngx_conf_t *cf)
{
    ngx_http_llama_session_main_conf_t  *lmcf;

    lmcf = ngx_pcalloc(cf->pool, sizeof(ngx_http_llama_session_main_conf_t));
    if (lmcf == NULL) {
        return NULL;
    }

    if (ngx_array_init(&lmcf->zones, cf->pool, 2,
                       sizeof(ngx_http_llama_session_zone_t *))
        != NGX_OK)
    {
        return NULL;
    }

    return lmcf;
}


static void *
ngx_http_llama_session_create_loc_conf(ngx_conf_t *cf)
{
    ngx_http_llama_session_loc_conf_t  *conf;

    conf = ngx_pcalloc(cf->pool, sizeof(ngx_http_llama_session_loc_conf_t));
    if (conf == NULL) {
        return NULL;
    }

    /*
     * set by ngx_pcalloc():
     *
     *     conf->zone = NULL;
     *     conf->zones = NULL;
     *     conf->slots_uri = { 0, NULL };
     *     conf->namespace = NULL;
     */

    conf->enable = NGX_CONF_UNSET;
    conf->id_headers = NGX_CONF_UNSET_PTR;
    conf->id_fields = NGX_CONF_UNSET_PTR;
    conf->endpoints = NGX_CONF_UNSET_PTR;
    conf->metrics = NGX_CONF_UNSET_PTR;
    conf->ollama = NGX_CONF_UNSET;
    conf->canonical = NGX_CONF_UNSET;
    conf->anthropic = NGX_CONF_UNSET;
    conf->fallback = NGX_CONF_UNSET_UINT;
    conf->wait_timeout = NGX_CONF_UNSET_MSEC;
    conf->body_max = NGX_CONF_UNSET_SIZE;
    conf->warm = NGX_CONF_UNSET_UINT;
    conf->warm_min = NGX_CONF_UNSET_SIZE;

    return conf;
}


static ngx_array_t *
ngx_http_llama_session_default_list(ngx_conf_t *cf, ngx_str_t *names)
{
    ngx_str_t    *s;
    ngx_array_t  *a;

    a = ngx_array_create(cf->pool, 5, sizeof(ngx_str_t));
    if (a == NULL) {
        return NULL;
    }

    for ( /* void */ ; names->len; names++) {
        s = ngx_array_push(a);
        if (s == NULL) {
            return NULL;
        }

        *s = *names;
    }

    return a;
}


/* the location's zones serve tenants: ram= is refused for them (init) */

static void
ngx_http_llama_session_tenants(ngx_http_llama_session_loc_conf_t *llcf)
{
    ngx_uint_t                      i;
    ngx_http_llama_session_zone_t  *zone, **zp;

    for (zone = llcf->zone; zone; zone = zone->models_next) {
        zone->has_tenants = 1;
    }

    if (llcf->zones == NULL) {
        return;
    }

    zp = llcf->zones->elts;

    for (i = 0; i < llcf->zones->nelts; i++) {
        zp[i]->has_tenants = 1;
    }
}


static char *
ngx_http_llama_session_merge_loc_conf(ngx_conf_t *cf, void *parent,
    void *child)
{
    ngx_http_llama_session_loc_conf_t *prev = parent;
    ngx_http_llama_session_loc_conf_t *conf = child;

    if (conf->enable == NGX_CONF_UNSET) {
        conf->enable = prev->enable;
        conf->zone = prev->zone;
        conf->zones = prev->zones;
    }

    if (conf->enable == NGX_CONF_UNSET) {
        conf->enable = 0;
    }

    ngx_conf_merge_value(conf->ollama, prev->ollama, 0);
    ngx_conf_merge_value(conf->canonical, prev->canonical, 1);
    ngx_conf_merge_value(conf->anthropic, prev->anthropic, 1);

    if (conf->ollama && (!conf->enable || conf->zone == NULL)) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"llama_session_ollama\" needs \"llama_session "
                           "zone\" in the same location: Ollama's requests "
                           "are sessions of a zone");
        return NGX_CONF_ERROR;
    }

    ngx_conf_merge_str_value(conf->slots_uri, prev->slots_uri,
                             "/_llama_slots");

    if (conf->id_headers == NGX_CONF_UNSET_PTR) {
        if (prev->id_headers == NGX_CONF_UNSET_PTR) {
            prev->id_headers = ngx_http_llama_session_default_list(cf,
                                        ngx_http_llama_session_default_headers);
            if (prev->id_headers == NULL) {
                return NGX_CONF_ERROR;
            }
        }

        conf->id_headers = prev->id_headers;
    }

    if (conf->id_fields == NGX_CONF_UNSET_PTR) {
        if (prev->id_fields == NGX_CONF_UNSET_PTR) {
            prev->id_fields = ngx_http_llama_session_default_list(cf,
                                        ngx_http_llama_session_default_fields);
            if (prev->id_fields == NULL) {
                return NGX_CONF_ERROR;
            }
        }

        conf->id_fields = prev->id_fields;
    }

    if (conf->endpoints == NGX_CONF_UNSET_PTR) {
        if (prev->endpoints == NGX_CONF_UNSET_PTR) {
            /* the dialects' paths (dialect.c) */
            prev->endpoints = ngx_http_llama_session_default_list(cf,
                                   ngx_http_llama_session_dialect_endpoints());
            if (prev->endpoints == NULL) {
                return NGX_CONF_ERROR;
            }
        }

        conf->endpoints = prev->endpoints;
    }

    ngx_conf_merge_uint_value(conf->fallback, prev->fallback,
                              NGX_HTTP_LLAMA_SESSION_FALLBACK_SYSTEM);

    if (conf->namespace == NULL) {
        conf->namespace = prev->namespace;
    }

    if (conf->namespace && conf->enable == 1) {
        /* tenants: no RAM cache, one for all of llama-server's (init) */
        ngx_http_llama_session_tenants(conf);
    }

    ngx_conf_merge_msec_value(conf->wait_timeout, prev->wait_timeout, 60000);
    ngx_conf_merge_size_value(conf->body_max, prev->body_max,
                              16 * 1024 * 1024);
    ngx_conf_merge_uint_value(conf->warm, prev->warm,
                              NGX_HTTP_LLAMA_SESSION_WARM_SYSTEM);
    ngx_conf_merge_size_value(conf->warm_min, prev->warm_min, 1024);

    return NGX_CONF_OK;
}


/* llama_session_zone's parameters, a parser each: zone=name:size */

static ngx_int_t
ngx_http_llama_session_zone_size(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    u_char     *p;
    size_t      min;
    ngx_str_t   s;

    p = (u_char *) ngx_strchr(arg->data, ':');

    if (p == NULL) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid zone size \"%V\": use zone=name:size",
                           value);
        return NGX_ERROR;
    }

    zc->name.data = arg->data;
    zc->name.len = p - arg->data;

    if ((zc->name.len == 3 && ngx_strncmp(zc->name.data, "off", 3) == 0)
        || (zc->name.len == 8
            && ngx_strncmp(zc->name.data, "identity", 8) == 0))
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "the zone name \"%V\" is reserved: "
                           "\"llama_session %V\" means something else",
                           &zc->name, &zc->name);
        return NGX_ERROR;
    }

    s.data = p + 1;
    s.len = arg->data + arg->len - s.data;

    zc->size = ngx_parse_size(&s);

    if (zc->size == NGX_ERROR) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid zone size \"%V\"", value);
        return NGX_ERROR;
    }

    min = 8 * ngx_pagesize + sizeof(ngx_http_llama_session_sh_t);

    if (zc->size < (ssize_t) min) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" is too small, the minimum is %uzk",
                           value, min / 1024 + 1);
        return NGX_ERROR;
    }

    return NGX_OK;
}


/* a number from param->min to param->max, into the ngx_uint_t at offset */

static ngx_int_t
ngx_http_llama_session_zone_number(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    ngx_int_t  n;

    n = ngx_atoi(arg->data, arg->len);

    if (n == NGX_ERROR || n < param->min || n > param->max) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, param->invalid, value,
                           param->max);
        return NGX_ERROR;
    }

    *(ngx_uint_t *) ((u_char *) zc + param->offset) = n;

    return NGX_OK;
}


/* a size such as 2g, into the off_t at offset */

static ngx_int_t
ngx_http_llama_session_zone_offset(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    off_t  size;

    size = ngx_parse_offset(arg);

    if (size == NGX_ERROR) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, param->invalid, value);
        return NGX_ERROR;
    }

    *(off_t *) ((u_char *) zc + param->offset) = size;

    return NGX_OK;
}


/*
 * slots=N, or slots=auto: what the backend's GET /props says, at the
 * first request
 */

static ngx_int_t
ngx_http_llama_session_zone_slots(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    if (ngx_strcmp(arg->data, "auto") == 0) {
        zc->zone.nslots = 0;
        return NGX_OK;
    }

    return ngx_http_llama_session_zone_number(cf, param, zc, value, arg);
}


static ngx_int_t
ngx_http_llama_session_zone_store(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    ngx_str_t  *store;

    store = &zc->zone.store;
    *store = *arg;

    if (store->len == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "empty \"store=\" path");
        return NGX_ERROR;
    }

    if (ngx_conf_full_name(cf->cycle, store, 0) != NGX_OK) {
        return NGX_ERROR;
    }

    while (store->len > 1 && store->data[store->len - 1] == '/') {
        store->len--;
    }

    return NGX_OK;
}


/* store_timeout=: how long a request waits for a store call */

static ngx_int_t
ngx_http_llama_session_zone_store_timeout(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    ngx_msec_t  timeout;

    timeout = ngx_parse_time(arg, 0);

    if (timeout == (ngx_msec_t) NGX_ERROR || timeout == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid time \"%V\": store_timeout= is how "
                           "long a request waits for the store, such as 10s",
                           value);
        return NGX_ERROR;
    }

    zc->zone.store_timeout = timeout;

    return NGX_OK;
}


/* thread_pool=: the nginx thread pool of the store's file calls */

static ngx_int_t
ngx_http_llama_session_zone_thread_pool(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    if (arg->len == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "empty \"thread_pool=\": the name of a "
                           "thread_pool, \"default\", or \"off\"");
        return NGX_ERROR;
    }

    zc->thread_pool = *arg;

    return NGX_OK;
}


static ngx_int_t
ngx_http_llama_session_zone_save_idle(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    ngx_msec_t  save_idle;

    save_idle = ngx_parse_time(arg, 0);

    if (save_idle == (ngx_msec_t) NGX_ERROR || save_idle == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid time \"%V\"", value);
        return NGX_ERROR;
    }

    zc->zone.save_idle = save_idle;

    return NGX_OK;
}


/* reprime=: the last turn made the slot's before each save (reprime.c) */

/* reprime=on|off, shared=on|off: a flag of the zone, at its offset */

static ngx_int_t
ngx_http_llama_session_zone_flag(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    ngx_uint_t  *flag;

    flag = (ngx_uint_t *) ((u_char *) zc + param->offset);

    if (ngx_strcmp(arg->data, "on") == 0) {
        *flag = 1;

    } else if (ngx_strcmp(arg->data, "off") == 0) {
        *flag = 0;

    } else {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid value \"%V\": \"%V\" is "
                           "\"on\" or \"off\"", value, &param->name);
        return NGX_ERROR;
    }

    return NGX_OK;
}


/*
 * backend= and api_key=, deprecated: idle saves go through the slots
 * location as every other slot call, with its address, TLS and API key
 */

static ngx_int_t
ngx_http_llama_session_zone_deprecated(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                       "\"%V\" is deprecated and ignored: idle saves go "
                       "through llama_session_slots_uri's location, as every "
                       "slot call; give its API key there with "
                       "proxy_set_header Authorization", &param->name);
    return NGX_OK;
}


/*
 * model=, llama-server's router mode: the model's name as the router knows
 * it goes into slot calls' JSON bodies and queries: letters, digits and
 * "._:/+@-" only
 */

static ngx_int_t
ngx_http_llama_session_zone_model(ngx_conf_t *cf,
    ngx_http_llama_session_zone_param_t *param,
    ngx_http_llama_session_zone_conf_t *zc, ngx_str_t *value, ngx_str_t *arg)
{
    if (!ngx_http_llama_session_model_valid(arg->data, arg->len)) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid model \"%V\": 1 to %d letters, digits "
                           "or \"._:/+@-\", as llama-server's router names "
                           "it in GET /models", arg,
                           NGX_HTTP_LLAMA_SESSION_MODEL_SHOW);
        return NGX_ERROR;
    }

    zc->model = *arg;

    return NGX_OK;
}


/*
 * llama_session_zone zone=name:size [slots=N] [store=path] [max_files=N]
 *     [max_size=size] [min_free=size] [save_idle=time] [ram=size]
 *     [store_timeout=time] [thread_pool=name]
 *     [model=name | models=N]
 *     [reprime=on|off];
 * (backend= and api_key=: deprecated, ignored)
 *
 * Each parameter is read into a zone_conf_t by its parser, as this table
 * names them; the rules between parameters are checked once all are read,
 * then the zone (or the zones of models=N) is made.
 */

static ngx_http_llama_session_zone_param_t  ngx_http_llama_session_params[] = {
    { ngx_string("zone="), ngx_http_llama_session_zone_size, 0, 0, 0, NULL },
    { ngx_string("slots="), ngx_http_llama_session_zone_slots,
      offsetof(ngx_http_llama_session_zone_conf_t, zone.nslots),
      1, NGX_HTTP_LLAMA_SESSION_SLOTS_MAX,
      "invalid number of slots \"%V\": 1 to %i, as llama-server's -np" },
    { ngx_string("store="), ngx_http_llama_session_zone_store, 0, 0, 0, NULL },
    { ngx_string("max_files="), ngx_http_llama_session_zone_number,
      offsetof(ngx_http_llama_session_zone_conf_t, zone.max_files),
      0, NGX_MAX_INT_T_VALUE, "invalid number of files \"%V\"" },
    { ngx_string("max_waiting="), ngx_http_llama_session_zone_number,
      offsetof(ngx_http_llama_session_zone_conf_t, zone.waiters_max),
      1, 65536, "invalid number of waiting requests \"%V\": 1 to %i" },
    { ngx_string("max_size="), ngx_http_llama_session_zone_offset,
      offsetof(ngx_http_llama_session_zone_conf_t, zone.max_size),
      0, 0, "invalid size \"%V\"" },
    { ngx_string("min_free="), ngx_http_llama_session_zone_offset,
      offsetof(ngx_http_llama_session_zone_conf_t, zone.min_free),
      0, 0, "invalid size \"%V\": min_free= is the free space to keep on "
            "the store's disk, such as 2g" },
    { ngx_string("save_idle="), ngx_http_llama_session_zone_save_idle,
      0, 0, 0, NULL },
    { ngx_string("store_timeout="),
      ngx_http_llama_session_zone_store_timeout, 0, 0, 0, NULL },
    { ngx_string("thread_pool="), ngx_http_llama_session_zone_thread_pool,
      0, 0, 0, NULL },
    { ngx_string("ram="), ngx_http_llama_session_zone_offset,
      offsetof(ngx_http_llama_session_zone_conf_t, zone.ram),
      0, 0, "invalid size \"%V\": ram= is llama-server's --cache-ram, "
            "such as 8g" },
    { ngx_string("reprime="), ngx_http_llama_session_zone_flag,
      offsetof(ngx_http_llama_session_zone_conf_t, zone.reprime),
      0, 0, NULL },
    { ngx_string("shared="), ngx_http_llama_session_zone_flag,
      offsetof(ngx_http_llama_session_zone_conf_t, zone.shared),
      0, 0, NULL },
    { ngx_string("backend="), ngx_http_llama_session_zone_deprecated,
      0, 0, 0, NULL },
    { ngx_string("api_key="), ngx_http_llama_session_zone_deprecated,
      0, 0, 0, NULL },
    { ngx_string("model="), ngx_http_llama_session_zone_model, 0, 0, 0, NULL },
    { ngx_string("models="), ngx_http_llama_session_zone_number,
      offsetof(ngx_http_llama_session_zone_conf_t, models),
      1, NGX_HTTP_LLAMA_SESSION_MODELS_MAX,
      "invalid number of models \"%V\": 1 to %i, how many of the router's "
      "models the zone keeps sessions for" },
    { ngx_null_string, NULL, 0, 0, 0, NULL }
};


static char *
ngx_http_llama_session_zone(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_llama_session_main_conf_t *lmcf = conf;

    ngx_str_t                            *value, arg;
    ngx_uint_t                            i;
    ngx_http_llama_session_zone_conf_t    zc;
    ngx_http_llama_session_zone_param_t  *param;

    value = cf->args->elts;

    ngx_memzero(&zc, sizeof(ngx_http_llama_session_zone_conf_t));

    zc.zone.nslots = 1;
    zc.zone.min_free = -1;
    zc.zone.reprime = 1;
    zc.zone.store_timeout = 10000;

    for (i = 1; i < cf->args->nelts; i++) {

        for (param = ngx_http_llama_session_params;
             param->name.len;
             param++)
        {
            if (ngx_strncmp(value[i].data, param->name.data, param->name.len)
                == 0)
            {
                break;
            }
        }

        if (param->name.len == 0) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid parameter \"%V\"", &value[i]);
            return NGX_CONF_ERROR;
        }

        arg.data = value[i].data + param->name.len;
        arg.len = value[i].len - param->name.len;

        if (param->parse(cf, param, &zc, &value[i], &arg) != NGX_OK) {
            return NGX_CONF_ERROR;
        }
    }

    if (zc.name.len == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"%V\" must have \"zone=name:size\" parameter",
                           &cmd->name);
        return NGX_CONF_ERROR;
    }

    if (ngx_http_llama_session_zone_check(cf, lmcf, &zc) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    if (zc.models) {
        return ngx_http_llama_session_zone_models(cf, lmcf, &zc);
    }

    return ngx_http_llama_session_zone_add(cf, lmcf, &zc.zone, &zc.name,
                                           zc.size, &zc.model);
}


/*
 * The rules between a zone's parameters, and between it and the zones
 * declared before; max_waiting= defaults to an eighth of the zone
 */

static ngx_int_t
ngx_http_llama_session_zone_check(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_conf_t *zc)
{
    ngx_str_t                       *name, *store;
    ngx_uint_t                       i;
    ngx_http_llama_session_zone_t  **zp;

    name = &zc->name;
    store = &zc->zone.store;
    zp = lmcf->zones.elts;

    for (i = 0; i < lmcf->zones.nelts; i++) {
        if (zp[i]->name.len == name->len
            && ngx_strncmp(zp[i]->name.data, name->data, name->len) == 0)
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "duplicate llama_session_zone \"%V\"", name);
            return NGX_ERROR;
        }

        if (store->len && zp[i]->store.len == store->len
            && ngx_strncmp(zp[i]->store.data, store->data, store->len) == 0
            && (!(zc->model.len || zc->models)
                || !ngx_http_llama_session_by_router(zp[i]))
            && !(zc->zone.shared && zp[i]->shared))
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "llama_session zones \"%V\" and \"%V\" have "
                               "the same store \"%V\": one folder per "
                               "llama-server, or \"shared=on\" on each "
                               "when their llama-servers run one model",
                               &zp[i]->name, name, store);
            return NGX_ERROR;
        }
    }

    if (zc->zone.waiters_max == 0) {
        /* an eighth of the zone, 32 to 4096 waiting requests */
        zc->zone.waiters_max = zc->size / 8
                               / sizeof(ngx_http_llama_session_waiter_t);
        zc->zone.waiters_max = ngx_max(zc->zone.waiters_max, 32);
        zc->zone.waiters_max = ngx_min(zc->zone.waiters_max, 4096);
    }

    if (zc->zone.waiters_max * sizeof(ngx_http_llama_session_waiter_t)
        > (size_t) zc->size / 2)
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" is too small for max_waiting=%ui: "
                           "a waiting request takes %uz bytes, at most half "
                           "the zone goes to them", name, zc->zone.waiters_max,
                           sizeof(ngx_http_llama_session_waiter_t));
        return NGX_ERROR;
    }

    if (zc->model.len && zc->models) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" has \"model=\" and \"models=\": a "
                           "zone drives one model of llama-server's router, "
                           "or any of them", name);
        return NGX_ERROR;
    }

    if ((zc->model.len || zc->models)
        && ngx_http_llama_session_zone_routed(cf, lmcf, zc) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if ((zc->zone.max_files || zc->zone.max_size || zc->zone.min_free >= 0)
        && store->len == 0)
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"max_files=\", \"max_size=\" and "
                           "\"min_free=\" need \"store=\": the module "
                           "deletes files there");
        return NGX_ERROR;
    }

    if (store->len == 0
        || (zc->thread_pool.len == 3
            && ngx_strncmp(zc->thread_pool.data, "off", 3) == 0))
    {
        /* thread_pool=off: the store's calls in the event loop, as before */
        return NGX_OK;
    }

    /* the store's file calls: in a thread pool, off the event loop (io.c) */

#if (NGX_THREADS)

    zc->zone.tp = ngx_thread_pool_add(cf, zc->thread_pool.len
                                          ? &zc->thread_pool : NULL);
    if (zc->zone.tp == NULL) {
        return NGX_ERROR;
    }

#else

    if (zc->thread_pool.len) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"thread_pool=%V\" needs an nginx built with "
                           "threads (--with-threads)", &zc->thread_pool);
        return NGX_ERROR;
    }

    ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                       "zone \"%V\": this nginx was built without threads "
                       "(--with-threads): the store's file calls run in the "
                       "event loop, and a store that stops answering (NFS) "
                       "holds every request of the worker", name);

#endif

    return NGX_OK;
}


/*
 * A zone in front of llama-server's router (model= or models=): its
 * sessions' keys start with "<zone>@" ("<zone>.<n>@") in a shared folder
 */

static ngx_int_t
ngx_http_llama_session_zone_routed(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_conf_t *zc)
{
    char                            *with;
    size_t                           max;
    ngx_str_t                       *name, *store, *model;
    ngx_uint_t                       i;
    ngx_http_llama_session_zone_t  **zp;

    name = &zc->name;
    store = &zc->zone.store;
    model = &zc->model;
    with = zc->models ? "models=" : "model=";

    for (i = 0; i < name->len; i++) {
        if (!((name->data[i] >= 'a' && name->data[i] <= 'z')
              || (name->data[i] >= 'A' && name->data[i] <= 'Z')
              || (name->data[i] >= '0' && name->data[i] <= '9')
              || name->data[i] == '-' || name->data[i] == '_'))
        {
            break;
        }
    }

    max = NGX_HTTP_LLAMA_SESSION_PREFIX_MAX - (zc->models ? 3 : 0);

    if (i < name->len || name->len > max) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" with \"%s\" needs a name of "
                           "1 to %uz letters, digits, \"-\" or \"_\": its "
                           "sessions' file names start with it", name,
                           with, max);
        return NGX_ERROR;
    }

    if (zc->zone.nslots == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" with \"%s\" cannot have "
                           "\"slots=auto\": the router's GET /props would "
                           "load the model, give its -np", name, with);
        return NGX_ERROR;
    }

    if (store->len == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" with \"%s\" needs "
                           "\"store=\": the sessions of a model that "
                           "llama-server's router unloads are saved "
                           "first, as idle saves are", name, with);
        return NGX_ERROR;
    }

    zp = lmcf->zones.elts;

    for (i = 0; model->len && i < lmcf->zones.nelts; i++) {
        if (zp[i]->model.len == model->len
            && ngx_strncmp(zp[i]->model.data, model->data, model->len) == 0
            && zp[i]->store.len == store->len
            && ngx_strncmp(zp[i]->store.data, store->data, store->len) == 0)
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "llama_session zones \"%V\" and \"%V\" "
                               "drive the same model \"%V\" of one "
                               "router: one zone per model", &zp[i]->name,
                               name, model);
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


/* models=N: the zones "<name>.1" to "<name>.N", given models later */

static char *
ngx_http_llama_session_zone_models(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_conf_t *zc)
{
    ngx_str_t                        member;
    ngx_uint_t                       i;
    ngx_http_llama_session_zone_t   *zone, *lead, *last, **zp;

    lead = NULL;
    last = NULL;

    for (i = 1; i <= zc->models; i++) {
        member.len = zc->name.len + 1 + NGX_INT_T_LEN;
        member.data = ngx_pnalloc(cf->pool, member.len);
        if (member.data == NULL) {
            return NGX_CONF_ERROR;
        }

        member.len = ngx_sprintf(member.data, "%V.%ui", &zc->name, i)
                     - member.data;

        zc->zone.models = lead;
        zc->zone.models_index = i;
        zc->zone.models_name = zc->name;

        if (ngx_http_llama_session_zone_add(cf, lmcf, &zc->zone, &member,
                                            zc->size, &zc->model)
            != NGX_CONF_OK)
        {
            return NGX_CONF_ERROR;
        }

        zp = lmcf->zones.elts;
        zone = zp[lmcf->zones.nelts - 1];

        if (lead == NULL) {
            lead = zone;
            zone->models = zone;

        } else {
            last->models_next = zone;
        }

        last = zone;
    }

    return NGX_CONF_OK;
}


/*
 * A zone as configured (tz: its parameters), with its shared memory;
 * model: its router's model (model=), if any
 */

static char *
ngx_http_llama_session_zone_add(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_t *tz, ngx_str_t *name, size_t size,
    ngx_str_t *model)
{
    uint32_t                         crc;
    ngx_uint_t                       i;
    ngx_shm_zone_t                  *shm_zone;
    ngx_http_llama_session_zone_t   *zone, **zp;

    zp = lmcf->zones.elts;

    for (i = 0; i < lmcf->zones.nelts; i++) {
        if ((zp[i]->name.len == name->len
             && ngx_strncmp(zp[i]->name.data, name->data, name->len) == 0)
            || (zp[i]->models
                && zp[i]->models_name.len == name->len
                && ngx_strncmp(zp[i]->models_name.data, name->data,
                               name->len) == 0))
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "duplicate llama_session_zone \"%V\"", name);
            return NGX_CONF_ERROR;
        }
    }

    if (ngx_http_llama_session_old_zone(cf, name, size, tz,
                                        model->len || tz->models_index)
        != NGX_OK)
    {
        return NGX_CONF_ERROR;
    }

    zone = ngx_pcalloc(cf->pool, sizeof(ngx_http_llama_session_zone_t));
    if (zone == NULL) {
        return NGX_CONF_ERROR;
    }

    shm_zone = ngx_shared_memory_add(cf, name, size,
                                     &ngx_http_llama_session_module);
    if (shm_zone == NULL) {
        return NGX_CONF_ERROR;
    }

    if (shm_zone->data) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "shared memory zone \"%V\" is already used "
                           "by another module", name);
        return NGX_CONF_ERROR;
    }

    *zone = *tz;

    zone->name = *name;
    zone->shm_zone = shm_zone;

    /*
     * a save's temporary file and the previous file it sets aside: the
     * zone's own in a shared store (by its host's name and its own), so
     * that no owner's start or save takes another's
     */

    if (zone->shared) {
        zone->tmp.data = ngx_pnalloc(cf->pool, 2 * sizeof(".12345678.tmp"));
        if (zone->tmp.data == NULL) {
            return NGX_CONF_ERROR;
        }

        ngx_crc32_init(crc);
        ngx_crc32_update(&crc, cf->cycle->hostname.data,
                         cf->cycle->hostname.len);
        ngx_crc32_update(&crc, (u_char *) "/", 1);
        ngx_crc32_update(&crc, name->data, name->len);
        ngx_crc32_final(crc);

        zone->tmp.len = ngx_sprintf(zone->tmp.data, ".%08xD.tmp", crc)
                        - zone->tmp.data;

        zone->old.data = zone->tmp.data + zone->tmp.len;
        zone->old.len = ngx_sprintf(zone->old.data, ".%08xD.old", crc)
                        - zone->old.data;

    } else {
        ngx_str_set(&zone->tmp, ".tmp");
        ngx_str_set(&zone->old, ".old");
    }

    /* index.c drops a file whose record it must recycle through the store */
    zone->unlink = ngx_http_llama_session_store_unlink;
    zone->cycle = cf->cycle;
    zone->group = zone;

    if ((model->len || zone->models_index)
        && ngx_http_llama_session_model_zone(cf, lmcf, zone, model)
           != NGX_OK)
    {
        return NGX_CONF_ERROR;
    }

    shm_zone->init = ngx_http_llama_session_zone_start;
    shm_zone->data = zone;

    zp = ngx_array_push(&lmcf->zones);
    if (zp == NULL) {
        return NGX_CONF_ERROR;
    }

    *zp = zone;

    return NGX_CONF_OK;
}


/*
 * A zone of a router's model: its query for GET calls, the prefix of its
 * sessions' keys, and its group: the zones with the same store folder
 * (one router), led by the first one declared.
 */

static ngx_int_t
ngx_http_llama_session_model_zone(ngx_conf_t *cf,
    ngx_http_llama_session_main_conf_t *lmcf,
    ngx_http_llama_session_zone_t *zone, ngx_str_t *model)
{
    u_char                          *p;
    ngx_uint_t                       i;
    ngx_http_llama_session_zone_t  **zp, *last;

    if (model->len) {
        zone->model = *model;

        zone->model_arg.data = ngx_pnalloc(cf->pool,
                                           NGX_HTTP_LLAMA_SESSION_MODEL_ARG);
        if (zone->model_arg.data == NULL) {
            return NGX_ERROR;
        }

        p = ngx_http_llama_session_model_arg(zone->model_arg.data,
                                             model->data, model->len);
        zone->model_arg.len = p - zone->model_arg.data;
    }

    zone->prefix.data = ngx_pnalloc(cf->pool, zone->name.len + 1);
    if (zone->prefix.data == NULL) {
        return NGX_ERROR;
    }

    p = ngx_cpymem(zone->prefix.data, zone->name.data, zone->name.len);
    *p++ = '@';
    zone->prefix.len = p - zone->prefix.data;

    zp = lmcf->zones.elts;

    for (i = 0; i < lmcf->zones.nelts; i++) {
        if (ngx_http_llama_session_by_router(zp[i])
            && zp[i]->store.len == zone->store.len
            && ngx_strncmp(zp[i]->store.data, zone->store.data,
                           zone->store.len) == 0)
        {
            zone->group = zp[i]->group;

            for (last = zone->group; last->group_next; last = last->group_next)
            {
                /* void */
            }

            last->group_next = zone;
            break;
        }
    }

    return NGX_OK;
}


/*
 * llama_session <zone> ... | identity | off;
 */

static char *
ngx_http_llama_session(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_llama_session_loc_conf_t *llcf = conf;

    ngx_str_t                           *value;
    ngx_uint_t                           i, j;
    ngx_http_llama_session_zone_t       *zone, **zp;
    ngx_http_llama_session_main_conf_t  *lmcf;

    if (llcf->enable != NGX_CONF_UNSET) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (ngx_strcmp(value[1].data, "off") == 0) {
        llcf->enable = 0;
        llcf->zone = NULL;
        return NGX_CONF_OK;
    }

    if (ngx_strcmp(value[1].data, "identity") == 0) {
        /* an edge node: the session's key for the upstream hash, no slot */
        llcf->enable = 1;
        llcf->zone = NULL;
        return NGX_CONF_OK;
    }

    llcf->zone = ngx_http_llama_session_find_zone(cf, &value[1]);
    if (llcf->zone == NULL) {
        return NGX_CONF_ERROR;
    }

    llcf->enable = 1;

    /* the zone's own requests (idle saves) run in this location */

    for (zone = llcf->zone; zone; zone = zone->models_next) {
        if (zone->log_conf == NULL) {
            zone->log_conf = ngx_http_conf_get_module_loc_conf(cf,
                                                       ngx_http_core_module);
            zone->conf_ctx = cf->ctx;
        }
    }

    if (cf->args->nelts == 2 && llcf->zone->model.len == 0) {
        /* an owner, for an upstream's llama_session_balance */
        lmcf = ngx_http_conf_get_module_main_conf(cf,
                                              ngx_http_llama_session_module);

        if (ngx_http_llama_session_balance_owner(cf, lmcf, llcf->zone)
            != NGX_OK)
        {
            return NGX_CONF_ERROR;
        }

        return NGX_CONF_OK;
    }

    /* router mode: a zone per model, the request's "model" chooses */

    llcf->zones = ngx_array_create(cf->pool, cf->args->nelts - 1,
                                   sizeof(ngx_http_llama_session_zone_t *));
    if (llcf->zones == NULL) {
        return NGX_CONF_ERROR;
    }

    for (i = 1; i < cf->args->nelts; i++) {
        zone = ngx_http_llama_session_find_zone(cf, &value[i]);
        if (zone == NULL) {
            return NGX_CONF_ERROR;
        }

        if (zone->model.len == 0 || zone->models) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "zone \"%V\" has no \"model=\": several "
                               "zones in \"llama_session\" are the models of "
                               "llama-server's router, chosen by the "
                               "request's \"model\"", &value[i]);
            return NGX_CONF_ERROR;
        }

        zp = llcf->zones->elts;

        for (j = 0; j < llcf->zones->nelts; j++) {
            if (zp[j]->model.len == zone->model.len
                && ngx_strncmp(zp[j]->model.data, zone->model.data,
                               zone->model.len) == 0)
            {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "zones \"%V\" and \"%V\" both drive the "
                                   "model \"%V\"", &zp[j]->name, &zone->name,
                                   &zone->model);
                return NGX_CONF_ERROR;
            }
        }

        zp = ngx_array_push(llcf->zones);
        if (zp == NULL) {
            return NGX_CONF_ERROR;
        }

        *zp = zone;

        if (zone->log_conf == NULL) {
            zone->log_conf = ngx_http_conf_get_module_loc_conf(cf,
                                                       ngx_http_core_module);
            zone->conf_ctx = cf->ctx;
        }
    }

    return NGX_CONF_OK;
}


static char *
ngx_http_llama_session_slots_uri(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_http_llama_session_loc_conf_t *llcf = conf;

    ngx_str_t  *value;

    if (llcf->slots_uri.data) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (value[1].len == 0 || value[1].data[0] != '/') {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid slots uri \"%V\": it must start "
                           "with \"/\"", &value[1]);
        return NGX_CONF_ERROR;
    }

    if (ngx_strlchr(value[1].data, value[1].data + value[1].len, '?')
        || ngx_strlchr(value[1].data, value[1].data + value[1].len, '$'))
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid slots uri \"%V\": arguments and "
                           "variables are not allowed", &value[1]);
        return NGX_CONF_ERROR;
    }

    llcf->slots_uri = value[1];

    while (llcf->slots_uri.len > 1
           && llcf->slots_uri.data[llcf->slots_uri.len - 1] == '/')
    {
        llcf->slots_uri.len--;
    }

    return NGX_CONF_OK;
}


/*
 * llama_session_id_headers name ... | off;
 * llama_session_id_fields name ... | off;
 */

static char *
ngx_http_llama_session_list(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    char  *p = conf;

    u_char        *c;
    ngx_str_t     *value, *s;
    ngx_uint_t     i, j, header;
    ngx_array_t  **a;

    a = (ngx_array_t **) (p + cmd->offset);

    if (*a != NGX_CONF_UNSET_PTR) {
        return "is duplicate";
    }

    value = cf->args->elts;

    *a = ngx_array_create(cf->pool, cf->args->nelts, sizeof(ngx_str_t));
    if (*a == NULL) {
        return NGX_CONF_ERROR;
    }

    if (cf->args->nelts == 2 && ngx_strcmp(value[1].data, "off") == 0) {
        return NGX_CONF_OK;
    }

    header = (cmd->offset
              == offsetof(ngx_http_llama_session_loc_conf_t, id_headers));

    if (!header && cf->args->nelts - 1 > NGX_HTTP_LLAMA_SESSION_FIELDS_MAX) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "too many fields, at most %d",
                           NGX_HTTP_LLAMA_SESSION_FIELDS_MAX);
        return NGX_CONF_ERROR;
    }

    for (i = 1; i < cf->args->nelts; i++) {

        c = value[i].data;

        for (j = 0; j < value[i].len; j++) {
            if (!((c[j] >= 'a' && c[j] <= 'z') || (c[j] >= 'A' && c[j] <= 'Z')
                  || (c[j] >= '0' && c[j] <= '9') || c[j] == '-'
                  || c[j] == '_' || (!header && c[j] == '.')))
            {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid %s name \"%V\"",
                                   header ? "header" : "field", &value[i]);
                return NGX_CONF_ERROR;
            }
        }

        if (value[i].len == 0 || c[0] == '.' || c[value[i].len - 1] == '.'
            || ngx_strnstr(c, "..", value[i].len))
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid %s name \"%V\"",
                               header ? "header" : "field", &value[i]);
            return NGX_CONF_ERROR;
        }

        s = ngx_array_push(*a);
        if (s == NULL) {
            return NGX_CONF_ERROR;
        }

        *s = value[i];

        if (header) {
            ngx_strlow(s->data, s->data, s->len);
        }
    }

    return NGX_CONF_OK;
}


/*
 * The zone's shared memory, with its store: the folder checked first,
 * then the zone made (or taken over on a reload), then the folder indexed.
 */

static ngx_int_t
ngx_http_llama_session_zone_start(ngx_shm_zone_t *shm_zone, void *data)
{
    ngx_http_llama_session_zone_t  *zone;

    zone = shm_zone->data;

    if (zone->store.len
        && ngx_http_llama_session_store_check(zone, shm_zone->shm.log)
           != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (ngx_http_llama_session_init_zone(shm_zone, data) != NGX_OK) {
        return NGX_ERROR;
    }

    if (zone->store.len && data == NULL && !shm_zone->shm.exists) {
        if (zone->models_index) {
            /* models=: the model given to the zone before, if any */
            ngx_http_llama_session_models_load(zone, shm_zone->shm.log);
        }

        ngx_http_llama_session_turn_clean(zone, shm_zone->shm.log);
        return ngx_http_llama_session_store_index(zone, shm_zone->shm.log);
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_llama_session_init(ngx_conf_t *cf)
{
    ngx_uint_t                           i;
    ngx_http_handler_pt                 *h;
    ngx_http_core_main_conf_t           *cmcf;
    ngx_http_llama_session_zone_t      **zp;
    ngx_http_llama_session_main_conf_t  *lmcf;

    cmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_core_module);
    lmcf = ngx_http_conf_get_module_main_conf(cf,
                                              ngx_http_llama_session_module);

    /* a zone's idle saves run in a location of the zone, see job.c */

    zp = lmcf->zones.elts;

    for (i = 0; i < lmcf->zones.nelts; i++) {
        if ((zp[i]->save_idle || ngx_http_llama_session_by_router(zp[i]))
            && zp[i]->conf_ctx == NULL)
        {
            ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                          "llama_session zone \"%V\" has \"%s\" but no "
                          "location has \"llama_session %V\" or "
                          "\"llama_session_api %V\": its saves go through "
                          "such a location's llama_session_slots_uri",
                          &zp[i]->name,
                          zp[i]->save_idle ? "save_idle="
                          : zp[i]->models ? "models=" : "model=",
                          &zp[i]->name, &zp[i]->name);
            return NGX_ERROR;
        }
    }

    for (i = 0; i < lmcf->zones.nelts; i++) {
        if (zp[i]->ram && zp[i]->has_tenants) {
            ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                          "llama_session zone \"%V\" has \"ram=\" and a "
                          "location with llama_session_namespace: "
                          "llama-server's RAM cache is one for all "
                          "conversations and would give one tenant's cache "
                          "to another's prompt; keep tenants' zones on "
                          "files (no ram=, llama-server with --cache-ram 0)",
                          &zp[i]->name);
            return NGX_ERROR;
        }
    }

    /*
     * the precontent phase runs after the whole access phase, so a request
     * that allow/deny, auth_basic or auth_request refuse never moves a slot
     */

    h = ngx_array_push(&cmcf->phases[NGX_HTTP_PRECONTENT_PHASE].handlers);
    if (h == NULL) {
        return NGX_ERROR;
    }

    *h = ngx_http_llama_session_handler;

    if (ngx_http_llama_session_capture_init(cf) != NGX_OK
        || ngx_http_llama_session_conv_init(cf) != NGX_OK
        || ngx_http_llama_session_told_filter_init(cf) != NGX_OK)
    {
        return NGX_ERROR;
    }

    return ngx_http_llama_session_reply_init(cf);
}


/*
 * A reload with a zone of another size (or another name over the same
 * store folder) would make a second zone: two coordinators for one
 * backend while the old workers finish, and the new zone's index would
 * delete the temporary files of saves still running.  nginx keeps a
 * zone only when its name and size stay; anything else needs a restart.
 * Zones that say shared=on over one folder are owners of it, each with
 * its own temporary files: added, or renamed, on a reload.
 */

static ngx_int_t
ngx_http_llama_session_old_zone(ngx_conf_t *cf, ngx_str_t *name, size_t size,
    ngx_http_llama_session_zone_t *tz, ngx_uint_t routed)
{
    ngx_str_t                      *store;
    ngx_uint_t                      i;
    ngx_list_part_t                *part;
    ngx_shm_zone_t                 *shm_zone;
    ngx_http_llama_session_zone_t  *ozone;

    if (cf->cycle->old_cycle == NULL
        || cf->cycle->old_cycle->conf_ctx == NULL)
    {
        return NGX_OK;
    }

    store = &tz->store;

    part = &cf->cycle->old_cycle->shared_memory.part;
    shm_zone = part->elts;

    for (i = 0; /* void */ ; i++) {

        if (i >= part->nelts) {
            if (part->next == NULL) {
                break;
            }

            part = part->next;
            shm_zone = part->elts;
            i = 0;
        }

        if (shm_zone[i].tag != &ngx_http_llama_session_module) {
            continue;
        }

        ozone = shm_zone[i].data;

        if (shm_zone[i].shm.name.len == name->len
            && ngx_strncmp(shm_zone[i].shm.name.data, name->data, name->len)
               == 0)
        {
            if (shm_zone[i].shm.size != size) {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "llama_session zone \"%V\" cannot change "
                                   "its size from %uz to %uz on a reload: "
                                   "restart nginx", name, shm_zone[i].shm.size,
                                   size);
                return NGX_ERROR;
            }

            continue;
        }

        /*
         * the zones of a router share a folder, each with its prefix; the
         * owners of a shared store, each with temporary files of its own
         */

        if (ozone && store->len && ozone->store.len == store->len
            && ngx_strncmp(ozone->store.data, store->data, store->len) == 0
            && (!routed || !ngx_http_llama_session_by_router(ozone))
            && !(tz->shared && ozone->shared))
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "llama_session zone \"%V\" would take the "
                               "store \"%V\" of the running zone \"%V\" on a "
                               "reload: restart nginx to rename a zone", name,
                               store, &shm_zone[i].shm.name);
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


/*
 * llama_session_endpoints uri ...;
 */

static char *
ngx_http_llama_session_endpoints(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_http_llama_session_loc_conf_t *llcf = conf;

    ngx_str_t   *value, *s;
    ngx_uint_t   i;

    if (llcf->endpoints != NGX_CONF_UNSET_PTR) {
        return "is duplicate";
    }

    value = cf->args->elts;

    llcf->endpoints = ngx_array_create(cf->pool, cf->args->nelts,
                                       sizeof(ngx_str_t));
    if (llcf->endpoints == NULL) {
        return NGX_CONF_ERROR;
    }

    for (i = 1; i < cf->args->nelts; i++) {

        if (value[i].len < 2 || value[i].data[0] != '/'
            || value[i].data[value[i].len - 1] == '/'
            || ngx_strlchr(value[i].data, value[i].data + value[i].len, '?'))
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid endpoint \"%V\": give the end of a "
                               "path, such as \"/chat/completions\"",
                               &value[i]);
            return NGX_CONF_ERROR;
        }

        s = ngx_array_push(llcf->endpoints);
        if (s == NULL) {
            return NGX_CONF_ERROR;
        }

        *s = value[i];
    }

    return NGX_CONF_OK;
}


static ngx_int_t
ngx_http_llama_session_init_process(ngx_cycle_t *cycle)
{
    ngx_http_llama_session_process_init();
    ngx_http_llama_session_io_init_process();

    if (ngx_http_llama_session_told_init_process(cycle) != NGX_OK) {
        return NGX_ERROR;
    }

    return ngx_http_llama_session_idle_init(cycle);
}


static void
ngx_http_llama_session_exit_process(ngx_cycle_t *cycle)
{
    ngx_http_llama_session_io_exit_process();
    ngx_http_llama_session_sha256_free();
}


/* llama_session_warm off | system | history [min=size]; */

static char *
ngx_http_llama_session_warm_conf(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_http_llama_session_loc_conf_t *llcf = conf;

    ssize_t     size;
    ngx_str_t  *value, s;

    if (llcf->warm != NGX_CONF_UNSET_UINT) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (ngx_strcmp(value[1].data, "off") == 0) {
        llcf->warm = NGX_HTTP_LLAMA_SESSION_WARM_OFF;

    } else if (ngx_strcmp(value[1].data, "system") == 0) {
        llcf->warm = NGX_HTTP_LLAMA_SESSION_WARM_SYSTEM;

    } else if (ngx_strcmp(value[1].data, "history") == 0) {
        llcf->warm = NGX_HTTP_LLAMA_SESSION_WARM_HISTORY;

    } else {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid value \"%V\" in \"%V\": use \"off\", "
                           "\"system\" or \"history\"",
                           &value[1], &cmd->name);
        return NGX_CONF_ERROR;
    }

    if (cf->args->nelts == 2) {
        return NGX_CONF_OK;
    }

    if (ngx_strncmp(value[2].data, "min=", 4) != 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid parameter \"%V\" in \"%V\": only "
                           "\"min=size\" is known", &value[2], &cmd->name);
        return NGX_CONF_ERROR;
    }

    s.data = value[2].data + 4;
    s.len = value[2].len - 4;

    size = ngx_parse_size(&s);

    if (size == NGX_ERROR) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid size \"%V\" in \"%V\" min=",
                           &s, &cmd->name);
        return NGX_CONF_ERROR;
    }

    llcf->warm_min = size;

    return NGX_CONF_OK;
}
