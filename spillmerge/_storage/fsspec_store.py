"""Storage on an fsspec filesystem other than the local disk (S3, GCS, Azure, memory://): no
links, no folders, no rename; an object is written whole by one PUT (or multipart upload)."""

from __future__ import annotations

import contextlib
import io
import itertools
import posixpath
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile
from zarr.storage import FsspecStore

from .._errors import UnsafePathError
from .base import Storage


class FsspecStorage(Storage):
    """A prefix of an fsspec filesystem (``s3://bucket/key``, ``memory://x`` ...)."""

    @staticmethod
    def _resolve_root(root: str) -> str:
        """``a/./b//c/../d`` -> ``a/b/d`` (object stores have no links), leaving a protocol prefix
        that a backend keeps in its paths (``proto://``) as it is."""
        if root in ("/", ""):
            return root
        proto, sep, rest = root.partition("://")
        if not sep:
            return posixpath.normpath(root)
        return f"{proto}://{posixpath.normpath(rest)}" if rest else root

    def _setup(self) -> None:
        # s3fs reads `?versionId=` in a path as an object's version: every name below such a root
        # would be one object outside it, the key before the `?`.
        split = getattr(self.fs, "split_path", None)
        if split is None or self.root in ("", "/"):
            return
        probe = f"{self.root}/x"
        try:
            bucket, key = split(probe)[:2]
        except Exception:  # noqa: BLE001 - a backend whose split_path means something else
            return
        if f"{bucket}/{key}" != probe.lstrip("/"):
            raise UnsafePathError(
                f"{self.url}: the backend reads part of this path as an object version, so every object below it "
                f"would be written to the one key {bucket}/{key.removesuffix('/x')}, outside it; give a bucket "
                "and prefix without ?versionId=",
                path=self.url,
            )

    # ---------------------------------------------------------------------------------- reads
    def _read_bounded(self, rel: str, max_bytes: int) -> bytes:
        p = self.path(rel)
        with self.storage_errors("read", rel, passthrough=(FileNotFoundError,)):
            # One ranged GET of at most one byte past the bound (get refuses a longer object): no
            # HEAD first (that doubled the requests of every read on an object store).
            try:
                return bytes(self.fs.cat_file(p, start=0, end=max_bytes + 1))
            except (FileNotFoundError, IsADirectoryError):
                # A prefix with objects below it (a "folder") is no object: refused by what it is.
                self._refuse_kind(rel, self.fs.info(p).get("type"))  # FileNotFoundError: nothing there
                raise

    def _before_listing(self, rel: str, path: str) -> None:
        # Object-store filesystems cache listings; a barrier polling for commit records must
        # see new objects.
        self.fs.invalidate_cache(path)

    def find(self, rel: str) -> list[tuple[str, int]]:
        top = self.path(rel)
        self.fs.invalidate_cache(top)
        found = {}
        with self.storage_errors("list", rel, ignore=(FileNotFoundError,)):
            found = self.fs.find(top, detail=True)
        base = self._below_root()
        out = []
        for path, info in found.items():
            path = str(path)
            if not path.startswith(base):
                continue
            child = path[len(base) :]
            self.path(child)  # a name that would escape the root is refused here
            out.append((child, int(info.get("size") or 0)))
        return sorted(out)

    def read_into(self, pieces: Sequence[tuple[str, int, int]], out: memoryview) -> None:
        """One ranged GET per run of nearby pieces of one object (:func:`coalesce`), not one per piece."""
        starts = [0, *itertools.accumulate(stop - start for _, start, stop in pieces)]  # where each lands in out
        runs = coalesce(pieces)
        paths = [self.path(rel) for rel, _, _, _ in runs]
        with self.storage_errors("read from"):
            blobs = self.fs.cat_ranges(paths, [a for _, a, _, _ in runs], [b for _, _, b, _ in runs], on_error="raise")
        for (rel, a, _, members), blob in zip(runs, blobs, strict=True):  # (on_error="raise": no error objects)
            for i in members:
                _, start, stop = pieces[i]
                n = stop - start
                got = blob[start - a : stop - a]
                if len(got) != n:
                    raise self._truncated(rel, start, len(got), n)
                out[starts[i] : starts[i] + n] = got

    # --------------------------------------------------------------------------------- writes
    def put(self, rel: str, data: bytes | memoryview | Sequence[bytes | memoryview], *, fsync: bool = False) -> None:
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        p = self.path(rel)
        with self.storage_errors("write", rel):
            self.fs.pipe_file(p, b"".join(parts))  # one bytes object: returned as it is, not copied

    def open_write(self, rel: str, *, durable: bool = False) -> _FsspecSink:
        return _FsspecSink(self, rel)

    def put_many(self, objects: dict[str, bytes]) -> None:
        paths = {self.path(rel): data for rel, data in objects.items()}
        batch = {"batch_size": 64} if getattr(self.fs, "async_impl", False) else {}  # (a sync pipe takes none)
        with self.storage_errors("write metadata under"):
            self.fs.pipe(paths, **batch)

    def rm_tree(self, rel: str = "") -> None:
        p = self.path(rel)
        with self.storage_errors("remove", rel, ignore=(FileNotFoundError,)):
            self.fs.invalidate_cache(p)
            found = self.fs.find(p)  # the objects below p, or p itself (never a pattern)
            # fsspec's rm reads `*`, `?` and `[` in a path as a glob pattern: it would delete what the
            # pattern matches beside the root (s3://b/out[12] -> out1, out2), not the object itself.
            plain = [q for q in found if not _GLOB_CHARS.intersection(q)]
            if plain:
                self.fs.rm(plain)  # deletes in batches of 1,000 on S3
            for q in set(found).difference(plain):
                self.fs.rm_file(q)

    def create(self, rel: str, data: bytes) -> bool:
        p = self.path(rel)
        # memory:// checks that the name is free, then puts the file: two threads could both create it.
        exclusive = _MEMORY_CREATE if isinstance(self.fs, MemoryFileSystem) else contextlib.nullcontext()
        with self.storage_errors("create", rel, ignore=(FileExistsError,)), exclusive:
            self.fs.pipe_file(p, data, mode="create")
            return True
        return False

    # ----------------------------------------------------------------------------------- zarr
    def zarr_store(self) -> Any:
        fs = self.fs
        if not getattr(fs, "async_impl", False):
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            fs = AsyncFileSystemWrapper(fs, asynchronous=True)
        elif not getattr(fs, "asynchronous", False):
            # zarr drives the filesystem from its own event loop: it needs an asynchronous instance.
            fs = type(fs)(**{**fs.storage_options, "asynchronous": True})
        return FsspecStore(fs, path=self.root, read_only=True)


