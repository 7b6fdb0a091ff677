"""A writer on a local disk whose frames are large writes them from the caller's thread straight
into their chunk files (``_write.staging``): the same bytes, journal and checks as a staged chunk,
the same crash safety (an entry names only chunks fsynced after their last write, with their
folder), the same checks at merge, and ``write()`` still leaves the caller free to reuse its
tensor."""

from __future__ import annotations

import glob
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

import spillmerge
from spillmerge import CorruptSpillError
from spillmerge._format import spill as FS
from spillmerge._storage import local as local_mod

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _helpers import assert_group_commits  # noqa: E402
from _nothing_lost_workers import BIG, DIRECT_CHUNK, big_value, spill_direct_killed  # noqa: E402
from _procs import join_all  # noqa: E402

CHUNK = 256 << 10


def _frame(i: int) -> torch.Tensor:
    return torch.arange(24_000, dtype=torch.float32) + i  # 96,000 bytes: frames cross chunk edges


def _spill(root: str, n: int = 12, **kw: Any) -> spillmerge.SpillWriter:
    with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=CHUNK, **kw) as w:
        for i in range(n):
            w.write("f", i, _frame(i))
        w.write("d", 0, {"small": torch.arange(3), "big": _frame(99)})
        w.write_batch(["b0", "b1", "b2"], torch.stack([_frame(5), _frame(6), _frame(7)]))
        w.write("f", 3, _frame(3))  # the same bytes again: read back from the chunk files
    return w


def _merged_ok(root: str, out: str, n: int = 12) -> None:
    spillmerge.merge(root, out, progress=False)
    res = spillmerge.open(out)
    assert torch.equal(res["f"].to_torch(), torch.stack([_frame(i) for i in range(n)]))
    assert torch.equal(torch.as_tensor(res["d"]["big"][0]), _frame(99))
    assert torch.equal(torch.as_tensor(res["b2"][0]), _frame(7))


def test_direct_chunks_hold_the_same_bytes_journal_and_checks_as_staged_ones(tmp_path):
    local = str(tmp_path / "spill")
    assert _spill(local)._staging.direct is True
    assert _spill("memory://direct-vs-staged/spill")._staging.direct is False  # object stores stage
    mem = fsspec.filesystem("memory")
    (seg,) = glob.glob(f"{local}/rank-00000/seg-*")
    (mseg,) = mem.glob("/direct-vs-staged/spill/rank-00000/seg-*")
    names = [f"{FS.DATA_NAME}/c/{c}" for c in range(len(os.listdir(f"{seg}/data/c")))]
    names += [f"journal/{n}" for n in sorted(os.listdir(f"{seg}/journal"))] + ["index/c/0/0", "checks/c/0/0"]
    assert len(names) > 8
    for name in names:
        assert Path(f"{seg}/{name}").read_bytes() == mem.cat(f"{mseg}/{name}"), name
    _merged_ok(local, str(tmp_path / "out"))


def _records(b: int) -> list[dict[str, Any]]:
    """Generation outputs of 70-170 KB each: a batch of them crosses 256 KiB chunks."""
    return [
        {"text": "é" * (35_000 + 9_000 * j + b), "ids": list(range(j, 40 * j + b + 1)), "p": -0.5 * j} for j in range(6)
    ]


def test_direct_chunks_of_flat_record_batches_match_staged_ones_and_read_back(tmp_path):
    def spill(root: str) -> spillmerge.SpillWriter:
        with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=CHUNK) as w:
            for b in range(3):
                w.write_batch([f"b{b}-{j}" for j in range(6)], _records(b))
        return w

    local = str(tmp_path / "spill")
    assert spill(local)._staging.direct is True
    assert spill("memory://direct-records/spill")._staging.direct is False
    (seg,) = glob.glob(f"{local}/rank-00000/seg-*")
    (mseg,) = fsspec.filesystem("memory").glob("/direct-records/spill/rank-00000/seg-*")
    names = [f"{FS.DATA_NAME}/c/{c}" for c in range(len(os.listdir(f"{seg}/data/c")))]
    names += [f"journal/{n}" for n in sorted(os.listdir(f"{seg}/journal"))] + ["index/c/0/0", "checks/c/0/0"]
    assert len(names) > 8
    for name in names:
        assert Path(f"{seg}/{name}").read_bytes() == fsspec.filesystem("memory").cat(f"{mseg}/{name}"), name
    spillmerge.merge(local, str(tmp_path / "out"), progress=False)
    res = spillmerge.open(str(tmp_path / "out"))
    assert {f: v for f, _, v in res.iter_values()} == {
        f"b{b}-{j}": r for b in range(3) for j, r in enumerate(_records(b))
    }


