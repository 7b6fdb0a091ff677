"""Single-process behaviour of SpillWriter, merge and open on local and memory:// roots."""

from __future__ import annotations

import os
import shutil
import time

import fsspec
import numpy as np
import pytest
import torch
import zarr
from _helpers import bits, is_safe_node_name, random_bits, zarr_filenames
from fsspec.implementations.memory import MemoryFileSystem

import spillmerge
from spillmerge._format import common as F
from spillmerge._format import output as FO

TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64, torch.complex64, torch.complex128, torch.complex32,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    # newer torch releases only: packed / raw-bit types, kept as their bits
    *(getattr(torch, n) for n in ("float8_e8m0fnu", "float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8",
                                  "bits16") if hasattr(torch, n)),
]  # fmt: skip


def test_every_torch_dtype_round_trips_bit_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    expected = {}
    with spillmerge.SpillWriter(tmp_path / "spill", rank=0, world_size=1) as w:
        for dt in TORCH_DTYPES:
            name = f"{dt}.bin"
            for frame in (5, 1, 3):
                t = random_bits(dt, (2, 3), g)
                w.write(name, frame, t)
                expected[(name, frame)] = t
    report = spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out"))
    assert report.n_files == len(TORCH_DTYPES) and report.n_frames == 3 * len(TORCH_DTYPES)
    res = spillmerge.open(str(tmp_path / "out"))
    for dt in TORCH_DTYPES:
        name = f"{dt}.bin"
        assert res.frames(name).tolist() == [1, 3, 5]
        got = res[name].to_torch()
        assert got.dtype == dt and got.shape == (3, 2, 3)
        for row, frame in enumerate([1, 3, 5]):
            assert torch.equal(bits(got[row]), bits(expected[(name, frame)])), (dt, frame)


def test_numpy_scalars_nested_dicts_and_odd_tensors(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    value = {
        "transposed": base.t(),  # non-contiguous
        "grad": base.clone().requires_grad_(),
        "conj": torch.complex(base, -base).conj(),
        "np": big_endian,
        "scalars": {"i": 7, "f": 2.5, "b": True, "c": 1 + 2j, "np": np.float32(3.0), "t0": torch.tensor(9)},
        "empty": torch.zeros(0, 3),
    }
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        w.update({"clip": {0: value, 1: value}})
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    v = res["clip"]
    assert torch.equal(v["transposed"].to_torch()[1], base.t())
    assert torch.equal(v["grad"].to_torch()[0], base)
    assert torch.equal(v["conj"].to_torch()[0], torch.complex(base, base))
    assert v["np"][0].tolist() == big_endian.tolist() and v["np"].dtype == np.int32
    s = v["scalars"]
    assert s["i"].shape == (2,) and s["i"][1] == 7 and s["i"].dtype == np.int64
    assert s["f"][0] == 2.5 and s["b"][0] and s["c"][0] == 1 + 2j and s["np"][0] == 3.0 and s["t0"][0] == 9
    assert v["empty"].shape == (2, 0, 3)


def test_update_shapes_and_frame_order_across_sessions(tmp_path):
    root = str(tmp_path / "s")
    with spillmerge.SpillWriter(root, rank=0, world_size=2) as w:
        w.update({"a": (3, torch.tensor([3.0]))})
        w.update({"a": {1: torch.tensor([1.0]), 2: torch.tensor([2.0])}})
    with spillmerge.SpillWriter(root, rank=1, world_size=2) as w:
        w.write("a", np.int64(0), torch.tensor([0.0]))
        w.write("a", torch.tensor(4), torch.tensor([4.0]))
    # A second session of rank 1 (a resumed job) adds frames and repeats one identically.
    with spillmerge.SpillWriter(root, rank=1, world_size=2) as w:
        w.write("a", 5, torch.tensor([5.0]))
        w.write("a", 4, torch.tensor([4.0]))
    rep = spillmerge.merge(root, str(tmp_path / "o"))
    assert rep.segments == 3 and rep.duplicates == 1 and rep.ranks == [0, 1]
    res = spillmerge.open(str(tmp_path / "o"))
    assert res.frames("a").dtype == np.int64
    assert res.frames("a").tolist() == [0, 1, 2, 3, 4, 5]
    assert res["a"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"late.mp4": (0, object())}, "late.mp4"),  # a value the writer refuses
        ({"late.mp4": (-1, torch.zeros(3))}, "frame_idx"),  # a bad frame index
        ({"late.mp4": 7}, "must be a \\(frame_idx, value\\) tuple"),  # a bad item shape
        ({"kept.mp4": (0, torch.ones(3))}, "already written"),  # a duplicate of other content
    ],
    ids=["value", "frame", "shape", "duplicate"],
)
def test_update_is_all_or_nothing(tmp_path, bad, error):
    """A bad item anywhere in an update() raises what write() would and stages nothing of the
    call (as write_batch); what was written before stays and the writer goes on."""
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        w.write("kept.mp4", 0, torch.zeros(3))
        good = {f"f{i}.mp4": {0: torch.full((3,), float(i)), 1: {"x": i}} for i in range(3)}
        with pytest.raises(spillmerge.SpillValueError, match=error) as info:
            w.update({**good, **bad})
        assert not str(info.value).startswith("write_batch item")  # write()'s words, not a batch position
        assert w.stats()["frames"] == 1 and w.stats()["rows"] == 1
        w.update({"after.mp4": (2, torch.ones(2))})
    spillmerge.merge(root, out, progress=False)
    assert sorted(spillmerge.open(out).filenames) == ["after.mp4", "kept.mp4"]


