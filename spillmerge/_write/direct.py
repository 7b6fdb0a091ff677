"""Direct chunk files: a writer on a local disk writes host frames from the caller's thread
straight into their data chunk file (no staging copy), the bytes and layout exactly as a staged
chunk's; the flush thread then only makes them durable and journals them (``_write.flush``).

Chosen once per writer, by its first frame (``Staging._decide``): on a local disk, a frame on the
host of at least :data:`DIRECT_MIN_BYTES`. Smaller frames stay staged: a copy into memory costs
less than a system call each.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._format import spill as FS
from .._storage import Storage

DIRECT_MIN_BYTES = 64 << 10
"""Smallest first frame (bytes, all leaves) that makes a local-disk writer write directly."""
NO_BUFFER = torch.empty(0, dtype=torch.uint8)
"""The ``Chunk.host`` of a direct chunk: it has no staging buffer."""


def open_chunk(storage: Storage, prefix: str, number: int) -> int:
    """Create (or truncate) data chunk ``number`` of segment ``prefix`` for writing, as ``put``
    does: its final name, no temporary one (a journal entry names it only once durable)."""
    rel = f"{prefix}/{FS.DATA_NAME}/c/{number}"
    with storage.storage_errors("write", rel):
        return os.open(storage.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)


def write_parts(storage: Storage, fd: int, parts: list[Any], at: int, where: str) -> None:
    """Write ``parts`` (host buffers) back to back at byte ``at`` of the chunk file ``fd``: one
    ``pwritev`` for them all, then the rest of a short write one part at a time. At an explicit
    offset, so a write that failed half way leaves the next one in its place."""
    with storage.storage_errors("write", where):
        views = [memoryview(p).cast("B") for p in parts]
        done = os.pwritev(fd, views, at)
        for v in views:
            at += len(v)
            if done >= len(v):
                done -= len(v)
                continue
            v, pos, done = v[done:], at - len(v) + done, 0
            while v:
                n = os.pwrite(fd, v, pos)
                v, pos = v[n:], pos + n


def close_chunk(storage: Storage, fd: int, fill: int, size: int, where: str) -> None:
    """End a direct chunk of ``fill`` bytes as an object of ``size`` bytes (zeros after
    ``fill``, as a staged chunk's padding) and close it."""
    with storage.storage_errors("write", where):
        try:
            if fill < size:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
