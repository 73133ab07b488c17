
/*
 * Copyright (C) ngx_http_llama_session_module authors
 *
 * The store folder (store= on the zone: llama-server's --slot-save-path as
 * nginx sees it).  Each saved session is "<key>.<fp>.bin", written by
 * llama-server under "<key>.<fp>.bin.tmp" and renamed by the module, with
 * "<key>.<fp>.json" beside it: the client's id, the model, tokens, bytes.
 * At start the zone's index is built from the folder.  Only small file
 * system calls happen here.
 */


#include "ngx_http_llama_session.h"
#include "ngx_http_llama_session_ext.h"
#include "ngx_http_llama_session_file.h"
#include "ngx_http_llama_session_miss.h"
#include "ngx_http_llama_session_index.h"
#include "ngx_http_llama_session_io.h"
#include "ngx_http_llama_session_sched.h"
#include "ngx_http_llama_session_shm.h"
#include "ngx_http_llama_session_store.h"

#include <cjson/cJSON.h>


/*
 * shared=on: a file a zone only found in the folder is not evicted while
 * another owner may be using it: within this many seconds of its .json's
 * last change (a save's, or a take-in's touch)
 */
#define NGX_HTTP_LLAMA_SESSION_SHARED_GRACE  600


typedef struct {
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          len;
    off_t                           size;
    time_t                          mtime;

    /* what its .json says */
    u_char                          id_len;
    u_char                          id[NGX_HTTP_LLAMA_SESSION_ID_SHOW];
    u_char                          model_len;
    u_char                          model[NGX_HTTP_LLAMA_SESSION_MODEL_SHOW];
    ngx_uint_t                      tokens;
    u_char                          idk[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          sys[NGX_HTTP_LLAMA_SESSION_DIGEST];
    u_char                          ns[NGX_HTTP_LLAMA_SESSION_DIGEST];
    ngx_uint_t                      base_uses;
    uint64_t                        chain;      /* ext.c's, 0: none */
    unsigned                        has_idk:1;
    unsigned                        has_sys:1;
    unsigned                        has_ns:1;
    unsigned                        is_base:1;
    unsigned                        primed:1;
    unsigned                        known:1;
} ngx_http_llama_session_found_t;


static ngx_int_t ngx_http_llama_session_store_name(
    ngx_http_llama_session_zone_t *zone, u_char *name, size_t len,
    size_t *base);
/* a save's file taking its name (store_commit()), in a thread */

typedef struct {
    u_char                          from[NGX_MAX_PATH];
    u_char                          to[NGX_MAX_PATH];
    u_char                          old[NGX_MAX_PATH];
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          name_len;
    u_char                          key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
    size_t                          key_len;
    u_char                          fp[NGX_HTTP_LLAMA_SESSION_FP_LEN];
    off_t                           size;
    ngx_uint_t                      tokens;
    ngx_uint_t                      slot;
    ngx_int_t                       rc;
    unsigned                        check_newer:1;
    unsigned                        is_base:1;
    unsigned                        aside:1;
} ngx_http_llama_session_commit_t;


/* a change of the store that nobody waits for (store_remove()...) */

typedef struct {
    u_char                          rm[2][NGX_MAX_PATH]; /* "": none */
    u_char                          file[NGX_MAX_PATH];  /* a .json to
                                                           write, "": none */
    u_char                          tmp[NGX_MAX_PATH];
    u_char                         *text;
    size_t                          len;
    ngx_uint_t                      access;     /* its mode */
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          name_len;   /* its use to record, 0 */
    ngx_uint_t                      touch;
    ngx_atomic_t                   *done;       /* takes seq once the file
                                                   is written or failed */
    ngx_atomic_t                   *after;      /* rm[] once it reaches
                                                   seq (store_timeout=) */
    ngx_atomic_uint_t               seq;
    ngx_http_llama_session_names_pt names;      /* rm[0] only if it names
                                                   key, NULL: whatever */
    u_char                          key[NGX_HTTP_LLAMA_SESSION_KEY_MAX];
    size_t                          key_len;
    ngx_http_llama_session_evicted_t evict;     /* rm[] an eviction's, */
    ngx_uint_t                      evict_why;  /* ... 0: none (evicted()) */
} ngx_http_llama_session_change_t;


/* why a file is evicted (store_evicted()) */

#define NGX_HTTP_LLAMA_SESSION_EVICT_LIMITS  1
#define NGX_HTTP_LLAMA_SESSION_EVICT_DISK    2


static ngx_http_llama_session_change_t *ngx_http_llama_session_store_change(
    ngx_http_llama_session_zone_t *zone, ngx_log_t *log,
    ngx_http_llama_session_io_t **iop);
static void ngx_http_llama_session_store_apply(
    ngx_http_llama_session_io_t *io);
static void ngx_http_llama_session_store_change_work(
    ngx_http_llama_session_io_t *io);
static void ngx_http_llama_session_store_touch(
    ngx_http_llama_session_zone_t *zone, u_char *name, size_t len,
    ngx_log_t *log);
static ngx_int_t ngx_http_llama_session_store_write_path(u_char *file,
    u_char *tmp, u_char *text, size_t len, ngx_uint_t access, ngx_log_t *log);
static ngx_uint_t ngx_http_llama_session_disk_ok(
    ngx_http_llama_session_ctx_t *ctx);
static ngx_int_t ngx_http_llama_session_store_stat(u_char *path,
    ngx_http_llama_session_fid_t *fid);
static void ngx_http_llama_session_store_room_work(
    ngx_http_llama_session_io_t *io);
static void ngx_http_llama_session_store_look_work(
    ngx_http_llama_session_io_t *io);
static ssize_t ngx_http_llama_session_store_read(u_char *file, u_char *buf,
    size_t size, ngx_log_t *log);
static void ngx_http_llama_session_store_parse_meta(
    ngx_http_llama_session_found_t *f, u_char *file, u_char *buf, size_t n,
    ngx_log_t *log);
static void ngx_http_llama_session_store_read_meta(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_found_t *f,
    ngx_log_t *log);
static void ngx_http_llama_session_store_set_meta(
    ngx_http_llama_session_sh_t *sh, ngx_http_llama_session_node_t *node,
    ngx_http_llama_session_found_t *f);
static void ngx_http_llama_session_store_chain(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_found_t *f);
static ngx_int_t ngx_http_llama_session_file_info(u_char *file,
    ngx_file_info_t *fi);
static ngx_int_t ngx_http_llama_session_store_hex(char *s, u_char *out);
static ngx_int_t ngx_http_llama_session_store_sync_read(
    ngx_http_llama_session_zone_t *zone, ngx_pool_t *pool, ngx_log_t *log,
    ngx_array_t **out);
static void ngx_http_llama_session_store_sync_apply(
    ngx_http_llama_session_zone_t *zone, ngx_array_t *found, ngx_uint_t seq,
    ngx_log_t *log);
static void ngx_http_llama_session_store_sync_work(
    ngx_http_llama_session_io_t *io);
static void ngx_http_llama_session_store_sync_late(
    ngx_http_llama_session_io_t *io);
static void ngx_http_llama_session_store_commit_work(
    ngx_http_llama_session_io_t *io);
static void ngx_http_llama_session_store_commit_run(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_commit_t *cm,
    ngx_log_t *log);
static ngx_int_t ngx_http_llama_session_store_committed(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_commit_t *cm);
static void ngx_http_llama_session_store_commit_late(
    ngx_http_llama_session_io_t *io);
static ngx_int_t ngx_http_llama_session_store_superseded(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_commit_t *cm,
    ngx_log_t *log);
static void ngx_http_llama_session_store_evict_file(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_evicted_t *e,
    ngx_uint_t why, ngx_log_t *log);
static ngx_uint_t ngx_http_llama_session_store_evicted(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_evicted_t *e,
    ngx_uint_t why, ngx_log_t *log);
static ngx_uint_t ngx_http_llama_session_store_evictable(
    ngx_http_llama_session_zone_t *zone, ngx_http_llama_session_evicted_t *e,
    ngx_log_t *log);
static ngx_uint_t ngx_http_llama_session_store_tokens(
    ngx_http_llama_session_zone_t *zone, u_char *fp, u_char *key, size_t len,
    ngx_log_t *log);
static int ngx_libc_cdecl ngx_http_llama_session_found_cmp(const void *one,
    const void *two);
static void ngx_http_llama_session_doomed_handler(ngx_event_t *ev);


/*
 * Large files are not deleted in one go in a worker: ext4 frees a file's
 * blocks at its unlink, which takes long for a state of gigabytes.  They
 * are renamed to "<name>.del", cut by 64 MB every 10 ms, then unlinked.
 * A worker that exits leaves its ".del" files to the next start.
 */

#define NGX_HTTP_LLAMA_SESSION_DELETE_STEP  (64 * 1024 * 1024)

typedef struct {
    ngx_queue_t                     queue;
    off_t                           size;
    dev_t                           dev;        /* the file renamed, */
    ino_t                           ino;        /* not what has its name */
    u_char                          path[1];
} ngx_http_llama_session_doomed_t;


static ngx_int_t ngx_http_llama_session_doomed_cut(
    ngx_http_llama_session_doomed_t *d, ngx_log_t *log);


static ngx_queue_t  ngx_http_llama_session_doomed = {
    &ngx_http_llama_session_doomed, &ngx_http_llama_session_doomed
};

static ngx_event_t  ngx_http_llama_session_doomed_ev;

/* the event's data as nginx's timer debug lines read it: fd -1 */
static ngx_connection_t  ngx_http_llama_session_doomed_conn;
static int ngx_libc_cdecl ngx_http_llama_session_name_cmp(const void *one,
    const void *two);


/*
 * Is "name" a session file of the zone, "<key>.<8 hex>.bin" (or ".bin.tmp"
 * and ".bin.old"; in a shared store ".bin.<crc32>.tmp" and ".bin.<crc32>.old"
 * of the zone's host and name)?  A zone of a router's model knows its own
 * by their prefix ("<zone>@"); the others have no "@" in their keys.
 * Returns NGX_OK for .bin, NGX_AGAIN for .bin.tmp, NGX_DONE for .bin.old,
 * NGX_DECLINED otherwise; *base is the length of "<key>.<fp>".
 */

static ngx_int_t
ngx_http_llama_session_store_name(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, size_t *base)
{
    size_t      i, b, start;
    ngx_int_t   rc;
    ngx_str_t  *t;

    t = &zone->tmp;

    if (len > 4 + t->len && ngx_strncmp(name + len - t->len, t->data, t->len)
                            == 0
        && ngx_strncmp(name + len - t->len - 4, ".bin", 4) == 0)
    {
        /* this zone's temporary file (another owner's is not its own) */
        b = len - t->len - 4;
        rc = NGX_AGAIN;

    } else if (len > 4 + zone->old.len
               && ngx_strncmp(name + len - zone->old.len, zone->old.data,
                              zone->old.len) == 0
               && ngx_strncmp(name + len - zone->old.len - 4, ".bin", 4)
                  == 0)
    {
        /* set aside by this zone's save (another owner's is its own) */
        b = len - zone->old.len - 4;
        rc = NGX_DONE;

    } else if (len > 4 && ngx_strncmp(name + len - 4, ".bin", 4) == 0) {
        b = len - 4;
        rc = NGX_OK;

    } else {
        return NGX_DECLINED;
    }

    if (b < 2 + NGX_HTTP_LLAMA_SESSION_FP_LEN
        || b > NGX_HTTP_LLAMA_SESSION_NAME_MAX
        || name[b - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN] != '.')
    {
        return NGX_DECLINED;
    }

    start = zone->prefix.len;

    if (start) {
        if (b < start + 2 + NGX_HTTP_LLAMA_SESSION_FP_LEN
            || ngx_strncmp(name, zone->prefix.data, start) != 0)
        {
            return NGX_DECLINED;
        }
    }

    for (i = start; i < b - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN; i++) {
        if (!((name[i] >= 'a' && name[i] <= 'z')
              || (name[i] >= 'A' && name[i] <= 'Z')
              || (name[i] >= '0' && name[i] <= '9')
              || name[i] == '-' || name[i] == '_'))
        {
            return NGX_DECLINED;
        }
    }

    for (i = b - NGX_HTTP_LLAMA_SESSION_FP_LEN; i < b; i++) {
        if (!((name[i] >= '0' && name[i] <= '9')
              || (name[i] >= 'a' && name[i] <= 'f')))
        {
            return NGX_DECLINED;
        }
    }

    *base = b;

    return rc;
}


/*
 * Lists the session files of the folder with their size and time.  At
 * start (clean), leftover temporary files of interrupted saves go; while
 * running, those that nothing wrote to for NGX_HTTP_LLAMA_SESSION_TMP_AGE
 * (a save whose client left: its .tmp was deleted at once, but llama-server
 * may have written it after).
 */

#define NGX_HTTP_LLAMA_SESSION_TMP_AGE  600

static ngx_int_t
ngx_http_llama_session_store_scan(ngx_http_llama_session_zone_t *zone,
    ngx_pool_t *pool, ngx_uint_t clean, ngx_log_t *log, ngx_array_t **list)
{
    u_char                          file[NGX_MAX_PATH];
    size_t                          len, base;
    ngx_int_t                       rc;
    ngx_dir_t                       dir;
    ngx_array_t                    *found;
    ngx_file_info_t                 fi;
    ngx_http_llama_session_found_t *f;

    found = ngx_array_create(pool, 64,
                             sizeof(ngx_http_llama_session_found_t));
    if (found == NULL) {
        return NGX_ERROR;
    }

    *list = found;

    if (ngx_open_dir(&zone->store, &dir) == NGX_ERROR) {
        ngx_log_error(NGX_LOG_WARN, log, ngx_errno,
                      "llama_session: cannot open the store folder \"%V\" "
                      "of zone \"%V\"", &zone->store, &zone->name);
        return NGX_DECLINED;
    }

    for ( ;; ) {
        ngx_set_errno(0);

        if (ngx_read_dir(&dir) == NGX_ERROR) {
            break;
        }

        len = ngx_de_namelen(&dir);

        if (clean && len > 8
            && ngx_strncmp(ngx_de_name(&dir) + len - 4, ".del", 4) == 0
            && len > zone->prefix.len
            && ngx_strncmp(ngx_de_name(&dir), zone->prefix.data,
                           zone->prefix.len) == 0
            && ngx_strlcasestrn(ngx_de_name(&dir), ngx_de_name(&dir) + len,
                                (u_char *) ".bin", 4 - 1))
        {
            /* a deletion a worker did not finish */
            ngx_snprintf(file, sizeof(file), "%V/%*s%Z", &zone->store, len,
                         ngx_de_name(&dir));
            (void) ngx_delete_file(file);
            continue;
        }

        rc = ngx_http_llama_session_store_name(zone, ngx_de_name(&dir), len,
                                               &base);

        if (rc == NGX_DECLINED) {
            continue;
        }

        ngx_snprintf(file, sizeof(file), "%V/%*s%Z", &zone->store, len,
                     ngx_de_name(&dir));

        if (rc == NGX_AGAIN) {
            if (clean
                || (ngx_link_info(file, &fi) != NGX_FILE_ERROR
                    && ngx_is_file(&fi)
                    && ngx_time() - ngx_file_mtime(&fi)
                       > NGX_HTTP_LLAMA_SESSION_TMP_AGE))
            {
                ngx_log_error(NGX_LOG_NOTICE, log, 0,
                              "llama_session: deleting \"%s\", left by an "
                              "interrupted save", file);
                (void) ngx_delete_file(file);
            }

            continue;
        }

        if (rc == NGX_DONE) {
            /* moved aside by a save that did not finish its renames */

            if (clean) {
                u_char  bin[NGX_MAX_PATH];

                ngx_snprintf(bin, sizeof(bin), "%V/%*s.bin%Z", &zone->store,
                             base, ngx_de_name(&dir));

                if (ngx_http_llama_session_file_info(bin, &fi)
                    == NGX_FILE_ERROR)
                {
                    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                                  "llama_session: bringing back \"%s\"",
                                  file);
                    (void) ngx_rename_file(file, bin);

                    if (ngx_http_llama_session_file_info(bin, &fi)
                        == NGX_FILE_ERROR)
                    {
                        continue;
                    }

                    f = ngx_array_push(found);
                    if (f == NULL) {
                        continue;
                    }

                    ngx_memzero(f, sizeof(ngx_http_llama_session_found_t));

                    ngx_memcpy(f->name, ngx_de_name(&dir), base);
                    f->len = base;
                    f->size = ngx_file_size(&fi);
                    f->mtime = ngx_file_mtime(&fi);

                } else {
                    (void) ngx_delete_file(file);
                }
            }

            continue;
        }

        if (ngx_http_llama_session_file_info(file, &fi) == NGX_FILE_ERROR) {
            continue;
        }

        f = ngx_array_push(found);
        if (f == NULL) {
            ngx_close_dir(&dir);
            return NGX_ERROR;
        }

        ngx_memzero(f, sizeof(ngx_http_llama_session_found_t));

        ngx_memcpy(f->name, ngx_de_name(&dir), base);
        f->len = base;
        f->size = ngx_file_size(&fi);
        f->mtime = ngx_file_mtime(&fi);
    }

    ngx_close_dir(&dir);

    return NGX_OK;
}