@pytest.mark.parametrize(
    "frame_idx",
    [-1, 1.5, True, "3", None, torch.tensor(1.0), torch.tensor([1, 2]), np.float64(2), 2**63],
)
def test_bad_frame_index_is_a_clear_error(tmp_path, frame_idx):
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        with pytest.raises(spillmerge.SpillValueError, match="frame_idx") as info:
            w.write("clip.mp4", frame_idx, torch.zeros(1))
        assert info.value.filename == "clip.mp4"
        w.write("clip.mp4", 0, torch.zeros(1))  # the writer is still usable


def _cycle() -> list[object]:
    a: list[object] = []
    a.append(a)
    return a


@pytest.mark.parametrize(
    "value, match",
    [
        ({"x": [1, object()]}, r"'x/\[1\]'.*frame 0.*object"),  # version 3: pickle's opt-in at any depth
        ({"x": object()}, "'x'.*object"),
        (_cycle(), r"'\[0\]'.*cycle"),
        ((t for t in ()), "generator"),
        (np.array(["a"], dtype=object), "pickle"),
        ({1: torch.zeros(1)}, "dict keys must be str"),
        (2**70, "int64"),
        (torch.zeros(2).to_sparse(), "dense"),
    ],
)
def test_unstorable_values_name_the_problem(tmp_path, value, match):
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        with pytest.raises(spillmerge.SpillValueError, match=match):
            w.write("f", 0, value)
        with pytest.raises(spillmerge.SpillValueError, match="filename must be a str"):
            w.write(b"bytes-name", 0, torch.zeros(1))


@pytest.mark.filterwarnings("ignore::UserWarning")  # both kinds are prototypes or deprecated in torch
def test_nested_and_quantized_tensors_are_refused_as_such(tmp_path):
    values = {
        "nested": torch.nested.nested_tensor([torch.zeros(1), torch.zeros(2)]),
        "quantized": torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8),
    }
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        for kind, value in values.items():
            with pytest.raises(spillmerge.SpillValueError, match=f"only dense .*, got a {kind} tensor"):
                w.write("f", 0, value)


