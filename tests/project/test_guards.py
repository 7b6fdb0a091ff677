"""Tests that guard the guarantees (issue 16): each one fails when one check of the library is
deleted or weakened. ``tests/mutation_check.py`` applies those one-line mutations one at a time
to a copy of the repository and runs the tests named for each; every mutation must make one fail.

Checked here, in one process: the CRC check of the stripe copy on the codec path, the index /
catalog checksums against the commit record and their own chunk checksums (not recomputed, unlike
tests/spill/test_hostile.py), the journal's sequence check, ``Storage.path`` refusing ``..``,
``Storage.get(max_bytes=)``, the receiver's manifest checks (``_transfer._receive``, fed by a
scripted link: no network), the storage failure record on the run-id path, the merge's memory
budget and the writer's backpressure (both observed through a gated fsspec filesystem), and what
survives a SIGKILL in the middle of a spill.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import google_crc32c
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import spillmerge
from spillmerge._dist import transfer as _transfer
from spillmerge._format import common as F
from spillmerge._format import spill as FS
from spillmerge._spill import root as _spillroot
from spillmerge._storage import Storage


def _frame(i: int) -> torch.Tensor:
    return torch.full((1024,), float(i), dtype=torch.float32)  # 4 KiB: one 4096-byte chunk


def _segment(root: Path, rank: int = 0) -> Path:
    return next(root.glob(f"rank-{rank:05d}/seg-*"))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One committed rank: 6 frames of 4 KiB in 4 KiB chunks (one journal entry per frame)."""
    root = tmp_path_factory.mktemp("guards") / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1, chunk_bytes=4096) as w:
        for i in range(6):
            w.write("f0.mp4", i, _frame(i))
    return root


@pytest.fixture
def spill(tmp_path: Path, pristine: Path) -> Path:
    root = tmp_path / "spill"
    shutil.copytree(pristine, root)
    return root


