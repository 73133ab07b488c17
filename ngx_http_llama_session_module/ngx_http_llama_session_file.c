
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * Every file the module opens in the store folder, or by a path a backend
 * names, is opened here, once, by one rule.  The store folder is
 * llama-server's user's and /props names the model's path: another user
 * can plant a symbolic link there (a worker that follows it truncates or
 * reads whatever it points at) or a FIFO (a worker that opens it blocks
 * until a writer comes, for ever).  So:
 *
 *   - every open is non-blocking (a FIFO's open returns at once) and
 *     what it opened must be a regular file, else it is closed again;
 *   - store files are opened without following a link (O_NOFOLLOW:
 *     ELOOP), and created exclusively (O_EXCL: never an existing name,
 *     which may be a link or a FIFO; the caller removes a stale name
 *     first, unlink takes a link itself, not what it points at);
 *   - a model's path follows links (hub caches are links), with the same
 *     non-blocking open and regular-file check.
 *
 * O_NONBLOCK changes nothing for a regular file's reads and writes.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_file.h"


/*
 * NGX_INVALID_FILE with errno set (ELOOP: a link; EINVAL: not a regular
 * file, which is logged here, at "warn", as somebody else's doing)
 */

ngx_fd_t
ngx_http_llama_session_file_open(u_char *path, ngx_uint_t how,
    ngx_uint_t access, ngx_log_t *log)
{
    int              flags;
    ngx_fd_t         fd;
    ngx_err_t        err;
    ngx_file_info_t  fi;

    switch (how) {

    case NGX_HTTP_LLAMA_SESSION_FILE_CREATE:
        flags = O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW|O_NONBLOCK;
        break;

    case NGX_HTTP_LLAMA_SESSION_FILE_MODEL:
        /* follows links: a model's path may be one (hub caches) */
        flags = O_RDONLY|O_NONBLOCK;
        break;

    default: /* NGX_HTTP_LLAMA_SESSION_FILE_READ */
        flags = O_RDONLY|O_NOFOLLOW|O_NONBLOCK;
        break;
    }

    /* flags: O_NONBLOCK always, O_NOFOLLOW but for a model's path */

    fd = open((const char *) path, flags|O_CLOEXEC, (mode_t) access);

    if (fd == NGX_INVALID_FILE) {
        return NGX_INVALID_FILE;
    }

    if (ngx_fd_info(fd, &fi) == NGX_FILE_ERROR) {
        err = ngx_errno;
        ngx_log_error(NGX_LOG_ALERT, log, err,
                      ngx_fd_info_n " \"%s\" failed", path);
        goto refuse;
    }

    if (ngx_is_file(&fi)) {
        return fd;
    }

    ngx_log_error(NGX_LOG_WARN, log, 0,
                  "llama_session: \"%s\" is not a regular file (a FIFO, a "
                  "device or a folder): not used", path);

    err = NGX_EINVAL;

refuse:

    if (ngx_close_file(fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, log, ngx_errno,
                      ngx_close_file_n " \"%s\" failed", path);
    }

    ngx_set_errno(err);

    return NGX_INVALID_FILE;
}
