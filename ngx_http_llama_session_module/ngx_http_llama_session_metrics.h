
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Metrics in the Prometheus text format: the functions of ngx_http_llama_session_metrics.c.
 */


#ifndef _NGX_HTTP_LLAMA_SESSION_METRICS_H_INCLUDED_
#define _NGX_HTTP_LLAMA_SESSION_METRICS_H_INCLUDED_


#include "ngx_http_llama_session.h"


char *ngx_http_llama_session_metrics(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
void ngx_http_llama_session_observe(ngx_http_llama_session_hist_t *h,
    double ms);
void ngx_http_llama_session_save_stat(ngx_http_llama_session_zone_t *zone,
    ngx_uint_t reason, ngx_uint_t ok, off_t bytes, double ms);


#endif /* _NGX_HTTP_LLAMA_SESSION_METRICS_H_INCLUDED_ */
