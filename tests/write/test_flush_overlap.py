"""A flush worker gives a staging buffer back once the chunk's bytes are written, before their
fsync (the journal thread fsyncs written chunks in groups): ``write()`` goes on filling buffers
while the disk flushes earlier chunks, up to a bound, and never refills a buffer whose bytes are
still being written. A journal entry is written only after every chunk it names and their folder
were fsynced (the group commit)."""

from __future__ import annotations

import glob
import os
import sys
import threading
import time
from typing import Any

import torch

import spillmerge
from spillmerge._storage import local as local_mod
from spillmerge._write import flush as flush_mod

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _helpers import assert_group_commits  # noqa: E402

CHUNK = 4096


def _frame(i: int) -> torch.Tensor:
    return torch.full((CHUNK // 4,), float(i), dtype=torch.float32)  # one whole chunk a frame


def _is_data_chunk(fd: int) -> bool:
    return "/data/c/" in os.readlink(f"/proc/self/fd/{fd}")


def _blocked_in_acquire(thread: threading.Thread) -> bool:
    """True while ``thread`` waits inside ``BufferPool.acquire`` for a buffer to come back."""
    frame: Any = sys._current_frames().get(thread.ident or -1)
    while frame is not None and frame.f_back is not None:
        caller = frame.f_back
        if frame.f_code.co_name == "wait" and caller.f_code.co_name == "acquire":
            return True
        frame = caller
    return False


def _merged(root: str, out: str, n: int) -> None:
    spillmerge.merge(root, out, progress=False)
    assert torch.equal(spillmerge.open(out)["f"].to_torch(), torch.stack([_frame(i) for i in range(n)]))


def _hang_data_fsyncs(monkeypatch: Any) -> threading.Event:
    """Every fsync of a data chunk waits until the returned event is set."""
    gate, real_fsync = threading.Event(), os.fsync

    def fsync(fd: int) -> None:
        if _is_data_chunk(fd):
            gate.wait(60)
        real_fsync(fd)

    monkeypatch.setattr(local_mod.os, "fsync", fsync)
    return gate


def _spill_in_thread(root: str, written: list[int], errors: list[BaseException]) -> threading.Thread:
    """A thread writing 12 one-chunk frames (two staging buffers, two flush workers), appending
    each frame to ``written`` once ``write()`` returned, an error to ``errors``."""

    def spill() -> None:
        try:
            with spillmerge.SpillWriter(
                root, rank=0, world_size=1, chunk_bytes=CHUNK, staging_bytes=2 * CHUNK, flush_threads=2
            ) as w:
                for i in range(12):
                    w.write("f", i, _frame(i))
                    written.append(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=spill, name="test-spill")
    t.start()
    return t


def test_write_fills_buffers_while_earlier_chunks_wait_for_their_fsync(tmp_path, monkeypatch):
    """The fsync of chunk 0 hangs: ``write()`` goes on while later chunks are written and wait
    for their fsync, more than two flush workers and two buffers could hold, up to a bound (at
    most ``n_buffers + 1`` journal entries waiting and ``flush_threads`` uploads in flight: the
    dirty bytes a crash may lose are bounded), fills both buffers again and only then waits."""
    gate = _hang_data_fsyncs(monkeypatch)
    root, written, errors = str(tmp_path / "spill"), [], []
    t = _spill_in_thread(root, written, errors)
    try:
        deadline = time.monotonic() + 30
        while t.is_alive() and not (len(written) >= 4 and _blocked_in_acquire(t)) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)  # a write() that should wait has had time to run on
        assert t.is_alive() and _blocked_in_acquire(t), f"write() did not wait: {len(written)} frames written"
        # a chunk a frame: chunks written (waiting for their fsync, buffers back), 2 staged
        (seg,) = glob.glob(f"{root}/rank-00000/seg-*")
        on_disk = sorted(map(int, os.listdir(f"{seg}/data/c")))
        assert 3 <= len(on_disk) <= 5 and on_disk == list(range(len(on_disk))), on_disk
        assert written == list(range(len(on_disk) + 2)), (written, on_disk)
        assert not glob.glob(f"{seg}/journal/*")  # chunk 0 is not durable: no entry names anything yet
    finally:
        gate.set()
        t.join(60)
    assert not t.is_alive() and not errors, errors
    _merged(root, str(tmp_path / "out"), 12)


def test_chunks_written_ahead_of_their_journal_stay_bounded_when_uploads_report_late(tmp_path, monkeypatch):
    """Chunk 0's fsync hangs and each upload reports done a while after its buffer went back (a
    loaded machine): still at most ``n_buffers + 1`` chunks awaiting the journal plus
    ``flush_threads`` being written, here 2 + 1 + 2 chunk files."""
    gate = _hang_data_fsyncs(monkeypatch)
    real_release = flush_mod.Flusher._release

    def release(self: Any, chunk: Any) -> None:
        real_release(self, chunk)
        if threading.current_thread().name.startswith("spillmerge-put"):
            time.sleep(0.3)  # the buffer is back; the upload's future is not done yet

    monkeypatch.setattr(flush_mod.Flusher, "_release", release)
    root, written, errors = str(tmp_path / "spill"), [], []
    t = _spill_in_thread(root, written, errors)
    try:
        time.sleep(2.5)  # every late report has come in: the flush thread waits on chunk 0's fsync
        (seg,) = glob.glob(f"{root}/rank-00000/seg-*")
        on_disk = sorted(map(int, os.listdir(f"{seg}/data/c")))
        assert on_disk == list(range(5)), on_disk
        assert t.is_alive() and not glob.glob(f"{seg}/journal/*")
    finally:
        gate.set()
        t.join(60)
    assert not t.is_alive() and not errors, errors
    _merged(root, str(tmp_path / "out"), 12)


def test_a_buffer_is_refilled_only_after_its_bytes_are_written(tmp_path, monkeypatch):
    """Each data chunk's write is slow: a buffer handed back before it would be refilled by the
    next frames while being written, and the merge would find other bytes than were staged."""
    real_write_all = local_mod._write_all

    def slow_write_all(fd: int, part: Any) -> None:
        if _is_data_chunk(fd):
            time.sleep(0.05)
        real_write_all(fd, part)

    monkeypatch.setattr(local_mod, "_write_all", slow_write_all)
    root = str(tmp_path / "spill")
    with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=CHUNK, staging_bytes=2 * CHUNK) as w:
        for i in range(10):
            w.write("f", i, _frame(i))
    _merged(root, str(tmp_path / "out"), 10)


