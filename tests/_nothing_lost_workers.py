"""Writer processes for tests/write/test_nothing_lost_writer.py, started from a forkserver that has
imported torch and spillmerge once, so each of the many killed writers starts in milliseconds."""

from __future__ import annotations

import os
import signal

import numpy as np
import torch

import spillmerge
from spillmerge._format import spill as FS
from spillmerge._storage import LocalStorage, Storage

CHUNK = 4096
A_LEN, B_LEN = 8, 2500  # int32: "a" is 32 bytes, "b" 10,000 bytes (it crosses 2 or 3 chunks)


def value(frame: int) -> dict[str, torch.Tensor]:
    """The dict value of a frame: a small leaf, then a large one (leaves go in sorted key order)."""
    return {
        "a": torch.arange(A_LEN, dtype=torch.int32) + frame * 1000,
        "b": torch.arange(B_LEN, dtype=torch.int32) * 7 - frame,
    }


def expected(frame: int) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in value(frame).items()}


def spill(root: str, rank: int, world: int, n_frames: int) -> None:
    """Rank ``rank`` writes frames ``rank, rank + world, ...`` of ``clip`` and commits (unless killed)."""
    torch.set_num_threads(1)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    with spillmerge.SpillWriter(root, rank=rank, world_size=world, chunk_bytes=CHUNK, fsync=False) as w:
        for i in range(n_frames):
            w.write("clip", rank + i * world, value(rank + i * world))


def spill_killed_at(root: str, rank: int, world: int, n_frames: int, when: str) -> None:
    """Like :func:`spill`, but the process SIGKILLs itself at one exact moment:

    - ``"header"``: as the segment header is about to be written (its folders exist, it does not);
    - ``"header-tmp"``: after the header's temporary file is written, before its rename;
    - ``"journal-N"``: right after journal entry ``N`` landed (the writer is mid-stream).
    """
    real_put, real_put_atomic = LocalStorage.put, LocalStorage.put_atomic  # the root is a local folder

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def put_atomic(self: Storage, rel: str, data: bytes) -> None:
        if rel.endswith("/zarr.json") and FS.is_segment_name(rel.split("/")[1]) and rel.count("/") == 2:
            if when == "header":
                die()
            if when == "header-tmp":
                with open(f"{self.path(rel)}.tmp-{os.getpid()}-1", "wb") as f:
                    f.write(data)
                die()
        real_put_atomic(self, rel, data)

    def put(self: Storage, rel: str, data: object, **kwargs: object) -> None:
        real_put(self, rel, data, **kwargs)  # type: ignore[arg-type]
        if when.startswith("journal-") and rel.endswith(f"/{FS.journal_name(int(when.split('-')[1]))}"):
            die()

    LocalStorage.put, LocalStorage.put_atomic = put, put_atomic  # type: ignore[method-assign]
    spill(root, rank, world, n_frames)


SMALL_B = 200  # write_batch frames: "a" 32 bytes, "b" 800 bytes: several frames fit in one chunk


def small_value(frame: int) -> dict[str, torch.Tensor]:
    return {
        "a": torch.arange(A_LEN, dtype=torch.int32) + frame * 1000,
        "b": torch.arange(SMALL_B, dtype=torch.int32) * 7 - frame,
    }


def spill_batches_killed_at(root: str, rank: int, world: int, n_frames: int, when: str | None) -> None:
    """Rank ``rank`` ``write_batch``es frames ``rank, rank + world, ...`` of ``clip``, 5 a batch
    (block checksums; a batch spans chunks), and SIGKILLs itself right after journal entry
    ``when`` (``"journal-N"``) landed; ``when=None``: commits."""
    torch.set_num_threads(1)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    real_put = LocalStorage.put

    def put(self: Storage, rel: str, data: object, **kwargs: object) -> None:
        real_put(self, rel, data, **kwargs)  # type: ignore[arg-type]
        if when and rel.endswith(f"/{FS.journal_name(int(when.split('-')[1]))}"):
            os.kill(os.getpid(), signal.SIGKILL)

    LocalStorage.put = put  # type: ignore[method-assign]
    frames = [rank + i * world for i in range(n_frames)]
    with spillmerge.SpillWriter(root, rank=rank, world_size=world, chunk_bytes=CHUNK, fsync=False) as w:
        for s in range(0, n_frames, 5):
            fr = frames[s : s + 5]
            vals = [small_value(f) for f in fr]
            w.write_batch(["clip"] * len(fr), {k: torch.stack([v[k] for v in vals]) for k in ("a", "b")}, frame_idx=fr)