def test_a_layout_change_on_one_rank_is_another_variant(tmp_path):
    """Version 3: a leaf's dtype, ndim or kind may change between frames of a file; each frame
    reads back as it was written, and the leaf views show one view per variant."""
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        w.write("v", 0, {"mask": torch.zeros(2, 2), "score": 1.0})
        w.write("v", 1, {"mask": torch.zeros(2, 2, dtype=torch.float16), "score": 1.0})
        w.write("v", 2, {"mask": "not a mask"})
        w.write("v", 3, {"mask": torch.ones(2, 2), "score": 2.0})
        w.write("v", 4, {"mask": torch.ones(3, 3)})  # shapes may change, leaves may be absent
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    assert res.frames("v").tolist() == [0, 1, 2, 3, 4]
    got = [res.value("v", i) for i in range(5)]
    assert got[1]["mask"].dtype == np.float16 and got[2] == {"mask": "not a mask"}
    assert got[3]["score"] == 2.0 and type(got[3]["score"]) is float and got[4]["mask"].shape == (3, 3)
    assert sorted(res["v"]) == ["mask.float16.2d", "mask.float32.2d", "mask.str", "score"]
    assert res["v"]["mask.str"][2] == "not a mask" and res["v"]["mask.str"][0] is None


def test_leaves_missing_on_one_rank_are_absent_in_those_rows(tmp_path):
    root = str(tmp_path / "s")
    with spillmerge.SpillWriter(root, rank=0, world_size=3) as w:
        w.write("v", 0, {"mask": torch.zeros(2), "score": 1.0})
    with spillmerge.SpillWriter(root, rank=1, world_size=3) as w:
        w.write("v", 1, {"mask": torch.zeros(2)})  # this rank's model gave no score: None in format 2
    with spillmerge.SpillWriter(root, rank=2, world_size=3) as w:
        w.write("v", 2, {"mask": torch.zeros(2), "score": 3.0})
    spillmerge.merge(root, str(tmp_path / "o"))
    score = spillmerge.open(str(tmp_path / "o"))["v"]["score"]
    assert [score[i] for i in range(3)] == [1.0, None, 3.0] and score.valid.tolist() == [True, False, True]


def test_duplicate_policies_on_one_rank(tmp_path):
    for policy, want in (("first", 1.0), ("last", 2.0)):
        root = str(tmp_path / policy)
        with spillmerge.SpillWriter(root, on_duplicate=policy) as w:
            w.write("f", 0, torch.tensor(1.0))
            w.write("f", 0, torch.tensor(2.0))
        spillmerge.merge(root, root + ".out")
        assert spillmerge.open(root + ".out")["f"][0] == want
    with spillmerge.SpillWriter(str(tmp_path / "err")) as w:
        w.write("f", 0, torch.tensor(1.0))
        w.write("f", 0, torch.tensor(1.0))  # the same bytes again: never an error
        with pytest.raises(spillmerge.DuplicateFrameError, match="frame 0 of 'f' was already written by rank 0"):
            w.write("f", 0, torch.tensor(2.0))


def test_merge_takes_an_output_path_object(tmp_path):
    with spillmerge.SpillWriter(tmp_path / "spill", rank=0, world_size=1) as w:
        w.write("a.mp4", 0, 1.5)
    assert w.merge(tmp_path / "out", wait=True, progress=False).n_frames == 1


@pytest.mark.parametrize("option", [{"world_size": 1}, {"run_id": "other"}])
def test_merge_refuses_the_writers_own_world_size_and_run_id_naming_them(tmp_path, option):
    with spillmerge.SpillWriter(tmp_path / "spill", rank=0, world_size=1) as w:
        w.write("a.mp4", 0, 1.5)
    (key,) = option
    with pytest.raises(spillmerge.SpillMergeError, match=rf"^{key}= cannot be passed to SpillWriter.merge"):
        w.merge(tmp_path / "out", progress=False, **option)
    assert not (tmp_path / "out").exists()
    assert w.merge(tmp_path / "out", progress=False, codec="zstd").n_frames == 1


