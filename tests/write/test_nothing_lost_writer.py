"""Issue 17, "Nothing lost" (writer side): duplicates are compared by their bytes, a partial merge
salvages whole frames only, a writer notices a spill root that vanished, and the same bytes
written twice on one rank are not an error."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import time
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
from _nothing_lost_workers import (
    expected,
    small_value,
    spill,
    spill_batches_killed_at,
    spill_killed_at,
    spill_parallel_killed,
)
from _procs import join_all

import spillmerge
from spillmerge._format import spill as FS
from spillmerge._storage import Storage


def forge_same_crc(data: bytes, pos: int) -> bytes:
    """``data`` with byte ``pos`` flipped and its last 4 bytes rewritten so that the CRC-32C is
    unchanged: a real collision. CRC-32C is affine over GF(2), so the CRC change caused by the
    last 4 bytes is a linear function of their 32 bits, and a 32x32 linear system gives the patch
    that cancels the flip (the standard CRC forging technique)."""
    n = len(data)
    assert n >= 8 and pos < n - 4
    out = bytearray(data)
    out[pos] ^= 0xFF
    zero = google_crc32c.value(bytes(n))
    basis: dict[int, tuple[int, int]] = {}  # leading bit of a CRC change -> (change, tail bits)
    for bit in range(32):
        e = bytearray(n)
        e[n - 4 + bit // 8] = 1 << (bit % 8)
        v, m = google_crc32c.value(bytes(e)) ^ zero, 1 << bit
        for lead in range(31, -1, -1):
            if v >> lead & 1:
                if lead not in basis:
                    basis[lead] = (v, m)
                    break
                v, m = v ^ basis[lead][0], m ^ basis[lead][1]
    target, tail = google_crc32c.value(bytes(out)) ^ google_crc32c.value(data), 0
    for lead in range(31, -1, -1):
        if target >> lead & 1:
            target, tail = target ^ basis[lead][0], tail ^ basis[lead][1]
    assert target == 0
    out[n - 4 :] = (int.from_bytes(out[n - 4 :], "little") ^ tail).to_bytes(4, "little")
    forged = bytes(out)
    assert forged != data and google_crc32c.value(forged) == google_crc32c.value(data)
    return forged


def u8(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------- row 5
def test_forged_collision_is_a_real_crc32c_collision():
    rng = np.random.default_rng(5)
    for n, pos in ((8, 0), (100, 50), (4096, 7)):
        raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        forged = forge_same_crc(raw, pos)
        assert forged[pos] != raw[pos] and google_crc32c.value(forged) == google_crc32c.value(raw)


def test_duplicates_across_ranks_with_equal_crc_but_different_bytes_follow_the_policy(backend_no_s3):
    backend = backend_no_s3
    rng = np.random.default_rng(17)
    small = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    # 2.5 MiB over 1 MiB chunks: compared in pieces; the flipped byte is in the first MiB, the
    # patch in the last, so every piece of the comparison matters.
    big = rng.integers(0, 256, (5 << 19), dtype=np.uint8).tobytes()
    values = {
        0: {"clip": u8(small), "dets": {"boxes": torch.ones(3, 4), "mask": u8(big)}, "same": u8(small)},
        1: {"clip": u8(forge_same_crc(small, 100)), "dets": {"boxes": torch.ones(3, 4), "mask": u8(forge_same_crc(big, 9))}, "same": u8(small)},
    }  # fmt: skip
    root = backend.url("spill")
    for rank in (0, 1):  # rank 0 first: its segment is the earlier one ("first")
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, storage_options=backend.options, chunk_bytes=1 << 20) as w:  # fmt: skip
            for name, v in values[rank].items():
                w.write(name, 0, v)
    opts = {"storage_options": backend.options, "out_storage_options": backend.options}
    with pytest.raises(spillmerge.DuplicateFrameError, match="CRC-32C checksums agree, their bytes do not") as info:
        spillmerge.merge(root, backend.url("err"), **opts)
    assert info.value.ranks == [0, 1] and info.value.frame_idx == 0
    assert info.value.filename in ("clip", "dets")
    for policy, rank in (("first", 0), ("last", 1)):
        out = backend.url(policy)
        rep = spillmerge.merge(root, out, on_duplicate=policy, **opts)
        assert rep.duplicates == 3  # clip and dets by the policy, "same" as identical content
        res = spillmerge.open(out, storage_options=backend.options)
        assert bytes(res["clip"][0]) == bytes(values[rank]["clip"].numpy())
        assert bytes(res["dets"]["mask"][0]) == bytes(values[rank]["dets"]["mask"].numpy())
        assert bytes(res["same"][0]) == small
        assert res.frame_ranks("clip").tolist() == [rank] and res.frame_ranks("same").tolist() == [0]


def test_identical_duplicates_across_ranks_are_read_and_still_merge(tmp_path):
    root = str(tmp_path / "spill")
    for rank in (0, 1):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096) as w:
            w.write("v", 0, {"x": torch.arange(3000.0), "y": 1})
    rep = spillmerge.merge(root, str(tmp_path / "out"))
    assert rep.duplicates == 1 and rep.n_frames == 1
    assert spillmerge.open(str(tmp_path / "out"))["v"]["x"][0].tolist() == list(range(3000))


# ---------------------------------------------------------------------------------------- row 6
CTX = mp.get_context("forkserver")
# torch is imported once, by the forkserver, not by each writer. (Python < 3.12 does not give the
# forkserver the test's sys.path, so it cannot preload tests/_nothing_lost_workers itself.)
CTX.set_forkserver_preload(["torch", "numpy", "spillmerge"])
N_FRAMES = 60  # frames of the killed rank (about 0.6 MB, 150 chunks)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _rank0_root(tmp_path: Path) -> Path:
    """Rank 0's committed half of the job (even frames), copied into every trial's root."""
    template = tmp_path / "rank0"
    spill(str(template), 0, 2, N_FRAMES)
    return template


def _check_partial_merge(root: Path, out: Path, label: str) -> spillmerge.MergeReport:
    """Merge what is there; every merged frame must be whole and bit-exact, every other frame
    reported missing."""
    all_frames = set(range(2 * N_FRAMES))
    try:
        rep = spillmerge.merge(
            str(root), str(out), allow_partial=True, world_size=2, expected={"clip": len(all_frames)}
        )
    except spillmerge.SpillMergeError as exc:  # no documented reason applies to these roots
        pytest.fail(f"{label}: the partial merge raised {type(exc).__name__}: {exc}")
    res = spillmerge.open(str(out))
    frames = res.frames("clip").tolist()
    a, b = res["clip"]["a"][:], res["clip"]["b"][:]
    for j, frame in enumerate(frames):
        want = expected(frame)
        assert np.array_equal(a[j], want["a"]) and np.array_equal(b[j], want["b"]), f"{label}: frame {frame} differs"
    odd = [f for f in frames if f % 2]
    assert [f for f in frames if f % 2 == 0] == list(range(0, 2 * N_FRAMES, 2)), label
    # Journals list frames in write order: what is salvaged is a prefix of what rank 1 wrote.
    assert odd == list(range(1, 2 * len(odd), 2)), f"{label}: salvaged frames are not a prefix: {odd}"
    gaps = set(rep.frame_gaps.get("clip", []))
    assert not gaps & set(frames) and gaps | set(frames) == all_frames, f"{label}: missing frames not all reported"
    committed = list(root.glob("rank-00001/seg-*/commit.json"))
    if committed:
        assert rep.missing_ranks == [] and len(odd) == N_FRAMES, label
    else:
        assert rep.missing_ranks == [1], label
        assert rep.salvaged_frames.get(1, 0) == len(odd), label
    for seg in root.glob("rank-00001/seg-*"):
        if not (seg / "zarr.json").exists():  # killed before its header landed
            assert len(odd) == 0 and rep.salvaged_frames.get(1, 0) == 0, label
            assert any("has no header" in n and "nothing to salvage" in n for n in rep.notes), (label, rep.notes)
    return rep


def test_a_rank_killed_at_exact_moments_leaves_whole_frames_or_nothing(tmp_path):
    template = _rank0_root(tmp_path)
    moments = ["header", "header-tmp", "journal-0", "journal-2", "journal-3", "journal-7"]
    roots = {m: tmp_path / f"root-{m}" for m in moments}
    procs = {}
    for m, root in roots.items():
        shutil.copytree(template, root)
        procs[m] = CTX.Process(target=spill_killed_at, args=(str(root), 1, 2, N_FRAMES, m))
        procs[m].start()
    join_all(list(procs.values()), timeout=120)
    for m, root in roots.items():
        assert procs[m].exitcode == -signal.SIGKILL, f"{m}: the writer was not killed ({procs[m].exitcode})"
        rep = _check_partial_merge(root, tmp_path / f"out-{m}", m)
        if m.startswith("header"):
            assert (root / "rank-00001").exists() and not list(root.glob("rank-00001/seg-*/zarr.json"))
            assert rep.salvaged_frames.get(1, 0) == 0
    # Rank 1's frame 1 ends in chunk 2, frame 3 in chunk 4, frame 5 in chunk 7: until a frame's
    # large leaf is flushed it is not salvaged, although its small leaf is in an earlier chunk.
    odd = {
        m: [f for f in spillmerge.open(str(tmp_path / f"out-{m}")).frames("clip").tolist() if f % 2] for m in moments
    }
    assert odd == {
        "header": [],
        "header-tmp": [],
        "journal-0": [],
        "journal-2": [1],
        "journal-3": [1],
        "journal-7": [1, 3, 5],
    }


def test_random_sigkills_of_a_dict_writer_salvage_only_whole_frames(tmp_path):
    seed = int(os.environ.get("SPILLMERGE_KILL_SEED", "1717"))
    rng = random.Random(seed)
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("untouched")
    before = _snapshot(sentinel)
    template = _rank0_root(tmp_path)
    # An uninterrupted run first: it warms the forkserver and times a whole writer session.
    root = tmp_path / "root-full"
    shutil.copytree(template, root)
    p = CTX.Process(target=spill, args=(str(root), 1, 2, N_FRAMES))
    p.start()
    join_all([p], timeout=120)
    t0 = time.monotonic()
    p = CTX.Process(target=spill, args=(str(tmp_path / "timing"), 1, 2, N_FRAMES))
    p.start()
    join_all([p], timeout=120)
    session = time.monotonic() - t0
    assert p.exitcode == 0
    shutil.rmtree(tmp_path / "timing")
    _check_partial_merge(root, tmp_path / "out-full", "uninterrupted")
    outcomes = []
    for i in range(20):
        # The first kills land around start-up and the segment header, the rest anywhere.
        delay = rng.uniform(0, 0.004) if i < 5 else rng.uniform(0, 1.2 * session)
        root = tmp_path / f"root-{i}"
        shutil.copytree(template, root)
        p = CTX.Process(target=spill, args=(str(root), 1, 2, N_FRAMES))
        p.start()
        time.sleep(delay)
        p.kill()
        join_all([p], timeout=60)
        label = f"kill {i} after {delay * 1000:.1f} ms (seed {seed}, session {session * 1000:.0f} ms)"
        rep = _check_partial_merge(root, tmp_path / f"out-{i}", label)
        outcomes.append((p.exitcode, rep.salvaged_frames.get(1, 0)))
    assert any(code == -signal.SIGKILL for code, _ in outcomes), outcomes
    # Nothing outside the spill roots and outputs was touched.
    assert _snapshot(sentinel) == before
    names = {p.name for p in tmp_path.iterdir()}
    assert names <= {"sentinel", "rank0", "root-full", "out-full"} | {f"root-{i}" for i in range(20)} | {
        f"out-{i}" for i in range(20)
    }, names


def test_a_batch_writer_killed_mid_stream_salvages_whole_frames_checked_by_their_blocks(tmp_path):
    # write_batch rows carry one checksum per leaf of a block (docs/FORMAT.md, checks), listed in
    # the journal entry of their chunk: a killed batch writer's salvage checks them like a commit.
    n = 40
    roots = {w: tmp_path / f"root-{w}" for w in ("journal-3", "journal-7", "committed")}
    procs = [
        CTX.Process(target=spill_batches_killed_at, args=(str(r), 0, 1, n, None if w == "committed" else w))
        for w, r in roots.items()
    ]
    for p in procs:
        p.start()
    join_all(procs, timeout=120)
    got = {}
    for (w, root), p in zip(roots.items(), procs, strict=True):
        assert p.exitcode == (0 if w == "committed" else -signal.SIGKILL), (w, p.exitcode)
        rep = spillmerge.merge(str(root), str(tmp_path / f"out-{w}"), allow_partial=True, world_size=1)
        res = spillmerge.open(str(tmp_path / f"out-{w}"))
        frames = res.frames("clip").tolist()
        a, b = res["clip"]["a"][:], res["clip"]["b"][:]
        for j, f in enumerate(frames):
            want = small_value(f)
            assert np.array_equal(a[j], want["a"].numpy()) and np.array_equal(b[j], want["b"].numpy()), (w, f)
        assert frames == list(range(len(frames))), (w, frames)  # a prefix of what was written
        got[w] = (len(frames), rep.salvaged_frames.get(0, 0))
    commit = json.loads(next(roots["committed"].glob("rank-00000/seg-*/commit.json")).read_text())
    assert commit["n_checks"] > 0 and commit["format_version"] == 4
    assert got["committed"] == (n, 0)
    assert 0 < got["journal-3"][0] == got["journal-3"][1] < got["journal-7"][0] == got["journal-7"][1] < n, got


def test_a_writer_killed_with_several_flush_workers_in_flight_journals_only_durable_chunks(tmp_path):
    # 4 flush workers, fsync on; chunk 5 is slow, so chunks 6.. are written before it: the
    # journal still waits for it, and the kill lands with uploads in flight. Chunks are fsynced
    # in groups (each with its folder) by the journal thread, before an entry names them.
    root = tmp_path / "root"
    shutil.copytree(_rank0_root(tmp_path), root)
    log = tmp_path / "events.log"
    p = CTX.Process(target=spill_parallel_killed, args=(str(root), 1, 2, N_FRAMES, str(log), 5, 9))
    p.start()
    join_all([p], timeout=120)
    assert p.exitcode == -signal.SIGKILL
    events = log.read_text().splitlines()
    written: set[int] = set()
    fsynced: set[int] = set()  # chunks fsynced by a sync that also fsynced their folder
    journals = []
    for e in events:
        kind, rest = e.split(" ", 1)
        if kind == "chunk":
            written.add(int(rest.split()[0]))
        elif kind == "sync" and "/data/c/" in rest:
            *rels, up = rest.split()
            named = {int(r.rsplit("/", 1)[1]) for r in rels}
            assert named <= written and up == "False", e  # written before, their own folder
            fsynced |= named
        elif kind == "journal":
            n = int(rest)
            journals.append(n)
            # Every chunk a journal entry can name (0..n) was fsynced, and so was its folder entry.
            assert set(range(n + 1)) <= fsynced, (n, sorted(fsynced))
    assert journals == list(range(10)), journals  # in chunk order, however the uploads finished
    # Written out of order: a chunk after the slow one landed before it.
    order = [int(e.split()[1]) for e in events if e.startswith("chunk ")]
    assert order.index(6) < order.index(5), order
    rep = _check_partial_merge(root, tmp_path / "out", "parallel flush workers")
    # Salvage keeps every frame the journal entries 0..9 list (two leaves a frame), no more.
    seg = next(root.glob("rank-00001/seg-*"))
    journaled = sum(
        len(FS.decode_journal((seg / FS.journal_name(n)).read_bytes(), path=str(seg)).rows) for n in range(10)
    )
    assert rep.salvaged_frames.get(1, 0) == journaled // 2 > 0


# ---------------------------------------------------------------------------------------- row 7
def _wait_flushed(w: spillmerge.SpillWriter, chunks: int) -> None:
    """Until data chunks ``0 .. chunks-1`` are on storage (their journal entries are written after them)."""
    entry = w._rel(FS.journal_name(chunks - 1))
    deadline = time.monotonic() + 30
    while not w.storage.exists(entry) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.storage.exists(entry)


@pytest.mark.parametrize("staged", [False, True], ids=["nothing-staged", "last-chunk-staged"])
def test_a_spill_root_deleted_while_spilling_is_never_committed(backend, staged):
    root = backend.url("spill")
    storage = Storage(root, backend.options)
    w = spillmerge.SpillWriter(root, rank=0, world_size=1, storage_options=backend.options, chunk_bytes=4096)
    with pytest.raises(spillmerge.SpillStorageError) as info:
        with w:
            for i in range(4):  # whole chunks, flushed by the background thread
                w.write("clip", i, torch.full((1024,), float(i)))
            _wait_flushed(w, 4)
            storage.rm_tree("")  # someone deletes the spill root under the running job
            if staged:
                w.write("tail", 0, torch.ones(10))
    assert w.state == "failed"
    msg = str(info.value)
    assert w.segment_path in msg and info.value.path is not None and root in info.value.path, msg
    if not staged or backend.name != "local":  # locally the staged chunk's write fails first
        assert "vanished while spilling" in msg, msg
    # No commit record anywhere, and the deleted folders were not silently recreated.
    assert not [p for p, _ in storage.find("") if p.endswith(FS.COMMIT_NAME)]
    if backend.name == "local":
        assert not os.path.exists(root)
    with pytest.raises(spillmerge.SpillMergeError):
        spillmerge.merge(root, backend.url("out"), storage_options=backend.options, world_size=1)


def test_a_vanished_data_chunk_stops_the_commit(tmp_path):
    root = tmp_path / "spill"
    w = spillmerge.SpillWriter(str(root), rank=0, world_size=1, chunk_bytes=4096)
    with pytest.raises(spillmerge.SpillStorageError, match="data chunk 1 is gone") as info:
        with w:
            for i in range(3):
                w.write("clip", i, torch.full((1024,), float(i)))
            _wait_flushed(w, 3)
            os.unlink(f"{w.segment_path}/{FS.DATA_NAME}/c/1")
    assert info.value.path == w.segment_path
    assert not list(root.glob("rank-*/seg-*/commit.json")) and list(root.glob("rank-*/seg-*/failed.json"))


# --------------------------------------------------------------------------------------- row 10
def test_identical_rewrite_on_one_rank_is_kept_once_wherever_the_first_copy_is(backend_no_s3):
    backend = backend_no_s3
    root = backend.url("spill")
    rng = np.random.default_rng(10)
    big = rng.integers(0, 256, 5 << 19, dtype=np.uint8)  # 2.5 MiB: several chunks and compare windows
    with spillmerge.SpillWriter(root, storage_options=backend.options, chunk_bytes=1 << 20) as w:
        w.write("dets", 0, {"mask": torch.from_numpy(big.copy()), "score": 0.5})
        for i in range(1, 6):  # pushes frame 0's chunks out to storage
            w.write("dets", i, {"mask": torch.from_numpy(np.roll(big, i)), "score": float(i)})
        _wait_flushed(w, 3)
        w.write("dets", 0, {"mask": torch.from_numpy(big.copy()), "score": 0.5})  # read back from storage
        w.write("dets", 5, {"mask": torch.from_numpy(np.roll(big, 5)), "score": 5.0})  # partly staged
        w.write("small", 0, np.arange(4))
        w.write("small", 0, np.arange(4))  # in the current staging chunk
        assert w.stats()["identical_rewrites"] == 3
        with pytest.raises(spillmerge.DuplicateFrameError, match="frame 0 of 'small' was already written by rank 0"):
            w.write("small", 0, np.arange(1, 5))
        changed = big.copy()
        changed[-1] ^= 1
        with pytest.raises(spillmerge.DuplicateFrameError, match="frame 0 of 'dets'"):
            w.write("dets", 0, {"mask": torch.from_numpy(changed), "score": 0.5})
        with pytest.raises(spillmerge.DuplicateFrameError, match="frame 0 of 'dets'"):
            w.write("dets", 0, {"mask": torch.from_numpy(big.copy()), "score": 0.25})
        assert w.stats()["frames"] == 7
    out = backend.url("out")
    rep = spillmerge.merge(root, out, storage_options=backend.options, out_storage_options=backend.options)
    assert rep.n_frames == 7 and rep.duplicates == 0
    res = spillmerge.open(out, storage_options=backend.options)
    assert np.array_equal(res["dets"]["mask"][0], big) and res["small"][0].tolist() == [0, 1, 2, 3]


def test_rewrite_with_the_same_crc_but_other_bytes_is_refused_at_write(tmp_path):
    raw = np.random.default_rng(3).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    with spillmerge.SpillWriter(str(tmp_path / "spill"), chunk_bytes=4096) as w:
        w.write("clip", 0, u8(raw))
        with pytest.raises(spillmerge.DuplicateFrameError):
            w.write("clip", 0, u8(forge_same_crc(raw, 1)))
        w.write("clip", 0, u8(raw))
        assert w.stats()["identical_rewrites"] == 1


def test_identical_rewrite_waits_for_a_chunk_in_flight(tmp_path):
    w = spillmerge.SpillWriter(str(tmp_path / "spill"), chunk_bytes=4096)
    with w:
        real_put = w.storage.put
        puts = []

        def slow_put(rel, data, **kwargs):  # uploads take a while: chunks stay in flight
            time.sleep(0.2)
            real_put(rel, data, **kwargs)
            puts.append(rel)

        w.storage.put = slow_put  # type: ignore[method-assign]
        w.write("clip", 0, torch.arange(1024, dtype=torch.int32))  # fills chunk 0: handed off
        assert not puts  # chunk 0 is still being uploaded
        w.write("clip", 0, torch.arange(1024, dtype=torch.int32))
        assert any(p.endswith(f"{FS.DATA_NAME}/c/0") for p in puts)
        del w.storage.put  # commit at full speed
        with pytest.raises(spillmerge.DuplicateFrameError):
            w.write("clip", 0, torch.arange(1024, dtype=torch.int32) + 1)
        assert w.stats()["identical_rewrites"] == 1


def test_first_and_last_policies_are_unchanged_by_identical_rewrites(tmp_path):
    for policy in ("first", "last"):
        with spillmerge.SpillWriter(str(tmp_path / policy), on_duplicate=policy) as w:
            w.write("f", 0, torch.tensor(1.0))
            w.write("f", 0, torch.tensor(1.0))
            assert w.stats()["identical_rewrites"] == 0


@pytest.mark.gpu
def test_identical_rewrite_of_a_cuda_tensor(tmp_path):
    x = torch.arange(5000, dtype=torch.float32, device="cuda")
    with spillmerge.SpillWriter(str(tmp_path / "spill"), chunk_bytes=4096) as w:
        w.write("clip", 0, x)
        w.write("clip", 0, x.clone())
        with pytest.raises(spillmerge.DuplicateFrameError):
            w.write("clip", 0, x + 1)
        assert w.stats()["identical_rewrites"] == 1
    rep = spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out"))
    assert rep.n_frames == 1
    assert torch.equal(spillmerge.open(str(tmp_path / "out"))["clip"].to_torch()[0], x.cpu())