# ------------------------------------------------------------------ stripe copy: CRC per frame
@pytest.mark.parametrize("codec", ["none", "blosc-lz4", "zstd"])
def test_a_flipped_data_byte_fails_the_merge_with_every_codec(tmp_path, spill, codec):
    """The local copy checks each frame's CRC-32C on both paths: straight from the page cache
    (``none``) and through the compressor's buffer (``blosc-lz4``, ``zstd``)."""
    chunk = _segment(spill) / "data" / "c" / "3"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0x01
    chunk.write_bytes(bytes(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"checksum mismatch for 'f0.mp4' frame 3") as info:
        spillmerge.merge(str(spill), str(tmp_path / "out"), codec=codec, chunk_bytes=4096, progress=False)
    assert info.value.rank == 0
    assert not spillmerge.verify(str(spill)).ok


# ------------------------------------------------- index and catalog: commit record and chunk CRC
def _rewrite_chunk(array: Path, raw: bytes) -> None:
    """Replace a one-chunk array's bytes with a valid chunk checksum (the commit record untouched)."""
    _chunk_path(array).write_bytes(raw + google_crc32c.value(raw).to_bytes(4, "little"))


def _chunk_path(array: Path) -> Path:
    p = array / "c" / "0"
    return p / "0" if p.is_dir() else p


def test_a_catalog_that_does_not_match_the_commit_record_is_refused(tmp_path, spill):
    seg = _segment(spill)
    raw = _chunk_path(seg / "catalog").read_bytes()[:-4]
    assert b'"f0.mp4"' in raw
    _rewrite_chunk(seg / "catalog", raw.replace(b'"f0.mp4"', b'"g0.mp4"'))  # valid JSON, valid chunk CRC
    with pytest.raises(spillmerge.CorruptSpillError, match="catalog checksum does not match the commit record"):
        spillmerge.merge(str(spill), str(tmp_path / "out"), progress=False)


def test_an_index_that_does_not_match_the_commit_record_is_refused(tmp_path, spill):
    seg = _segment(spill)
    index = np.frombuffer(_chunk_path(seg / "index").read_bytes()[:-4], dtype="<i8").reshape(-1, FS.INDEX_COLUMNS)
    index = index.copy()
    index[0, FS.COL_FRAME] = 99  # a plausible row: only the commit record's checksum can tell
    _rewrite_chunk(seg / "index", index.tobytes())
    with pytest.raises(spillmerge.CorruptSpillError, match="index checksum does not match the commit record"):
        spillmerge.merge(str(spill), str(tmp_path / "out"), progress=False)


@pytest.mark.parametrize("array", ["catalog", "index"])
def test_a_torn_index_or_catalog_chunk_is_named_as_such(tmp_path, spill, array):
    """A flipped byte with the stored checksum left as it was: the chunk's own CRC catches it."""
    chunk = _chunk_path(_segment(spill) / array)
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x20
    chunk.write_bytes(bytes(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"chunk checksum mismatch \(corrupt or torn write\)"):
        spillmerge.merge(str(spill), str(tmp_path / "out"), progress=False)


# ------------------------------------------------------------------------ journal replay order
def _uncommit(root: Path) -> Path:
    seg = _segment(root)
    (seg / FS.COMMIT_NAME).unlink()
    return seg


def _entry(seg: Path, n: int) -> Path:
    return seg / FS.journal_name(n)


def test_salvage_stops_at_a_journal_entry_of_another_chunk(tmp_path, spill):
    seg = _uncommit(spill)
    shutil.copyfile(_entry(seg, 2), _entry(seg, 3))  # intact, checksummed, but chunk 2's entry
    storage = Storage(str(spill))
    loaded, problems = _spillroot.load_flushed(storage, _spillroot.list_segments(storage, 0)[0])
    assert sorted(set(loaded.index[:, FS.COL_FRAME].tolist())) == [0, 1, 2]
    assert len(problems) == 1 and "journal entry out of sequence" in problems[0], problems
    rep = spillmerge.merge(str(spill), str(tmp_path / "out"), allow_partial=True, progress=False)
    assert rep.salvaged_frames == {0: 3} and any("out of sequence" in n for n in rep.notes), rep.notes
    res = spillmerge.open(str(tmp_path / "out"))
    assert res.frames("f0.mp4").tolist() == [0, 1, 2]
    assert torch.equal(res["f0.mp4"].to_torch(), torch.stack([_frame(i) for i in range(3)]))


def test_salvage_stops_at_a_journal_entry_with_the_wrong_catalog_base(tmp_path, spill):
    seg = _uncommit(spill)
    e = FS.decode_journal(_entry(seg, 4).read_bytes(), path="journal/4")
    assert e.file_base == 1  # f0.mp4 was registered by entry 0
    _entry(seg, 4).write_bytes(FS.encode_journal(4, 0, ["f0.mp4"], e.layout_base, e.layouts, e.rows))
    storage = Storage(str(spill))
    loaded, problems = _spillroot.load_flushed(storage, _spillroot.list_segments(storage, 0)[0])
    assert sorted(set(loaded.index[:, FS.COL_FRAME].tolist())) == [0, 1, 2, 3]
    assert loaded.filenames == ["f0.mp4"]
    assert len(problems) == 1 and "journal entry out of sequence" in problems[0], problems


# ------------------------------------------------------------------------------ storage guards
@pytest.mark.parametrize("rel", ["..", "../x", "../../etc/passwd", "a/../../x", "../rank-00000", "./../x"])
def test_storage_paths_with_dot_dot_are_refused(tmp_path, rel):
    """The property test draws random text, which almost never starts with ``..``."""
    storage = Storage(str(tmp_path / "root"))
    with pytest.raises(spillmerge.UnsafePathError):
        storage.path(rel)
    with pytest.raises(spillmerge.UnsafePathError):
        storage.put(rel, b"x")
    assert not (tmp_path / "x").exists() and not (tmp_path / "rank-00000").exists()


def test_get_refuses_an_object_larger_than_max_bytes(tmp_path, spill):
    storage = Storage(str(tmp_path))
    storage.put("blob", b"x" * 1000)
    assert storage.get("blob", max_bytes=1000) == b"x" * 1000
    # Larger than its format allows: hostile or not ours (a CorruptSpillError, since the untrusted-
    # storage hardening), refused before more than max_bytes + 1 bytes are read.
    with pytest.raises(spillmerge.CorruptSpillError, match="is at least 1000 bytes, more than the 999 its format"):
        storage.get("blob", max_bytes=999)
    # A commit record of 2 MiB is refused before it is read (records are at most 64 KiB).
    record = _segment(spill) / FS.COMMIT_NAME
    record.write_bytes(record.read_bytes() + b" " * (2 << 20))
    with pytest.raises(spillmerge.CorruptSpillError, match=f"more than the {F.RECORD_MAX_BYTES} its format allows"):
        spillmerge.merge(str(spill), str(tmp_path / "out"), progress=False)


# ------------------------------------------------------- the failure record on the run-id path
def test_a_failure_record_of_the_run_fails_the_barrier_at_once(tmp_path):
    root = str(tmp_path / "spill")
    with spillmerge.SpillWriter(root, rank=0, world_size=2, run_id="run-a") as w:
        w.write("a.mp4", 0, torch.ones(4))
    with pytest.raises(ValueError, match="boom"):
        with spillmerge.SpillWriter(root, rank=1, world_size=2, run_id="run-a") as w:
            w.write("a.mp4", 1, torch.ones(4))
            raise ValueError("boom")
    for run_id in ("run-a", None):
        # Not IncompleteSpillError ("no commit record"): the rank is named as failed, with its error.
        with pytest.raises(spillmerge.RankFailedError, match="ValueError: boom") as info:
            spillmerge.merge(root, str(tmp_path / "out"), run_id=run_id, progress=False)
        assert set(info.value.failures) == {1}
        assert not isinstance(info.value, spillmerge.IncompleteSpillError)


# ------------------------------------------------------------ the receiver's manifest checks
class _ScriptedLink:
    """Stands in for ``_transfer._Link`` on the receiving side: replays what a (hostile) sender
    would send, records the acknowledgements."""

    def __init__(self, manifest: bytes, objects: list[bytes], crcs: list[int] | None = None, size: int | None = None):
        self.piece = 1 << 16
        self.ints: list[list[int]] = [[len(manifest) if size is None else size]]
        self.manifest = manifest
        self.pieces: list[bytes] = []
        for i, data in enumerate(objects):
            self.pieces += [data[lo : lo + self.piece] for lo in range(0, len(data), self.piece)]
            self.ints.append([google_crc32c.value(data) if crcs is None else crcs[i]])
        self.acks: list[int] = []

    def recv_ints(self, n: int, peer: int, me: int, what: str) -> list[int]:
        return self.ints.pop(0)

    def recv_blob(self, size: int, peer: int, me: int, what: str) -> bytes:
        return self.manifest[:size]

    def recv_bytes_piece(self, n: int, peer: int, me: int, what: str, slot: int = 0) -> np.ndarray:
        piece = self.pieces.pop(0)
        assert len(piece) == n
        return np.frombuffer(piece, dtype=np.uint8)

    def send_ints(self, values: list[int], peer: int, me: int, what: str) -> None:
        self.acks.extend(values)


def _manifest(objects: list[tuple[Any, int]]) -> bytes:
    return json.dumps({"ranks": [2], "objects": objects}).encode()


def _receive(root: Path, link: _ScriptedLink, ranks: list[int] = [2]) -> dict[int, int]:  # noqa: B006
    return _transfer._receive(Storage(str(root)), link, 0, 1, ranks)  # type: ignore[arg-type]


def test_receiver_writes_a_well_formed_manifest_commit_record_last(tmp_path):
    rel = "rank-00002/seg-x"
    link = _ScriptedLink(_manifest([(f"{rel}/data/c/0", 5), (f"{rel}/commit.json", 2)]), [b"hello", b"{}"])
    assert _receive(tmp_path / "dst", link) == {2: 7}
    assert link.acks == [0, 0]
    assert (tmp_path / "dst" / rel / "data/c/0").read_bytes() == b"hello"
    assert (tmp_path / "dst" / rel / "commit.json").read_bytes() == b"{}"
    assert sorted(p.name for p in (tmp_path / "dst" / rel).iterdir()) == ["commit.json", "data"]


@pytest.mark.parametrize(
    "rel",
    [
        "rank-00000/seg-x/commit.json",  # another rank's folder: not the sender's to write
        "rank-00002/../rank-00000/seg-x/commit.json",  # under the prefix only before normpath
        "rank-00002/./seg-x/data/c/0",
        "rank-00002//seg-x/data/c/0",
        "rank-000020/seg-x/data/c/0",  # a prefix of the name, not of the folder
        "/abs/rank-00002/x",
        "../rank-00002/x",
        7,
        None,
    ],
)
def test_receiver_refuses_objects_outside_the_senders_ranks(tmp_path, rel):
    dst = tmp_path / "dst"
    (dst / "rank-00000").mkdir(parents=True)
    link = _ScriptedLink(_manifest([("rank-00002/seg-x/data/c/0", 1), (rel, 1)]), [b"a", b"b"])
    with pytest.raises(spillmerge.CorruptSpillError, match="rank 1 sent"):
        _receive(dst, link)
    assert link.acks == []  # refused before a single byte was received
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["dst", "dst/rank-00000"]


@pytest.mark.parametrize(
    "manifest, size, match",
    [
        (b"", 0, "announced a manifest of 0 bytes"),
        (b"{}", _transfer._MAX_MANIFEST + 1, f"announced a manifest of {_transfer._MAX_MANIFEST + 1} bytes"),
        (b"not json", None, "malformed manifest"),
        (b'{"objects": 3}', None, "malformed manifest"),
        (b'{"objects": [["rank-00002/x", "many"]]}', None, "malformed manifest"),
        (b'{"ranks": [2]}', None, "malformed manifest"),
    ],
    ids=["empty", "huge", "not-json", "not-a-list", "bad-size", "no-objects"],
)
def test_receiver_refuses_malformed_manifests(tmp_path, manifest, size, match):
    link = _ScriptedLink(manifest, [], size=size)
    with pytest.raises(spillmerge.CorruptSpillError, match=match):
        _receive(tmp_path / "dst", link)
    assert not (tmp_path / "dst").exists()


def test_receiver_refuses_negative_sizes_and_huge_commit_records(tmp_path):
    for objects in (
        [("rank-00002/seg-x/data/c/0", -1)],
        [("rank-00002/seg-x/commit.json", _transfer._MAX_RECORD + 1)],
    ):
        link = _ScriptedLink(_manifest(objects), [])
        with pytest.raises(spillmerge.CorruptSpillError, match="announced rank-00002/seg-x"):
            _receive(tmp_path / "dst", link)
    assert not (tmp_path / "dst").exists()


class _FailingSender(_ScriptedLink):
    """A sender that could not read its first object: zeroed pieces, the failure trailer, its error."""

    why = b"rank 1 could not read x: OSError: gone"

    def __init__(self, rel: str, size: int) -> None:
        super().__init__(_manifest([(f"{rel}/data/c/0", 5), (f"{rel}/commit.json", 2)]), [bytes(5)])
        self.ints[-1] = [_transfer.SENDER_FAILED]
        self.ints.append([size])

    def recv_blob(self, size: int, peer: int, me: int, what: str) -> bytes:
        return super().recv_blob(size, peer, me, what) if what == "the manifest" else self.why[:size]


def test_receiver_names_a_sender_that_could_not_read_and_refuses_an_oversized_error(tmp_path):
    rel = "rank-00002/seg-x"
    link = _FailingSender(rel, len(_FailingSender.why))
    with pytest.raises(
        spillmerge.RankFailedError, match="rank 1 stopped sending its shards: rank 1 could not read x"
    ) as info:
        _receive(tmp_path / "dst", link)
    assert info.value.failures == {1: _FailingSender.why.decode()} and link.acks == []
    link = _FailingSender(rel, _transfer._MAX_ERROR + 1)
    with pytest.raises(spillmerge.CorruptSpillError, match=f"announced an error of {_transfer._MAX_ERROR + 1} bytes"):
        _receive(tmp_path / "dst", link)
    assert not list((tmp_path / "dst").rglob("commit.json*"))


def test_receiver_keeps_a_commit_record_with_a_bad_checksum_invisible(tmp_path):
    rel = "rank-00002/seg-x"
    link = _ScriptedLink(
        _manifest([(f"{rel}/data/c/0", 5), (f"{rel}/commit.json", 2)]),
        [b"hello", b"{}"],
        crcs=[google_crc32c.value(b"hello"), 12345],
    )
    with pytest.raises(spillmerge.CorruptSpillError, match="received from rank 1 with CRC-32C"):
        _receive(tmp_path / "dst", link)
    assert link.acks == [0, 1]  # the sender is told, so it stops too
    assert not (tmp_path / "dst" / rel / "commit.json").exists()


# ------------------------------------------------------------------ gated fsspec filesystems
class GatedMemoryFS(MemoryFileSystem):
    """An in-memory filesystem (its own store) that counts and can hold reads and writes of data
    chunks, so a test observes how many are in flight at once."""

    protocol = "gatedmem"
    store: dict = {}
    pseudo_dirs = [""]
    gate = threading.Event()
    """Writes of spill data chunks wait for this."""
    lock = threading.Condition()
    reads_in_flight = 0
    max_reads_in_flight = 0
    hold = 0.3
    """Seconds a data read waits for a second one to join it."""

    @classmethod
    def reset(cls) -> None:
        cls.store.clear()
        cls.gate = threading.Event()
        cls.reads_in_flight = cls.max_reads_in_flight = 0
        cls.hold = 0.3

    def pipe_file(self, path, value, **kwargs):
        if "/data/c/" in path:
            type(self).gate.wait(timeout=120)
        return super().pipe_file(path, value, **kwargs)

    def cat_ranges(self, paths, starts, ends, **kwargs):
        cls = type(self)
        if not any("/data/c/" in p for p in paths):
            return super().cat_ranges(paths, starts, ends, **kwargs)
        with cls.lock:
            cls.reads_in_flight += 1
            cls.max_reads_in_flight = max(cls.max_reads_in_flight, cls.reads_in_flight)
            cls.lock.notify_all()
            # Hold this read until another one joins it (or a moment passes): a copy that keeps
            # more than the budget in flight shows up as two reads at once. Once seen, no more holds.
            cls.lock.wait_for(lambda: cls.max_reads_in_flight > 1, timeout=cls.hold)
        try:
            return super().cat_ranges(paths, starts, ends, **kwargs)
        finally:
            with cls.lock:
                cls.reads_in_flight -= 1


@pytest.fixture
def gated() -> Any:
    fsspec.register_implementation("gatedmem", GatedMemoryFS, clobber=True)
    GatedMemoryFS.reset()
    GatedMemoryFS.gate.set()
    yield GatedMemoryFS
    GatedMemoryFS.gate.set()
    GatedMemoryFS.reset()


def test_merge_keeps_at_most_its_memory_budget_of_stripes_in_flight(tmp_path, gated):
    root = "gatedmem://budget/spill"
    with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=4096) as w:
        for i in range(6):
            w.write("f.mp4", i, _frame(i))
    # Output chunks of one frame: 6 stripes of 4 KiB; a budget of one stripe allows one in flight
    # although 4 threads are free.
    rep = spillmerge.merge(root, str(tmp_path / "out"), chunk_bytes=4096, memory_budget=4096, threads=4, progress=False)
    assert rep.n_frames == 6
    assert gated.max_reads_in_flight == 1
    # The same merge with room for all of them does keep several in flight (the probe works;
    # a long hold, which ends as soon as a second read joins the first).
    gated.max_reads_in_flight, gated.hold = 0, 30.0
    spillmerge.merge(root, str(tmp_path / "out2"), chunk_bytes=4096, memory_budget=1 << 20, threads=4, progress=False)
    assert gated.max_reads_in_flight > 1
    res = spillmerge.open(str(tmp_path / "out"))
    assert torch.equal(res["f.mp4"].to_torch(), torch.stack([_frame(i) for i in range(6)]))


def _blocked_in_acquire(thread: threading.Thread) -> bool:
    """True while ``thread`` waits inside ``BufferPool.acquire`` (for a buffer to come back)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None and frame.f_back is not None:
        caller = frame.f_back
        if (
            frame.f_code.co_name == "wait"
            and caller.f_code.co_name == "acquire"
            and caller.f_code.co_filename.endswith("_write/flush.py")
        ):
            return True
        frame = caller
    return False


def test_write_blocks_while_every_staging_buffer_waits_for_storage(gated):
    """Backpressure itself: with storage stalled, ``write()`` stops once both staging buffers are
    full, instead of buffering the 40 frames; it goes on once storage moves again."""
    gated.gate.clear()
    written: list[int] = []
    errors: list[BaseException] = []

    def spill() -> None:
        try:
            with spillmerge.SpillWriter(
                "gatedmem://bp/spill", rank=0, world_size=1, chunk_bytes=4096, staging_bytes=2 * 4096, flush_threads=1
            ) as w:
                for i in range(40):
                    w.write("f", i, _frame(i))
                    written.append(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=spill, name="test-spill")
    t.start()
    try:
        deadline = time.monotonic() + 60  # a hang guard only: the pass path does not depend on it
        while t.is_alive() and len(written) <= 3 and not _blocked_in_acquire(t) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert t.is_alive() and _blocked_in_acquire(t), f"write() did not block: {len(written)} frames written"
        # Two buffers (one uploading, one queued) and the frame being copied: no more.
        assert len(written) <= 3, written
    finally:
        gated.gate.set()
        t.join(60)
    assert not t.is_alive() and not errors, errors
    assert written == list(range(40))
    out = "gatedmem://bp/out"
    spillmerge.merge("gatedmem://bp/spill", out, progress=False)
    assert torch.equal(spillmerge.open(out)["f"].to_torch(), torch.stack([_frame(i) for i in range(40)]))


# --------------------------------------------------------------------- SIGKILL in the middle
_KILLED_CHILD = r"""
import os, sys, time, numpy, spillmerge
root = sys.argv[1]
with spillmerge.SpillWriter(root, rank=0, world_size=2, chunk_bytes=4096, flush_threads=2) as w:
    for i in range(1_000_000):  # never finishes: SIGKILLed while writing
        w.write("k.mp4", i, numpy.full(1024, i, numpy.float32))
"""


def _complete_entries(journal: Path) -> int:
    """Entries 0..m-1 that decode now (local writes are not atomic: the newest may be torn)."""
    m = 0
    while (journal / f"{m:06d}").exists():
        try:
            FS.decode_journal((journal / f"{m:06d}").read_bytes(), path=str(journal))
        except spillmerge.CorruptSpillError:
            break
        m += 1
    return m


def test_a_rank_sigkilled_mid_spill_leaves_a_salvageable_prefix(tmp_path):
    """A real kill, not a graceful drain: the flush thread dies with uploads and journal entries in
    flight. The rank has no commit record; what its journal lists is salvaged bit-exact, as one
    prefix of its frames (entries replay in order and stop at the first gap)."""
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=1, world_size=2) as w:
        w.write("other.mp4", 0, torch.ones(3))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(root)], stderr=subprocess.PIPE)
    try:
        journal = None
        deadline = time.monotonic() + 120  # hang guard only
        while time.monotonic() < deadline and proc.poll() is None:
            segs = list(root.glob("rank-00000/seg-*/journal"))
            if segs and len([n for n in os.listdir(segs[0]) if n.isdigit()]) >= 20:
                journal = segs[0]
                break
            time.sleep(0.01)
        assert journal is not None, proc.stderr.read().decode() if proc.poll() is not None else "no progress"
        seen = _complete_entries(journal)
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    seg = journal.parent
    assert not (seg / FS.COMMIT_NAME).exists() and not (seg / FS.FAILURE_NAME).exists()
    with pytest.raises(spillmerge.IncompleteSpillError) as info:
        spillmerge.merge(str(root), str(tmp_path / "out"), progress=False)
    assert info.value.missing == [0]
    rep = spillmerge.merge(str(root), str(tmp_path / "out"), allow_partial=True, progress=False)
    assert rep.missing_ranks == [0]
    n = rep.salvaged_frames[0]
    assert n >= seen >= 19  # every entry that was whole before the kill is salvaged
    res = spillmerge.open(str(tmp_path / "out"))
    assert res.frames("k.mp4").tolist() == list(range(n))
    # One column for both files (format 2): other.mp4's (3,) rows make it ragged, so k.mp4's rows
    # (all (1024,)) are stacked by slicing the view, not by a whole-array to_torch().
    got = torch.from_numpy(res["k.mp4"][:])
    assert torch.equal(got, torch.arange(n, dtype=torch.float32)[:, None].expand(n, 1024))
    assert res["other.mp4"][0].tolist() == [1.0, 1.0, 1.0]
    assert spillmerge.verify(str(tmp_path / "out")).ok


def test_a_flipped_data_byte_on_an_object_store_fails_the_merge(tmp_path):
    """The range-GET path of the copy (a spill root on an object store) checks each frame too."""
    root = "memory://guards-crc/spill"
    fs = fsspec.filesystem("memory")
    try:
        with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=4096) as w:
            for i in range(4):
                w.write("f0.mp4", i, _frame(i))
        (key,) = [p for p in fs.find("/guards-crc/spill") if p.endswith("/data/c/2")]
        raw = bytearray(fs.cat_file(key))
        raw[7] ^= 0x04
        fs.pipe_file(key, bytes(raw))
        with pytest.raises(spillmerge.CorruptSpillError, match=r"checksum mismatch for 'f0.mp4' frame 2"):
            spillmerge.merge(root, str(tmp_path / "out"), chunk_bytes=4096, progress=False)
    finally:
        fs.rm("/guards-crc", recursive=True)