/*
 * Can nginx's workers work in the store folder?  They rename and delete
 * the files that llama-server writes there, which needs write and search
 * permission on the folder for the workers' user (not on the files), and
 * no sticky bit unless the workers own the folder.  Checked when the zone
 * starts (nginx -t, start, reload), with the commands that fix it.
 */

ngx_int_t
ngx_http_llama_session_store_check(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    int               n, i;
    uid_t             uid;
    gid_t             gid, groups[256];
    mode_t            need;
    u_char            path[NGX_MAX_PATH], mode[4];
    struct stat       st;
    struct group     *gr;
    struct passwd    *pw;
    ngx_uint_t        member;
    ngx_core_conf_t  *ccf;

    ngx_snprintf(path, sizeof(path), "%V%Z", &zone->store);

    if (stat((char *) path, &st) == -1) {
        ngx_log_error(NGX_LOG_EMERG, log, ngx_errno,
                      "llama_session zone \"%V\": the store folder \"%s\" "
                      "is not there: create it and give it to llama-server's "
                      "--slot-save-path", &zone->name, path);
        return NGX_ERROR;
    }

    if (!S_ISDIR(st.st_mode)) {
        ngx_log_error(NGX_LOG_EMERG, log, 0,
                      "llama_session zone \"%V\": store \"%s\" is not a "
                      "folder", &zone->name, path);
        return NGX_ERROR;
    }

    ccf = (ngx_core_conf_t *) ngx_get_conf(zone->cycle->conf_ctx,
                                           ngx_core_module);

    if (geteuid() == 0 && ccf && ccf->user != (uid_t) NGX_CONF_UNSET_UINT) {
        uid = ccf->user;
        gid = ccf->group;

        n = 256;
        if (getgrouplist(ccf->username, gid, groups, &n) == -1) {
            n = 1;
            groups[0] = gid;
        }

    } else {
        uid = geteuid();
        gid = getegid();

        n = getgroups(256, groups);
        if (n == -1) {
            n = 0;
        }
    }

    if (uid == 0) {
        return NGX_OK;
    }

    member = (st.st_gid == gid);

    for (i = 0; i < n && !member; i++) {
        member = (groups[i] == st.st_gid);
    }

    /* read (the API lists it), write and search */

    need = (st.st_uid == uid) ? (S_IRUSR|S_IWUSR|S_IXUSR)
           : member ? (S_IRGRP|S_IWGRP|S_IXGRP)
                    : (S_IROTH|S_IWOTH|S_IXOTH);

    if ((st.st_mode & need) == need
        && (!(st.st_mode & S_ISVTX) || st.st_uid == uid))
    {
        return NGX_OK;
    }

    pw = getpwuid(uid);
    gr = getgrgid(gid);

    /* the mode in octal: nginx's formats have no %o */

    for (i = 0; i < 4; i++) {
        mode[i] = (u_char) ('0' + ((st.st_mode >> (3 * (3 - i))) & 7));
    }

    ngx_log_error(NGX_LOG_EMERG, log, 0,
                  "llama_session zone \"%V\": nginx's workers (user \"%s\") "
                  "cannot list, rename and delete the files llama-server "
                  "writes in "
                  "\"%s\" (owner %d, group %d, mode %*s%s): give the folder "
                  "to both, e.g. \"chgrp %s %s && chmod 2775 %s\"",
                  &zone->name, pw ? pw->pw_name : "?", path,
                  (int) st.st_uid, (int) st.st_gid, (size_t) 4, mode,
                  (st.st_mode & S_ISVTX) ? ", sticky" : "",
                  gr ? gr->gr_name : "WORKER-GROUP", path, path);

    return NGX_ERROR;
}


/*
 * Builds the zone's index from the folder at start: every session file
 * with its size and time, oldest first in the LRU, and what its .json
 * says.
 */

ngx_int_t
ngx_http_llama_session_store_index(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    ngx_int_t                        rc;
    ngx_uint_t                       i;
    ngx_pool_t                      *pool;
    ngx_array_t                     *found;
    ngx_http_llama_session_node_t   *node;
    ngx_http_llama_session_found_t  *f;

    if (ngx_test_config) {
        return NGX_OK;
    }

    pool = ngx_create_pool(16384, log);
    if (pool == NULL) {
        return NGX_ERROR;
    }

    rc = ngx_http_llama_session_store_scan(zone, pool, 1, log, &found);

    if (rc != NGX_OK) {
        ngx_destroy_pool(pool);
        return rc == NGX_DECLINED ? NGX_OK : NGX_ERROR;
    }

    f = found->elts;

    ngx_qsort(f, found->nelts, sizeof(ngx_http_llama_session_found_t),
              ngx_http_llama_session_found_cmp);

    for (i = 0; i < found->nelts; i++) {
        ngx_http_llama_session_store_read_meta(zone, &f[i], log);
    }

    ngx_shmtx_lock(&zone->shpool->mutex);

    for (i = 0; i < found->nelts; i++) {
        node = ngx_http_llama_session_node(zone, f[i].name, f[i].len);
        if (node == NULL) {
            ngx_log_error(NGX_LOG_WARN, log, 0,
                          "llama_session zone \"%V\" is too small to index "
                          "every file of its store folder", &zone->name);
            break;
        }

        ngx_http_llama_session_node_file(zone->sh, node, 1, f[i].size);
        node->saved_at = f[i].mtime;
        node->used_at = f[i].mtime;

        ngx_http_llama_session_store_set_meta(zone->sh, node, &f[i]);
        ngx_http_llama_session_store_chain(zone, &f[i]);
    }

    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                  "llama_session zone \"%V\": %ui saved sessions, %O bytes "
                  "in \"%V\"", &zone->name, zone->sh->files, zone->sh->bytes,
                  &zone->store);

    ngx_shmtx_unlock(&zone->shpool->mutex);

    ngx_destroy_pool(pool);

    ngx_http_llama_session_store_evict(log, zone, NULL, 0);

    return NGX_OK;
}


/*
 * The folder is the truth: files that appeared are added to the index,
 * files that vanished are no longer counted as saved.  A save recorded
 * while the folder was read is newer than what the scan saw: it stays.
 * The .json files of new sessions are read before the lock is taken.
 */

ngx_int_t
ngx_http_llama_session_store_sync(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log)
{
    ngx_int_t     rc;
    ngx_uint_t    seq;
    ngx_pool_t   *pool;
    ngx_array_t  *found;

    if (zone->store.len == 0) {
        return NGX_DECLINED;
    }

    pool = ngx_create_pool(16384, log);
    if (pool == NULL) {
        return NGX_ERROR;
    }

    ngx_shmtx_lock(&zone->shpool->mutex);
    seq = zone->sh->seq;
    ngx_shmtx_unlock(&zone->shpool->mutex);

    rc = ngx_http_llama_session_store_sync_read(zone, pool, log, &found);

    if (rc == NGX_OK) {
        ngx_http_llama_session_store_sync_apply(zone, found, seq, log);
    }

    ngx_destroy_pool(pool);

    return rc;
}


/*
 * The same in a thread of the zone's pool (io.c): NGX_AGAIN, "wake" is
 * woken when it is done or its bound passed (then store_sync_end()); wake
 * NULL: nobody waits, it is applied when done.  NGX_OK: done here (no
 * threads); NGX_DECLINED: no store, or a look at it already runs.
 */

typedef struct {
    ngx_array_t                    *found;
    ngx_uint_t                      seq;
    ngx_int_t                       rc;
    u_char                          store[NGX_MAX_PATH];
    off_t                           avail;
} ngx_http_llama_session_sync_t;


ngx_int_t
ngx_http_llama_session_store_sync_start(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log, ngx_event_t *wake, ngx_http_llama_session_io_t **iop)
{
    ngx_int_t                       rc;
    ngx_http_llama_session_io_t    *io;
    ngx_http_llama_session_sync_t  *sy;

    if (zone->store.len == 0 || zone->syncing) {
        return NGX_DECLINED;
    }

    io = NULL;

    if (ngx_http_llama_session_io_threads(zone)) {
        io = ngx_http_llama_session_io_create(zone, log,
                                     sizeof(ngx_http_llama_session_sync_t));
    }

    if (io == NULL) {
        (void) ngx_http_llama_session_store_sync(zone, log);
        return NGX_OK;
    }

    sy = io->data;

    ngx_shmtx_lock(&zone->shpool->mutex);
    sy->seq = zone->sh->seq;
    ngx_shmtx_unlock(&zone->shpool->mutex);

    ngx_snprintf(sy->store, sizeof(sy->store), "%V%Z", &zone->store);

    io->work = ngx_http_llama_session_store_sync_work;
    io->late = ngx_http_llama_session_store_sync_late;

    rc = ngx_http_llama_session_io_post(io, wake);

    if (rc == NGX_AGAIN) {
        /* one at a time: a store that hangs holds one thread for it */
        zone->syncing = 1;

        if (iop) {
            *iop = io;
        }

        return NGX_AGAIN;
    }

    ngx_http_llama_session_io_free(io);

    (void) ngx_http_llama_session_store_sync(zone, log);

    return NGX_OK;
}


/* its waiter woke: the folder as read, or the index as it is */

void
ngx_http_llama_session_store_sync_end(ngx_http_llama_session_io_t *io,
    ngx_log_t *log)
{
    if (!io->done) {
        ngx_http_llama_session_io_leave(io, log,
                                        "the zone's index as it is, without "
                                        "a look at the folder");
        return;
    }

    ngx_http_llama_session_store_sync_late(io);
    ngx_http_llama_session_io_free(io);
}


/* in a thread */