class _FsspecSink:
    """See :meth:`Storage.open_write`: one streamed (multipart) upload, which the object store
    makes visible only when it completes. memory:// shows a file from the moment it is opened:
    there the bytes are gathered and put whole at the end (they are held in memory anyway)."""

    closed = False
    """What pyarrow asks of a file it writes to (``to_parquet``)."""

    def __init__(self, storage: FsspecStorage, rel: str) -> None:
        self.storage, self.rel = storage, rel
        self.path = storage.path(rel)
        self._gather = isinstance(storage.fs, MemoryFileSystem)
        self._fh: Any = None

    def __enter__(self) -> _FsspecSink:
        with self.storage.storage_errors("write", self.rel):
            self._fh = io.BytesIO() if self._gather else self.storage.fs.open(self.path, "wb")
        return self

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        with self.storage.storage_errors("write", self.rel):
            self._fh.write(data)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._fh is None:
            return
        ok = exc_type is None
        try:
            with self.storage.storage_errors("write", self.rel):
                if ok and self._gather:
                    self.storage.fs.pipe_file(self.path, self._fh.getvalue())  # in place whole, at once
                elif ok:
                    self._fh.close()
                elif not self._gather:
                    # Marked closed, the file's __del__ never completes the upload (gcsfs would PUT a
                    # small object then); s3fs and gcsfs abandon a multipart upload in discard().
                    if isinstance(self._fh, AbstractBufferedFile):
                        self._fh.closed = True
                    getattr(self._fh, "discard", lambda: None)()
        except BaseException:
            if ok:
                raise


_GLOB_CHARS = frozenset("*?[")
_MEMORY_CREATE = threading.Lock()

COALESCE_GAP = 64 << 10
"""Bytes between two pieces of one object read in one GET rather than two: a request costs about
what 64 KiB of transfer does on an object store."""
COALESCE_MAX = 16 << 20
"""Bytes at most in one coalesced GET (one spill data chunk)."""


def coalesce(pieces: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int, list[int]]]:
    """Runs ``(rel, start, stop, members)`` covering the byte ranges ``pieces`` (indices into it in
    ``members``): pieces of one object at most :data:`COALESCE_GAP` apart share a run of at most
    :data:`COALESCE_MAX` bytes (a longer piece is a run of its own)."""
    order = sorted(range(len(pieces)), key=lambda i: (pieces[i][0], pieces[i][1]))
    runs: list[tuple[str, int, int, list[int]]] = []
    for i in order:
        rel, start, stop = pieces[i]
        if runs:
            r_rel, r_start, r_stop, members = runs[-1]
            end = max(r_stop, stop)
            if r_rel == rel and start <= r_stop + COALESCE_GAP and end - r_start <= COALESCE_MAX:
                members.append(i)
                runs[-1] = (rel, r_start, end, members)
                continue
        runs.append((rel, start, stop, [i]))
    return runs
