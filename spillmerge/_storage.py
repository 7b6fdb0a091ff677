"""The few storage primitives spillmerge needs, on top of fsspec.

Every path handed to a method is relative to the storage root and is checked to stay inside it,
so a name read from an untrusted spill root can never reach outside.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import posixpath
import shutil
import stat
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ._errors import (
    CorruptSpillError,
    MissingDependencyError,
    SpillMergeError,
    SpillStorageError,
    TruncatedObjectError,
    UnsafePathError,
)
from ._format import ARRAY_DOC_MAX_BYTES, RECORD_MAX_BYTES, ROOT_DOC_MAX_BYTES

# protocol -> (package, spillmerge extra that installs it)
_BACKENDS = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"),
}  # fmt: skip


# Transient S3 failures (5xx, throttling, resets, timeouts) are retried by botocore itself with
# exponential backoff; spillmerge adds no retry loop of its own. Users override via storage_options.
_S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"retries": {"max_attempts": 10, "mode": "standard"}, "connect_timeout": 10, "read_timeout": 60}
}


def _with_defaults(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    opts = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        config = dict(_S3_DEFAULTS["config_kwargs"])
        config.update(opts.get("config_kwargs", {}))
        opts["config_kwargs"] = config
    return opts


def _syncfs(path: str) -> bool:
    """Flush the whole filesystem holding ``path`` with one syncfs(2) call (Linux): one journal
    commit and one device flush, where an fsync per object costs one each (~100 objects per
    merge, 20-30 ms apiece on the virtual disks we measured). False when unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return bool(libc.syncfs(fd) == 0)
    except AttributeError:
        return False
    finally:
        os.close(fd)


def _why(exc: BaseException) -> str:
    """The cause of a storage error in a few words (``No space left on device`` ...)."""
    if isinstance(exc, OSError) and exc.strerror:
        return str(exc.strerror)
    return f"{type(exc).__name__}: {exc}"


def _normalize_key(root: str) -> str:
    """``a/./b//c/../d`` -> ``a/b/d`` for an object-store root, leaving a protocol prefix that a
    backend keeps in its paths (``proto://``) as it is."""
    if root in ("/", ""):
        return root
    proto, sep, rest = root.partition("://")
    if not sep:
        return posixpath.normpath(root)
    return f"{proto}://{posixpath.normpath(rest)}" if rest else root


def _url_to_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    try:
        return fsspec.core.url_to_fs(url, **_with_defaults(url, storage_options))
    except ImportError as exc:
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol in _BACKENDS:
            package, extra = _BACKENDS[protocol]
            raise MissingDependencyError(package, extra, f"{protocol}:// paths ({url})") from None
        raise SpillStorageError(f"no fsspec backend for {protocol}:// paths ({exc})", path=url) from None
    except ValueError as exc:
        raise SpillStorageError(f"cannot open {url!r}: {exc}", path=url) from None