def test_writer_lifecycle_errors(tmp_path):
    w = spillmerge.SpillWriter(str(tmp_path / "s"))
    with pytest.raises(spillmerge.WriterClosedError):
        w.write("f", 0, 1.0)
    with w:
        w.write("f", 0, 1.0)
        with pytest.raises(spillmerge.WriterClosedError, match="after leaving"):
            w.merge(str(tmp_path / "o"))
    with pytest.raises(spillmerge.WriterClosedError):
        w.write("f", 1, 1.0)
    with pytest.raises(spillmerge.WriterClosedError):
        w.__enter__()
    assert w.merge(str(tmp_path / "o")).n_frames == 1
    with pytest.raises(spillmerge.SpillValueError, match="rank 3 is not in"):
        spillmerge.SpillWriter(str(tmp_path / "s"), rank=3, world_size=2)
    with pytest.raises(spillmerge.SpillValueError, match="on_duplicate"):
        spillmerge.SpillWriter(str(tmp_path / "s"), on_duplicate="newest")


def test_rank_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    w = spillmerge.SpillWriter(str(tmp_path / "s"))
    assert (w.rank, w.world_size) == (2, 3)
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(spillmerge.SpillValueError, match="RANK='two'"):
        spillmerge.SpillWriter(str(tmp_path / "s"))


def test_background_write_failure_reaches_the_loop(tmp_path):
    root = tmp_path / "s"
    w = spillmerge.SpillWriter(str(root), chunk_bytes=4096, staging_bytes=8192)
    with pytest.raises(spillmerge.SpillStorageError) as info:
        with w:
            w.write("f", 0, torch.zeros(1024))  # exactly one chunk: handed to the flush thread
            for _ in range(100):  # the storage vanishes under the writer (whose flush thread may
                shutil.rmtree(root, ignore_errors=True)  # still be adding files while we delete)
                if not root.exists():
                    break
            assert not root.exists()
            for i in range(1, 50):
                w.write("f", i, torch.zeros(1024))
    # the flush worker's write or the journal thread's fsync of a written chunk meets it first
    assert ("cannot write" in str(info.value) or "cannot sync" in str(info.value)) and str(root) in str(info.value)


class SlowMemoryFS(MemoryFileSystem):
    """An in-memory filesystem whose writes take 20 ms: a slow object store."""

    protocol = "slowmem"
    store: dict = {}
    pseudo_dirs = [""]
    puts = 0

    def pipe_file(self, path, value, **kwargs):
        type(self).puts += 1
        time.sleep(0.02)
        return super().pipe_file(path, value, **kwargs)


def test_backpressure_bounds_staging_memory_on_a_slow_store(tmp_path):
    fsspec.register_implementation("slowmem", SlowMemoryFS, clobber=True)
    SlowMemoryFS.store.clear()
    frame = torch.arange(1024, dtype=torch.float32)  # 4 KiB = one chunk
    t0 = time.perf_counter()
    with spillmerge.SpillWriter("slowmem://bp/spill", chunk_bytes=4096, staging_bytes=2 * 4096, flush_threads=1) as w:
        for i in range(40):
            w.write("f", i, frame + i)
        assert w.stats()["staging_buffers"] <= 2
    assert time.perf_counter() - t0 >= 40 * 0.02  # write() waited for storage instead of buffering
    spillmerge.merge("slowmem://bp/spill", str(tmp_path / "out"))
    res = spillmerge.open(str(tmp_path / "out"))
    assert torch.equal(res["f"].to_torch(), torch.stack([frame + i for i in range(40)]))