def test_a_tensor_changed_after_write_keeps_the_bytes_it_had(tmp_path):
    root = str(tmp_path / "spill")
    t = torch.zeros(40_000, dtype=torch.float32)
    with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=CHUNK) as w:
        for i in range(10):
            t.fill_(i)  # one tensor, reused for every frame
            w.write("f", i, t)
        assert w._staging.direct
        time.sleep(0.1)  # the flush thread's start-up (it readies a spare buffer for a staged writer)
        assert not w._staging.pool._free  # no staging memory held: the frames went to their files
        t.fill_(-1)
    spillmerge.merge(root, str(tmp_path / "out"), progress=False)
    got = spillmerge.open(str(tmp_path / "out"))["f"].to_torch()
    assert torch.equal(got, torch.arange(10, dtype=torch.float32)[:, None].expand(10, 40_000))


def test_a_flipped_byte_in_a_direct_chunk_fails_the_merge(tmp_path):
    root = tmp_path / "spill"
    _spill(str(root))
    chunk = next(root.glob("rank-00000/seg-*/data/c/1"))
    raw = bytearray(chunk.read_bytes())
    raw[CHUNK // 2] ^= 0x10
    chunk.write_bytes(bytes(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match="checksum mismatch"):
        spillmerge.merge(str(root), str(tmp_path / "out"), progress=False)


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_a_direct_writers_journal_entry_names_only_chunks_fsynced_after_their_last_write(tmp_path, monkeypatch):
    """What reaches the disk, in order: before journal entry N is written, every data chunk
    ``0..N`` was fsynced after the caller's last write into it, and so was its folder. The fsync
    of chunk 0 waits until chunk 2 is written, so a later group commit holds several chunks."""
    events: list[tuple[str, str]] = []
    real_fsync, real_pwritev, real_write_all = os.fsync, os.pwritev, local_mod._write_all
    chunk2 = threading.Event()

    def fsync(fd: int) -> None:
        path = _path_of(fd)
        if path.endswith("/data/c/0"):
            chunk2.wait(30)
            time.sleep(0.5)
        real_fsync(fd)
        events.append(("fsync", path))

    def pwritev(fd: int, parts: Any, at: int) -> int:
        n = real_pwritev(fd, parts, at)
        path = _path_of(fd)
        events.append(("write", path))
        if path.endswith("/data/c/2"):
            chunk2.set()
        return n

    def write_all(fd: int, part: Any) -> None:
        path = _path_of(fd)
        if "/journal/" in path:
            events.append(("entry", path))  # before a byte of it lands
        real_write_all(fd, part)

    monkeypatch.setattr(local_mod.os, "fsync", fsync)
    monkeypatch.setattr(local_mod.os, "pwritev", pwritev)
    monkeypatch.setattr(local_mod, "_write_all", write_all)
    root = str(tmp_path / "spill")
    w = _spill(root, n=40)
    assert w._staging.direct
    entries = [(k, p) for k, (what, p) in enumerate(events) if what == "entry"]
    assert len(entries) >= 14 and [int(p.rsplit("/", 1)[1]) for _, p in entries] == list(range(len(entries)))
    assert_group_commits(events)
    _merged_ok(root, str(tmp_path / "out"), 40)


def _waiting_for_journal(thread: threading.Thread) -> bool:
    frame: Any = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "_wait_journaled":
            return True
        frame = frame.f_back
    return False


def test_a_direct_writer_waits_while_its_bound_of_chunks_awaits_the_journal(tmp_path, monkeypatch):
    """The fsync of chunk 0 hangs: ``write()`` goes on writing chunk files up to ``n_buffers``
    of them not journaled (the bytes a crash may lose are bounded, as with staging), then waits."""
    gate = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if "/data/c/" in _path_of(fd):
            gate.wait(60)
        real_fsync(fd)

    monkeypatch.setattr(local_mod.os, "fsync", fsync)
    root, written, errors = str(tmp_path / "spill"), [], []
    frame = torch.zeros(CHUNK // 4, dtype=torch.float32)  # one whole chunk a frame

    def spill() -> None:
        try:
            with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=CHUNK, staging_bytes=2 * CHUNK) as w:
                for i in range(12):
                    w.write("f", i, frame + i)
                    written.append(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=spill, name="test-spill")
    t.start()
    try:
        deadline = time.monotonic() + 30
        while t.is_alive() and not _waiting_for_journal(t) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)
        assert t.is_alive() and _waiting_for_journal(t), f"write() did not wait: {len(written)} frames written"
        (seg,) = glob.glob(f"{root}/rank-00000/seg-*")
        assert sorted(map(int, os.listdir(f"{seg}/data/c"))) == [0, 1]  # n_buffers chunks, then a wait
        assert written == [0, 1] and not glob.glob(f"{seg}/journal/*")
    finally:
        gate.set()
        t.join(60)
    assert not t.is_alive() and not errors, errors
    spillmerge.merge(root, str(tmp_path / "out"), progress=False)
    got = spillmerge.open(str(tmp_path / "out"))["f"].to_torch()
    assert torch.equal(got, torch.arange(12, dtype=torch.float32)[:, None].expand(12, CHUNK // 4))


CTX = __import__("multiprocessing").get_context("forkserver")
CTX.set_forkserver_preload(["torch", "numpy", "spillmerge"])
N_FRAMES = 60  # 6 MB, 23 chunks of 256 KiB


def _salvaged(root: Path, out: Path, label: str) -> tuple[int, int]:
    """Merge what the killed writer left: every frame whole and bit-exact, a prefix of what it
    wrote, exactly the frames its journal entries list. (frames merged, journal entries)."""
    rep = spillmerge.merge(str(root), str(out), allow_partial=True, world_size=1, progress=False)
    res = spillmerge.open(str(out))
    frames = res.frames("clip").tolist() if "clip" in res else []
    assert frames == list(range(len(frames))), (label, frames)
    data = res["clip"][:] if frames else []
    for j, f in enumerate(frames):
        assert np.array_equal(data[j], big_value(f).numpy()), (label, f)
    entries = 0
    for seg in root.glob("rank-00000/seg-*"):
        if (seg / "commit.json").exists():
            assert len(frames) == N_FRAMES, label
            return len(frames), -1
        names = sorted(os.listdir(seg / "journal"), key=int) if (seg / "journal").exists() else []
        listed = entries = 0
        for n in names:  # as the reader replays them: up to the first entry the kill left torn
            try:
                listed += len(FS.decode_journal((seg / "journal" / n).read_bytes(), path=str(seg)).rows)
            except CorruptSpillError:
                assert n == names[-1], (label, "an entry after a torn one", names)
                break
            entries += 1
        assert rep.salvaged_frames.get(0, 0) == len(frames) == listed, (label, len(frames), listed)
    return len(frames), entries


def test_a_direct_writer_killed_mid_chunk_salvages_every_journaled_frame(tmp_path):
    root = tmp_path / "root"
    p = CTX.Process(target=spill_direct_killed, args=(str(root), 0, 1, N_FRAMES, 5))
    p.start()
    join_all([p], timeout=120)
    assert p.exitcode == -signal.SIGKILL
    (seg,) = root.glob("rank-00000/seg-*")
    sizes = {int(c.name): c.stat().st_size for c in (seg / "data" / "c").iterdir()}
    last = max(sizes)
    assert last >= 6 and 0 < sizes[last] < DIRECT_CHUNK, sizes  # killed with a chunk half written
    frames, entries = _salvaged(root, tmp_path / "out", "mid-chunk")
    assert entries >= 6 and frames * BIG * 4 <= entries * DIRECT_CHUNK < (frames + 1) * BIG * 4, (frames, entries)


def test_a_direct_writer_killed_while_writing_a_journal_entry_salvages_the_entries_before_it(tmp_path):
    """The journal entry being written when the kill came is torn: salvage keeps exactly the
    frames of the entries before it, and says which entry it stopped at."""
    root = tmp_path / "root"
    p = CTX.Process(target=spill_direct_killed, args=(str(root), 0, 1, N_FRAMES, None, None, 4))
    p.start()
    join_all([p], timeout=120)
    assert p.exitcode == -signal.SIGKILL
    (seg,) = root.glob("rank-00000/seg-*")
    torn = seg / FS.journal_name(4)
    assert 0 < torn.stat().st_size and sorted(os.listdir(seg / "journal"))[-1] == torn.name
    frames, entries = _salvaged(root, tmp_path / "out", "torn entry 4")
    assert entries == 4 and 0 < frames, (frames, entries)


def test_direct_writers_killed_at_random_moments_salvage_only_journaled_frames(tmp_path):
    """Killed right after a random write into a chunk file (the journal thread wherever it is):
    what is salvaged is exactly what the journal lists, whole and bit-exact."""
    seed = int(os.environ.get("SPILLMERGE_KILL_SEED", "4141"))
    rng = random.Random(seed)
    for i in range(8):
        after = rng.randint(1, N_FRAMES + 20)  # about one write a frame, two for a frame across chunks
        root = tmp_path / f"root-{i}"
        p = CTX.Process(target=spill_direct_killed, args=(str(root), 0, 1, N_FRAMES, None, after))
        p.start()
        join_all([p], timeout=60)
        assert p.exitcode == -signal.SIGKILL, (i, after, p.exitcode)
        _salvaged(root, tmp_path / f"out-{i}", f"kill {i} after write {after} (seed {seed})")