static void
ngx_http_llama_session_store_sync_work(ngx_http_llama_session_io_t *io)
{
    ngx_http_llama_session_sync_t  *sy;

    sy = io->data;

    sy->avail = ngx_fs_available(sy->store);
    sy->rc = ngx_http_llama_session_store_sync_read(io->zone, io->pool,
                                                    &io->log, &sy->found);
}


static void
ngx_http_llama_session_store_sync_late(ngx_http_llama_session_io_t *io)
{
    ngx_http_llama_session_sync_t  *sy;

    sy = io->data;

    io->zone->syncing = 0;

    if (sy->avail != NGX_MAX_OFF_T_VALUE) {
        io->zone->avail = sy->avail;
    }

    if (sy->rc == NGX_OK) {
        ngx_http_llama_session_store_sync_apply(io->zone, sy->found, sy->seq,
                                                &io->log);
    }
}


/*
 * The folder read: its files, sorted by name, and the .json of those the
 * index does not know (the lock taken only to ask it, between file calls)
 */

static ngx_int_t
ngx_http_llama_session_store_sync_read(ngx_http_llama_session_zone_t *zone,
    ngx_pool_t *pool, ngx_log_t *log, ngx_array_t **out)
{
    ngx_int_t                        rc;
    ngx_uint_t                       i;
    ngx_array_t                     *found;
    ngx_http_llama_session_node_t   *node;
    ngx_http_llama_session_found_t  *f;

    rc = ngx_http_llama_session_store_scan(zone, pool, 0, log, &found);

    if (rc != NGX_OK) {
        return rc;
    }

    f = found->elts;

    ngx_qsort(f, found->nelts, sizeof(ngx_http_llama_session_found_t),
              ngx_http_llama_session_name_cmp);

    /* which files the index does not know: their .json, without the lock */

    ngx_shmtx_lock(&zone->shpool->mutex);

    for (i = 0; i < found->nelts; i++) {
        node = ngx_http_llama_session_lookup_name(zone, f[i].name, f[i].len);
        f[i].known = (node != NULL);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    for (i = 0; i < found->nelts; i++) {
        if (!f[i].known) {
            ngx_http_llama_session_store_read_meta(zone, &f[i], log);
        }
    }

    *out = found;

    return NGX_OK;
}


/* what the folder held, into the index (seq: the index's when it began) */

static void
ngx_http_llama_session_store_sync_apply(ngx_http_llama_session_zone_t *zone,
    ngx_array_t *found, ngx_uint_t seq, ngx_log_t *log)
{
    ngx_int_t                        rc;
    ngx_uint_t                       i, lo, hi, mid, seen;
    ngx_queue_t                     *q, *next;
    ngx_http_llama_session_node_t   *node;
    ngx_http_llama_session_found_t  *f;

    f = found->elts;

    ngx_shmtx_lock(&zone->shpool->mutex);

    for (q = ngx_queue_head(&zone->sh->lru);
         q != ngx_queue_sentinel(&zone->sh->lru);
         q = next)
    {
        next = ngx_queue_next(q);

        node = ngx_queue_data(q, ngx_http_llama_session_node_t, lru);

        if (!node->saved || node->seq > seq) {
            continue;
        }

        seen = 0;
        lo = 0;
        hi = found->nelts;

        while (lo < hi) {
            mid = (lo + hi) / 2;
            rc = ngx_memn2cmp(node->name, f[mid].name, node->name_len,
                              f[mid].len);
            if (rc == 0) {
                seen = 1;
                break;
            }

            if (rc < 0) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }

        if (!seen) {
            ngx_log_error(NGX_LOG_INFO, log, 0,
                          "llama_session: the file of \"%*s\" is gone from "
                          "\"%V\"", (size_t) node->name_len, node->name,
                          &zone->store);
            ngx_http_llama_session_node_file(zone->sh, node, 0, 0);
        }
    }

    for (i = 0; i < found->nelts; i++) {
        node = ngx_http_llama_session_lookup_name(zone, f[i].name, f[i].len);

        if (node && (node->saved || node->seq > seq)) {
            continue;
        }

        if (node == NULL) {
            node = ngx_http_llama_session_node(zone, f[i].name, f[i].len);
            if (node == NULL) {
                break;
            }

            node->used_at = f[i].mtime;
            ngx_http_llama_session_store_set_meta(zone->sh, node, &f[i]);
            ngx_http_llama_session_store_chain(zone, &f[i]);
        }

        ngx_http_llama_session_node_file(zone->sh, node, 1, f[i].size);
        node->saved_at = f[i].mtime;
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


static int ngx_libc_cdecl
ngx_http_llama_session_name_cmp(const void *one, const void *two)
{
    const ngx_http_llama_session_found_t  *a = one, *b = two;

    return ngx_memn2cmp((u_char *) a->name, (u_char *) b->name, a->len,
                        b->len);
}


static int ngx_libc_cdecl
ngx_http_llama_session_found_cmp(const void *one, const void *two)
{
    const ngx_http_llama_session_found_t  *a = one, *b = two;

    return (a->mtime > b->mtime) - (a->mtime < b->mtime);
}


/*
 * The session's previous prompt from its .json, for a restored session
 * (miss.c).  A small read in the store folder; nothing when absent.
 */

/*
 * A look at the session's file and its .json, in a thread (io.c), before
 * the request decides by them: whether it has a file to restore (when the
 * zone's index does not know, or shared=on), whether another owner's is
 * newer (shared=on, a hit), its previous prompt (miss.c).  NGX_AGAIN: the
 * request waits for it (store_looked() then); NGX_DECLINED: nothing to
 * wait for.
 */

typedef struct {
    u_char                          store[NGX_MAX_PATH];
    u_char                          bin[NGX_MAX_PATH];
    u_char                          base[NGX_MAX_PATH]; /* "": none */
    u_char                          json[NGX_MAX_PATH];
    u_char                          meta[NGX_HTTP_LLAMA_SESSION_META_MAX];
    ngx_http_llama_session_disk_t   disk;
} ngx_http_llama_session_look_t;


ngx_int_t
ngx_http_llama_session_store_look(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_int_t                       rc;
    ngx_http_llama_session_io_t    *io;
    ngx_http_llama_session_zone_t  *zone;
    ngx_http_llama_session_look_t  *look;

    zone = ctx->zone;

    if (ngx_http_llama_session_disk_ok(ctx) || zone->store.len == 0
        || ctx->default_session
        || !ngx_http_llama_session_fingerprint(zone, ctx->job->fp))
    {
        return NGX_DECLINED;
    }

    io = ngx_http_llama_session_io_create(zone, r->connection->log,
                                     sizeof(ngx_http_llama_session_look_t));
    if (io == NULL) {
        return NGX_DECLINED;
    }

    look = io->data;

    n = ngx_http_llama_session_file_name(name, ctx->key, ctx->key_len,
                                         ctx->job->fp);

    ngx_snprintf(look->store, sizeof(look->store), "%V%Z", &zone->store);
    ngx_snprintf(look->bin, sizeof(look->bin), "%V/%*s.bin%Z", &zone->store,
                 n, name);
    ngx_snprintf(look->json, sizeof(look->json), "%V/%*s.json%Z",
                 &zone->store, n, name);

    if (ctx->base_len) {
        /* a warm start's base (warm.c), should the session start fresh */
        n = ngx_http_llama_session_file_name(name, ctx->base_key,
                                             ctx->base_len, ctx->job->fp);
        ngx_snprintf(look->base, sizeof(look->base), "%V/%*s.bin%Z",
                     &zone->store, n, name);
    }

    io->work = ngx_http_llama_session_store_look_work;

    rc = ngx_http_llama_session_io_post(io, &ctx->job->wait_ev);

    if (rc == NGX_ERROR) {
        /* the calls where they are made, as without threads */
        ngx_http_llama_session_io_free(io);
        return NGX_DECLINED;
    }

    ctx->job->io = io;

    if (rc == NGX_AGAIN) {
        return NGX_AGAIN;
    }

    ngx_http_llama_session_store_looked(r, ctx);

    return NGX_DECLINED;
}


/*
 * Does the look stand for the request's files?  Not once the backend's
 * configuration changed since (a restart with another model: the names
 * carry its fingerprint)
 */

static ngx_uint_t
ngx_http_llama_session_disk_ok(ngx_http_llama_session_ctx_t *ctx)
{
    return ctx->job->disk.valid
           && ngx_memcmp(ctx->job->disk.fp, ctx->job->fp,
                         NGX_HTTP_LLAMA_SESSION_FP_LEN) == 0;
}


/* a regular file's identity: NGX_OK, NGX_DECLINED (none), NGX_ERROR */

static ngx_int_t
ngx_http_llama_session_store_stat(u_char *path,
    ngx_http_llama_session_fid_t *fid)
{
    ngx_err_t        err;
    ngx_file_info_t  fi;

    ngx_memzero(fid, sizeof(ngx_http_llama_session_fid_t));

    if (ngx_link_info(path, &fi) == NGX_FILE_ERROR) {
        err = ngx_errno;
        return (err == NGX_ENOENT || err == NGX_ENOTDIR) ? NGX_DECLINED
                                                          : NGX_ERROR;
    }

    if (!ngx_is_file(&fi)) {
        return NGX_DECLINED;
    }

    fid->uniq = ngx_file_uniq(&fi);
    fid->size = ngx_file_size(&fi);
    fid->mtime = ngx_file_mtime(&fi);

    return NGX_OK;
}


/* in a thread */

static void
ngx_http_llama_session_store_look_work(ngx_http_llama_session_io_t *io)
{
    ssize_t                         n;
    ngx_err_t                       err;
    ngx_file_info_t                 fi;
    ngx_http_llama_session_look_t  *look;

    look = io->data;

    /* the room for a save (store_room()) */
    look->disk.avail = ngx_fs_available(look->store);

    look->disk.base_rc = look->base[0]
                         ? ngx_http_llama_session_store_stat(look->base,
                                                   &look->disk.base_fid)
                         : NGX_ERROR;

    /* a regular file: a link is never restored (nor committed) */

    if (ngx_link_info(look->bin, &fi) == NGX_FILE_ERROR) {
        err = ngx_errno;

        if (err == NGX_ENOENT || err == NGX_ENOTDIR) {
            look->disk.rc = NGX_DECLINED;
            return;
        }

        ngx_log_error(NGX_LOG_ERR, &io->log, err,
                      ngx_link_info_n " \"%s\" failed: the store of zone "
                      "\"%V\" cannot be read, the session starts fresh",
                      look->bin, &io->zone->name);

        look->disk.rc = NGX_ERROR;
        return;
    }

    if (!ngx_is_file(&fi)) {
        look->disk.rc = NGX_DECLINED;
        return;
    }

    look->disk.rc = NGX_OK;
    look->disk.fid.uniq = ngx_file_uniq(&fi);
    look->disk.fid.size = ngx_file_size(&fi);
    look->disk.fid.mtime = ngx_file_mtime(&fi);

    n = ngx_http_llama_session_store_read(look->json, look->meta,
                                          sizeof(look->meta), &io->log);
    if (n > 0) {
        look->disk.meta = look->meta;
        look->disk.meta_len = n;
    }
}


/* back in the request: what the look found, or that the store was silent */

void
ngx_http_llama_session_store_looked(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_http_llama_session_io_t    *io;
    ngx_http_llama_session_disk_t  *disk;
    ngx_http_llama_session_look_t  *look;

    io = ctx->job->io;
    ctx->job->io = NULL;

    disk = &ctx->job->disk;

    if (io == NULL) {
        return;
    }

    if (!io->done) {
        ngx_http_llama_session_io_leave(io, r->connection->log,
                                        "the session goes on without its "
                                        "file (fresh, or as its slot holds "
                                        "it)");
        disk->rc = NGX_ERROR;
        disk->base_rc = NGX_ERROR;
        disk->avail = NGX_MAX_OFF_T_VALUE;
        ngx_memcpy(disk->fp, ctx->job->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);
        disk->valid = 1;
        return;
    }

    look = io->data;
    *disk = look->disk;
    ngx_memcpy(disk->fp, ctx->job->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);
    disk->valid = 1;

    if (disk->avail != NGX_MAX_OFF_T_VALUE) {
        ctx->zone->avail = disk->avail;
    }

    if (disk->meta) {
        disk->meta = ngx_pnalloc(r->pool, disk->meta_len);
        if (disk->meta == NULL) {
            disk->meta_len = 0;

        } else {
            ngx_memcpy(disk->meta, look->meta, disk->meta_len);
        }
    }

    ngx_http_llama_session_io_free(io);
}


ngx_int_t
ngx_http_llama_session_store_prev(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char    file[NGX_MAX_PATH], *buf;
    cJSON    *json, *msgs, *tokens;
    ssize_t   n;

    if (ctx->zone->store.len == 0 || ctx->msgs == NULL) {
        return NGX_DECLINED;
    }

    if (ngx_http_llama_session_disk_ok(ctx)) {
        /* as the look before the swap read it (store_look()) */
        buf = ctx->job->disk.meta;
        n = ctx->job->disk.meta_len;

    } else {
        ngx_snprintf(file, sizeof(file), "%V/%*s.%*s.json%Z",
                     &ctx->zone->store, ctx->key_len, ctx->key,
                     (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN, ctx->job->fp);

        buf = ngx_pnalloc(r->pool, NGX_HTTP_LLAMA_SESSION_META_MAX);
        if (buf == NULL) {
            return NGX_ERROR;
        }

        n = ngx_http_llama_session_store_read(file, buf,
                                              NGX_HTTP_LLAMA_SESSION_META_MAX,
                                              r->connection->log);
    }

    if (buf == NULL || n <= 0) {
        return NGX_DECLINED;
    }

    json = cJSON_ParseWithLength((const char *) buf, n);
    msgs = cJSON_GetObjectItemCaseSensitive(json, "msgs");
    tokens = cJSON_GetObjectItemCaseSensitive(json, "prompt_tokens");

    if (cJSON_IsString(msgs) && cJSON_IsNumber(tokens)
        && tokens->valuedouble > 0 && tokens->valuedouble < 1e9
        && ngx_http_llama_session_msgs_decode(r->pool,
                                      (u_char *) msgs->valuestring,
                                      ngx_strlen(msgs->valuestring),
                                      &ctx->prev, &ctx->nprev)
           == NGX_OK)
    {
        ctx->prev_tokens = (ngx_uint_t) tokens->valuedouble;
    }

    cJSON_Delete(json);

    return NGX_OK;
}


/* what "<name>.json" says, read without following a symbolic link */

static void
ngx_http_llama_session_store_read_meta(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_found_t *f, ngx_log_t *log)
{
    u_char   file[NGX_MAX_PATH], buf[NGX_HTTP_LLAMA_SESSION_META_MAX];
    ssize_t  n;

    ngx_snprintf(file, sizeof(file), "%V/%*s.json%Z", &zone->store,
                 f->len, f->name);

    n = ngx_http_llama_session_store_read(file, buf, sizeof(buf), log);

    if (n > 0) {
        ngx_http_llama_session_store_parse_meta(f, file, buf, n, log);
    }
}


/* a small file of the store (a .json), at most size bytes; -1: none */

static ssize_t
ngx_http_llama_session_store_read(u_char *file, u_char *buf, size_t size,
    ngx_log_t *log)
{
    ssize_t   n;
    ngx_fd_t  fd;

    fd = ngx_http_llama_session_file_open(file,
                                          NGX_HTTP_LLAMA_SESSION_FILE_READ, 0,
                                          log);
    if (fd == NGX_INVALID_FILE) {
        return -1;
    }

    n = ngx_read_fd(fd, buf, size);
    ngx_close_file(fd);

    return n;
}


static void
ngx_http_llama_session_store_parse_meta(ngx_http_llama_session_found_t *f,
    u_char *file, u_char *buf, size_t n, ngx_log_t *log)
{
    cJSON  *json, *item, *msgs;

    json = cJSON_ParseWithLength((const char *) buf, n);
    if (json == NULL) {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: \"%s\" is not JSON, ignored", file);
        return;
    }

    item = cJSON_GetObjectItemCaseSensitive(json, "id");
    if (cJSON_IsString(item)) {
        f->id_len = (u_char) ngx_min(ngx_strlen(item->valuestring),
                                     NGX_HTTP_LLAMA_SESSION_ID_SHOW);
        ngx_memcpy(f->id, item->valuestring, f->id_len);
    }

    item = cJSON_GetObjectItemCaseSensitive(json, "model");
    if (cJSON_IsString(item)) {
        f->model_len = (u_char) ngx_min(ngx_strlen(item->valuestring),
                                        NGX_HTTP_LLAMA_SESSION_MODEL_SHOW);
        ngx_memcpy(f->model, item->valuestring, f->model_len);
    }

    item = cJSON_GetObjectItemCaseSensitive(json, "tokens");
    if (cJSON_IsNumber(item) && item->valuedouble >= 0
        && item->valuedouble < 1e15)
    {
        f->tokens = (ngx_uint_t) item->valuedouble;
    }

    /* "idn": the id's digest without the model ("idk" had it, earlier) */
    item = cJSON_GetObjectItemCaseSensitive(json, "idn");
    if (cJSON_IsString(item)
        && ngx_http_llama_session_store_hex(item->valuestring, f->idk)
           == NGX_OK)
    {
        f->has_idk = 1;
    }

    item = cJSON_GetObjectItemCaseSensitive(json, "system");
    if (cJSON_IsString(item)
        && ngx_http_llama_session_store_hex(item->valuestring, f->sys)
           == NGX_OK)
    {
        f->has_sys = 1;
    }

    /* re-primed before its save: the next turn extends all of it */
    f->primed = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(json,
                                                              "primed"));

    /* a warm start's base, and how many sessions started from it */
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(json, "base"))) {
        f->is_base = 1;

        item = cJSON_GetObjectItemCaseSensitive(json, "base_uses");
        if (cJSON_IsNumber(item) && item->valuedouble >= 0
            && item->valuedouble < 65536)
        {
            f->base_uses = (ngx_uint_t) item->valuedouble;
        }
    }

    /* "ns": the tenant's digest (none: the API's operator sees it only) */
    item = cJSON_GetObjectItemCaseSensitive(json, "ns");
    if (cJSON_IsString(item)
        && ngx_http_llama_session_store_hex(item->valuestring, f->ns)
           == NGX_OK)
    {
        f->has_ns = 1;
    }

    /*
     * a conversation without an id: its last request's chain (ext.c), as
     * saved, or from the messages a .json of a version before kept
     */
    item = cJSON_GetObjectItemCaseSensitive(json, "chain");
    msgs = cJSON_GetObjectItemCaseSensitive(json, "msgs");

    if (f->has_ns && f->has_sys && f->id_len > sizeof("sys-") - 1
        && ngx_strncmp(f->id, "sys-", sizeof("sys-") - 1) == 0)
    {
        if (cJSON_IsString(item)) {
            f->chain = ngx_http_llama_session_ext_parse(
                                          (u_char *) item->valuestring,
                                          ngx_strlen(item->valuestring));

        } else if (cJSON_IsString(msgs)) {
            f->chain = ngx_http_llama_session_ext_saved(f->ns, f->sys,
                                          f->model, f->model_len,
                                          (u_char *) msgs->valuestring,
                                          ngx_strlen(msgs->valuestring));
        }
    }

    cJSON_Delete(json);
}