def test_memory_filesystem_end_to_end():
    fs = fsspec.filesystem("memory")
    fs.rm("/mm", recursive=True) if fs.exists("/mm") else None
    with spillmerge.SpillWriter("memory://mm/spill", chunk_bytes=4096) as w:
        for i in range(10):
            w.write("x/../y", i, torch.full((700,), float(i)))
    spillmerge.merge("memory://mm/spill", "memory://mm/out")
    res = spillmerge.open("memory://mm/out")
    assert res.filenames == ["x/../y"] and res["x/../y"][9, 0] == 9.0
    g = zarr.open_group("memory://mm/out", mode="r")
    assert zarr_filenames(g) == ["x/../y"]


def test_plain_zarr_reads_the_output(tmp_path):
    names = ["video_001.mp4", "Video_001.MP4", "a/b/c.mp4", "../escape", ".hidden", "__x", "ü ñ %20 ☃", "x" * 300]
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        for i, n in enumerate(names):
            w.write(n, 0, torch.full((2,), float(i)))
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    g = zarr.open_group(str(tmp_path / "o"), mode="r")
    assert g.attrs["spillmerge"]["format_version"] == F.FORMAT_VERSION
    stored = zarr_filenames(g)
    assert stored == sorted(names)  # filenames are data in format 2, never node names
    off = g["index/frame_offsets"][:]
    for i, name in enumerate(stored):
        assert g["columns/_value/values"][int(off[i]), 0] == float(names.index(name))
    # Dict keys name columns: hostile ones become safe node names, distinct case-insensitively.
    hostile = {"../up": 1.0, "a/b": 2.0, "A/B": 3.0, "zarr.json": 4.0, "con": 5.0, ".": 6.0}
    with spillmerge.SpillWriter(str(tmp_path / "s2")) as w:
        w.write("f", 0, hostile)
    spillmerge.merge(str(tmp_path / "s2"), str(tmp_path / "o2"))
    cols = sorted(zarr.open_group(str(tmp_path / "o2"), mode="r")["columns"].group_keys())
    assert len({c.lower() for c in cols}) == len(cols) == len(hostile)
    assert all(is_safe_node_name(c) and not c.lower().startswith("zarr.") for c in cols), cols
    res = spillmerge.open(str(tmp_path / "o2"))
    assert {k: res["f"][k][0] for k in hostile} == hostile
    # Nothing was created outside the outputs and the spill roots.
    assert sorted(os.listdir(tmp_path)) == ["o", "o2", "s", "s2"]


def test_output_protection_and_interrupted_merge(tmp_path):
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root) as w:
        w.write("f", 0, 1.0)
    spillmerge.merge(root, out)
    with pytest.raises(spillmerge.OutputExistsError, match="overwrite"):
        spillmerge.merge(root, out)
    spillmerge.merge(root, out, overwrite=True)
    # An interrupted merge: the completion marker is missing.
    os.remove(os.path.join(out, FO.COMPLETE_NAME))
    with pytest.raises(spillmerge.IncompleteOutputError, match="did not finish"):
        spillmerge.open(out)
    spillmerge.merge(root, out)  # rebuilt without --overwrite
    assert spillmerge.open(out)["f"][0] == 1.0
    # Never delete what is not ours, never overlap the spill root.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    # (the messages name the Python argument, out=, and the CLI's flag)
    with pytest.raises(spillmerge.OutputExistsError, match=r"not a spillmerge output; choose another out= \(--out\)"):
        spillmerge.merge(root, str(tmp_path / "mine"), overwrite=True)
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"
    with pytest.raises(spillmerge.SpillValueError, match=r"overlap; choose another out= \(--out\)"):
        spillmerge.merge(root, root + "/merged")


