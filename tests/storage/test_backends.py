"""The storage-facing behaviour, written once and run against every back-end (local directory,
memory://, a real S3 protocol server): see the ``backend`` fixture in conftest.py."""

from __future__ import annotations

import fsspec
import numpy as np
import pytest
import torch
import zarr
from _helpers import zarr_filenames

import spillmerge


def _value(name: str, frame: int) -> dict:
    g = torch.Generator().manual_seed(frame * 1000 + len(name))
    return {"mask": torch.randn(2, 8, 8, generator=g).to(torch.bfloat16), "score": float(frame), "n": frame}


def _spill(backend, root: str, world: int = 2, frames: int = 12) -> None:
    for r in range(world):
        with spillmerge.SpillWriter(
            root, rank=r, world_size=world, storage_options=backend.options, chunk_bytes=4096
        ) as w:
            for f in range(r, frames, world):
                w.write("clip/a b.mp4", f, _value("clip/a b.mp4", f))
                w.write("other.mp4", f, torch.full((3,), float(f)))


def test_round_trip_and_plain_zarr(backend):
    root, out = backend.url("spill"), backend.url("out.zarr")
    _spill(backend, root)
    rep = spillmerge.merge(root, out, storage_options=backend.options)
    assert (rep.n_files, rep.n_frames, rep.ranks) == (2, 24, [0, 1])
    res = spillmerge.open(out, storage_options=backend.options)
    assert res.filenames == ["clip/a b.mp4", "other.mp4"]
    assert res.frames("clip/a b.mp4").tolist() == list(range(12))
    mask = res["clip/a b.mp4"]["mask"].to_torch()
    for f in range(12):
        want = _value("clip/a b.mp4", f)["mask"]
        assert torch.equal(mask[f].view(torch.int16), want.view(torch.int16))
    g = zarr.open_group(out, mode="r", storage_options=backend.options or None)
    names, off = zarr_filenames(g), g["index/frame_offsets"][:]
    i = names.index("other.mp4")
    arr = g["columns/_value/values"]  # other.mp4 holds plain tensors; clip/a b.mp4 dicts
    first = int(g["columns/_value/offsets"][int(off[i])])
    np.testing.assert_array_equal(arr[first : first + 12, 0], np.arange(12, dtype=np.float32))
    assert spillmerge.verify(out, backend.options).ok and spillmerge.verify(root, backend.options).ok


def test_barrier_failure_records_and_partial_merge(backend):
    root = backend.url("spill")
    _spill(backend, root, world=3, frames=6)
    fs, path = fsspec.core.url_to_fs(root, **backend.options)
    # Rank 2 reruns and is killed (no record at all): named at the timeout with what it flushed.
    dead = spillmerge.SpillWriter(root, rank=2, world_size=3, storage_options=backend.options, chunk_bytes=4096)
    dead.open()
    for f in range(200, 205):
        dead.write("dead.mp4", f, torch.full((1024,), float(f)))  # 4 KiB: one chunk each, flushed
    dead._staging.flusher.q.put(None)
    dead._staging.flusher.join()
    with pytest.raises(spillmerge.CommitTimeout, match=r"rank 2 \(uncommitted segment .*5 chunk\(s\) flushed") as tinfo:
        spillmerge.merge(root, backend.url("o1"), storage_options=backend.options, timeout=0.5)
    assert tinfo.value.missing == [2]
    # Rank 1 crashes in a rerun: its failure record ends the wait at once.
    with pytest.raises(KeyError):
        with spillmerge.SpillWriter(root, rank=1, world_size=3, storage_options=backend.options) as w:
            w.write("other.mp4", 100, torch.zeros(3))
            raise KeyError("missing input")
    with pytest.raises(spillmerge.RankFailedError, match="rank 1: KeyError") as info:
        spillmerge.merge(root, backend.url("o1"), storage_options=backend.options, timeout=30)
    assert list(info.value.failures) == [1]
    rep = spillmerge.merge(root, backend.url("o1"), storage_options=backend.options, allow_partial=True)
    assert rep.missing_ranks == [1, 2]
    frames = spillmerge.open(backend.url("o1"), storage_options=backend.options).frames("other.mp4").tolist()
    assert frames == [*range(6), 100]
    assert spillmerge.open(backend.url("o1"), storage_options=backend.options).frames("dead.mp4").tolist() == list(
        range(200, 205)
    )
    assert fs.exists(f"{path}/rank-00001")


def test_corruption_is_found_by_verify_and_merge(backend):
    root = backend.url("spill")
    _spill(backend, root, world=1)
    fs, path = fsspec.core.url_to_fs(root, **backend.options)
    chunk = sorted(p for p in fs.find(path) if "/data/c/" in p)[0]
    raw = bytearray(fs.cat_file(chunk))
    raw[10] ^= 0xFF
    fs.pipe_file(chunk, bytes(raw))
    rep = spillmerge.verify(root, backend.options)
    assert not rep.ok and any("checksum mismatch" in p and chunk.split("/", 1)[-1] in p for p in rep.problems)
    with pytest.raises(spillmerge.CorruptSpillError, match="checksum mismatch"):
        spillmerge.merge(root, backend.url("out"), storage_options=backend.options)
    assert not fs.exists(backend.url("out").split("://")[-1] + "/spillmerge-complete.json")