static void
ngx_http_llama_session_store_set_meta(ngx_http_llama_session_sh_t *sh,
    ngx_http_llama_session_node_t *node, ngx_http_llama_session_found_t *f)
{
    if (f->is_base) {
        ngx_http_llama_session_node_base(sh, node, 1, f->base_uses);
    }

    if (f->id_len) {
        node->id_len = f->id_len;
        ngx_memcpy(node->id, f->id, f->id_len);
    }

    if (f->model_len) {
        node->model_len = f->model_len;
        ngx_memcpy(node->model, f->model, f->model_len);
    }

    if (f->tokens) {
        node->tokens = f->tokens;
    }

    node->primed = f->primed;

    if (f->has_idk) {
        node->has_idk = 1;
        ngx_memcpy(node->idk, f->idk, NGX_HTTP_LLAMA_SESSION_DIGEST);
    }

    if (f->has_sys) {
        node->has_sys = 1;
        ngx_memcpy(node->sys, f->sys, NGX_HTTP_LLAMA_SESSION_DIGEST);
    }

    if (f->has_ns) {
        node->has_ns = 1;
        ngx_memcpy(node->ns, f->ns, NGX_HTTP_LLAMA_SESSION_DIGEST);
    }
}


/* with the zone locked: a saved conversation's last request (ext.c) */

static void
ngx_http_llama_session_store_chain(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_found_t *f)
{
    if (f->chain && f->has_idk
        && f->len > 1 + NGX_HTTP_LLAMA_SESSION_FP_LEN)
    {
        ngx_http_llama_session_ext_index(zone, f->chain, f->name,
                                 f->len - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN,
                                 f->id, f->id_len, f->idk, f->ns);
    }
}


/* 16 hex digits into 8 bytes */

static ngx_int_t
ngx_http_llama_session_store_hex(char *s, u_char *out)
{
    ngx_int_t   n;
    ngx_uint_t  i;

    if (ngx_strlen(s) != 2 * NGX_HTTP_LLAMA_SESSION_DIGEST) {
        return NGX_ERROR;
    }

    for (i = 0; i < NGX_HTTP_LLAMA_SESSION_DIGEST; i++) {
        n = ngx_hextoi((u_char *) s + 2 * i, 2);
        if (n == NGX_ERROR) {
            return NGX_ERROR;
        }

        out[i] = (u_char) n;
    }

    return NGX_OK;
}


/* a regular file's information, without following a symbolic link */

static ngx_int_t
ngx_http_llama_session_file_info(u_char *file, ngx_file_info_t *fi)
{
    if (ngx_link_info(file, fi) == NGX_FILE_ERROR) {
        return NGX_FILE_ERROR;
    }

    if (!ngx_is_file(fi)) {
        ngx_set_errno(NGX_ENOENT);
        return NGX_FILE_ERROR;
    }

    return NGX_OK;
}


/* writes "<name>.json" beside the session's file, atomically */