def test_missing_and_failed_ranks(tmp_path):
    root = str(tmp_path / "s")
    with spillmerge.SpillWriter(root, rank=0, world_size=3) as w:
        w.write("f", 0, 1.0)
    with pytest.raises(RuntimeError):
        with spillmerge.SpillWriter(root, rank=2, world_size=3) as w:
            w.write("f", 2, 1.0)
            raise RuntimeError("CUDA error: device-side assert triggered")
    t0 = time.perf_counter()
    with pytest.raises(spillmerge.RankFailedError, match="rank 2: RuntimeError: CUDA error") as info:
        spillmerge.merge(root, str(tmp_path / "o"), timeout=30)
    assert time.perf_counter() - t0 < 5  # fails fast, not at the timeout
    assert info.value.failures == {2: "RuntimeError: CUDA error: device-side assert triggered"}
    # Rank 2 reruns and commits; rank 1 never shows up.
    with spillmerge.SpillWriter(root, rank=2, world_size=3) as w:
        w.write("f", 2, 1.0)
    with pytest.raises(spillmerge.CommitTimeout, match=r"rank 1 \(no segment\)") as info2:
        spillmerge.merge(root, str(tmp_path / "o"), timeout=0.3)
    assert info2.value.missing == [1] and info2.value.waited_s >= 0.3
    with pytest.raises(spillmerge.IncompleteSpillError, match="1 of 3 rank"):
        spillmerge.merge(root, str(tmp_path / "o"))
    rep = spillmerge.merge(root, str(tmp_path / "o"), allow_partial=True)
    assert rep.missing_ranks == [1] and rep.n_frames == 2
    assert rep.abandoned_segments and "rank-00002" in rep.abandoned_segments[0]


@pytest.mark.parametrize("damage", ["bit flip", "truncated", "deleted"])
def test_corrupt_data_is_detected_by_merge(tmp_path, damage):
    root = tmp_path / "s"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1, chunk_bytes=4096) as w:
        for i in range(4):
            w.write("f", i, torch.full((1024,), float(i)))
    chunk = next(root.glob("rank-00000/seg-*/data/c/2"))
    raw = bytearray(chunk.read_bytes())
    if damage == "bit flip":
        raw[100] ^= 0x01
        chunk.write_bytes(bytes(raw))
        needle = "checksum mismatch for 'f' frame 2"
    elif damage == "truncated":
        chunk.write_bytes(bytes(raw[:100]))
        needle = "short read at byte 0 \\(100 of 4096 bytes\\): the object is truncated"
    else:
        chunk.unlink()
        needle = "data chunk 2 is missing"
    with pytest.raises(spillmerge.CorruptSpillError, match=needle) as info:
        spillmerge.merge(str(root), str(tmp_path / "o"))
    assert str(chunk) in str(info.value) or damage == "bit flip"
    assert info.value.rank == 0 or damage == "truncated"  # a short read is found below the index
    assert not (tmp_path / "o").exists()  # no half-written output left behind


def test_rerun_skips_committed_keys_and_salvages_flushed_frames(tmp_path):
    root = str(tmp_path / "s")
    # A first run: rank 0 commits frames 0-3; rank 1 flushes frames 10-13 then dies (no commit).
    with spillmerge.SpillWriter(root, rank=0, world_size=2, chunk_bytes=4096) as w:
        for i in range(4):
            w.write("f", i, torch.full((1024,), float(i)))
    dead = spillmerge.SpillWriter(root, rank=1, world_size=2, chunk_bytes=4096)
    dead.open()
    for i in range(10, 15):
        dead.write("f", i, torch.full((1024,), float(i)))  # one whole chunk each: handed to the flusher
    dead._staging.flusher.q.put(None)
    dead._staging.flusher.join()  # "killed": the flush thread stops, nothing else is written
    rep = spillmerge.merge(root, str(tmp_path / "partial"), allow_partial=True)
    assert rep.missing_ranks == [1]
    assert rep.salvaged_frames[1] >= 3  # everything whose chunk and journal entry were durable
    res = spillmerge.open(str(tmp_path / "partial"))
    frames = res.frames("f").tolist()
    assert frames[:4] == [0, 1, 2, 3] and set(frames[4:]) <= {10, 11, 12, 13, 14}
    assert rep.frame_gaps["f"][:6] == [4, 5, 6, 7, 8, 9]
    for row, frame in enumerate(frames):
        assert res["f"][row, 0] == frame
    # The rerun asks what is done and skips it.
    assert spillmerge.committed_keys(root) == {"f": {0, 1, 2, 3}}
    for rank in (0, 1):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096) as w:
            todo = [i for i in range(rank * 10, rank * 10 + 5) if not w.is_committed("f", i)]
            for i in todo:
                w.write("f", i, torch.full((1024,), float(i)))
        assert todo == ([4] if rank == 0 else [10, 11, 12, 13, 14])
    rep = spillmerge.merge(root, str(tmp_path / "full"))
    assert rep.n_frames == 10 and rep.missing_ranks == [] and rep.abandoned_segments
    assert spillmerge.open(str(tmp_path / "full")).frames("f").tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]