def test_output_is_protected_and_interrupted_merges_rebuild(backend):
    root, out = backend.url("spill"), backend.url("out")
    _spill(backend, root, world=1, frames=3)
    spillmerge.merge(root, out, storage_options=backend.options)
    with pytest.raises(spillmerge.OutputExistsError):
        spillmerge.merge(root, out, storage_options=backend.options)
    fs, path = fsspec.core.url_to_fs(out, **backend.options)
    fs.rm(f"{path}/spillmerge-complete.json")
    with pytest.raises(spillmerge.IncompleteOutputError):
        spillmerge.open(out, storage_options=backend.options)
    spillmerge.merge(root, out, storage_options=backend.options)
    assert spillmerge.open(out, storage_options=backend.options).frames("other.mp4").tolist() == [0, 1, 2]


def test_glob_characters_in_a_name_delete_that_name_and_nothing_beside_it(backend):
    """fsspec's rm reads ``*?[`` as a glob pattern: an output named ``res[12]`` replaced, and its
    spill root ``sp[1]`` removed, delete their own objects (the lease released too), never the
    complete output ``res1`` that the pattern matches beside them."""
    root, out, other = backend.url("sp[1]"), backend.url("res[12]"), backend.url("res1")
    _spill(backend, root, world=1, frames=2)
    spillmerge.merge(root, other, storage_options=backend.options)
    fs, path = fsspec.core.url_to_fs(other, **backend.options)
    before = sorted(fs.find(path))
    spillmerge.merge(root, out, storage_options=backend.options)
    rep = spillmerge.merge(root, out, storage_options=backend.options, overwrite=True, remove_spill=True)
    assert rep.n_frames == 4
    fs.invalidate_cache()
    assert sorted(fs.find(path)) == before
    assert fs.find(fsspec.core.url_to_fs(root, **backend.options)[1]) == []
    assert spillmerge.open(out, storage_options=backend.options).frames("other.mp4").tolist() == [0, 1]
    assert spillmerge.open(other, storage_options=backend.options).frames("other.mp4").tolist() == [0, 1]


def test_resume_sees_committed_keys(backend):
    root = backend.url("spill")
    _spill(backend, root, world=2, frames=4)
    assert spillmerge.committed_keys(root, backend.options) == {"clip/a b.mp4": {0, 1, 2, 3}, "other.mp4": {0, 1, 2, 3}}
    with spillmerge.SpillWriter(root, rank=0, world_size=2, storage_options=backend.options) as w:
        assert w.is_committed("other.mp4", 3) and not w.is_committed("other.mp4", 4)


def test_syncing_an_output_tree_skips_a_file_another_part_renamed_away(tmp_path):
    """Parts of one merge write beside each other: a part's fsync of the output tree may list
    another part's temporary file that is renamed before its fsync. That file is not ours to
    flush (the other part syncs what it renames), so the walk goes on; a file we name ourselves
    and that is gone is still an error, naming it."""
    from spillmerge._storage import Storage

    (tmp_path / "out").mkdir()
    out = Storage(str(tmp_path / "out"))
    out.put("kept.json", b"{}")
    out.sync(["gone.json.tmp-1"], missing_ok=True)  # listed by the walk, renamed away since
    out.fsync_tree()
    with pytest.raises(spillmerge.SpillStorageError, match="gone.json"):
        out.sync(["gone.json"])


def test_a_process_forked_after_a_spill_spills_and_merges(tmp_path):
    """The fsync threads are started once per process and shared by every sync; a child forked
    after the parent used them (a DataLoader worker, a launcher's fork) has none of them, and
    its spill must still commit and merge, not wait forever on threads that do not exist."""
    import multiprocessing as mp

    _spill_local(str(tmp_path / "parent"), 0)
    ctx = mp.get_context("fork")
    child = ctx.Process(target=_spill_local, args=(str(tmp_path / "child"), 1))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child's spill hung")
    assert child.exitcode == 0
    rep = spillmerge.merge(str(tmp_path / "child"), str(tmp_path / "out"))
    assert (rep.n_files, rep.n_frames) == (1, 6)


def _spill_local(root: str, seed: int) -> None:
    with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=4096) as w:
        for f in range(6):
            w.write("a.mp4", f, torch.full((2048,), float(f + seed)))


