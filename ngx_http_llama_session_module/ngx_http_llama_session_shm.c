
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The shared-memory zone: its layout made (or kept over a reload), found
 * by name, its counters.  What it holds is the scheduler's (sched.c: the
 * slots, who holds and who waits for them) and the file index's (index.c:
 * which sessions have a saved file).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_index.h"
#include "ngx_http_llama_session_shm.h"



ngx_int_t
ngx_http_llama_session_init_zone(ngx_shm_zone_t *shm_zone, void *data)
{
    ngx_http_llama_session_zone_t  *ozone = data;

    size_t                          len;
    ngx_uint_t                      i;
    ngx_http_llama_session_sh_t    *sh;
    ngx_http_llama_session_zone_t  *zone;

    zone = shm_zone->data;

    if (ozone) {
        if (ozone->sh->magic != NGX_HTTP_LLAMA_SESSION_MAGIC
            || ozone->sh->version != NGX_HTTP_LLAMA_SESSION_VERSION)
        {
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "llama_session zone \"%V\" has layout version %uD, "
                          "this module needs %d: restart nginx instead of "
                          "reloading it", &shm_zone->shm.name,
                          ozone->sh->version, NGX_HTTP_LLAMA_SESSION_VERSION);
            return NGX_ERROR;
        }

        if (ozone->sh->waiters_max != zone->waiters_max) {
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "llama_session zone \"%V\" uses max_waiting=%ui "
                          "while previously it used %ui: restart nginx to "
                          "change it", &shm_zone->shm.name,
                          zone->waiters_max, ozone->sh->waiters_max);
            return NGX_ERROR;
        }

        if (ozone->nslots != zone->nslots) {
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "llama_session zone \"%V\" uses slots=%ui while "
                          "previously it used slots=%ui: restart nginx to "
                          "change it", &shm_zone->shm.name, zone->nslots,
                          ozone->nslots);
            return NGX_ERROR;
        }

        if (zone->models == NULL
            && (ozone->model.len != zone->model.len
                || ngx_strncmp(ozone->model.data, zone->model.data,
                               zone->model.len) != 0))
        {
            /* its slots' contents and fingerprint are the old model's */
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "llama_session zone \"%V\" drives model \"%V\" "
                          "while previously it drove \"%V\": restart nginx "
                          "to change it", &shm_zone->shm.name, &zone->model,
                          &ozone->model);
            return NGX_ERROR;
        }

        zone->sh = ozone->sh;
        zone->shpool = ozone->shpool;

        /* a reload: the old workers exit without their saves at stop */
        zone->generation = ++zone->sh->cycles;

        return NGX_OK;
    }

    zone->shpool = (ngx_slab_pool_t *) shm_zone->shm.addr;

    if (shm_zone->shm.exists) {
        zone->sh = zone->shpool->data;
        zone->generation = ++zone->sh->cycles;
        return NGX_OK;
    }


    sh = ngx_slab_calloc(zone->shpool, sizeof(ngx_http_llama_session_sh_t));
    if (sh == NULL) {
        return NGX_ERROR;
    }

    zone->sh = sh;
    zone->shpool->data = sh;

    sh->magic = NGX_HTTP_LLAMA_SESSION_MAGIC;
    sh->version = NGX_HTTP_LLAMA_SESSION_VERSION;
    sh->nslots = zone->nslots;
    sh->next_ticket = 1;
    sh->cycles = 1;
    zone->generation = 1;

    ngx_queue_init(&sh->waiters);
    ngx_queue_init(&sh->free_waiters);
    ngx_http_llama_session_index_init(sh);

    /*
     * waiting requests have storage of their own, reserved now: records
     * of sessions may fill the rest of the zone, they never take it
     */

    sh->waiters_max = zone->waiters_max;
    sh->waiter_pool = ngx_slab_calloc(zone->shpool, zone->waiters_max
                                      * sizeof(ngx_http_llama_session_waiter_t));
    if (sh->waiter_pool == NULL) {
        ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                      "llama_session zone \"%V\" is too small for "
                      "max_waiting=%ui", &shm_zone->shm.name,
                      zone->waiters_max);
        return NGX_ERROR;
    }

    for (i = 0; i < zone->waiters_max; i++) {
        ngx_queue_insert_tail(&sh->free_waiters, &sh->waiter_pool[i].queue);
    }

    /* after a start nobody can vouch for what the backend's slots hold */

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_SLOTS_MAX; i++) {
        sh->slots[i].state = NGX_HTTP_LLAMA_SESSION_SLOT_UNKNOWN;
        sh->slots[i].task = -1;
    }

    len = sizeof(" in llama_session zone \"\"") + shm_zone->shm.name.len;

    zone->shpool->log_ctx = ngx_slab_alloc(zone->shpool, len);
    if (zone->shpool->log_ctx == NULL) {
        return NGX_ERROR;
    }

    ngx_sprintf(zone->shpool->log_ctx, " in llama_session zone \"%V\"%Z",
                &shm_zone->shm.name);

    zone->shpool->log_nomem = 0;

    return NGX_OK;
}


void
ngx_http_llama_session_stat(ngx_atomic_uint_t *counter)
{
    (void) ngx_atomic_fetch_add(counter, 1);
}


/* a zone declared before, by name; logs the error when there is none */

ngx_http_llama_session_zone_t *
ngx_http_llama_session_find_zone(ngx_conf_t *cf, ngx_str_t *name)
{
    ngx_uint_t                           i;
    ngx_http_llama_session_zone_t      **zp;
    ngx_http_llama_session_main_conf_t  *lmcf;

    lmcf = ngx_http_conf_get_module_main_conf(cf,
                                              ngx_http_llama_session_module);

    zp = lmcf->zones.elts;

    for (i = 0; i < lmcf->zones.nelts; i++) {
        if (zp[i]->name.len == name->len
            && ngx_strncmp(zp[i]->name.data, name->data, name->len) == 0)
        {
            /* a zone of a set ("r.2"): the set */
            return zp[i]->models ? zp[i]->models : zp[i];
        }

        if (zp[i]->models_index == 1
            && zp[i]->models_name.len == name->len
            && ngx_strncmp(zp[i]->models_name.data, name->data, name->len)
               == 0)
        {
            /* models=: the first of its zones leads them */
            return zp[i];
        }
    }

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "unknown llama_session zone \"%V\": declare it with "
                       "\"llama_session_zone zone=%V:size\" before use",
                       name, name);

    return NULL;
}
