#!/usr/bin/python3
#
# hangfs.py: a FUSE pass-through file system that hangs one user's calls.
#
# For the t/*.t tests of a slot store that stops answering.  The store is
# mounted through this file system; nginx's workers, running as an
# unprivileged user, wait on it for as long as the CONTROL file exists,
# while llama-server's own reads and writes (another uid, e.g. root) go on
# at once.  It plays a hard-mounted NFS store whose server stopped
# answering, for one user's processes only.
#
# With --rate=BYTES (bytes a second) it also plays a store at the end of
# a link of that bandwidth, for every user: the reads and writes of files
# named *.bin (llama-server's slot files) share it, one at a time, as
# bench/bench.py's balance part does with BENCH_STORE_RATE.
#
# Usage (as root):
#
#     /usr/bin/python3 t/hangfs.py [--rate=BYTES] ROOT MOUNTPOINT CONTROL UID
#                                  [LOG]
#
#     ROOT        folder to mirror (the real store)
#     MOUNTPOINT  empty folder to mount it on
#     CONTROL     a path OUTSIDE the mount; while it exists, every call made
#                 by a process of uid UID waits (polled every 20 ms); if it
#                 holds lines "OP PATTERN" (e.g. "write /.turn.*.tmp"), only
#                 the calls of that op (* for any) on a path that matches
#                 the shell pattern (the path in the mount, from its /)
#     UID         numeric uid or user name whose calls are held
#     LOG         optional file; one line is appended per delayed call:
#                 "<time> <op> <path> waited <ms>"
#
# It runs in the foreground, multithreaded, with allow_other (so that
# other users can use a mount made by root) and without
# default_permissions.  It prints "hangfs: mounted MOUNTPOINT" to stderr
# once the kernel has connected, so a test can wait for that line (or for
# `mountpoint -q MOUNTPOINT`).  The attribute and entry caches are off
# (timeouts 0), so every stat and lookup reaches this process and can be
# held.
#
# Stopping, from a test:
#
#     fusermount -u -z MOUNTPOINT     (or: umount -l MOUNTPOINT)
#     kill PID                        (SIGTERM or SIGINT; SIGKILL also works)
#     waitpid PID
#
# With nothing held, the lazy unmount alone makes FUSE() return and the
# process exit (so the kill may find it gone already); a plain
# `fusermount -u` fails with EBUSY while a process is held in the mount,
# the lazy one always works.  On SIGTERM or SIGINT libfuse leaves its
# loop, the calls being held give up with EIO, and the process unmounts
# (lazily) and exits within about 0.1 s, CONTROL or not.  Calls not yet
# answered then fail with ECONNABORTED.  After a SIGKILL the same, but a
# mount not yet unmounted stays behind ("Transport endpoint is not
# connected") until `umount -l MOUNTPOINT`.
#
# Things a test should know:
#
# - A held process sleeps in the kernel (request_wait_answer) and, once
#   signalled, uninterruptibly (state D): `timeout`, SIGTERM and even
#   SIGKILL do not free it until CONTROL is removed (or this process
#   stops), as on a hard NFS mount.  `timeout 2 cat` returns 124 only
#   when CONTROL goes.
# - Other uids are never delayed here, but the kernel's own locks still
#   apply.  A held create, unlink, rename or mkdir (its lookup) holds the
#   parent folder's lock: anyone's listing of, or create in, that folder
#   waits too (stat, open and read of a file already there do not).  A
#   held write holds that file's pages: anyone's read, write or open of
#   the same file waits too.  Held reads, stats and plain opens hold
#   nothing.
# - This process runs as root and checks no permissions: any user may
#   read and write any file through the mount.  Files, folders, symlinks
#   and nodes made through the mount are chowned to the caller's uid and
#   gid.
# - libfuse 2 drops a utimensat() that sets only one of the two times
#   (touch -a, touch -m); setting both (futimens with two times, plain
#   touch) works.
# - An open file that is unlinked is renamed to .fuse_hiddenNNN in ROOT
#   until it is closed (libfuse 2 behaviour; the rename is asynchronous).
#
# Needs only Debian's python3-fusepy (module "fusepy"; "fuse" elsewhere).