ngx_int_t
ngx_http_llama_session_store_meta(ngx_log_t *log,
    ngx_http_llama_session_zone_t *zone, u_char *name, size_t len,
    ngx_uint_t slot)
{
    u_char                         msgs[ngx_base64_encoded_length(
                                        NGX_HTTP_LLAMA_SESSION_MSGS_MAX
                                        * sizeof(ngx_http_llama_session_msg_t))
                                        + 1];
    size_t                         mlen;
    uint64_t                       chain;
    ngx_int_t                      rc;
    ngx_uint_t                     tokens, nmsgs;
    u_char                         file[NGX_HTTP_LLAMA_SESSION_NAME_MAX
                                        + sizeof(".json")];
    u_char                         id[NGX_HTTP_LLAMA_SESSION_ID_SHOW + 1];
    u_char                         model[NGX_HTTP_LLAMA_SESSION_MODEL_SHOW + 1];
    u_char                         nm[NGX_HTTP_LLAMA_SESSION_NAME_MAX + 1];
    u_char                         hex[2 * NGX_HTTP_LLAMA_SESSION_DIGEST + 1];
    char                          *text;
    cJSON                         *json;
    ngx_http_llama_session_node_t  node;
    ngx_http_llama_session_io_t      *io;
    ngx_http_llama_session_change_t  *ch;
    ngx_http_llama_session_msg_t   prompt[NGX_HTTP_LLAMA_SESSION_MSGS_MAX];

    if (ngx_http_llama_session_node_info(zone, name, len, &node) != NGX_OK) {
        return NGX_DECLINED;
    }

    json = cJSON_CreateObject();
    if (json == NULL) {
        return NGX_ERROR;
    }

    /* the record's fields are not terminated, and may fill their arrays */

    *ngx_cpymem(id, node.id, node.id_len) = '\0';
    *ngx_cpymem(model, node.model, node.model_len) = '\0';
    *ngx_cpymem(nm, node.name, node.name_len) = '\0';

    if (cJSON_AddStringToObject(json, "id", (char *) id) == NULL
        || cJSON_AddStringToObject(json, "model", (char *) model) == NULL
        || cJSON_AddStringToObject(json, "name", (char *) nm) == NULL
        || cJSON_AddNumberToObject(json, "tokens", node.tokens) == NULL
        || cJSON_AddNumberToObject(json, "bytes", node.bytes) == NULL
        || cJSON_AddNumberToObject(json, "saved_at", node.saved_at) == NULL)
    {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    if (node.has_idk) {
        *ngx_hex_dump(hex, node.idk, NGX_HTTP_LLAMA_SESSION_DIGEST) = '\0';

        if (cJSON_AddStringToObject(json, "idn", (char *) hex) == NULL) {
            cJSON_Delete(json);
            return NGX_ERROR;
        }
    }

    if (node.has_ns) {
        *ngx_hex_dump(hex, node.ns, NGX_HTTP_LLAMA_SESSION_DIGEST) = '\0';

        if (cJSON_AddStringToObject(json, "ns", (char *) hex) == NULL) {
            cJSON_Delete(json);
            return NGX_ERROR;
        }
    }

    if (node.has_sys) {
        *ngx_hex_dump(hex, node.sys, NGX_HTTP_LLAMA_SESSION_DIGEST) = '\0';

        if (cJSON_AddStringToObject(json, "system", (char *) hex) == NULL) {
            cJSON_Delete(json);
            return NGX_ERROR;
        }
    }

    if (node.primed && cJSON_AddTrueToObject(json, "primed") == NULL) {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    if (node.is_base
        && (cJSON_AddTrueToObject(json, "base") == NULL
            || cJSON_AddNumberToObject(json, "base_uses", node.base_uses)
               == NULL))
    {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    /* the prompt of the session in the slot, to explain a later miss */

    tokens = 0;
    chain = 0;
    mlen = 0;
    nmsgs = ngx_http_llama_session_slot_msgs_copy(zone, slot, name,
                                   len - 1 - NGX_HTTP_LLAMA_SESSION_FP_LEN,
                                   prompt, NGX_HTTP_LLAMA_SESSION_MSGS_MAX,
                                   &tokens, &chain);
    if (nmsgs) {
        rc = ngx_http_llama_session_msgs_encode(msgs, sizeof(msgs), prompt,
                                                nmsgs);
        mlen = (rc > 0) ? (size_t) rc : 0;
    }

    if (mlen
        && (cJSON_AddStringToObject(json, "msgs", (char *) msgs) == NULL
            || cJSON_AddNumberToObject(json, "prompt_tokens", tokens)
               == NULL))
    {
        cJSON_Delete(json);
        return NGX_ERROR;
    }

    /* a conversation without an id: the chain of all its messages */

    if (mlen && chain) {
        ngx_sprintf(hex, "%016uxL%Z", chain);

        if (cJSON_AddStringToObject(json, "chain", (char *) hex) == NULL) {
            cJSON_Delete(json);
            return NGX_ERROR;
        }
    }

    text = cJSON_PrintUnformatted(json);
    cJSON_Delete(json);

    if (text == NULL) {
        return NGX_ERROR;
    }

    ngx_snprintf(file, sizeof(file), "%*s.json%Z", len, name);

    ch = ngx_http_llama_session_store_change(zone, log, &io);

    if (ch == NULL) {
        rc = ngx_http_llama_session_store_write(&zone->store, file,
                                                &zone->tmp, (u_char *) text,
                                                ngx_strlen(text), log);
        cJSON_free(text);

        if (rc == NGX_OK && zone->shared) {
            ngx_http_llama_session_store_used(zone, name, len, 0, log);
        }

        return rc;
    }

    /* written in a thread: the request does not wait for it */

    ch->len = ngx_strlen(text);
    ch->text = ngx_pnalloc(io->pool, ch->len);

    if (ch->text == NULL) {
        cJSON_free(text);
        ngx_http_llama_session_io_free(io);
        return NGX_ERROR;
    }

    ngx_memcpy(ch->text, text, ch->len);
    cJSON_free(text);

    ch->access = NGX_FILE_DEFAULT_ACCESS;

    ngx_snprintf(ch->file, sizeof(ch->file), "%V/%s%Z", &zone->store, file);
    ngx_snprintf(ch->tmp, sizeof(ch->tmp), "%V/%s%V%Z", &zone->store, file,
                 &zone->tmp);

    if (zone->shared) {
        ngx_memcpy(ch->name, name, len);
        ch->name_len = len;
    }

    ngx_http_llama_session_store_apply(io);

    return NGX_OK;
}


/*
 * Changes of the store that no request waits for (a file deleted, a .json
 * written, a use recorded): in a thread of the zone's pool (io.c), the
 * request going on at once; where they are asked without threads
 */


static ngx_http_llama_session_change_t *
ngx_http_llama_session_store_change(ngx_http_llama_session_zone_t *zone,
    ngx_log_t *log, ngx_http_llama_session_io_t **iop)
{
#if (NGX_THREADS)
    ngx_http_llama_session_io_t  *io;

    if (ngx_http_llama_session_io_threads(zone)) {
        io = ngx_http_llama_session_io_create(zone, log,
                                   sizeof(ngx_http_llama_session_change_t));
        if (io) {
            io->work = ngx_http_llama_session_store_change_work;
            *iop = io;
            return io->data;
        }
    }
#endif

    *iop = NULL;

    return NULL;
}


/* posts the change (nobody waits for it), or makes it here */

static void
ngx_http_llama_session_store_apply(ngx_http_llama_session_io_t *io)
{
    ngx_int_t  rc;

    rc = ngx_http_llama_session_io_post(io, NULL);

    if (rc == NGX_AGAIN) {
        return;
    }

    if (rc == NGX_ERROR) {
        /* no memory for its task: here */
        io->work(io);
    }

    ngx_http_llama_session_io_free(io);
}


static void
ngx_http_llama_session_store_change_work(ngx_http_llama_session_io_t *io)
{
    ngx_uint_t                        i;
    ngx_http_llama_session_change_t  *ch;

    ch = io->data;

    if (ch->after
        && ngx_http_llama_session_io_wait(ch->after, ch->seq,
                                          io->zone->store_timeout)
           != NGX_OK)
    {
        ngx_log_error(NGX_LOG_WARN, &io->log, 0,
                      "llama_session: the write of \"%s\" did not end within "
                      "store_timeout=%M, it is deleted now", ch->rm[0],
                      io->zone->store_timeout);
    }

    if (ch->names
        && !ch->names(ch->rm[0], ch->key, ch->key_len, &io->log))
    {
        ch->rm[0][0] = '\0';
    }

    if (ch->evict_why
        && !ngx_http_llama_session_store_evicted(io->zone, &ch->evict,
                                                 ch->evict_why, &io->log))
    {
        return;
    }

    for (i = 0; i < 2; i++) {
        if (ch->rm[i][0]
            && ngx_delete_file(ch->rm[i]) == NGX_FILE_ERROR
            && ngx_errno != NGX_ENOENT)
        {
            ngx_log_error(NGX_LOG_WARN, &io->log, ngx_errno,
                          ngx_delete_file_n " \"%s\" failed", ch->rm[i]);
        }
    }

    if (ch->file[0]
        && ngx_http_llama_session_store_write_path(ch->file, ch->tmp,
                                                   ch->text, ch->len,
                                                   ch->access, &io->log)
           != NGX_OK)
    {
        ch->name_len = 0;
    }

    if (ch->done) {
        /* after the rename: a reader that sees seq finds the file */
        ngx_memory_barrier();
        *ch->done = ch->seq;
    }

    if (ch->name_len) {
        ngx_http_llama_session_store_used(io->zone, ch->name, ch->name_len,
                                          ch->touch, &io->log);
    }
}


/*
 * A small file of the store written whole (a slot's turn, turn.c; a
 * router zone's model, models.c): its bytes, n parts, go to "tmp", then
 * take the name "file"; off the loop.  "done", unless NULL, takes "seq"
 * once the write ended, written or failed.
 */

ngx_int_t
ngx_http_llama_session_store_put(ngx_http_llama_session_zone_t *zone,
    u_char *file, u_char *tmp, ngx_str_t *parts, ngx_uint_t n,
    ngx_uint_t access, ngx_atomic_t *done, ngx_atomic_uint_t seq,
    ngx_log_t *log)
{
    u_char                           *p, *text;
    size_t                            len;
    ngx_int_t                         rc;
    ngx_uint_t                        i;
    ngx_pool_t                       *pool;
    ngx_http_llama_session_io_t      *io;
    ngx_http_llama_session_change_t  *ch;

    len = 0;

    for (i = 0; i < n; i++) {
        len += parts[i].len;
    }

    ch = ngx_http_llama_session_store_change(zone, log, &io);

    pool = io ? io->pool : ngx_create_pool(1024, log);
    if (pool == NULL) {
        return NGX_ERROR;
    }

    text = ngx_pnalloc(pool, len ? len : 1);
    if (text == NULL) {
        ngx_destroy_pool(pool);
        return NGX_ERROR;
    }

    p = text;

    for (i = 0; i < n; i++) {
        p = ngx_cpymem(p, parts[i].data, parts[i].len);
    }

    if (ch == NULL) {
        rc = ngx_http_llama_session_store_write_path(file, tmp, text, len,
                                                     access, log);
        ngx_destroy_pool(pool);

        if (done) {
            *done = seq;
        }

        return rc;
    }

    ngx_cpystrn(ch->file, file, NGX_MAX_PATH);
    ngx_cpystrn(ch->tmp, tmp, NGX_MAX_PATH);
    ch->text = text;
    ch->len = len;
    ch->access = access;
    ch->done = done;
    ch->seq = seq;

    ngx_http_llama_session_store_apply(io);

    return NGX_OK;
}


/* a file of the store goes: the delete of store_delete(), off the loop */

void
ngx_http_llama_session_store_remove(ngx_http_llama_session_zone_t *zone,
    u_char *file, u_char *file2, ngx_log_t *log)
{
    ngx_http_llama_session_store_remove_after(zone, file, file2, NULL, 0,
                                              log);
}


/*
 * store_remove(), once "done" reached "seq": the write that store_put()
 * gave them, in a thread of this worker's or another's, ended (nothing
 * it writes stays after the delete); without threads it did
 */

void
ngx_http_llama_session_store_remove_after(ngx_http_llama_session_zone_t *zone,
    u_char *file, u_char *file2, ngx_atomic_t *done, ngx_atomic_uint_t seq,
    ngx_log_t *log)
{
    ngx_http_llama_session_io_t      *io;
    ngx_http_llama_session_change_t  *ch;

    ch = ngx_http_llama_session_store_change(zone, log, &io);

    if (ch == NULL) {
        if (ngx_http_llama_session_store_delete(file) == NGX_FILE_ERROR
            && ngx_errno != NGX_ENOENT)
        {
            ngx_log_error(NGX_LOG_WARN, log, ngx_errno,
                          ngx_delete_file_n " \"%s\" failed", file);
        }

        if (file2) {
            (void) ngx_delete_file(file2);
        }

        return;
    }

    ngx_cpystrn(ch->rm[0], file, NGX_MAX_PATH);

    if (file2) {
        ngx_cpystrn(ch->rm[1], file2, NGX_MAX_PATH);
    }

    ch->after = done;
    ch->seq = seq;

    ngx_http_llama_session_store_apply(io);
}


/*
 * A file of the store goes if names() finds key in it (a turn file that
 * names a deleted session, turn.c), off the loop: the file's read too
 */

void
ngx_http_llama_session_store_remove_if(ngx_http_llama_session_zone_t *zone,
    u_char *file, ngx_http_llama_session_names_pt names, u_char *key,
    size_t len, ngx_log_t *log)
{
    ngx_http_llama_session_io_t      *io;
    ngx_http_llama_session_change_t  *ch;

    ch = ngx_http_llama_session_store_change(zone, log, &io);

    if (ch == NULL) {
        if (names(file, key, len, log)
            && ngx_http_llama_session_store_delete(file) == NGX_FILE_ERROR
            && ngx_errno != NGX_ENOENT)
        {
            ngx_log_error(NGX_LOG_WARN, log, ngx_errno,
                          ngx_delete_file_n " \"%s\" failed", file);
        }

        return;
    }

    ngx_cpystrn(ch->rm[0], file, NGX_MAX_PATH);

    ch->names = names;
    ngx_memcpy(ch->key, key, len);
    ch->key_len = len;

    ngx_http_llama_session_store_apply(io);
}


/* shared=on: a session taken in here (store_used()), off the loop */

static void
ngx_http_llama_session_store_touch(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, ngx_log_t *log)
{
    ngx_http_llama_session_io_t      *io;
    ngx_http_llama_session_change_t  *ch;

    ch = ngx_http_llama_session_store_change(zone, log, &io);

    if (ch == NULL) {
        ngx_http_llama_session_store_used(zone, name, len, 1, log);
        return;
    }

    ngx_memcpy(ch->name, name, len);
    ch->name_len = len;
    ch->touch = 1;

    ngx_http_llama_session_store_apply(io);
}


/*
 * "<folder>/<name>" written whole: through "<name><tmp_suffix>" (the
 * zone's: ".tmp", or its own in a shared store), created anew, never
 * through a link nor over another's file, then renamed over; failures
 * logged
 */

ngx_int_t
ngx_http_llama_session_store_write(ngx_str_t *folder, u_char *name,
    ngx_str_t *tmp_suffix, u_char *text, size_t len, ngx_log_t *log)
{
    u_char  file[NGX_MAX_PATH], tmp[NGX_MAX_PATH];

    ngx_snprintf(file, sizeof(file), "%V/%s%Z", folder, name);
    ngx_snprintf(tmp, sizeof(tmp), "%V/%s%V%Z", folder, name, tmp_suffix);

    return ngx_http_llama_session_store_write_path(file, tmp, text, len,
                                                   NGX_FILE_DEFAULT_ACCESS,
                                                   log);
}


static ngx_int_t
ngx_http_llama_session_store_write_path(u_char *file, u_char *tmp,
    u_char *text, size_t len, ngx_uint_t access, ngx_log_t *log)
{
    ssize_t   n;
    ngx_fd_t  fd;

    (void) ngx_delete_file(tmp);

    fd = ngx_http_llama_session_file_open(tmp,
                                          NGX_HTTP_LLAMA_SESSION_FILE_CREATE,
                                          access, log);
    if (fd == NGX_INVALID_FILE) {
        ngx_log_error(NGX_LOG_ERR, log, ngx_errno,
                      ngx_open_file_n " \"%s\" failed", tmp);
        return NGX_ERROR;
    }

    n = ngx_write_fd(fd, text, len);

    if (ngx_close_file(fd) == NGX_FILE_ERROR || n != (ssize_t) len) {
        ngx_log_error(NGX_LOG_ERR, log, ngx_errno,
                      "llama_session: cannot write \"%s\"", tmp);
        (void) ngx_delete_file(tmp);
        return NGX_ERROR;
    }

    if (ngx_rename_file(tmp, file) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ERR, log, ngx_errno,
                      ngx_rename_file_n " \"%s\" to \"%s\" failed", tmp, file);
        (void) ngx_delete_file(tmp);
        return NGX_ERROR;
    }

    return NGX_OK;
}


ngx_int_t
ngx_http_llama_session_store_unlink(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, ngx_log_t *log)
{
    u_char  file[NGX_MAX_PATH], json[NGX_MAX_PATH];

    if (zone->store.len == 0) {
        return NGX_DECLINED;
    }

    ngx_snprintf(file, sizeof(file), "%V/%*s.bin%Z", &zone->store, len, name);
    ngx_snprintf(json, sizeof(json), "%V/%*s.json%Z", &zone->store, len,
                 name);

    ngx_http_llama_session_store_remove(zone, file, json, log);

    return NGX_OK;
}


/*
 * Deletes a store file; a large one in steps (see above).  Returns
 * NGX_OK or NGX_FILE_ERROR with ngx_errno set, as ngx_delete_file().
 */

ngx_int_t
ngx_http_llama_session_store_delete(u_char *file)
{
    size_t                            len;
    u_char                           *p;
    ngx_file_info_t                   fi;
    ngx_http_llama_session_doomed_t  *d;

    if (ngx_link_info(file, &fi) == NGX_FILE_ERROR) {
        return NGX_FILE_ERROR;
    }

    if (!ngx_is_file(&fi)
        || ngx_file_size(&fi) <= NGX_HTTP_LLAMA_SESSION_DELETE_STEP
        || ngx_process != NGX_PROCESS_WORKER)
    {
        return ngx_delete_file(file);
    }

    len = ngx_strlen(file);

    d = ngx_alloc(sizeof(ngx_http_llama_session_doomed_t) + len
                  + sizeof(".del"), ngx_cycle->log);
    if (d == NULL) {
        return ngx_delete_file(file);
    }

    p = ngx_cpymem(d->path, file, len);
    ngx_memcpy(p, ".del", sizeof(".del"));

    if (ngx_rename_file(file, d->path) == NGX_FILE_ERROR) {
        ngx_free(d);
        return ngx_delete_file(file);
    }

    d->size = ngx_file_size(&fi);
    d->dev = fi.st_dev;
    d->ino = fi.st_ino;

    ngx_queue_insert_tail(&ngx_http_llama_session_doomed, &d->queue);

    if (!ngx_http_llama_session_doomed_ev.timer_set) {
        ngx_http_llama_session_doomed_ev.handler =
                                         ngx_http_llama_session_doomed_handler;
        ngx_http_llama_session_doomed_ev.log = ngx_cycle->log;
        ngx_http_llama_session_doomed_conn.fd = (ngx_socket_t) -1;
        ngx_http_llama_session_doomed_ev.data =
                                         &ngx_http_llama_session_doomed_conn;
        ngx_http_llama_session_doomed_ev.cancelable = 1;

        ngx_add_timer(&ngx_http_llama_session_doomed_ev, 10);
    }

    return NGX_OK;
}


/*
 * Cuts the renamed file to d->size: through a descriptor of the very file
 * renamed (no link followed, the same device and inode), never through
 * its name, which llama-server (the folder's owner) could have swapped for
 * a link to any file the worker may write.  NGX_DECLINED: not that file,
 * its name goes (unlink takes a link itself, not what it points at).
 */

static ngx_int_t
ngx_http_llama_session_doomed_cut(ngx_http_llama_session_doomed_t *d,
    ngx_log_t *log)
{
    ngx_fd_t         fd;
    ngx_int_t        rc;
    ngx_file_info_t  fi;

    fd = open((char *) d->path, O_WRONLY|O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC);

    if (fd == NGX_INVALID_FILE) {
        if (ngx_errno == NGX_ELOOP) {
            ngx_log_error(NGX_LOG_WARN, log, 0,
                          "llama_session: \"%s\" is no longer the file the "
                          "module renamed (a link): only its name is "
                          "removed", d->path);
        }

        return NGX_DECLINED;
    }

    rc = NGX_DECLINED;

    if (ngx_fd_info(fd, &fi) != NGX_FILE_ERROR
        && ngx_is_file(&fi) && fi.st_dev == d->dev && fi.st_ino == d->ino)
    {
        if (ftruncate(fd, d->size) == 0) {
            rc = NGX_OK;

        } else {
            ngx_log_error(NGX_LOG_WARN, log, ngx_errno,
                          "ftruncate(\"%s\") failed", d->path);
        }

    } else {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: \"%s\" is no longer the file the "
                      "module renamed (a link, or another file): only its "
                      "name is removed", d->path);
    }

    if (ngx_close_file(fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, log, ngx_errno,
                      ngx_close_file_n " \"%s\" failed", d->path);
    }

    return rc;
}


static void
ngx_http_llama_session_doomed_handler(ngx_event_t *ev)
{
    ngx_queue_t                      *q;
    ngx_http_llama_session_doomed_t  *d;

    if (ngx_queue_empty(&ngx_http_llama_session_doomed)) {
        return;
    }

    q = ngx_queue_head(&ngx_http_llama_session_doomed);
    d = ngx_queue_data(q, ngx_http_llama_session_doomed_t, queue);

    d->size = (d->size > NGX_HTTP_LLAMA_SESSION_DELETE_STEP)
              ? d->size - NGX_HTTP_LLAMA_SESSION_DELETE_STEP : 0;

    if (d->size == 0
        || ngx_http_llama_session_doomed_cut(d, ev->log) != NGX_OK)
    {

        if (ngx_delete_file(d->path) == NGX_FILE_ERROR
            && ngx_errno != NGX_ENOENT)
        {
            ngx_log_error(NGX_LOG_WARN, ev->log, ngx_errno,
                          ngx_delete_file_n " \"%s\" failed", d->path);
        }

        ngx_queue_remove(q);
        ngx_free(d);
    }

    if (!ngx_queue_empty(&ngx_http_llama_session_doomed) && !ngx_exiting) {
        ngx_add_timer(ev, 10);
    }
}


/*
 * With store= the save went to "<key>.<fp>.bin.tmp": move it into place, so
 * a save that fails or dies half way never harms the previous file.  The
 * temporary file must be a regular file (no link) of the size llama-server
 * says it wrote.
 *
 * With the zone's threads the file calls run in one (io.c): NGX_AGAIN,
 * "wake" is woken and the request calls again once they are done or their
 * bound (store_timeout=) passed.
 *
 * The previous file is first moved aside to ".bin.old", then the new one
 * takes its name, then the old one goes: a rename over an existing file
 * makes ext4 (auto_da_alloc) write the new file's data out at once, which
 * costs more than the save itself; renames to free names do not.  If the
 * process dies between the two renames, the next start brings ".bin.old"
 * back.
 */

ngx_int_t
ngx_http_llama_session_store_commit(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len, off_t size,
    ngx_uint_t tokens, ngx_event_t *wake)
{
    u_char                           name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                           n;
    ngx_int_t                        rc;
    ngx_str_t                       *store;
    ngx_http_llama_session_io_t     *io;
    ngx_http_llama_session_commit_t  *cm, local;

    store = &ctx->zone->store;
    io = ctx->job->io;

    if (io) {
        /* back from its thread, or its bound passed */

        ctx->job->io = NULL;

        if (!io->done) {
            io->late = ngx_http_llama_session_store_commit_late;

            ngx_http_llama_session_io_leave(io, log,
                                            "the save is not committed "
                                            "yet, the session's turns since "
                                            "its file stay unsaved until it "
                                            "is");
            ctx->job->store_silent = 1;
            return NGX_ERROR;
        }

        cm = io->data;
        rc = ngx_http_llama_session_store_committed(log, ctx, cm);
        ngx_http_llama_session_io_free(io);

        return rc;
    }

    if (store->len == 0) {
        return NGX_OK;
    }

    cm = &local;

    if (ngx_http_llama_session_io_threads(ctx->zone)) {
        io = ngx_http_llama_session_io_create(ctx->zone, log,
                                   sizeof(ngx_http_llama_session_commit_t));
        if (io) {
            cm = io->data;
        }
    }

    ngx_memzero(cm, sizeof(ngx_http_llama_session_commit_t));

    n = ngx_http_llama_session_file_name(name, key, len, ctx->job->fp);

    ngx_snprintf(cm->to, sizeof(cm->to), "%V/%*s.bin%Z", store, n, name);
    ngx_snprintf(cm->from, sizeof(cm->from), "%V/%*s.bin%V%Z", store, n,
                 name, &ctx->zone->tmp);
    ngx_snprintf(cm->old, sizeof(cm->old), "%V/%*s.bin%V%Z", store, n, name,
                 &ctx->zone->old);

    ngx_memcpy(cm->name, name, n);
    cm->name_len = n;
    ngx_memcpy(cm->key, key, len);
    cm->key_len = len;
    ngx_memcpy(cm->fp, ctx->job->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);
    cm->size = size;
    cm->tokens = tokens;
    cm->slot = ctx->job->slot;
    cm->check_newer = (ctx->zone->shared && key != ctx->base_key);
    cm->is_base = (key == ctx->base_key);

    if (io) {
        io->work = ngx_http_llama_session_store_commit_work;

        rc = ngx_http_llama_session_io_post(io, wake);

        if (rc == NGX_AGAIN) {
            ctx->job->io = io;
            return NGX_AGAIN;
        }

        if (rc == NGX_OK) {
            rc = ngx_http_llama_session_store_committed(log, ctx, cm);
            ngx_http_llama_session_io_free(io);
            return rc;
        }

        /* not posted: here, as without threads */
        local = *cm;
        cm = &local;
        ngx_http_llama_session_io_free(io);
    }

    ngx_http_llama_session_store_commit_run(ctx->zone, cm, log);

    return ngx_http_llama_session_store_committed(log, ctx, cm);
}


/* in a thread */

static void
ngx_http_llama_session_store_commit_work(ngx_http_llama_session_io_t *io)
{
    ngx_http_llama_session_store_commit_run(io->zone, io->data, &io->log);
}


/*
 * The commit's file calls, in a thread or where it is asked; the shared
 * memory is read (file_newer(), file_seen()) under its lock, never held
 * across a file call
 */

static void
ngx_http_llama_session_store_commit_run(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_commit_t *cm, ngx_log_t *log)
{
    ngx_file_info_t               fi;
    ngx_http_llama_session_fid_t  fid;

    cm->rc = NGX_ERROR;

    if (ngx_link_info(cm->from, &fi) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ERR, log, ngx_errno,
                      ngx_link_info_n " \"%s\" failed: is store= the folder "
                      "of llama-server's --slot-save-path?", cm->from);
        return;
    }

    if (!ngx_is_file(&fi) || cm->size <= 0 || ngx_file_size(&fi) != cm->size)
    {
        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "llama_session: \"%s\" is not the file llama-server "
                      "said it wrote (%O bytes, it has %O): a full disk?",
                      cm->from, cm->size,
                      ngx_is_file(&fi) ? ngx_file_size(&fi) : (off_t) -1);
        return;
    }

    if (cm->check_newer) {
        cm->rc = ngx_http_llama_session_store_superseded(zone, cm, log);

        if (cm->rc != NGX_OK) {
            (void) ngx_delete_file(cm->from);
            return;
        }
    }

    cm->aside = (ngx_rename_file(cm->to, cm->old) != NGX_FILE_ERROR);

    if (ngx_rename_file(cm->from, cm->to) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ERR, log, ngx_errno,
                      ngx_rename_file_n " \"%s\" to \"%s\" failed: is "
                      "store= the folder of llama-server's --slot-save-path "
                      "and writable by nginx's workers?", cm->from, cm->to);

        if (cm->aside) {
            (void) ngx_rename_file(cm->old, cm->to);
            cm->aside = 0;
        }

        cm->rc = NGX_ERROR;
        return;
    }

    if (zone->shared) {
        /* the file the slot's state went to: the rename keeps it */
        fid.uniq = ngx_file_uniq(&fi);
        fid.size = ngx_file_size(&fi);
        fid.mtime = ngx_file_mtime(&fi);

        ngx_http_llama_session_file_seen(zone, cm->fp, cm->key, cm->key_len,
                                         &fid);
    }

    cm->rc = NGX_OK;
}