class Storage:
    """A root directory (local path or fsspec URL) and relative-path operations below it."""

    def __init__(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        self.url = os.fspath(url)
        self.storage_options = dict(storage_options or {})
        self.fs, root = _url_to_fs(self.url, self.storage_options)
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            # One spelling per folder: `..`, `.`, `//`, relative paths and symlinks resolved, so two
            # spellings of one folder compare equal (an output "inside" a spill root is refused
            # however it is written) and `tmp/../x` never creates `tmp` on the way.
            root = os.path.realpath(root)
        else:
            # Object stores have no links; `..`, `.` and `//` are resolved the way fsspec users mean them.
            root = _normalize_key(root)
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._maps: OrderedDict[str, Any] = OrderedDict()
        self._fd_lock = threading.Lock()
        # Folders below the root already seen to be real folders (not links): a path below them
        # costs no lstat of its ancestors again (see _refuse_links_in).
        self._real_dirs: set[str] = set()

    # ---------------------------------------------------------------------------------- paths
    def path(self, rel: str = "") -> str:
        """Absolute (backend) path of ``rel``, refusing anything that leaves the root."""
        if rel in ("", "."):
            return self.root
        if rel.startswith("/") or "\\" in rel or "\x00" in rel:
            raise UnsafePathError(f"path {rel!r} is not a relative path below {self.url}", path=rel)
        norm = posixpath.normpath(rel)
        if norm == ".." or norm.startswith("../") or norm != rel.rstrip("/"):
            raise UnsafePathError(f"path {rel!r} escapes or is not normalised below {self.url}", path=rel)
        return f"{self.root}/{norm}" if self.root not in ("", "/") else f"{self.root}{norm}"

    def describe(self, rel: str = "") -> str:
        """A user-facing name of ``rel`` (the URL the user gave, joined)."""
        return self.url.rstrip("/") + ("/" + rel if rel else "")

    @contextlib.contextmanager
    def storage_errors(
        self, verb: str, rel: str = "", *, passthrough: tuple[type[BaseException], ...] = ()
    ) -> Iterator[None]:
        """The one place backend errors become ``SpillStorageError("cannot VERB PATH: cause")``,
        also for callers that drive a backend through zarr (the merge's index). Our own errors and
        the ``passthrough`` types (a caller's ``FileNotFoundError``) pass."""
        try:
            yield
        except SpillMergeError:
            raise
        except passthrough:
            raise
        except Exception as exc:  # noqa: BLE001 - backends raise their own types (botocore, aiohttp)
            where = self.describe(rel)
            raise SpillStorageError(f"cannot {verb} {where}: {_why(exc)}", path=where) from exc

    # ---------------------------------------------------------------------------------- reads
    def exists(self, rel: str) -> bool:
        with self.storage_errors("check", rel):
            return bool(self.fs.exists(self.path(rel)))

    def get(self, rel: str, *, max_bytes: int = RECORD_MAX_BYTES) -> bytes:
        """Whole object ``rel``, at most ``max_bytes`` long (a small record unless the caller says
        otherwise); ``FileNotFoundError`` when absent.

        Storage is untrusted: the object must be a regular file (never a link, FIFO, device,
        socket or folder), its size is checked before it is read, and no more than
        ``max_bytes + 1`` bytes are ever read, so an object that lies about its size (a growing
        file, ``/dev/zero``) still cannot make us allocate more (docs/GUARANTEES.md, *Threat model*).
        """
        p = self.path(rel)
        if self.local:
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
            data = b"".join(chunks)
        else:
            with self.storage_errors("read", rel, passthrough=(FileNotFoundError,)):
                info = self.fs.info(p)
                self._refuse_kind(rel, info.get("type"))
                size = info.get("size")
                if size is not None:
                    self._refuse_size(rel, int(size), max_bytes)
                data = bytes(self.fs.cat_file(p, start=0, end=max_bytes + 1))
        self._refuse_size(rel, len(data), max_bytes)
        return data

    def get_or_none(self, rel: str, *, max_bytes: int = RECORD_MAX_BYTES) -> bytes | None:
        try:
            return self.get(rel, max_bytes=max_bytes)
        except FileNotFoundError:
            return None

    def _refuse_size(self, rel: str, size: int, max_bytes: int) -> None:
        if size > max_bytes:
            raise CorruptSpillError(
                f"{self.describe(rel)} is {'at least ' if size == max_bytes + 1 else ''}{size} bytes, more than "
                f"the {max_bytes} its format allows: not an object spillmerge wrote (docs/FORMAT.md, size limits)",
                path=self.describe(rel),
            )

    def _refuse_kind(self, rel: str, kind: object) -> None:
        if kind != "file":
            raise CorruptSpillError(
                f"{self.describe(rel)} is a {kind}, not a regular file: spillmerge reads regular files only",
                path=self.describe(rel),
            )

    def _refuse_links_in(self, rel: str, *, itself: bool) -> None:
        """Refuse ``rel`` (local disks) when a folder between the root and it — or, with
        ``itself``, ``rel`` itself — is a symbolic link. Reads never follow a link inside a root:
        it could lead outside it (docs/GUARANTEES.md, *Threat model*). Folders found real are
        remembered, so reading thousands of chunks of one folder costs one lstat of it."""
        if not self.local or rel in ("", "."):
            return
        parts = rel.split("/")
        for depth in range(1, len(parts) + (1 if itself else 0)):
            above = "/".join(parts[:depth])
            if above in self._real_dirs:
                continue
            try:
                with self.storage_errors("check", above, passthrough=(FileNotFoundError, NotADirectoryError)):
                    mode = os.lstat(self.path(above)).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return  # nothing below exists: the caller's open or listing says so
            if stat.S_ISLNK(mode):
                raise UnsafePathError(
                    f"{self.describe(above)} is a symbolic link; spillmerge never follows links inside "
                    f"{self.describe()} (it could read outside it): replace the link by the object itself",
                    path=self.describe(above),
                )
            if stat.S_ISDIR(mode):
                self._real_dirs.add(above)

    def _check_regular(self, rel: str) -> int | None:
        """Refuse ``rel`` unless it is absent (None) or a regular file reached without a link
        (local disks); its size."""
        self._refuse_links_in(rel, itself=False)
        try:
            with self.storage_errors("check", rel, passthrough=(FileNotFoundError, NotADirectoryError)):
                st = os.lstat(self.path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return None
        self._refuse_mode(rel, st.st_mode)
        return st.st_size

    def _open_regular(self, rel: str) -> int:
        """A read-only descriptor of the regular file ``rel`` (local disks). What ``rel`` is gets
        checked without following a link (lstat) before it is opened, so a FIFO, device or socket
        is never opened at all; the open itself neither follows a link (``O_NOFOLLOW``) nor blocks
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

    def listdir(self, rel: str = "") -> list[str]:
        """Names directly below ``rel`` (files and folders); empty when ``rel`` does not exist."""
        p = self.path(rel)
        self._refuse_links_in(rel, itself=True)
        if not self.local:
            # Object-store filesystems cache listings; a barrier polling for commit records must
            # see new objects.
            self.fs.invalidate_cache(p)
        try:
            with self.storage_errors("list", rel, passthrough=(FileNotFoundError, NotADirectoryError)):
                entries = self.fs.ls(p, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = []
        for e in entries:
            name = posixpath.basename(str(e).rstrip("/"))
            if name and name not in (".", ".."):
                names.append(name)
        return sorted(set(names))

    def find(self, rel: str) -> list[tuple[str, int]]:
        """Every file below ``rel`` as ``(relative path, size)``, sorted; empty when absent."""
        top = self.path(rel)
        if self.local:
            return self._find_local(rel)
        self.fs.invalidate_cache(top)
        try:
            with self.storage_errors("list", rel, passthrough=(FileNotFoundError,)):
                found = self.fs.find(top, detail=True)
        except FileNotFoundError:
            return []
        base = self.root.rstrip("/") + "/" if self.root not in ("", "/") else self.root
        out = []
        for path, info in found.items():
            path = str(path)
            if not path.startswith(base):
                continue
            child = path[len(base) :]
            self.path(child)  # a name that would escape the root is refused here
            out.append((child, int(info.get("size") or 0)))
        return sorted(out)

    def _find_local(self, rel: str) -> list[tuple[str, int]]:
        """:meth:`find` on a local disk, never following a link: a link, FIFO, device or socket
        below ``rel`` is refused by name (a sender would otherwise read through it)."""
        self._refuse_links_in(rel, itself=True)
        top = self.path(rel)
        base = self.root.rstrip("/") + "/" if self.root not in ("", "/") else self.root
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

    def open_write(self, rel: str, *, durable: bool = False) -> _Sink:
        """A file-like sink that streams one object into ``rel`` (multipart on object stores), so
        a large object never sits whole in memory. Use it as a context manager: the object exists
        under its name only once the block exits without an exception (locally: a temporary name,
        renamed; ``durable``: fsync of the file before and of its folder after the rename)."""
        return _Sink(self, rel, durable)

    def read_into(self, pieces: Sequence[tuple[str, int, int]], out: memoryview) -> None:
        """Read byte ranges ``(rel, start, stop)`` back to back into ``out``."""
        if self.local:
            pos = 0
            for rel, start, stop in pieces:
                n = stop - start
                fd = self._fd(rel)
                got = os.preadv(fd, [out[pos : pos + n]], start)
                if got != n:
                    raise TruncatedObjectError(
                        f"{self.describe(rel)}: short read at byte {start} ({got} of {n} bytes): "
                        "the object is truncated",
                        path=self.describe(rel),
                    )
                pos += n
            return
        paths = [self.path(rel) for rel, _, _ in pieces]
        with self.storage_errors("read from"):
            blobs = self.fs.cat_ranges(paths, [s for _, s, _ in pieces], [e for _, _, e in pieces], on_error="raise")
        pos = 0
        for (rel, start, stop), blob in zip(pieces, blobs, strict=True):
            n = stop - start
            if isinstance(blob, BaseException):
                raise SpillStorageError(f"cannot read {self.describe(rel)}: {blob}", path=self.describe(rel))
            if len(blob) != n:
                raise TruncatedObjectError(
                    f"{self.describe(rel)}: short read at byte {start} ({len(blob)} of {n} bytes): "
                    "the object is truncated",
                    path=self.describe(rel),
                )
            out[pos : pos + n] = blob
            pos += n

    def view(self, rel: str, start: int, stop: int | None) -> Any:
        """A read-only view of bytes ``[start, stop)`` (``stop`` None: to the end) of a local file,
        mapped from the page cache without copying (local storage only)."""
        with self._fd_lock:
            mm = self._maps.get(rel)
            if mm is None:
                fd = self._fd_unlocked(rel)
                try:
                    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if os.fstat(fd).st_size else b""
                except (OSError, ValueError) as exc:
                    raise SpillStorageError(f"cannot map {self.describe(rel)}: {exc}", path=self.describe(rel)) from exc
                self._maps[rel] = mm
                while len(self._maps) > 16:  # bounds the mapped (resident, reclaimable) spill
                    # Dropping our reference (not closing): views still in use keep the mapping alive.
                    self._maps.popitem(last=False)
            else:
                self._maps.move_to_end(rel)
        if stop is None:
            stop = max(len(mm), start)
        if len(mm) < stop:
            got = max(0, len(mm) - start)
            raise TruncatedObjectError(
                f"{self.describe(rel)}: short read at byte {start} ({got} of {stop - start} bytes): "
                "the object is truncated",
                path=self.describe(rel),
            )
        # A numpy view: zero-copy, and accepted by the CRC-32C extension (memoryviews are not).
        return np.frombuffer(mm, dtype=np.uint8, count=stop - start, offset=start)

    def _fd(self, rel: str) -> int:
        with self._fd_lock:
            return self._fd_unlocked(rel)

    def _fd_unlocked(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is not None:
            self._fds.move_to_end(rel)
            return fd
        try:
            fd = self._open_regular(rel)
        except FileNotFoundError as exc:
            where = self.describe(rel)
            raise SpillStorageError(f"cannot open {where}: {_why(exc)}", path=where) from exc
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
        if self.local:
            with self.storage_errors("create", rel):
                os.makedirs(self.path(rel), exist_ok=True)

    def put(self, rel: str, data: bytes | memoryview | Sequence[bytes | memoryview], *, fsync: bool = False) -> None:
        """Write one whole object. A sequence of buffers is written back to back (no join copy
        on local disks)."""
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        p = self.path(rel)
        with self.storage_errors("write", rel):
            if self.local:
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for part in parts:
                        _write_all(fd, part)
                    if fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                blob = parts[0] if len(parts) == 1 else b"".join(bytes(x) for x in parts)
                self.fs.pipe_file(p, bytes(blob))

    def fsync_tree(self, rel: str = "", *, threads: int = 8) -> None:
        """Make every file below ``rel`` (and the folders holding them) durable on a local disk:
        one syncfs(2) where Linux has it, else an fsync per file with many in flight. A no-op on
        object stores, where a PUT is durable when it returns."""
        if not self.local:
            return
        top = self.path(rel)
        if _syncfs(top):
            return
        paths: list[str] = []
        for dirpath, _dirs, files in os.walk(top):
            paths.append(dirpath)
            paths.extend(os.path.join(dirpath, f) for f in files)

        with (
            self.storage_errors("sync", rel),
            ThreadPoolExecutor(threads, thread_name_prefix="spillmerge-fsync") as pool,
        ):
            list(pool.map(_fsync_path, paths))

    def put_many(self, objects: dict[str, bytes], *, batch: int = 64) -> None:
        """Write many small objects; concurrently on object stores."""
        if self.local:
            for rel, data in objects.items():
                self.makedirs(posixpath.dirname(rel))
                self.put(rel, data)
            return
        paths = {self.path(rel): data for rel, data in objects.items()}
        with self.storage_errors("write metadata under"):
            if getattr(self.fs, "async_impl", False):
                self.fs.pipe(paths, batch_size=batch)
            else:
                self.fs.pipe(paths)

    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write ``rel`` so that readers see either nothing or the whole object, durably: a
        temporary name, fsync, rename and fsync of the folder on local disks; a single PUT
        (objects are immutable) elsewhere."""
        if not self.local:
            self.put(rel, data)
            return
        with self.open_write(rel, durable=True) as sink:
            sink.write(data)

    def is_link(self, rel: str) -> bool:
        """True when ``rel`` is a symbolic link (local disks; object stores have none)."""
        if not self.local:
            return False
        try:
            with self.storage_errors("check", rel, passthrough=(FileNotFoundError,)):
                return stat.S_ISLNK(os.lstat(self.path(rel)).st_mode)
        except FileNotFoundError:
            return False

    def _refuse_links_above(self, rel: str) -> None:
        """Refuse ``rel`` when a folder between the root and it is a symbolic link: an operation
        through it would act outside the root (a ``files/`` linked to another folder)."""
        parts = rel.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            above = "/".join(parts[:depth])
            if self.is_link(above):
                raise UnsafePathError(
                    f"{self.describe(above)} is a symbolic link; spillmerge does not write or delete through links "
                    f"(it would act outside {self.describe()}): remove the link",
                    path=self.describe(above),
                )

    def rm_tree(self, rel: str = "") -> None:
        """Delete ``rel`` and everything below it, never following a symbolic link: a link is
        removed itself (its target is untouched) and a link above ``rel`` is refused."""
        p = self.path(rel)
        if self.local and rel not in ("", "."):
            self._refuse_links_above(rel)
        try:
            with self.storage_errors("remove", rel, passthrough=(FileNotFoundError,)):
                if not self.local:
                    if self.fs.exists(p):
                        self.fs.rm(p, recursive=True)
                elif stat.S_ISDIR(os.lstat(p).st_mode):
                    # fd-based on Linux: unlinks links inside, never follows them; what another
                    # process removes meanwhile is fine, the rest of the tree still goes.
                    shutil.rmtree(p, **_RMTREE_HANDLER)
                else:
                    os.unlink(p)
        except FileNotFoundError:
            pass

    def remove_empty_dir(self, rel: str) -> None:
        """Remove the folder ``rel`` if it is empty (local disks; object stores have no folders)."""
        if self.local:
            try:
                os.rmdir(self.path(rel))
            except OSError:
                pass

    def create(self, rel: str, data: bytes) -> bool:
        """Write ``rel`` only if it does not exist; False when it does. Locally an ``O_EXCL``
        create; on object stores a conditional PUT (``If-None-Match: *``, s3fs ``mode="create"``),
        so of two processes creating one name, exactly one succeeds."""
        p = self.path(rel)
        try:
            with self.storage_errors("create", rel, passthrough=(FileExistsError,)):
                if not self.local:
                    self.fs.pipe_file(p, data, mode="create")
                    return True
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                return True
        except FileExistsError:
            return False

    # ----------------------------------------------------------------------------------- zarr
    def zarr_store(self, rel: str = "", *, read_only: bool = False) -> Any:
        """A zarr store rooted at ``rel``."""
        from zarr.storage import FsspecStore, LocalStore

        p = self.path(rel)
        if self.local:
            storage = self

            class RegularFilesOnly(LocalStore):
                """zarr's LocalStore, refusing (by name) to read a link, FIFO, device or folder,
                and any object below a linked folder: zarr would follow or block on them."""

                async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
                    where = f"{rel}/{key}" if rel else key
                    size = storage._check_regular(where)
                    if size is not None and key.endswith("zarr.json"):  # read whole by zarr
                        limit = ROOT_DOC_MAX_BYTES if where == "zarr.json" else ARRAY_DOC_MAX_BYTES
                        storage._refuse_size(where, size, limit)
                    return await super().get(key, prototype, byte_range)

                async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
                    key_ranges = list(key_ranges)
                    for key, _ in key_ranges:
                        storage._check_regular(f"{rel}/{key}" if rel else key)
                    return await super().get_partial_values(prototype, key_ranges)

            return RegularFilesOnly(p, read_only=read_only)
        fs = self.fs
        if not getattr(fs, "async_impl", False):
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            fs = AsyncFileSystemWrapper(fs, asynchronous=True)
        elif not getattr(fs, "asynchronous", False):
            # zarr drives the filesystem from its own event loop: it needs an asynchronous instance.
            fs = type(fs)(**{**fs.storage_options, "asynchronous": True})
        return FsspecStore(fs, path=p, read_only=read_only)


class _Sink:
    """See :meth:`Storage.open_write`: the one way an object appears whole under its name."""

    def __init__(self, storage: Storage, rel: str, durable: bool) -> None:
        self.storage, self.rel, self.durable = storage, rel, durable
        self.path = storage.path(rel)
        self._fd: int | None = None
        self._fh: Any = None
        # `.tmp-` for records written whole (put_atomic), `.part-` for streamed objects.
        self._tmp = f"{self.path}.{'tmp' if durable else 'part'}-{os.getpid()}-{threading.get_ident()}"

    def __enter__(self) -> _Sink:
        with self.storage.storage_errors("write", self.rel):
            if self.storage.local:
                # A received object must land below the root, never through a linked folder.
                self.storage._refuse_links_above(self.rel)
                self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            else:
                self._fh = self.storage.fs.open(self.path, "wb")
        return self

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        with self.storage.storage_errors("write", self.rel):
            if self._fd is not None:
                _write_all(self._fd, data)
            else:
                self._fh.write(data)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        ok = exc_type is None
        try:
            with self.storage.storage_errors("write", self.rel):
                if self._fd is not None:
                    try:
                        if ok and self.durable:
                            os.fsync(self._fd)
                    finally:
                        os.close(self._fd)
                    if ok:
                        os.replace(self._tmp, self.path)
                        if self.durable:
                            _fsync_path(os.path.dirname(self.path))
                elif self._fh is not None:
                    if ok:
                        self._fh.close()
                    else:
                        discard = getattr(self._fh, "discard", None)
                        if discard is not None:
                            discard()
        except BaseException:
            if self._fd is not None:
                _unlink_quietly(self._tmp)
            if ok:
                raise
            return
        if not ok and self._fd is not None:
            _unlink_quietly(self._tmp)


def _write_all(fd: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
    """``os.write`` until every byte of ``data`` is written (a write may be short)."""
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _fsync_path(path: str) -> None:
    """fsync a file or a folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gone_is_fine(func: Any, path: str, exc: Any) -> None:
    """``shutil.rmtree`` error handler: an entry already removed is not an error."""
    err = exc[1] if isinstance(exc, tuple) else exc  # onerror passes exc_info, onexc the exception
    if not isinstance(err, FileNotFoundError):
        raise err


_RMTREE_HANDLER: dict[str, Any] = {"onexc" if sys.version_info >= (3, 12) else "onerror": _gone_is_fine}


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
