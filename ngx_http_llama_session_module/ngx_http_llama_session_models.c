
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * One zone for a router of many models: "llama_session_zone zone=r:32m
 * ... models=N" makes the zones r.1 to r.N (module.c), each a router's
 * model zone (router.c) whose model is not known yet.  A request naming a
 * model that none of them drives is let in only when the router lists the
 * model in its GET /models (a client never makes up a zone's model); the
 * first zone without one is then given it, under the set's first zone's
 * lock, for good.  The binding is kept in the store folder as the file
 * "<zone>.model" (the model's name), read when nginx starts, so the
 * sessions' files ("<zone>@<key>.<fp>.bin") keep their model.
 *
 * The request's step (the router's list, then the binding) is router.c's.
 * A zone's binding is written in its shared memory (the name, its query
 * form, then "bound"); each process takes it into its own zone structure
 * when it first needs it (ngx_http_llama_session_models_adopt()).
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_file.h"
#include "ngx_http_llama_session_models.h"
#include "ngx_http_llama_session_store.h"


static void ngx_http_llama_session_models_write(
    ngx_http_llama_session_zone_t *zone, u_char *model, size_t len,
    ngx_log_t *log);
static void ngx_http_llama_session_models_set(ngx_http_llama_session_sh_t *sh,
    u_char *model, size_t len);


/* a model's name as the router gives it: letters, digits, "._:/+@-" */

ngx_uint_t
ngx_http_llama_session_model_valid(u_char *model, size_t len)
{
    u_char  c;
    size_t  i;

    if (len == 0 || len > NGX_HTTP_LLAMA_SESSION_MODEL_SHOW) {
        return 0;
    }

    for (i = 0; i < len; i++) {
        c = model[i];

        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
              || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == ':'
              || c == '/' || c == '+' || c == '@' || c == '-'))
        {
            return 0;
        }
    }

    return 1;
}


/*
 * "model=<name>&autoload=false", the name percent-encoded as a query
 * decodes it: "+", "/", ":" and "@" that NGX_ESCAPE_ARGS keeps too;
 * dst has NGX_HTTP_LLAMA_SESSION_MODEL_ARG bytes
 */

u_char *
ngx_http_llama_session_model_arg(u_char *dst, u_char *model, size_t len)
{
    u_char  c, *p;
    size_t  i;

    p = ngx_cpymem(dst, "model=", sizeof("model=") - 1);

    for (i = 0; i < len; i++) {
        c = model[i];

        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
            || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-')
        {
            *p++ = c;

        } else {
            p = ngx_sprintf(p, "%%%02XD", (ngx_uint_t) c);
        }
    }

    return ngx_cpymem(p, "&autoload=false", sizeof("&autoload=false") - 1);
}


/* how many zones the set has: its models= */

ngx_uint_t
ngx_http_llama_session_models_size(ngx_http_llama_session_zone_t *zone)
{
    ngx_uint_t                      n;
    ngx_http_llama_session_zone_t  *z;

    n = 0;

    for (z = zone->models; z; z = z->models_next) {
        n++;
    }

    return n;
}


/* this process takes the zone's binding, if it has one; 1: bound */

ngx_uint_t
ngx_http_llama_session_models_adopt(ngx_http_llama_session_zone_t *zone)
{
    ngx_http_llama_session_sh_t  *sh;

    if (zone->model.len) {
        return 1;
    }

    sh = zone->sh;

    if (zone->models == NULL || sh == NULL || !sh->bound) {
        return 0;
    }

    ngx_memory_barrier();

    zone->model.data = sh->bound_model;
    zone->model_arg.data = sh->bound_arg;
    zone->model_arg.len = sh->bound_arg_len;
    zone->model.len = sh->bound_len;

    return 1;
}


/* the set's zone of a model, NULL: none drives it yet */

ngx_http_llama_session_zone_t *
ngx_http_llama_session_models_find(ngx_http_llama_session_zone_t *lead,
    u_char *model, size_t len)
{
    ngx_http_llama_session_zone_t  *z;

    for (z = lead->models; z; z = z->models_next) {
        if (ngx_http_llama_session_models_adopt(z)
            && z->model.len == len
            && ngx_strncmp(z->model.data, model, len) == 0)
        {
            return z;
        }
    }

    return NULL;
}


/* the zone of the model, or the first one free given it; NULL: full */