import ctypes
import errno
import fnmatch
import os
import pwd
import sys
import threading
import time

try:
    import fusepy as fuse
except ImportError:
    import fuse


POLL = 0.020

# utimensat()'s special tv_nsec values, should a libfuse pass them on
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2

# ops that are never held: mount and unmount housekeeping
FREE_OPS = ('init', 'destroy')

# libfuse's own exit flag, set by its SIGTERM/SIGINT/SIGHUP handler: held
# calls give up when it is set, or libfuse would wait for them forever
_libfuse = getattr(fuse, '_libfuse', None)
if _libfuse is not None and hasattr(_libfuse, 'fuse_exited'):
    _libfuse.fuse_exited.argtypes = [ctypes.c_void_p]
    _libfuse.fuse_exited.restype = ctypes.c_int
else:
    _libfuse = None


def fuse_exited():
    if _libfuse is None:
        return False
    f = _libfuse.fuse_get_context().contents.fuse
    return _libfuse.fuse_exited(f) != 0


class HangFS(fuse.Operations):

    use_ns = True

    # not offered: the kernel then stops asking (ENOSYS)
    getxattr = None
    setxattr = None
    listxattr = None
    removexattr = None
    ioctl = None

    def __init__(self, root, mountpoint, control, uid, log=None, rate=0):
        self.rate = rate
        self.link = 0.0     # when the link is free again (time.monotonic)
        self.link_lock = threading.Lock()
        self.root = os.path.realpath(root)
        self.mountpoint = mountpoint
        self.control = control
        self.uid = uid
        self.log = None
        self.log_lock = threading.Lock()
        if log is not None:
            self.log = open(log, 'a', buffering=1)

    def __call__(self, op, *args):
        if op not in FREE_OPS:
            self._hold(op, args)
        try:
            return getattr(self, op)(*args)
        except fuse.FuseOSError:
            raise
        except OSError as e:
            raise fuse.FuseOSError(e.errno or errno.EIO)

    def _held(self, op, args):
        try:
            with open(self.control) as f:
                rules = [line.split() for line in f if line.strip()]
        except OSError:
            return False
        path = args[0] if args and isinstance(args[0], str) else ''
        return not rules or any(len(r) == 2 and r[0] in (op, '*')
                                and fnmatch.fnmatchcase(path, r[1])
                                for r in rules)

    def _hold(self, op, args):
        uid, gid, pid = fuse.fuse_get_context()
        if uid != self.uid or not self._held(op, args):
            return
        start = time.monotonic()
        stopped = False
        while os.path.exists(self.control):
            if fuse_exited():
                stopped = True
                break
            time.sleep(POLL)
        if self.log is not None:
            ms = int((time.monotonic() - start) * 1000)
            path = args[0] if args and isinstance(args[0], str) else '-'
            with self.log_lock:
                if self.log is not None:
                    self.log.write('%.3f %s %s waited %d\n'
                                   % (time.time(), op, path, ms))
        if stopped:
            raise fuse.FuseOSError(errno.EIO)

    def _full(self, path):
        return self.root + path

    def _give(self, path, follow=True):
        uid, gid, pid = fuse.fuse_get_context()
        if follow:
            os.chown(path, uid, gid)
        else:
            os.lchown(path, uid, gid)

    # --- housekeeping ---------------------------------------------------

    def init(self, path):
        sys.stderr.write('hangfs: mounted %s\n' % self.mountpoint)
        sys.stderr.flush()

    def destroy(self, path):
        with self.log_lock:
            if self.log is not None:
                self.log.close()
                self.log = None

    # --- attributes -----------------------------------------------------

    def getattr(self, path, fh=None):
        if fh is not None:
            st = os.fstat(fh)
        else:
            st = os.lstat(self._full(path))
        return {
            'st_mode': st.st_mode,
            'st_ino': st.st_ino,
            'st_nlink': st.st_nlink,
            'st_uid': st.st_uid,
            'st_gid': st.st_gid,
            'st_rdev': st.st_rdev,
            'st_size': st.st_size,
            'st_blksize': st.st_blksize,
            'st_blocks': st.st_blocks,
            'st_atime': st.st_atime_ns,
            'st_mtime': st.st_mtime_ns,
            'st_ctime': st.st_ctime_ns,
        }

    def access(self, path, amode):
        if not os.access(self._full(path), amode):
            raise fuse.FuseOSError(errno.EACCES)

    def chmod(self, path, mode):
        os.chmod(self._full(path), mode)

    def chown(self, path, uid, gid):
        os.lchown(self._full(path), uid, gid)

    def utimens(self, path, times=None):
        full = self._full(path)
        if times is None:
            os.utime(full)
            return
        now = None
        st = None
        ns = []
        for i, t in enumerate(times):
            if t == UTIME_NOW:
                if now is None:
                    now = time.time_ns()
                t = now
            elif t == UTIME_OMIT:
                if st is None:
                    st = os.stat(full)
                t = st.st_atime_ns if i == 0 else st.st_mtime_ns
            ns.append(t)
        os.utime(full, ns=tuple(ns))

    def statfs(self, path):
        sv = os.statvfs(self._full(path))
        return {k: getattr(sv, k) for k in (
            'f_bsize', 'f_frsize', 'f_blocks', 'f_bfree', 'f_bavail',
            'f_files', 'f_ffree', 'f_favail', 'f_flag', 'f_namemax')}

    # --- folders and names ----------------------------------------------

    def readdir(self, path, fh):
        return ['.', '..'] + os.listdir(self._full(path))

    def mkdir(self, path, mode):
        full = self._full(path)
        os.mkdir(full, mode)
        self._give(full)

    def rmdir(self, path):
        os.rmdir(self._full(path))

    def mknod(self, path, mode, dev):
        full = self._full(path)
        os.mknod(full, mode, dev)
        self._give(full)

    def unlink(self, path):
        os.unlink(self._full(path))

    def rename(self, old, new):
        os.rename(self._full(old), self._full(new))

    def link(self, target, source):
        # ln source target
        os.link(self._full(source), self._full(target))

    def symlink(self, target, source):
        # ln -s source target: source is the link's text, kept as is
        full = self._full(target)
        os.symlink(source, full)
        self._give(full, follow=False)

    def readlink(self, path):
        return os.readlink(self._full(path))

    # --- files ----------------------------------------------------------

    def open(self, path, flags):
        return os.open(self._full(path), flags & ~os.O_DIRECT)

    def create(self, path, mode, fi=None):
        # fusepy does not pass the open flags here: open read-write, so
        # that both reads and writes through the handle work
        full = self._full(path)
        fd = os.open(full, os.O_RDWR | os.O_CREAT, mode)
        try:
            self._give(full)
        except OSError:
            os.close(fd)
            raise
        return fd

    def _carry(self, path, n):
        # n bytes over the link: after what it carries already
        if not self.rate or not path.endswith('.bin'):
            return
        with self.link_lock:
            now = time.monotonic()
            self.link = max(self.link, now) + float(n) / self.rate
            until = self.link
        time.sleep(max(0.0, until - now))

    def read(self, path, size, offset, fh):
        data = os.pread(fh, size, offset)
        self._carry(path, len(data))
        return data

    def write(self, path, data, offset, fh):
        self._carry(path, len(data))
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._full(path), length)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)

    def release(self, path, fh):
        os.close(fh)


def main(argv):
    rate = 0
    if len(argv) > 1 and argv[1].startswith('--rate='):
        rate = int(argv.pop(1)[len('--rate='):])
    if len(argv) not in (5, 6):
        sys.stderr.write('usage: %s [--rate=BYTES] ROOT MOUNTPOINT CONTROL '
                         'UID [LOG]\n' % argv[0])
        return 2
    root, mountpoint, control, uid = argv[1:5]
    log = argv[5] if len(argv) == 6 else None
    try:
        uid = int(uid)
    except ValueError:
        uid = pwd.getpwnam(uid).pw_uid

    ops = HangFS(root, mountpoint, control, uid, log, rate)
    fuse.FUSE(ops, mountpoint, foreground=True, nothreads=False,
              allow_other=True, fsname='hangfs', subtype='hangfs',
              use_ino=True, big_writes=True, attr_timeout=0,
              entry_timeout=0, negative_timeout=0)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