def spill_parallel_killed(root: str, rank: int, world: int, n_frames: int, log: str, slow: int, kill: int) -> None:
    """Like :func:`spill`, durably (``fsync=True``) with 4 flush workers: data chunk ``slow``
    takes 0.3 s to write, so the chunks after it finish first (several uploads in flight, out of
    order); the process SIGKILLs itself right after journal entry ``kill`` landed. Appends to
    ``log`` what reached storage, in order: ``chunk C FSYNC``, ``sync REL... UP``, ``journal N``."""
    torch.set_num_threads(1)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    real_put, real_sync = LocalStorage.put, LocalStorage.sync
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(line: str) -> None:
        os.write(fd, f"{line}\n".encode())

    def put(self: Storage, rel: str, data: object, **kwargs: object) -> None:
        chunk = rel.split(f"/{FS.DATA_NAME}/c/")
        if len(chunk) == 2 and int(chunk[1]) == slow:
            import time

            time.sleep(0.3)
        real_put(self, rel, data, **kwargs)  # type: ignore[arg-type]
        if len(chunk) == 2:
            note(f"chunk {chunk[1]} {kwargs.get('fsync', False)}")
        if rel.endswith(f"/{FS.journal_name(kill)}"):
            note(f"journal {kill}")
            os.kill(os.getpid(), signal.SIGKILL)
        elif "/journal/" in rel:
            note(f"journal {int(rel.rsplit('/', 1)[1])}")

    def sync(self: Storage, rels: list[str], **kwargs: object) -> None:
        real_sync(self, rels, **kwargs)  # type: ignore[arg-type]
        note(f"sync {' '.join(rels)} {kwargs.get('up', True)}")

    LocalStorage.put, LocalStorage.sync = put, sync  # type: ignore[method-assign]
    with spillmerge.SpillWriter(
        root, rank=rank, world_size=world, chunk_bytes=CHUNK, flush_threads=4, staging_bytes=8 * CHUNK
    ) as w:
        for i in range(n_frames):
            w.write("clip", rank + i * world, value(rank + i * world))


DIRECT_CHUNK = 256 << 10
BIG = 25_000  # int32: a 100,000-byte frame, written straight into its chunk file (no staging)


def big_value(frame: int) -> torch.Tensor:
    return torch.arange(BIG, dtype=torch.int32) * 3 + frame


def spill_direct_killed(
    root: str, rank: int, world: int, n_frames: int, kill: int | None, after_writes: int | None = None,
    tear: int | None = None,
) -> None:  # fmt: skip
    """Rank ``rank`` writes 100 KB frames ``rank, rank + world, ...`` of ``clip`` durably; the
    caller writes them straight into 256 KiB chunk files, a frame often across two. With ``kill``:
    the process SIGKILLs itself in the middle of a chunk, right after the first write into a chunk
    file that leaves it partly filled once journal entry ``kill`` has landed; ``after_writes``:
    right after that many writes into chunk files, wherever the journal thread is; ``tear``: half
    way through writing journal entry ``tear`` (a torn entry); all None: it commits."""
    torch.set_num_threads(1)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    real_put, real_pwritev = LocalStorage.put, os.pwritev
    landed, writes = [False], [0]

    def put(self: Storage, rel: str, data: object, **kwargs: object) -> None:
        if tear is not None and rel.endswith(f"/{FS.journal_name(tear)}"):
            blob = b"".join(bytes(p) for p in ([data] if isinstance(data, (bytes, memoryview)) else data))  # type: ignore[union-attr]
            real_put(self, rel, blob[: len(blob) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        real_put(self, rel, data, **kwargs)  # type: ignore[arg-type]
        if kill is not None and rel.endswith(f"/{FS.journal_name(kill)}"):
            landed[0] = True

    def pwritev(fd: int, buffers: object, at: int) -> int:
        n = real_pwritev(fd, buffers, at)  # type: ignore[arg-type]
        writes[0] += 1
        if writes[0] == after_writes:
            os.kill(os.getpid(), signal.SIGKILL)
        if landed[0]:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if f"/{FS.DATA_NAME}/c/" in path and os.fstat(fd).st_size % DIRECT_CHUNK:
                os.kill(os.getpid(), signal.SIGKILL)
        return n

    LocalStorage.put = put  # type: ignore[method-assign]
    os.pwritev = pwritev
    with spillmerge.SpillWriter(root, rank=rank, world_size=world, chunk_bytes=DIRECT_CHUNK) as w:
        for i in range(n_frames):
            w.write("clip", rank + i * world, big_value(rank + i * world))