/* back in the event loop: what the commit did, for the request */

static ngx_int_t
ngx_http_llama_session_store_committed(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, ngx_http_llama_session_commit_t *cm)
{
    if (cm->rc == NGX_DECLINED) {
        ctx->job->superseded = 1;
        return NGX_DECLINED;
    }

    if (cm->rc != NGX_OK) {
        return NGX_ERROR;
    }

    if (cm->aside && ctx->request && !ctx->api && !ctx->job->own
        && ctx->job->old_len == 0)
    {
        /* deleting a large file takes its time: after the request */
        ngx_memcpy(ctx->job->old_name, cm->name, cm->name_len);
        ctx->job->old_len = cm->name_len;
        return NGX_OK;
    }

    if (cm->aside) {
        ngx_http_llama_session_store_remove(ctx->zone, cm->old, NULL, log);
    }

    return NGX_OK;
}


/*
 * A commit that ended after its request went on (its bound passed): the
 * file took its name, the index and its .json learn it, the previous one
 * goes
 */

static void
ngx_http_llama_session_store_commit_late(ngx_http_llama_session_io_t *io)
{
    ngx_http_llama_session_job_t     *job;
    ngx_http_llama_session_commit_t  *cm;

    cm = io->data;

    if (cm->rc != NGX_OK) {
        return;
    }

    job = ngx_pcalloc(io->pool, sizeof(ngx_http_llama_session_job_t));

    if (job) {
        ngx_memcpy(job->fp, cm->fp, NGX_HTTP_LLAMA_SESSION_FP_LEN);
        job->log = &io->log;

        ngx_http_llama_session_file_saved(io->zone, job, cm->key, cm->key_len,
                                          cm->is_base, 1, cm->tokens,
                                          cm->size);
        (void) ngx_http_llama_session_store_meta(&io->log, io->zone, cm->name,
                                                 cm->name_len, cm->slot);
    }

    if (cm->aside) {
        ngx_http_llama_session_store_remove(io->zone, cm->old, NULL,
                                            &io->log);
    }
}


/*
 * shared=on: may this save replace the session's file?  Not when another
 * owner saved the session since this zone's slot took it in (a file of
 * another identity) with more tokens than the slot holds: a later turn
 * of the conversation, which stays, and the slot's is dropped
 * (NGX_DECLINED).  With fewer, the other owner's save was of an older
 * turn (its idle save after the session had moved on): it is replaced.
 * NGX_ERROR: the folder cannot be read.  The look and the rename are two
 * steps: two owners committing one session between them both write whole
 * files, the last rename wins.
 */