def test_a_journal_entry_names_only_chunks_fsynced_with_their_folder_before_it(tmp_path, monkeypatch):
    """What reaches the disk, in order, as the OS sees it: before journal entry N is written,
    every data chunk ``0..N`` was fsynced after its last write, and so was the folder that names
    it (a power loss keeps every chunk an entry names). The fsync of chunk 0 waits until chunk
    2 is written, so a later group commit holds several chunks, some ahead of its entry."""
    events: list[tuple[str, str]] = []  # (what, path): appended by every thread, in order
    real_fsync, real_write_all = os.fsync, local_mod._write_all
    chunk2 = threading.Event()

    def path_of(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def fsync(fd: int) -> None:
        path = path_of(fd)
        if path.endswith("/data/c/0"):
            chunk2.wait(30)
            time.sleep(0.5)  # the flush thread counts chunk 2 as written: the next group holds it
        real_fsync(fd)
        events.append(("fsync", path))

    def write_all(fd: int, part: Any) -> None:
        path = path_of(fd)
        if "/journal/" in path:
            events.append(("entry", path))  # before a byte of it lands
        real_write_all(fd, part)
        if "/data/c/" in path:
            events.append(("write", path))
            if path.endswith("/data/c/2"):
                chunk2.set()

    monkeypatch.setattr(local_mod.os, "fsync", fsync)
    monkeypatch.setattr(local_mod, "_write_all", write_all)
    root = str(tmp_path / "spill")
    with spillmerge.SpillWriter(
        root, rank=0, world_size=1, chunk_bytes=CHUNK, staging_bytes=2 * CHUNK, flush_threads=2
    ) as w:
        for i in range(12):
            w.write("f", i, _frame(i))
    entries = [(k, p) for k, (what, p) in enumerate(events) if what == "entry"]
    assert [int(p.rsplit("/", 1)[1]) for _, p in entries] == list(range(12)), events
    assert_group_commits(events)
    _merged(root, str(tmp_path / "out"), 12)