def test_empty_spill_and_all_zero_data_merge_and_verify(tmp_path):
    with spillmerge.SpillWriter(str(tmp_path / "empty")):
        pass
    rep = spillmerge.merge(str(tmp_path / "empty"), str(tmp_path / "o1"))
    assert rep.n_files == 0 and spillmerge.open(str(tmp_path / "o1")).filenames == []
    with spillmerge.SpillWriter(str(tmp_path / "zeros")) as w:
        w.write("z", 0, torch.zeros(10))  # every index array of the output is all zeros too
    spillmerge.merge(str(tmp_path / "zeros"), str(tmp_path / "o2"))
    for path in ("empty", "o1", "zeros", "o2"):
        rep = spillmerge.verify(str(tmp_path / path))
        assert rep.ok, rep.problems


def test_consolidated_metadata_matches_zarrs_own(tmp_path):
    import json
    import warnings

    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        for f in range(3):
            w.write("a.mp4", f, {"x": torch.zeros(2), "deep": {"er": {"y": f}}})
            w.write("b/c.mp4", f, torch.ones(2, dtype=torch.bfloat16))
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    ours = json.loads((tmp_path / "o" / "zarr.json").read_text())
    shutil.copytree(tmp_path / "o", tmp_path / "z")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(tmp_path / "z"))
    theirs = json.loads((tmp_path / "z" / "zarr.json").read_text())
    assert ours == theirs
    g = zarr.open_group(str(tmp_path / "o"), mode="r", use_consolidated=True)
    assert g.metadata.consolidated_metadata is not None
    assert {p for p, _ in g.members(max_depth=None)} == set(ours["consolidated_metadata"]["metadata"])


def test_output_chunks_are_balanced_so_padding_stays_below_one_row_per_chunk(tmp_path):
    for name, floats, chunk_bytes in (("big", 16384, 42 << 16), ("small", 256, 4 * 42 << 10)):
        root, out = tmp_path / f"s-{name}", tmp_path / f"o-{name}"
        with spillmerge.SpillWriter(str(root)) as w:
            for f in range(100):
                w.write("clip.mp4", f, torch.full((floats,), float(f)))  # 64 KiB or 1 KiB frames
        # At most 42 frames per chunk: chunk_bytes for rows of 64 KiB and more, a quarter of it
        # for smaller rows (docs/FORMAT.md, Chunks).
        spillmerge.merge(str(root), str(out), chunk_bytes=chunk_bytes)
        arr = spillmerge.open(str(out))["clip.mp4"]
        assert arr.zarr.chunks == (34, floats)  # 3 chunks of 34 rows, not 42 + 42 + 16-and-26-padding
        stored = sum(p.stat().st_size for p in (out / "columns").rglob("c/*"))
        assert stored <= (100 + 3) * floats * 4 + 3 * 4  # (rows + one per chunk) plus each chunk's crc32c
        assert torch.equal(arr.to_torch()[:, 0], torch.arange(100, dtype=torch.float32))