static ngx_int_t
ngx_http_llama_session_store_superseded(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_commit_t *cm, ngx_log_t *log)
{
    ngx_err_t                     err;
    ngx_uint_t                    theirs;
    ngx_file_info_t               fi;
    ngx_http_llama_session_fid_t  fid;

    if (ngx_link_info(cm->to, &fi) == NGX_FILE_ERROR) {
        err = ngx_errno;

        if (err == NGX_ENOENT) {
            /* none (or deleted by another owner's eviction) */
            return NGX_OK;
        }

        ngx_log_error(NGX_LOG_ERR, log, err,
                      ngx_link_info_n " \"%s\" failed: the store of zone "
                      "\"%V\" cannot be read", cm->to, &zone->name);
        return NGX_ERROR;
    }

    if (!ngx_is_file(&fi)) {
        /* not a file: the rename's own checks refuse it */
        return NGX_OK;
    }

    fid.uniq = ngx_file_uniq(&fi);
    fid.size = ngx_file_size(&fi);
    fid.mtime = ngx_file_mtime(&fi);

    if (!ngx_http_llama_session_file_newer(zone, cm->fp, cm->key, cm->key_len,
                                           &fid))
    {
        return NGX_OK;
    }

    theirs = ngx_http_llama_session_store_tokens(zone, cm->fp, cm->key,
                                                 cm->key_len, log);

    if (theirs <= cm->tokens) {
        ngx_log_error(NGX_LOG_INFO, log, 0,
                      "llama_session: another owner saved session \"%*s\" "
                      "since slot %ui of zone \"%V\" took it in, %ui tokens "
                      "against the slot's %ui: replaced",
                      cm->key_len, cm->key, cm->slot, &zone->name, theirs,
                      cm->tokens);
        return NGX_OK;
    }

    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                  "llama_session: another owner saved session \"%*s\" "
                  "since slot %ui of zone \"%V\" took it in, %ui tokens "
                  "against the slot's %ui: its newer file stays, the slot's "
                  "older state is not kept",
                  cm->key_len, cm->key, cm->slot, &zone->name, theirs,
                  cm->tokens);

    return NGX_DECLINED;
}


/* the tokens a session's .json gives its file, 0: unknown */

static ngx_uint_t
ngx_http_llama_session_store_tokens(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len, ngx_log_t *log)
{
    ngx_http_llama_session_found_t  f;

    ngx_memzero(&f, sizeof(ngx_http_llama_session_found_t));

    f.len = ngx_http_llama_session_file_name(f.name, key, len, fp);

    ngx_http_llama_session_store_read_meta(zone, &f, log);

    return f.tokens;
}


/* a previous file moved aside by a save, once the request is over */

void
ngx_http_llama_session_store_drop_old(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx)
{
    u_char  file[NGX_MAX_PATH];

    ngx_snprintf(file, sizeof(file), "%V/%*s.bin%V%Z", &ctx->zone->store,
                 ctx->job->old_len, ctx->job->old_name, &ctx->zone->old);

    ctx->job->old_len = 0;

    ngx_http_llama_session_store_remove(ctx->zone, file, NULL, log);
}


/* after a failed save: the temporary file, if llama-server left one */

void
ngx_http_llama_session_store_drop_tmp(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len)
{
    u_char     file[NGX_MAX_PATH];
    u_char     name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t     n;

    if (ctx->zone->store.len == 0 || ctx->job->store_silent) {
        /* silent: a commit of it may still run in its thread (io.c) */
        return;
    }

    n = ngx_http_llama_session_file_name(name, key, len, ctx->job->fp);

    ngx_snprintf(file, sizeof(file), "%V/%*s.bin%V%Z", &ctx->zone->store,
                 n, name, &ctx->zone->tmp);

    ngx_http_llama_session_store_remove(ctx->zone, file, NULL, log);
}


/*
 * Keeps the folder within max_files and max_size: the zone picks the
 * least recently used files (never a session in a slot nor "keep"), then
 * they go outside the lock (store_evict_file()).
 */

#define NGX_HTTP_LLAMA_SESSION_EVICT_BATCH  64

void
ngx_http_llama_session_store_evict(ngx_log_t *log,
    ngx_http_llama_session_zone_t *zone, u_char *keep, size_t keep_len)
{
    ngx_uint_t                        i, n;
    ngx_http_llama_session_evicted_t  out[NGX_HTTP_LLAMA_SESSION_EVICT_BATCH];

    if (zone->max_files == 0 && zone->max_size == 0) {
        return;
    }

    n = ngx_http_llama_session_evict_pick(zone, keep, keep_len, 0, out,
                                          NGX_HTTP_LLAMA_SESSION_EVICT_BATCH);

    for (i = 0; i < n; i++) {
        ngx_http_llama_session_store_evict_file(zone, &out[i],
                                          NGX_HTTP_LLAMA_SESSION_EVICT_LIMITS,
                                          log);
    }
}


/*
 * A file eviction picked goes with its .json, off the loop: with shared=on
 * the look whether another owner used it since (store_evictable()) too
 */

static void
ngx_http_llama_session_store_evict_file(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_evicted_t *e, ngx_uint_t why, ngx_log_t *log)
{
    ngx_http_llama_session_io_t      *io;
    ngx_http_llama_session_change_t  *ch;

    ch = ngx_http_llama_session_store_change(zone, log, &io);

    if (ch == NULL) {
        /* no threads: here */

        if (ngx_http_llama_session_store_evicted(zone, e, why, log)) {
            (void) ngx_http_llama_session_store_unlink(zone, e->name, e->len,
                                                       log);
        }

        return;
    }

    ngx_snprintf(ch->rm[0], NGX_MAX_PATH, "%V/%*s.bin%Z", &zone->store,
                 e->len, e->name);
    ngx_snprintf(ch->rm[1], NGX_MAX_PATH, "%V/%*s.json%Z", &zone->store,
                 e->len, e->name);

    ch->evict = *e;
    ch->evict_why = why;

    ngx_http_llama_session_store_apply(io);
}


/* may the file go (shared=on: store_evictable()), logged if it does */

static ngx_uint_t
ngx_http_llama_session_store_evicted(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_evicted_t *e, ngx_uint_t why, ngx_log_t *log)
{
    if (zone->shared
        && !ngx_http_llama_session_store_evictable(zone, e, log))
    {
        return 0;
    }

    if (why == NGX_HTTP_LLAMA_SESSION_EVICT_LIMITS) {
        ngx_log_error(NGX_LOG_INFO, log, 0,
                      "llama_session: evicted session \"%*s\" (%O bytes) to "
                      "keep zone \"%V\" within max_files=%ui max_size=%O",
                      e->len, e->name, e->bytes, &zone->name,
                      zone->max_files, zone->max_size);

    } else {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "llama_session: evicted session \"%*s\" (%O bytes) to "
                      "make room on the disk of zone \"%V\"'s store",
                      e->len, e->name, e->bytes, &zone->name);
    }

    return 1;
}


/*
 * shared=on: may the zone delete a file eviction picked?  Not when another
 * owner used the session since this zone did: its .json, which each save
 * writes and each owner's take-in touches (store_used()), is not as this
 * zone left it; for a file the zone only found in the folder, when the
 * .json changed within NGX_HTTP_LLAMA_SESSION_SHARED_GRACE.  Such a file
 * stays, the zone's most recently used.  A file without a .json goes.
 */

static ngx_uint_t
ngx_http_llama_session_store_evictable(ngx_http_llama_session_zone_t *zone,
    ngx_http_llama_session_evicted_t *e, ngx_log_t *log)
{
    u_char                         file[NGX_MAX_PATH];
    time_t                         since;
    ngx_file_info_t                fi;
    ngx_http_llama_session_fid_t   fid, bin, *json, *binp;

    /*
     * another owner's later use: its .json changed, or its .bin is another
     * owner's, renamed in within the grace period (before its .json is
     * written, or when that write failed)
     */

    json = NULL;
    binp = NULL;

    ngx_snprintf(file, sizeof(file), "%V/%*s.json%Z", &zone->store, e->len,
                 e->name);

    if (ngx_link_info(file, &fi) != NGX_FILE_ERROR && ngx_is_file(&fi)) {
        fid.uniq = ngx_file_uniq(&fi);
        fid.size = ngx_file_size(&fi);
        fid.mtime = ngx_file_mtime(&fi);
        json = &fid;
    }

    ngx_snprintf(file, sizeof(file), "%V/%*s.bin%Z", &zone->store, e->len,
                 e->name);

    if (ngx_link_info(file, &fi) != NGX_FILE_ERROR && ngx_is_file(&fi)) {
        bin.uniq = ngx_file_uniq(&fi);
        bin.size = ngx_file_size(&fi);
        bin.mtime = ngx_file_mtime(&fi);
        binp = &bin;
    }

    if (json == NULL && binp == NULL) {
        return 1;
    }

    since = ngx_time() - NGX_HTTP_LLAMA_SESSION_SHARED_GRACE;

    if (!ngx_http_llama_session_file_kept(zone, e, json, binp, since)) {
        return 1;
    }

    ngx_log_error(NGX_LOG_INFO, log, 0,
                  "llama_session: session \"%*s\" of the shared store is "
                  "not evicted: another owner used it since zone \"%V\" "
                  "did", e->len, e->name, &zone->name);

    return 0;
}


/*
 * shared=on: the session's .json as this zone leaves it, recorded: after
 * its save wrote it, or when the zone takes the session in ("touch": its
 * time set to now, which other owners' eviction sees).
 */

void
ngx_http_llama_session_store_used(ngx_http_llama_session_zone_t *zone,
    u_char *name, size_t len, ngx_uint_t touch, ngx_log_t *log)
{
    u_char                        file[NGX_MAX_PATH];
    ngx_fd_t                      fd;
    ngx_file_info_t               fi;
    struct timespec               ts[2];
    ngx_http_llama_session_fid_t  fid;

    ngx_snprintf(file, sizeof(file), "%V/%*s.json%Z", &zone->store, len,
                 name);

    /* opened as every store file: no link followed, no FIFO waited for */

    fd = ngx_http_llama_session_file_open(file,
                                          NGX_HTTP_LLAMA_SESSION_FILE_READ, 0,
                                          log);
    if (fd == NGX_INVALID_FILE) {
        return;
    }

    if (ngx_fd_info(fd, &fi) == NGX_FILE_ERROR) {
        goto done;
    }

    if (touch) {
        /* a time it does not have: a save in this second changed it too */

        ts[0].tv_sec = ngx_time();
        ts[0].tv_nsec = 0;
        ts[1].tv_sec = ngx_max(ngx_time(), ngx_file_mtime(&fi) + 1);
        ts[1].tv_nsec = 0;

        if (futimens(fd, ts) == -1) {
            /* another user's .json: other owners will not see this use */
            ngx_log_error(NGX_LOG_INFO, log, ngx_errno,
                          "futimens() \"%s\" failed", file);

        } else if (ngx_fd_info(fd, &fi) == NGX_FILE_ERROR) {
            goto done;
        }
    }

    fid.uniq = ngx_file_uniq(&fi);
    fid.size = ngx_file_size(&fi);
    fid.mtime = ngx_file_mtime(&fi);

    ngx_http_llama_session_file_meta(zone, name, len, &fid);

done:

    (void) ngx_close_file(fd);
}


/*
 * Room on the store's disk for a save (min_free, as proxy_cache_path's):
 * before it, the file it will write (the slot's tokens times the bytes per
 * token of the zone's earlier saves) and min_free (none by default, as
 * proxy_cache_path's) must fit in the file system's free space, else the
 * least recently
 * used files of this zone go (never a session in a slot, nor "keep": the
 * session saved, whose previous file stays until the new one is whole).
 * Files of other zones or programs in the folder are never touched.
 * failed: the save failed (llama-server's 500), the free space its look
 * found after it (store_room_after()).  NGX_OK: files go, a save may be tried
 * (again).
 */

ngx_int_t
ngx_http_llama_session_store_room(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len,
    ngx_uint_t failed)
{
    off_t                              avail, file, min, need, freed;
    u_char                             path[NGX_MAX_PATH];
    ngx_uint_t                         i, n, bpt, level;
    ngx_http_llama_session_zone_t     *zone;
    ngx_http_llama_session_evicted_t   out[NGX_HTTP_LLAMA_SESSION_EVICT_BATCH];

    zone = ctx->zone;

    if (zone->store.len == 0) {
        return NGX_DECLINED;
    }

    /* the file ahead: by the bytes per token, else the files' average */

    bpt = zone->sh->bytes_per_token;

    if (ctx->job->slot_tokens > 0 && bpt) {
        file = (off_t) ctx->job->slot_tokens * (off_t) bpt / 256;

    } else {
        file = zone->sh->files ? zone->sh->bytes / (off_t) zone->sh->files
                               : 0;
    }

    min = (zone->min_free >= 0) ? zone->min_free : 0;

    if (failed) {
        /* as the look after the failed save saw it (store_room_after()) */
        avail = ctx->job->room_avail;

    } else if (ngx_http_llama_session_disk_ok(ctx)) {
        /* as the look before the swap saw it, in a thread */
        avail = ctx->job->disk.avail;

    } else if (ngx_http_llama_session_io_threads(zone)) {
        /* as a look last saw it (an idle save): no file call here */
        avail = zone->avail ? zone->avail : NGX_MAX_OFF_T_VALUE;

    } else {
        ngx_snprintf(path, sizeof(path), "%V%Z", &zone->store);
        avail = ngx_fs_available(path);
    }

    if (avail == NGX_MAX_OFF_T_VALUE) {
        /* statvfs() failed: nothing is known */
        return NGX_DECLINED;
    }

    if (!failed) {
        if (avail >= file + min) {
            return NGX_DECLINED;
        }

        need = file + min - avail;

    } else {
        /*
         * a failed save: the disk was full if the file and min_free did
         * not fit, or barely (the file was larger than its estimate)
         */

        if (file == 0 || avail >= 2 * file + min) {
            return NGX_DECLINED;
        }

        need = ngx_max(file + min - avail, file);
    }

    n = ngx_http_llama_session_evict_pick(zone, key, len, need, out,
                                          NGX_HTTP_LLAMA_SESSION_EVICT_BATCH);
    freed = 0;

    for (i = 0; i < n; i++) {
        ngx_http_llama_session_store_evict_file(zone, &out[i],
                                            NGX_HTTP_LLAMA_SESSION_EVICT_DISK,
                                            log);
        freed += out[i].bytes;
    }

    level = failed ? NGX_LOG_ERR : NGX_LOG_WARN;

    ngx_log_error(level, log, 0,
                  "llama_session: the disk of \"%V\" is %s: %O bytes free, "
                  "the save of \"%*s\" needs about %O and min_free=%O; "
                  "%ui least recently used files of zone \"%V\" go "
                  "(%O bytes)%s",
                  &zone->store, failed ? "full" : "nearly full", avail,
                  len, key, file, min, n, &zone->name, freed,
                  n ? "" : ", nothing more of this zone to delete: "
                      "free space there, or lower max_size/max_files");

    return n ? NGX_OK : NGX_DECLINED;
}