ngx_http_llama_session_zone_t *
ngx_http_llama_session_models_take(ngx_http_llama_session_zone_t *lead,
    u_char *model, size_t len, ngx_log_t *log)
{
    ngx_http_llama_session_zone_t  *z, *free;

    free = NULL;

    ngx_shmtx_lock(&lead->shpool->mutex);

    for (z = lead; z; z = z->models_next) {
        if (z->sh->bound) {
            if (z->sh->bound_len == len
                && ngx_strncmp(z->sh->bound_model, model, len) == 0)
            {
                /* another worker gave it one */
                ngx_shmtx_unlock(&lead->shpool->mutex);
                (void) ngx_http_llama_session_models_adopt(z);
                return z;
            }

            continue;
        }

        if (free == NULL) {
            free = z;
        }
    }

    if (free == NULL) {
        ngx_shmtx_unlock(&lead->shpool->mutex);
        return NULL;
    }

    /* the zone's memory under the lock (once per model ever), then the file */

    ngx_http_llama_session_models_set(free->sh, model, len);

    ngx_shmtx_unlock(&lead->shpool->mutex);

    ngx_http_llama_session_models_write(free, model, len, log);

    (void) ngx_http_llama_session_models_adopt(free);

    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                  "llama_session: zone \"%V\" now keeps the sessions of the "
                  "router's model \"%V\"", &free->name, &free->model);

    return free;
}


static void
ngx_http_llama_session_models_set(ngx_http_llama_session_sh_t *sh,
    u_char *model, size_t len)
{
    u_char  *p;

    ngx_memcpy(sh->bound_model, model, len);
    sh->bound_len = (u_char) len;

    p = ngx_http_llama_session_model_arg(sh->bound_arg, model, len);
    sh->bound_arg_len = (u_short) (p - sh->bound_arg);

    ngx_memory_barrier();

    sh->bound = 1;
}


/*
 * "<store>/<zone>.model", the model's name and a line feed, written whole
 * in a thread of the zone's store (store_put()); a failure is logged
 * there: the binding holds until nginx restarts, when the zone may be
 * given another model (its files then stay unused, their fingerprint
 * being the old model's), as after a crash before the write
 */

static void
ngx_http_llama_session_models_write(ngx_http_llama_session_zone_t *zone,
    u_char *model, size_t len, ngx_log_t *log)
{
    u_char     file[NGX_MAX_PATH], tmp[NGX_MAX_PATH];
    u_char     lf;
    ngx_str_t  parts[2];

    ngx_snprintf(file, sizeof(file), "%V/%V.model%Z", &zone->store,
                 &zone->name);
    ngx_snprintf(tmp, sizeof(tmp), "%V/%V.model%V%Z", &zone->store,
                 &zone->name, &zone->tmp);

    lf = LF;

    parts[0].data = model;
    parts[0].len = len;
    parts[1].data = &lf;
    parts[1].len = 1;

    if (ngx_http_llama_session_store_put(zone, file, tmp, parts, 2,
                                         NGX_FILE_DEFAULT_ACCESS, NULL, 0,
                                         log)
        != NGX_OK)
    {
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: zone \"%V\" may be given another "
                      "model than \"%*s\" after a restart", &zone->name,
                      len, model);
    }
}


/*
 * At start (the zone's shared memory new): its binding from the store,
 * before the folder's files are indexed for it
 */

void
ngx_http_llama_session_models_load(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    u_char                          path[NGX_MAX_PATH];
    u_char                          line[NGX_HTTP_LLAMA_SESSION_MODEL_SHOW
                                         + 2];
    size_t                          len;
    ssize_t                         n;
    ngx_fd_t                        fd;
    ngx_http_llama_session_zone_t  *z;

    ngx_snprintf(path, sizeof(path), "%V/%V.model%Z", &zone->store,
                 &zone->name);

    fd = ngx_http_llama_session_file_open(path,
                                          NGX_HTTP_LLAMA_SESSION_FILE_READ, 0,
                                          log);

    if (fd == NGX_INVALID_FILE) {
        if (ngx_errno != NGX_ENOENT) {
            ngx_log_error(NGX_LOG_WARN, log, ngx_errno,
                          "llama_session: " ngx_open_file_n " \"%s\" failed: "
                          "zone \"%V\" is given the next model asked for",
                          path, &zone->name);
        }

        return;
    }

    n = ngx_read_fd(fd, line, sizeof(line));

    (void) ngx_close_file(fd);

    len = (n > 0) ? (size_t) n : 0;

    if (len && line[len - 1] == LF) {
        len--;
    }

    if (len == (size_t) n || !ngx_http_llama_session_model_valid(line, len)) {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: \"%s\" is not a model's name and a "
                      "line feed: zone \"%V\" is given the next model asked "
                      "for", path, &zone->name);
        return;
    }

    for (z = zone->models; z && z != zone; z = z->models_next) {
        if (z->sh && z->sh->bound && z->sh->bound_len == len
            && ngx_strncmp(z->sh->bound_model, line, len) == 0)
        {
            ngx_log_error(NGX_LOG_WARN, log, 0,
                          "llama_session: \"%s\" names the model \"%*s\" of "
                          "zone \"%V\": zone \"%V\" is given the next model "
                          "asked for", path, len, line, &z->name,
                          &zone->name);
            return;
        }
    }

    ngx_http_llama_session_models_set(zone->sh, line, len);
    (void) ngx_http_llama_session_models_adopt(zone);
}
