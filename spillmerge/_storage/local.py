"""Storage on a local disk: POSIX calls, regular files only, never following a link inside the
root (checked before and after each open); writes go to a temporary name and are renamed."""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import posixpath
import shutil
import stat
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
from zarr.storage import LocalStore

from .._errors import UnsafePathError
from .._format.common import ARRAY_DOC_MAX_BYTES, ROOT_DOC_MAX_BYTES
from .base import Storage


class LocalStorage(Storage):
    """A folder on a local disk (a plain path or a ``file://`` URL)."""

    local: ClassVar[bool] = True

    @staticmethod
    def _resolve_root(root: str) -> str:
        # One spelling per folder: `..`, `.`, `//`, relative paths and symlinks resolved, so two
        # spellings of one folder compare equal (an output "inside" a spill root is refused
        # however it is written) and `tmp/../x` never creates `tmp` on the way.
        return os.path.realpath(root)

    def _setup(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._maps: OrderedDict[str, Any] = OrderedDict()
        self._fd_lock = threading.Lock()
        # Folders below the root already seen to be real folders (not links): a path below them
        # costs no lstat of its ancestors again (see _refuse_links_in).
        self._real_dirs: set[str] = set()
        # Objects this handle wrote and fsynced (``put(fsync=True)``): ``sync`` and ``fsync_tree``
        # fsync only the rest and the folders, not each chunk a second time.
        self._synced: set[str] = set()

    # ---------------------------------------------------------------------------------- reads
    def _read_bounded(self, rel: str, max_bytes: int) -> bytes:
        fd = self._open_regular(rel)
        try:
            with self.storage_errors("read", rel):
                self._refuse_size(rel, os.fstat(fd).st_size, max_bytes)
                chunks, got = [], 0
                while got <= max_bytes:
                    piece = os.read(fd, min(max_bytes + 1 - got, 16 << 20))
                    if not piece:
                        break
                    chunks.append(piece)
                    got += len(piece)
        finally:
            os.close(fd)
        return b"".join(chunks)

    def _refuse_links_in(self, rel: str, *, itself: bool, acting: bool = False) -> None:
        """Refuse ``rel`` when a folder between the root and it — or, with ``itself``, ``rel``
        itself — is a symbolic link: it could lead outside the root (docs/GUARANTEES.md, *Threat
        model*). Reads remember the folders found real, so reading thousands of chunks of one
        folder costs one lstat of it; a write or removal (``acting``) checks every folder again."""
        if rel in ("", "."):
            return
        parts = rel.split("/")
        for depth in range(1, len(parts) + (1 if itself else 0)):
            above = "/".join(parts[:depth])
            if above in self._real_dirs and not acting:
                continue
            try:
                with self.storage_errors("check", above, passthrough=(FileNotFoundError, NotADirectoryError)):
                    mode = os.lstat(self.path(above)).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return  # nothing below exists: the caller's open or listing says so
            if stat.S_ISLNK(mode) and acting:
                raise UnsafePathError(
                    f"{self.describe(above)} is a symbolic link; spillmerge does not write or delete through links "
                    f"(it would act outside {self.describe()}): remove the link",
                    path=self.describe(above),
                )
            if stat.S_ISLNK(mode):
                self._refuse_mode(above, mode)
            if stat.S_ISDIR(mode):
                self._real_dirs.add(above)

    def _check_regular(self, rel: str) -> int | None:
        """Refuse ``rel`` unless it is absent (None) or a regular file reached without a link;
        its size."""
        self._refuse_links_in(rel, itself=False)
        with self.storage_errors("check", rel, ignore=(FileNotFoundError, NotADirectoryError)):
            st = os.lstat(self.path(rel))
            self._refuse_mode(rel, st.st_mode)
            return st.st_size
        return None

    def _open_regular(self, rel: str) -> int:
        """A read-only descriptor of the regular file ``rel``. What ``rel`` is gets checked
        without following a link (lstat) before it is opened, so a FIFO, device or socket is never
        opened at all; the open itself neither follows a link (``O_NOFOLLOW``) nor blocks
        (``O_NONBLOCK``), and ``fstat`` checks again what was opened, so an object swapped after
        the lstat is refused too. ``FileNotFoundError`` when absent."""
        self._refuse_links_in(rel, itself=False)
        p = self.path(rel)
        with self.storage_errors("open", rel, passthrough=(FileNotFoundError,)):
            self._refuse_mode(rel, os.lstat(p).st_mode)
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    self._refuse_mode(rel, stat.S_IFLNK)
                if exc.errno == errno.ENXIO:
                    self._refuse_mode(rel, stat.S_IFSOCK)
                raise
            try:
                self._refuse_mode(rel, os.fstat(fd).st_mode)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _refuse_mode(self, rel: str, mode: int) -> None:
        if stat.S_ISREG(mode):
            return
        if stat.S_ISLNK(mode):
            raise UnsafePathError(
                f"{self.describe(rel)} is a symbolic link; spillmerge never follows links inside "
                f"{self.describe()} (it could read outside it): replace the link by the object itself",
                path=self.describe(rel),
            )
        kind = (
            "FIFO" if stat.S_ISFIFO(mode) else "folder" if stat.S_ISDIR(mode) else "socket" if stat.S_ISSOCK(mode)
            else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special file"
        )  # fmt: skip
        self._refuse_kind(rel, kind)

    def _before_listing(self, rel: str, path: str) -> None:
        self._refuse_links_in(rel, itself=True)

    def find(self, rel: str) -> list[tuple[str, int]]:
        """:meth:`Storage.find`, never following a link: a link, FIFO, device or socket below
        ``rel`` is refused by name (a sender would otherwise read through it)."""
        top = self.path(rel)
        self._refuse_links_in(rel, itself=True)
        base = self._below_root()
        out: list[tuple[str, int]] = []

        def fail(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError):
                raise exc

        with self.storage_errors("list", rel):
            for dirpath, dirs, files in os.walk(top, onerror=fail):  # followlinks=False
                for name in [*dirs, *files]:
                    child = os.path.join(dirpath, name)[len(base) :]
                    st = os.lstat(self.path(child))
                    if stat.S_ISDIR(st.st_mode):
                        continue
                    self._refuse_mode(child, st.st_mode)
                    out.append((child, st.st_size))
        return sorted(out)

    def read_into(self, pieces: Sequence[tuple[str, int, int]], out: memoryview) -> None:
        pos = 0
        for rel, start, stop in pieces:
            n = stop - start
            with self._fd_lock:
                fd = self._fd_unlocked(rel)
            got = os.preadv(fd, [out[pos : pos + n]], start)
            if got != n:
                raise self._truncated(rel, start, got, n)
            pos += n

    def view(self, rel: str, start: int, stop: int | None) -> Any:
        with self._fd_lock:
            mm = self._maps.get(rel)
            if mm is None:
                fd = self._fd_unlocked(rel)
                with self.storage_errors("map", rel):
                    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if os.fstat(fd).st_size else b""
                self._maps[rel] = mm
                while len(self._maps) > 16:  # bounds the mapped (resident, reclaimable) spill
                    # Dropping our reference (not closing): views still in use keep the mapping alive.
                    self._maps.popitem(last=False)
            else:
                self._maps.move_to_end(rel)
        if stop is None:
            stop = max(len(mm), start)
        if len(mm) < stop:
            raise self._truncated(rel, start, max(0, len(mm) - start), stop - start)
        # A numpy view: zero-copy, and accepted by the CRC-32C extension (memoryviews are not).
        return np.frombuffer(mm, dtype=np.uint8, count=stop - start, offset=start)

    def _fd_unlocked(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is not None:
            self._fds.move_to_end(rel)
            return fd
        with self.storage_errors("open", rel):  # absent here is damage: SpillStorageError
            fd = self._open_regular(rel)
        self._fds[rel] = fd
        while len(self._fds) > 128:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def close(self) -> None:
        with self._fd_lock:
            self._maps.clear()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # --------------------------------------------------------------------------------- writes
    def makedirs(self, rel: str) -> None:
        with self.storage_errors("create", rel):
            os.makedirs(self.path(rel), exist_ok=True)

    def put(self, rel: str, data: bytes | memoryview | Sequence[bytes | memoryview], *, fsync: bool = False) -> None:
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        p = self.path(rel)
        with self.storage_errors("write", rel):
            _write_file(p, parts, os.O_TRUNC, fsync=fsync)
        if fsync:
            self._synced.add(rel)

    def open_write(self, rel: str, *, durable: bool = False) -> _LocalSink:
        return _LocalSink(self, rel, durable)

    def fsync_tree(self) -> None:
        # An fsync of each of our files and folders, never syncfs(2): that flushes every dirty
        # page of the whole filesystem, other jobs' too, and each commit would wait for them.
        top, base = self.path(""), self._below_root()
        files = [
            os.path.join(dirpath, n)[len(base) :] for dirpath, _dirs, names in os.walk(top) for n in names
        ]  # fmt: skip
        # another process's temporary file (a part writing beside us) may be renamed away between
        # the walk and its fsync: a file gone by then is not ours to flush
        self.sync(files, missing_ok=True)

    def sync(self, rels: Sequence[str], *, up: bool = True, missing_ok: bool = False) -> None:
        paths = {self.path(r) for r in rels if r not in self._synced}
        paths.update(self._folders(rels, up))
        if not paths:
            return
        with self.storage_errors("sync", rels[0]):
            fsync = functools.partial(_fsync_path, missing_ok=missing_ok)
            if len(paths) == 1:  # no thread hand-off for one (a loaded machine schedules the pool late)
                fsync(paths.pop())
            else:
                list(_fsync_pool().map(fsync, sorted(paths)))
        self._synced.update(rels)

    def _folders(self, rels: Sequence[str], up: bool) -> set[str]:
        """The folder holding each of ``rels`` and, with ``up``, every folder above it up to and
        including the root: each must be fsynced for the entries naming them to survive a power
        loss."""
        out: set[str] = set()
        for rel in rels:
            d = posixpath.dirname(rel)
            while (p := self.path(d)) not in out:
                out.add(p)
                if not d or not up:
                    break
                d = posixpath.dirname(d)
        return out

    def put_atomic(self, rel: str, data: bytes) -> None:
        with self.open_write(rel, durable=True) as sink:
            sink.write(data)

    def is_link(self, rel: str) -> bool:
        with self.storage_errors("check", rel, ignore=(FileNotFoundError,)):
            return stat.S_ISLNK(os.lstat(self.path(rel)).st_mode)
        return False

    def rm_tree(self, rel: str = "") -> None:
        p = self.path(rel)
        self._refuse_links_in(rel, itself=False, acting=True)
        with self.storage_errors("remove", rel, ignore=(FileNotFoundError,)):
            if stat.S_ISDIR(os.lstat(p).st_mode):
                # fd-based on Linux: unlinks links inside, never follows them; what another
                # process removes meanwhile is fine, the rest of the tree still goes.
                shutil.rmtree(p, **_RMTREE_HANDLER)
            else:
                os.unlink(p)

    def remove_empty_dir(self, rel: str) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(self.path(rel))

    def create(self, rel: str, data: bytes) -> bool:
        p = self.path(rel)
        with self.storage_errors("create", rel, ignore=(FileExistsError,)):
            _write_file(p, [data], os.O_EXCL | os.O_NOFOLLOW, fsync=True)
            return True
        return False

    # ----------------------------------------------------------------------------------- zarr
    def zarr_store(self) -> Any:
        storage = self

        class RegularFilesOnly(LocalStore):
            """zarr's LocalStore, refusing (by name) to read a link, FIFO, device or folder,
            and any object below a linked folder: zarr would follow or block on them."""

            async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
                storage._check_zarr_get(key)
                return await super().get(key, prototype, byte_range)

            async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
                key_ranges = list(key_ranges)
                for key, _ in key_ranges:
                    storage._check_regular(key)
                return await super().get_partial_values(prototype, key_ranges)

        return RegularFilesOnly(self.root, read_only=True)

    def _check_zarr_get(self, where: str) -> None:
        """What :meth:`zarr_store` checks before zarr reads ``where`` whole: a regular file reached
        without a link (or absent), and a ``zarr.json`` no larger than its limit."""
        size = self._check_regular(where)
        if size is not None and where.endswith("zarr.json"):  # read whole by zarr
            limit = ROOT_DOC_MAX_BYTES if where == "zarr.json" else ARRAY_DOC_MAX_BYTES
            self._refuse_size(where, size, limit)


class _LocalSink:
    """See :meth:`Storage.open_write`: the one way an object appears whole under its name on a
    local disk — written under a temporary name, renamed when whole."""

    def __init__(self, storage: LocalStorage, rel: str, durable: bool) -> None:
        self.storage, self.rel, self.durable = storage, rel, durable
        self.path = storage.path(rel)
        self._fd: int | None = None
        # `.tmp-` for records written whole (put_atomic), `.part-` for streamed objects.
        self._tmp = f"{self.path}.{'tmp' if durable else 'part'}-{os.getpid()}-{threading.get_ident()}"

    def __enter__(self) -> _LocalSink:
        with self.storage.storage_errors("write", self.rel):
            # A received object must land below the root, never through a linked folder.
            self.storage._refuse_links_in(self.rel, itself=False, acting=True)
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        return self

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        assert self._fd is not None
        with self.storage.storage_errors("write", self.rel):
            _write_all(self._fd, data)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._fd is None:
            return
        ok = exc_type is None
        try:
            with self.storage.storage_errors("write", self.rel):
                try:
                    if ok and self.durable:
                        os.fsync(self._fd)
                finally:
                    os.close(self._fd)
                if ok:
                    os.replace(self._tmp, self.path)
                    if self.durable:
                        _fsync_path(os.path.dirname(self.path))
        except BaseException:
            if ok:  # the caller's error is the one raised; a failed close adds nothing to it
                raise
        finally:  # a temporary left by a failure (renamed away on success: nothing to remove)
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)


def _write_file(path: str, parts: Sequence[bytes | memoryview], flags: int, *, fsync: bool) -> None:
    """Create or open ``path`` for writing (``flags`` added), write ``parts`` back to back, with
    ``fsync`` make them durable, close it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        for part in parts:
            _write_all(fd, part)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
    """``os.write`` until every byte of ``data`` is written (a write may be short)."""
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    while view:
        view = view[os.write(fd, view) :]


FSYNC_THREADS = 8
"""fsyncs in flight at once: a disk's queue takes many, and each waits mostly on the device."""


@functools.cache
def _fsync_pool() -> ThreadPoolExecutor:
    """This process's fsync threads, started once and shared by every ``sync``; forgotten in a
    forked child, where the parent's threads do not exist (a sync would wait on them forever)."""
    return ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="spillmerge-fsync")


os.register_at_fork(after_in_child=_fsync_pool.cache_clear)


def _fsync_path(path: str, *, missing_ok: bool = False) -> None:
    """fsync a file or a folder by path. Anything else is skipped unopened or unsynced: a link
    (``O_NOFOLLOW``), a FIFO (opened without blocking; a blocking open waits for a writer
    forever), a device or socket planted in a tree we sync is not ours to flush; with
    ``missing_ok``, so is a path gone since it was listed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO) or (missing_ok and exc.errno == errno.ENOENT):
            return
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            os.fsync(fd)
    finally:
        os.close(fd)


def _gone_is_fine(func: Any, path: str, exc: Any) -> None:
    """``shutil.rmtree`` error handler: an entry already removed is not an error."""
    err = exc[1] if isinstance(exc, tuple) else exc  # onerror passes exc_info, onexc the exception
    if not isinstance(err, FileNotFoundError):
        raise err


_RMTREE_HANDLER: dict[str, Any] = {"onexc" if sys.version_info >= (3, 12) else "onerror": _gone_is_fine}