/*
 * A save that llama-server failed (5xx), maybe on a full disk: its partial
 * temporary file goes and the free space is looked at, in a thread (the
 * waiter's wake, within store_timeout=), then room is made (store_room()).
 * Once per save.  NGX_AGAIN: the look is on its way, back here after it;
 * NGX_OK: room was made, the save may be sent once more; NGX_DECLINED:
 * the failure stands.
 */

typedef struct {
    u_char                          store[NGX_MAX_PATH];
    u_char                          tmp[NGX_MAX_PATH];
    off_t                           avail;
} ngx_http_llama_session_room_t;


ngx_int_t
ngx_http_llama_session_store_room_after(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len,
    ngx_event_t *wake)
{
    u_char                          name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                          n;
    ngx_int_t                       rc;
    ngx_http_llama_session_io_t    *io;
    ngx_http_llama_session_zone_t  *zone;
    ngx_http_llama_session_room_t  *room;

    zone = ctx->zone;

    if (ctx->job->room == 0) {

        if (zone->store.len == 0
            || ctx->job->call_status < NGX_HTTP_INTERNAL_SERVER_ERROR
            || ctx->request->connection->error)
        {
            return NGX_DECLINED;
        }

        ctx->job->room = 2;

        io = ngx_http_llama_session_io_create(zone, log,
                                     sizeof(ngx_http_llama_session_room_t));
        if (io == NULL) {
            return NGX_DECLINED;
        }

        room = io->data;
        n = ngx_http_llama_session_file_name(name, key, len, ctx->job->fp);

        ngx_snprintf(room->store, sizeof(room->store), "%V%Z", &zone->store);
        ngx_snprintf(room->tmp, sizeof(room->tmp), "%V/%*s.bin%V%Z",
                     &zone->store, n, name, &zone->tmp);

        io->work = ngx_http_llama_session_store_room_work;

        rc = ngx_http_llama_session_io_post(io, wake);

        if (rc == NGX_ERROR) {
            ngx_http_llama_session_io_free(io);
            return NGX_DECLINED;
        }

        ctx->job->io = io;
        ctx->job->room = 1;

        if (rc == NGX_AGAIN) {
            return NGX_AGAIN;
        }
    }

    if (ctx->job->room != 1) {
        return NGX_DECLINED;
    }

    /* back from the look, or its bound passed */

    ctx->job->room = 2;

    io = ctx->job->io;
    ctx->job->io = NULL;

    if (!io->done) {
        ngx_http_llama_session_io_leave(io, log, "the failed save is not "
                                        "sent again");
        return NGX_DECLINED;
    }

    room = io->data;
    ctx->job->room_avail = room->avail;

    ngx_http_llama_session_io_free(io);

    return ngx_http_llama_session_store_room(log, ctx, key, len, 1);
}


/* in a thread */

static void
ngx_http_llama_session_store_room_work(ngx_http_llama_session_io_t *io)
{
    ngx_http_llama_session_room_t  *room;

    room = io->data;

    if (ngx_delete_file(room->tmp) == NGX_FILE_ERROR
        && ngx_errno != NGX_ENOENT)
    {
        ngx_log_error(NGX_LOG_WARN, &io->log, ngx_errno,
                      ngx_delete_file_n " \"%s\" failed", room->tmp);
    }

    room->avail = ngx_fs_available(room->store);
}


/*
 * Is there a file to restore?  The zone's record says; without one, the
 * store folder says; without a store folder, a restore is tried (a missing
 * file only costs a 400 and leaves the slot empty, as an erase would).
 */

ngx_uint_t
ngx_http_llama_session_store_has_file(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len)
{
    u_char                        *path;
    u_char                         name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t                         n;
    ngx_int_t                      rc;
    ngx_str_t                     *store;
    ngx_file_info_t                fi;
    ngx_http_llama_session_fid_t   fid;

    rc = ngx_http_llama_session_file_known(ctx->zone, ctx->job->fp, key, len);

    if (ctx->zone->shared && ctx->zone->store.len) {
        /*
         * another owner may have saved the session since, or deleted its
         * file: the folder says, and which file the slot takes it from
         * orders this owner's next save of it against theirs
         */

        if ((key == ctx->key || key == ctx->base_key)
            && ngx_http_llama_session_disk_ok(ctx))
        {
            /* as the look before the swap found it (store_look()) */
            rc = (key == ctx->key) ? ctx->job->disk.rc
                                   : ctx->job->disk.base_rc;
            fid = (key == ctx->key) ? ctx->job->disk.fid
                                    : ctx->job->disk.base_fid;

        } else {
            rc = ngx_http_llama_session_store_fid(ctx->zone, ctx->job->fp,
                                                  key, len, &fid,
                                                  r->connection->log);
        }

        ngx_http_llama_session_file_seen(ctx->zone, ctx->job->fp, key, len,
                                         (rc == NGX_ERROR) ? NULL : &fid);

        if (rc == NGX_OK) {
            /* in use here from now: no other owner's eviction takes it */
            n = ngx_http_llama_session_file_name(name, key, len,
                                                 ctx->job->fp);
            ngx_http_llama_session_store_touch(ctx->zone, name, n,
                                               r->connection->log);
        }

        return rc == NGX_OK;
    }

    if (rc != -1) {
        return rc;
    }

    /* not known to the zone: the folder says */

    store = &ctx->zone->store;

    if (store->len == 0) {
        return 1;
    }

    if (key == ctx->key && ngx_http_llama_session_disk_ok(ctx)) {
        return ctx->job->disk.rc == NGX_OK;
    }

    if (key == ctx->base_key && ngx_http_llama_session_disk_ok(ctx)) {
        return ctx->job->disk.base_rc == NGX_OK;
    }

    path = ngx_pnalloc(r->pool, store->len + len
                                + NGX_HTTP_LLAMA_SESSION_FP_LEN
                                + sizeof("/..bin"));
    if (path == NULL) {
        return 1;
    }

    ngx_sprintf(path, "%V/%*s.%*s.bin%Z", store, len, key,
                (size_t) NGX_HTTP_LLAMA_SESSION_FP_LEN, ctx->job->fp);

    /* a regular file: a link is never restored (nor committed) */

    return ngx_link_info(path, &fi) != NGX_FILE_ERROR && ngx_is_file(&fi);
}


/*
 * shared=on: which file the store holds for the session now.  NGX_OK: a
 * regular file, fid says which; NGX_DECLINED: none (nor a link, which is
 * never restored), fid zeroed; NGX_ERROR: the folder cannot be read (a
 * shared file system gone), logged.
 */

ngx_int_t
ngx_http_llama_session_store_fid(ngx_http_llama_session_zone_t *zone,
    u_char *fp, u_char *key, size_t len, ngx_http_llama_session_fid_t *fid,
    ngx_log_t *log)
{
    u_char           path[NGX_MAX_PATH];
    u_char           name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t           n;
    ngx_err_t        err;
    ngx_file_info_t  fi;

    ngx_memzero(fid, sizeof(ngx_http_llama_session_fid_t));

    n = ngx_http_llama_session_file_name(name, key, len, fp);

    ngx_snprintf(path, sizeof(path), "%V/%*s.bin%Z", &zone->store, n, name);

    if (ngx_link_info(path, &fi) == NGX_FILE_ERROR) {
        err = ngx_errno;

        if (err == NGX_ENOENT || err == NGX_ENOTDIR) {
            return NGX_DECLINED;
        }

        ngx_log_error(NGX_LOG_ERR, log, err,
                      ngx_link_info_n " \"%s\" failed: the store of zone "
                      "\"%V\" cannot be read, the session starts fresh",
                      path, &zone->name);
        return NGX_ERROR;
    }

    if (!ngx_is_file(&fi)) {
        return NGX_DECLINED;
    }

    fid->uniq = ngx_file_uniq(&fi);
    fid->size = ngx_file_size(&fi);
    fid->mtime = ngx_file_mtime(&fi);

    return NGX_OK;
}


/*
 * shared=on, a hit: has another owner saved a later turn of the session
 * since the slot took it in (the front sent the session elsewhere a
 * while)?  Then the file is restored instead.
 */

ngx_uint_t
ngx_http_llama_session_store_newer(ngx_http_request_t *r,
    ngx_http_llama_session_ctx_t *ctx)
{
    ngx_uint_t                       tokens;
    ngx_http_llama_session_fid_t     fid;
    ngx_http_llama_session_found_t   f;
    ngx_http_llama_session_disk_t   *disk;

    disk = &ctx->job->disk;

    if (!ctx->zone->shared || ctx->zone->store.len == 0
        || ctx->default_session
        || !ngx_http_llama_session_fingerprint(ctx->zone, ctx->job->fp)
        || ngx_http_llama_session_restores_off(ctx->zone, ctx->job->fp))
    {
        return 0;
    }

    if (ngx_http_llama_session_disk_ok(ctx)) {
        /* as the look before it found it (store_look()) */
        if (disk->rc != NGX_OK) {
            return 0;
        }

        fid = disk->fid;

    } else if (ngx_http_llama_session_store_fid(ctx->zone, ctx->job->fp,
                                                ctx->key, ctx->key_len, &fid,
                                                r->connection->log)
               != NGX_OK)
    {
        return 0;
    }

    if (!ngx_http_llama_session_file_newer(ctx->zone, ctx->job->fp,
                                           ctx->key, ctx->key_len, &fid))
    {
        return 0;
    }

    /*
     * another owner's file: newer when it holds more than the slot's last
     * prompt (a later turn; its own idle save of an older turn is not)
     */

    if (ngx_http_llama_session_disk_ok(ctx)) {
        ngx_memzero(&f, sizeof(ngx_http_llama_session_found_t));

        if (disk->meta) {
            ngx_http_llama_session_store_parse_meta(&f, (u_char *) "(.json)",
                                                    disk->meta,
                                                    disk->meta_len,
                                                    r->connection->log);
        }

        tokens = f.tokens;

    } else {
        tokens = ngx_http_llama_session_store_tokens(ctx->zone, ctx->job->fp,
                                                     ctx->key, ctx->key_len,
                                                     r->connection->log);
    }

    if (tokens <= ctx->prev_tokens) {
        return 0;
    }

    /* indexed as it is: what its restore would cost (cost.c) */
    ngx_http_llama_session_file_saved(ctx->zone, ctx->job, ctx->key,
                                      ctx->key_len, 0, 1, tokens, fid.size);

    return 1;
}


/*
 * The outgoing session's file is in place: record it, write its .json,
 * mark the slot clean if the session is still there, and keep the folder
 * within max_files and max_size (never evicting the session coming in).
 */

void
ngx_http_llama_session_store_saved(ngx_log_t *log,
    ngx_http_llama_session_ctx_t *ctx, u_char *key, size_t len,
    ngx_uint_t tokens, off_t bytes)
{
    u_char  name[NGX_HTTP_LLAMA_SESSION_NAME_MAX];
    size_t  n;

    ngx_http_llama_session_file_saved(ctx->zone, ctx->job, key, len,
                                      key == ctx->base_key, 1, tokens, bytes);
    ngx_http_llama_session_stat(&ctx->zone->sh->stats.saves);

    if (tokens) {
        /* the next save's size, ahead (store_room()) */
        ctx->zone->sh->bytes_per_token = (ngx_atomic_uint_t)
                                         (bytes * 256 / (off_t) tokens + 1);
    }

    if (ctx->zone->store.len) {
        n = ngx_http_llama_session_file_name(name, key, len, ctx->job->fp);
        (void) ngx_http_llama_session_store_meta(log, ctx->zone, name, n,
                                                 ctx->job->slot);
    }

    ngx_http_llama_session_slot_saved(ctx->zone, ctx->job, key, len);

    if (key != ctx->job->out_key) {
        /* a base: it goes before the session that starts from it */
        ngx_http_llama_session_store_evict(log, ctx->zone, key, len);

    } else if (ctx->key_len) {
        ngx_http_llama_session_store_evict(log, ctx->zone, ctx->key, ctx->key_len);

    } else {
        ngx_http_llama_session_store_evict(log, ctx->zone, ctx->job->out_key,
                                     ctx->job->out_len);
    }
}
