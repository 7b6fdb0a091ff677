"""The storage interface: what every backend shares, and the primitives each implements. Every
relative path is checked to stay inside the root, so no name read from storage reaches outside."""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Protocol

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from .._errors import (
    CorruptSpillError,
    MissingDependencyError,
    SpillMergeError,
    SpillStorageError,
    TruncatedObjectError,
    UnsafePathError,
)
from .._format.common import RECORD_MAX_BYTES

# protocol -> (package, spillmerge extra that installs it)
_BACKENDS = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"),
}  # fmt: skip


# Transient S3 failures (5xx, throttling, resets, timeouts) are retried by botocore itself with
# exponential backoff; spillmerge adds no retry loop of its own. Users override via storage_options.
_S3_CONFIG: dict[str, Any] = {
    "retries": {"max_attempts": 10, "mode": "standard"},
    "connect_timeout": 10,
    "read_timeout": 60,
}


def _url_to_fs(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    opts = dict(storage_options)
    if url.startswith(("s3://", "s3a://")):
        opts["config_kwargs"] = {**_S3_CONFIG, **opts.get("config_kwargs", {})}
    try:
        return fsspec.core.url_to_fs(url, **opts)
    except ImportError as exc:
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol in _BACKENDS:
            raise MissingDependencyError(*_BACKENDS[protocol], f"{protocol}:// paths ({url})") from None
        raise SpillStorageError(f"no fsspec backend for {protocol}:// paths ({exc})", path=url) from None
    except ValueError as exc:
        raise SpillStorageError(f"cannot open {url!r}: {exc}", path=url) from None


Errors = tuple[type[BaseException], ...]


class Sink(Protocol):
    """What :meth:`Storage.open_write` returns: a context manager taking writes."""

    def __enter__(self) -> Sink: ...

    def write(self, data: bytes | memoryview | np.ndarray) -> None: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...


class Storage:
    """A root directory (local path or fsspec URL) and relative-path operations below it; the
    methods raising ``NotImplementedError`` here are the primitives each backend implements, the
    others do here what an object store does (no folders, links or fsync)."""

    local: ClassVar[bool] = False
    """Objects are files on a local disk (fsspec's ``LocalFileSystem``): :meth:`view` maps them,
    :meth:`fsync_tree` syncs them, a lease can hold an flock."""
    url: str
    """The root as the user gave it (joined by :meth:`describe`)."""
    storage_options: dict[str, Any]
    """Options passed to fsspec (``storage_options`` of the public API)."""
    fs: Any
    """The fsspec filesystem of ``url``."""
    root: str
    """The backend path of the root, resolved (see :meth:`_resolve_root`), without a trailing ``/``."""

    def __new__(cls, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
        text = os.fspath(url) if isinstance(url, (str, os.PathLike)) else None
        if not isinstance(text, str) or not text:  # None, bytes, "" (an unset variable, not the current folder)
            raise SpillStorageError(f"a location is a local path or an fsspec URL (a non-empty str), got {url!r:.200}")
        options = dict(storage_options or {})
        fs, root = _url_to_fs(text, options)
        protocol = text.split("://", 1)[0] if "://" in text else ""
        if protocol in _BACKENDS and not root.strip("/"):
            raise SpillStorageError(f"{text!r} names no bucket: give {protocol}://BUCKET/PATH", path=text)
        # The backends are Storage's subclasses (spillmerge/_storage/__init__.py imports each one):
        # the one whose `local` says whether the filesystem is the local disk serves it.
        backend = next(b for b in Storage.__subclasses__() if b.local == isinstance(fs, LocalFileSystem))
        self = super().__new__(backend)
        self.url, self.storage_options, self.fs = text, options, fs
        root = backend._resolve_root(root)
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self._setup()
        return self

    @staticmethod
    def _resolve_root(root: str) -> str:
        """One spelling of the root folder, so two spellings of one folder compare equal."""
        raise NotImplementedError

    def _setup(self) -> None:
        """Backend state, after the common attributes are set."""

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
        base = self.url if self.url.endswith("://") else self.url.rstrip("/")  # memory:// keeps its //
        return base + (("" if base.endswith("/") else "/") + rel if rel else "")

    @contextlib.contextmanager
    def storage_errors(
        self, verb: str, rel: str = "", *, passthrough: Errors = (), ignore: Errors = ()
    ) -> Iterator[None]:
        """The one place backend errors become ``SpillStorageError("cannot VERB PATH: cause")``,
        also for callers that drive a backend through zarr (the merge's index). Our own errors and
        the ``passthrough`` types (a caller's ``FileNotFoundError``) pass; the ``ignore`` types
        end the block quietly (an absent object where absent is an answer)."""
        try:
            yield
        except SpillMergeError:
            raise
        except passthrough:
            raise
        except ignore:
            pass
        except Exception as exc:  # noqa: BLE001 - backends raise their own types (botocore, aiohttp)
            where = self.describe(rel)
            why = str(exc.strerror) if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            raise SpillStorageError(f"cannot {verb} {where}: {why}", path=where) from exc

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
        self.path(rel)  # an escaping name is refused before anything is touched
        data = self._read_bounded(rel, max_bytes)
        self._refuse_size(rel, len(data), max_bytes)
        return data

    def _read_bounded(self, rel: str, max_bytes: int) -> bytes:
        """:meth:`get` without the final size check: the regular file ``rel``, its announced size
        checked first, and at most ``max_bytes + 1`` of its bytes read."""
        raise NotImplementedError

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

    def _truncated(self, rel: str, start: int, got: int, n: int) -> TruncatedObjectError:
        return TruncatedObjectError(
            f"{self.describe(rel)}: short read at byte {start} ({got} of {n} bytes): the object is truncated",
            path=self.describe(rel),
        )

    def listdir(self, rel: str = "") -> list[str]:
        """Names directly below ``rel`` (files and folders); empty when ``rel`` does not exist."""
        p = self.path(rel)
        self._before_listing(rel, p)
        entries = []
        with self.storage_errors("list", rel, ignore=(FileNotFoundError, NotADirectoryError)):
            entries = self.fs.ls(p, detail=False)
        return sorted({posixpath.basename(str(e).rstrip("/")) for e in entries} - {"", ".", ".."})

    def _before_listing(self, rel: str, path: str) -> None:
        """What a listing of ``rel`` (backend path ``path``) needs first."""
        raise NotImplementedError

    def _below_root(self) -> str:
        """The prefix a backend path below the root starts with."""
        return self.root.rstrip("/") + "/" if self.root not in ("", "/") else self.root

    def find(self, rel: str) -> list[tuple[str, int]]:
        """Every file below ``rel`` as ``(relative path, size)``, sorted; empty when absent."""
        raise NotImplementedError

    def read_into(self, pieces: Sequence[tuple[str, int, int]], out: memoryview) -> None:
        """Read byte ranges ``(rel, start, stop)`` back to back into ``out``."""
        raise NotImplementedError

    def view(self, rel: str, start: int, stop: int | None) -> Any:
        """A read-only view of bytes ``[start, stop)`` (``stop`` None: to the end) of a local file,
        mapped from the page cache without copying (only where :attr:`local`)."""
        raise NotImplementedError(f"{type(self).__name__} has no page-cache views ({self.describe(rel)})")

    def close(self) -> None:
        """Release what reads keep open (descriptors, mappings)."""

    # --------------------------------------------------------------------------------- writes
    def makedirs(self, rel: str) -> None:
        """Create the folder ``rel`` and its parents (a no-op where folders do not exist)."""

    def put(self, rel: str, data: bytes | memoryview | Sequence[bytes | memoryview], *, fsync: bool = False) -> None:
        """Write one whole object. A sequence of buffers is written back to back (no join copy
        on local disks). ``fsync``: the object's bytes are durable when this returns (its folder
        entry: after :meth:`sync`; object stores: always, once the PUT returned). ``data`` is no
        longer needed once this returns."""
        raise NotImplementedError

    def open_write(self, rel: str, *, durable: bool = False) -> Sink:
        """A file-like sink that streams one object into ``rel`` (multipart on object stores), so
        a large object never sits whole in memory. Use it as a context manager: the object exists
        under its name only once the block exits without an exception (locally: a temporary name,
        renamed; ``durable``: fsync of the file before and of its folder after the rename)."""
        raise NotImplementedError

    def fsync_tree(self) -> None:
        """Make every file below the root, and the folders holding them, durable on a local disk:
        an fsync of each, many in flight, skipping the files this handle already fsynced
        (``put(fsync=True)``). A no-op on object stores, where a PUT is durable when it returns."""

    def sync(self, rels: Sequence[str], *, up: bool = True) -> None:
        """Make the objects ``rels`` (written already) durable on a local disk: an fsync of each
        one this handle has not fsynced yet and of every folder holding one of them (with
        ``up``: and every folder above, up to the root), so the names survive a power loss too.
        A no-op on object stores."""

    def put_many(self, objects: dict[str, bytes]) -> None:
        """Write many small objects (each folder made first); concurrently on object stores."""
        for rel, data in objects.items():
            self.makedirs(posixpath.dirname(rel))
            self.put(rel, data)

    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write ``rel`` so that readers see either nothing or the whole object, durably: a
        temporary name, fsync, rename and fsync of the folder on local disks; a single PUT
        (objects are immutable) elsewhere."""
        self.put(rel, data)  # one PUT: objects appear whole or not at all

    def is_link(self, rel: str) -> bool:
        """True when ``rel`` is a symbolic link (local disks; object stores have none)."""
        return False

    def rm_tree(self, rel: str = "") -> None:
        """Delete ``rel`` and everything below it, never following a symbolic link: a link is
        removed itself (its target is untouched) and a link above ``rel`` is refused."""
        raise NotImplementedError

    def remove_empty_dir(self, rel: str) -> None:
        """Remove the folder ``rel`` if it is empty (local disks; object stores have no folders)."""

    def create(self, rel: str, data: bytes) -> bool:
        """Write ``rel`` only if it does not exist; False when it does. Locally an ``O_EXCL``
        create; on object stores a conditional PUT (``If-None-Match: *``, s3fs ``mode="create"``),
        so of two processes creating one name, exactly one succeeds."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------- zarr
    def zarr_store(self) -> Any:
        """A read-only zarr store of the root."""
        raise NotImplementedError


def overlaps(a: Storage, b: Storage) -> bool:
    """True when one storage root is, contains or lies inside the other on the same filesystem.
    Roots are resolved first (``Storage``: ``..``, ``.``, ``//``, ``file://``, relative paths and
    symbolic links), so every spelling of one folder compares equal."""
    if type(a.fs) is not type(b.fs):
        return False
    pa, pb = a.root.rstrip("/") + "/", b.root.rstrip("/") + "/"
    return pa.startswith(pb) or pb.startswith(pa)


def output_options(
    root: str, out: str, storage_options: dict[str, Any] | None, out_storage_options: dict[str, Any] | None
) -> dict[str, Any] | None:
    """A merge output's storage options: ``out_storage_options``, else the spill root's
    ``storage_options`` when both share a protocol (the same credentials serve both ends)."""
    if out_storage_options is not None:
        return out_storage_options
    same = fsspec.core.split_protocol(str(root))[0] == fsspec.core.split_protocol(str(out))[0]
    return storage_options if same else None