class _DyingSender:
    """A node-local transfer link whose sender dies once it sent ``pieces`` pieces of ``data``
    (at the checksum that follows them when it sent them all)."""

    piece = 64

    def __init__(self, data: bytes, pieces: int) -> None:
        self.data, self.pieces, self.sent = np.frombuffer(data, dtype=np.uint8), pieces, 0

    def _died(self, what: str, sender: int, me: int) -> spillmerge.RankFailedError:
        return spillmerge.RankFailedError(
            f"rank {me}: receiving {what} from rank {sender} failed", failures={sender: ""}
        )

    def recv_bytes_piece(self, n: int, sender: int, me: int, what: str, slot: int = 0) -> np.ndarray:
        if self.sent == self.pieces:
            raise self._died(what, sender, me)
        lo, self.sent = self.sent * self.piece, self.sent + 1
        return self.data[lo : lo + n]

    def recv_ints(self, n: int, sender: int, me: int, what: str) -> list[int]:
        raise self._died(what, sender, me)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # an upload ended when collected
@pytest.mark.parametrize("pieces", [1, 100], ids=["mid-object", "at-its-checksum"])
def test_a_receive_interrupted_in_a_commit_record_never_looks_committed(backend, pieces):
    """A streamed write (``open_write``, here node-local transfer's receive) that fails partway
    leaves no object under its name, nor a torn one in place of the object it was replacing, on
    every backend: a half-received rank never looks committed (memory:// shows an object it is
    writing from the moment it is opened; a discarded upload must not complete when collected)."""
    from spillmerge._dist.transfer import _receive_object
    from spillmerge._storage import Storage

    root = backend.url("spill")
    _spill(backend, root)
    storage = Storage(root, backend.options)
    commit = next(rel for rel, _ in storage.find("rank-00001") if rel.endswith("/commit.json"))
    record = storage.get(commit)
    storage.rm_tree(commit)  # rank 1's segment received up to its commit record, which comes last
    with pytest.raises(spillmerge.RankFailedError):
        _receive_object(storage, _DyingSender(record, pieces), 0, 1, commit, len(record))  # type: ignore[arg-type]
    assert not storage.exists(commit)
    with pytest.raises(spillmerge.CommitTimeout) as info:
        spillmerge.merge(root, backend.url("out"), storage_options=backend.options, timeout=0.5)
    assert info.value.missing == [1]
    storage.put(commit, record)  # the record in place: a failed rewrite leaves it whole
    with pytest.raises(spillmerge.RankFailedError):
        _receive_object(storage, _DyingSender(record[::-1], pieces), 0, 1, commit, len(record))  # type: ignore[arg-type]
    assert storage.get(commit) == record
    assert spillmerge.merge(root, backend.url("out"), storage_options=backend.options).ranks == [0, 1]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_parquet_export_that_fails_partway_leaves_no_file(backend, monkeypatch):
    """``to_parquet`` streams its file: one that fails after a row group leaves nothing at the
    destination (a half file would read as a shorter export, or not at all)."""
    from spillmerge._read import export

    root, out, dest = backend.url("spill"), backend.url("out"), backend.url("x.parquet")
    _spill(backend, root, world=1)
    spillmerge.merge(root, out, storage_options=backend.options)
    store = spillmerge.open(out, storage_options=backend.options)
    whole = export.iter_batches

    def dying(*args, **kwargs):
        batches = whole(*args, **kwargs)
        yield next(batches)
        raise OSError("the output vanished")

    monkeypatch.setattr(export, "iter_batches", dying)
    with pytest.raises(spillmerge.SpillStorageError, match="the output vanished"):
        store.to_parquet(dest, batch_size=2, storage_options=backend.options)
    fs, path = fsspec.core.url_to_fs(backend.base, **backend.options)
    fs.invalidate_cache()
    assert not [p for p in fs.find(path) if "x.parquet" in p]


def test_of_threads_creating_one_name_at_once_exactly_one_succeeds(backend):
    """``create`` is exclusive between threads too (a lease taken by two merges in one process):
    memory:// checks that a name is free before it puts the file, so both could succeed there."""
    import sys
    import threading

    from spillmerge._storage import Storage

    if backend.name == "s3":
        # S3 makes a conditional PUT atomic; moto's server looks the key up and then puts it
        # (moto/s3/responses.py, If-None-Match), so two threads can both win there: not ours to test.
        pytest.skip("moto's If-None-Match is check-then-put; S3's conditional create is tested sequentially")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between the check and the put
    try:
        storage = Storage(backend.url("leases"), backend.options)
        for i in range(100):
            go, won = threading.Barrier(4), []
            storage.makedirs(str(i))

            def create(k: int, i: int = i, go: threading.Barrier = go, won: list = won) -> None:
                go.wait()
                if storage.create(f"{i}/lease.json", b"%d" % k):
                    won.append(k)

            threads = [threading.Thread(target=create, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(won) == 1 and storage.get(f"{i}/lease.json") == b"%d" % won[0], (i, won)
    finally:
        sys.setswitchinterval(old)
