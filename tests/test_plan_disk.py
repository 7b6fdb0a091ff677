"""The out-of-core merge plan (issue 24): forced with a tiny ``plan_budget``, it writes the same
bytes as the in-memory plan on the same spill root, checks the same things, works in parts, and
leaves no temporary file behind after success or failure."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spillmerge
from spillmerge import _format_spill as FS
from spillmerge import _plan, _plan_disk, _zarrmeta
from spillmerge._spillroot import LoadedSegment, Segment, lex_order
from tests._helpers import make_hostile
from tests._mp_scenarios import output_tree, tree_diff

TINY = 4000  # bytes: blocks of ~10 index rows, so every spill below is planned in many blocks


def _spill_mixed(root: str, *, variants: bool = False) -> None:
    """Four ranks: one-frame images (an emb, a label, a caption), padding duplicates, videos of
    ragged frames, lists of strings, None, empty tensors, bytes, a file only some ranks write
    frames of, and a segment that holds nothing; with ``variants``, a leaf of two dtypes in two
    files (which the out-of-core plan leaves to the in-memory one)."""
    for r in range(4):
        with spillmerge.SpillWriter(root, rank=r, world_size=4) as w:
            for i in range(r, 203, 4):
                w.write(f"img/{i:05d}.jpg", 0,
                        {"emb": torch.full((8,), float(i)).half(), "label": i, "caption": f"image {i} é"})  # fmt: skip
            w.write("img/00000.jpg", 0, {"emb": torch.zeros(8).half(), "label": 0, "caption": "image 0 é"})  # padding
            for f in range(3):
                w.write(f"vid{r}.mp4", f, {"feat": torch.ones(2 + f, 3) * r, "tags": [f"t{r}", "x" * f]})
            w.write("shared.mp4", r, {"feat": torch.ones(r + 1, 3), "raw": bytes([r]) * r, "opt": None if r % 2 else r})
            if variants:
                w.write(f"dtype{r % 2}.bin", r, {"x": torch.ones(2, dtype=torch.float16 if r % 2 else torch.float32)})
            w.write("empty.bin", r, {"e": torch.zeros(0)})
            names = [f"batch/{i:04d}.jpg" for i in range(r, 120, 4)]  # block checksums (write_batch)
            w.write_batch(names, {"vec": torch.arange(len(names) * 4.0).reshape(-1, 4), "n": torch.arange(len(names))})
        if r == 2:
            with spillmerge.SpillWriter(root, rank=r, world_size=4):
                pass


# Few letters, so names repeat across segments and share prefixes; surrogates and astral letters
# (UTF-8 byte order must equal code point order); NUL, which a fixed-width byte sort would drop.
_LETTERS = st.sampled_from(["a", "b", "\x00", "\x7f", "é", "\ud800", "\U0001f600"])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.text(_LETTERS, max_size=4), max_size=12, unique=True), min_size=1, max_size=7),
    st.integers(1, 30),
    st.booleans(),
    st.integers(1, 5),
)
def test_out_of_core_filenames_and_rows_are_the_in_memory_plans_for_any_names(segment_names, block_entries, shared,
                                                                             ranges):  # fmt: skip
    """The names merge of the out-of-core plan (runs merged in rounds of a few names, ties across
    runs and rounds) gives the in-memory plan's sorted filenames and rows; so it does when
    ``shared``: every odd segment's run comes from another work folder (as a part publishes it),
    taken after the even ones are built, its layout ids mapped to global ones only then; and in
    any number of ``ranges`` of filenames (some of them empty when names are few)."""
    loaded = []
    for si, names in enumerate(segment_names):
        # odd segments list an unused layout first: their layout ids differ from the global ones
        lay = [FS.Layout(("label",), "int64", ())]
        if si % 2:
            lay.insert(0, FS.Layout((f"other{si}",), "int64", ()))
        idx = np.zeros((len(names), FS.INDEX_COLUMNS), dtype=np.int64)
        idx[:, FS.COL_LAYOUT] = len(lay) - 1
        idx[:, FS.COL_FILE] = np.arange(len(names))[::-1]  # rows not in filename order
        idx[:, FS.COL_FRAME] = si  # a file has one frame per segment that names it: no duplicates
        idx[:, FS.COL_OFFSET] = np.arange(len(names)) * 8
        idx[:, FS.COL_NBYTES] = 8
        seg = Segment(rank=si % 3, name=f"seg-{si}", rel=f"rank-{si % 3}/seg-{si}", header=None, commit=None, failure=None)
        loaded.append(LoadedSegment(seg, list(names), lay, idx, 1 << 20))

    def same(a, b):
        raise AssertionError("no key has two copies here")

    class Elsewhere(_plan_disk.RunSource):
        def __init__(self) -> None:
            self.work = _plan_disk.WorkFolder(None)

        def elsewhere(self, si):
            return si % 2 == 1

        def take(self, si, work, tag):
            run = _plan_disk.sort_run(self.work, f"x{si}", loaded[si])
            return _plan_disk.record_of(loaded[si]), dataclasses.replace(run, source=f"run {si}")  # names checked

    mem = _plan.build(loaded, "error", same_bytes=same)
    other = Elsewhere() if shared else None
    disk = _plan_disk.build([_plan_disk.SegmentSource(lambda s=s: s) for s in loaded], "error", same_bytes=same,
                            budget=block_entries * _plan_disk.ENTRY_BYTES, shared=other, ranges=ranges)  # fmt: skip
    try:
        assert disk.taken == (len(loaded) // 2 if shared else 0)
        assert list(disk.plan.filenames) == list(mem.filenames)
        for k in ("file_offsets", "frame_idx", "rank", "copies", "seg", "offset", "nbytes"):
            assert np.asarray(getattr(disk.plan, k)).tolist() == np.asarray(getattr(mem, k)).tolist(), k
        assert [c.header() for c in disk.plan.columns] == [c.header() for c in mem.columns]
        for c, m in zip(disk.plan.columns, mem.columns, strict=True):
            assert np.asarray(c.src).tolist() == np.asarray(m.src).tolist()
            if m.has_offsets:
                assert np.asarray(c.offsets()).tolist() == np.asarray(m.offsets()).tolist()
        assert disk.plan.file_layouts == mem.file_layouts
        assert np.asarray(disk.plan.file_layout).tolist() == mem.file_layout.tolist()
        if ranges == 1:  # in ranges, the fingerprint hashes the ranges' digests (``Plan.range_digests``)
            assert _plan.fingerprint(disk.plan) == _plan.fingerprint(mem)
        elif disk.plan.n_files:
            assert len(disk.plan.range_digests) == ranges
    finally:
        disk.close()
        assert not os.path.exists(disk.work.dir)
        if other is not None:
            other.work.close()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=6), max_size=40), st.integers(0, 3))
def test_name_keys_order_and_compare_as_the_names_bytes_do(names, extra):
    """Step 2's fixed-width keys: zero bytes inside or at the end of a name, prefixes, 0xff; any
    width at least the longest name's. Sorted keys give the bytes' order, equal keys equal
    names, and the names come back from the keys."""
    lens = np.array([len(n) for n in names], dtype=np.int64)
    width = max([1, *lens.tolist()]) + extra
    keys = _plan_disk.name_keys(np.frombuffer(b"".join(names), dtype=np.uint8), lens, width)
    order = np.argsort(keys, kind="stable")
    assert [names[i] for i in order] == sorted(names)
    for i in range(len(names) - 1):
        assert (keys[i] < keys[i + 1]) == (names[i] < names[i + 1]) and (keys[i] == keys[i + 1]) == (
            names[i] == names[i + 1]
        )
    data, back = _plan_disk.key_names(keys, width)
    assert back.tolist() == lens.tolist() and data.tobytes() == b"".join(names)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(-3, 3), st.integers(0, 2)), max_size=60),
    st.sampled_from([0, 1 << 40, -(1 << 61)]),
)
def test_lex_order_is_lexsorts_order(rows, big):
    """``lex_order`` (keys packed into one int64 when their ranges fit, else ``np.lexsort``) gives
    ``np.lexsort``'s stable order, ties included; ``big`` stretches one key past 63 bits."""
    a = np.array([r[0] for r in rows], dtype=np.int64)
    b = np.array([r[1] for r in rows], dtype=np.int64) * (big or 1)
    c = np.array([r[2] for r in rows], dtype=np.int64)
    assert lex_order(a, b, c).tolist() == np.lexsort((c, b, a)).tolist()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 2), st.integers(0, 1)), max_size=40),
    st.sampled_from(["first", "last"]),
)
def test_resolve_duplicates_leaves_entries_in_row_order(entries, policy):
    """The plan takes ``resolve_duplicates``' entries as they come as the rows' order: (file,
    frame, leaf), whatever segments wrote copies of a key and whichever copy the policy keeps."""
    uniq = sorted(set(entries))  # (file, frame, segment, leaf): a segment lists a leaf of a frame once
    order = np.random.default_rng(len(uniq)).permutation(len(uniq))
    c = {k: np.array([uniq[i][j] for i in order], dtype=np.int64) for j, k in enumerate(("file", "frame", "seg", "lp"))}
    n = len(uniq)
    c.update(gl=c["lp"].copy(), off=np.arange(n, dtype=np.int64) * 8, nb=np.full(n, 8, np.int64), crc=np.full(n, 7, np.int64))
    segs = [LoadedSegment(Segment(rank=s, name=f"s{s}", rel=f"r{s}", header=None, commit=None, failure=None), [], [],
                          np.zeros((0, FS.INDEX_COLUMNS), np.int64), 1 << 20) for s in range(3)]  # fmt: skip
    kept, copies, _ = _plan.resolve_duplicates(c, [f"f{i}" for i in range(4)], segs, policy, lambda x, y: True)
    keys = list(zip(kept["file"].tolist(), kept["frame"].tolist(), kept["lp"].tolist(), strict=True))
    assert keys == sorted(keys)
    assert len({(f, fr) for f, fr, _ in keys}) == len({(u[0], u[1]) for u in uniq})

@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_an_out_of_core_plan_writes_the_bytes_of_the_in_memory_plan(tmp_path, codec):
    root = str(tmp_path / "spill")
    _spill_mixed(root)
    mem = spillmerge.merge(root, str(tmp_path / "mem"), codec=codec, chunk_bytes=512)
    plan_dir = tmp_path / "plan-tmp"
    disk = spillmerge.merge(root, str(tmp_path / "disk"), codec=codec, chunk_bytes=512, plan_budget=TINY,
                            plan_dir=str(plan_dir))  # fmt: skip
    assert not any("out of core" in n for n in mem.notes)
    assert any("out of core" in n for n in disk.notes), disk.notes
    assert os.listdir(plan_dir) == []  # the work folder is gone after success
    assert (disk.n_files, disk.n_frames, disk.duplicates, disk.nbytes) == (mem.n_files, mem.n_frames, 3, mem.nbytes)
    a, b = output_tree(str(tmp_path / "mem")), output_tree(str(tmp_path / "disk"))
    assert a == b, tree_diff(a, b)
    res = spillmerge.open(str(tmp_path / "disk"))
    assert res["img/00117.jpg"]["caption"][0] == "image 117 é"
    assert res.frame_ranks("img/00000.jpg").tolist() == [0]
    assert spillmerge.verify(str(tmp_path / "disk")).ok


@pytest.mark.parametrize(("ranges", "name_block"), [(2, 1024), (5, 1024), (3, 7)])
def test_an_out_of_core_plan_in_ranges_writes_the_bytes_of_the_in_memory_plan(tmp_path, monkeypatch, ranges, name_block):
    """The plan split into ranges of filenames (each planned on its own, its arrays read back to
    back) writes the in-memory plan's bytes: ragged, string, list-of-str, bytes and optional
    columns, duplicates, a file written by several ranks, a segment that holds nothing; and the
    filename heads each range takes of its names (a head every 7 names: heads in every range, none
    at a range's start)."""
    monkeypatch.setattr(_zarrmeta, "NAME_BLOCK", name_block)
    monkeypatch.setattr(_plan_disk, "NAME_BLOCK", name_block)
    root = str(tmp_path / "spill")
    _spill_mixed(root)
    mem = spillmerge.merge(root, str(tmp_path / "mem"), chunk_bytes=512)
    monkeypatch.setattr(_plan_disk, "RANGES", ranges)
    disk = spillmerge.merge(root, str(tmp_path / "disk"), chunk_bytes=512, plan_budget=TINY)
    assert any("out of core" in n for n in disk.notes), disk.notes
    assert (disk.n_files, disk.n_frames, disk.duplicates, disk.nbytes) == (mem.n_files, mem.n_frames, 3, mem.nbytes)
    a, b = output_tree(str(tmp_path / "mem")), output_tree(str(tmp_path / "disk"))
    assert a == b, tree_diff(a, b)
    for i in range(2):
        spillmerge.merge(root, str(tmp_path / "parts"), chunk_bytes=512, part=(i, 2), plan_budget=TINY)
    spillmerge.merge(root, str(tmp_path / "parts"), finalize=True, plan_budget=TINY)
    c = output_tree(str(tmp_path / "parts"))
    assert a == c, tree_diff(a, c)


def test_an_out_of_core_plan_in_parts_writes_the_same_bytes(tmp_path):
    root = str(tmp_path / "spill")
    _spill_mixed(root)
    spillmerge.merge(root, str(tmp_path / "whole"), chunk_bytes=256)
    for i in range(3):
        spillmerge.merge(root, str(tmp_path / "parts"), chunk_bytes=256, part=(i, 3), plan_budget=TINY)
    spillmerge.merge(root, str(tmp_path / "parts"), finalize=True, plan_budget=TINY)
    a, b = output_tree(str(tmp_path / "whole")), output_tree(str(tmp_path / "parts"))
    assert a == b, tree_diff(a, b)


def test_an_out_of_core_plan_refuses_what_the_in_memory_plan_refuses_and_cleans_up(tmp_path):
    plan_dir = tmp_path / "plan-tmp"
    root = str(tmp_path / "dup")
    for r in range(2):
        with spillmerge.SpillWriter(root, rank=r, world_size=2) as w:
            for i in range(50):
                if i != 25:
                    w.write(f"f{i:03d}", 0, torch.full((2,), float(i)))
            w.write("f025", 0, torch.full((2,), float(r + 100)))  # different content on both ranks
    for budget in (None, TINY):
        kw = {} if budget is None else {"plan_budget": budget, "plan_dir": str(plan_dir)}
        with pytest.raises(spillmerge.DuplicateFrameError, match="frame 0 of 'f025'") as err:
            spillmerge.merge(root, str(tmp_path / f"out-dup-{budget}"), **kw)
        assert err.value.ranks == [0, 1]
        rep = spillmerge.merge(root, str(tmp_path / f"out-last-{budget}"), on_duplicate="last", **kw)
        assert rep.duplicates == 50
    assert os.listdir(plan_dir) == []  # nothing left after the failure either
    a, b = output_tree(str(tmp_path / "out-last-None")), output_tree(str(tmp_path / f"out-last-{TINY}"))
    assert a == b, tree_diff(a, b)



def _planned_in_memory(tmp_path, root, why):
    """Merge ``root`` with the default budget and with a tiny one: the second says its plan was
    built in memory (``why``), leaves nothing in its plan folder and writes the same output."""
    plan_dir = tmp_path / "plan-tmp"
    spillmerge.merge(root, str(tmp_path / "mem"))
    disk = spillmerge.merge(root, str(tmp_path / "disk"), plan_budget=TINY, plan_dir=str(plan_dir))
    assert any("built in memory" in n and why in n for n in disk.notes), disk.notes
    assert not plan_dir.exists() or os.listdir(plan_dir) == []
    a, b = output_tree(str(tmp_path / "mem")), output_tree(str(tmp_path / "disk"))
    assert a == b, tree_diff(a, b)


@pytest.mark.parametrize("mixed", [True, False])
def test_leaves_of_several_variants_are_planned_in_memory_whatever_the_budget(tmp_path, mixed):
    """Format 3 lets a leaf change kind, dtype or dimensions between files; the out-of-core plan
    does not group variants, so it leaves such a merge to the in-memory plan and says so."""
    root = str(tmp_path / "spill")
    if mixed:
        _spill_mixed(root, variants=True)
    else:
        for r in range(2):
            with spillmerge.SpillWriter(root, rank=r, world_size=2) as w:
                for i in range(r, 40, 2):
                    w.write(f"g{i:03d}", 0, {"v": "text" if i == 33 else torch.ones(2)})
    _planned_in_memory(tmp_path, root, "several variants")
    # In parts: no plan in ranges; part 0 plans in memory and publishes it, part 1 maps it.
    out = tmp_path / "parts"
    reps = [spillmerge.merge(root, str(out), part=(i, 2), plan_budget=TINY) for i in range(2)]
    assert any("built in memory" in n for n in reps[0].notes), reps[0].notes
    assert any("was mapped, not rebuilt" in n for n in reps[1].notes), reps[1].notes
    assert not (out / "spillmerge-parts" / "ranges").exists()
    spillmerge.merge(root, str(out), finalize=True, plan_budget=TINY)
    a, b = output_tree(str(tmp_path / "mem")), output_tree(str(out))
    assert a == b, tree_diff(a, b)


def test_lists_of_items_are_planned_in_memory_from_the_first_segment_that_has_them(tmp_path):
    """A mixed list (torch's object-collective list holds one) gets list offsets the out-of-core
    plan does not build: the merge says so and writes what the in-memory plan writes, whichever
    segment holds the first list and however many segments follow it."""
    root = str(tmp_path / "spill")
    for r in range(3):
        with spillmerge.SpillWriter(root, rank=r, world_size=3) as w:
            for i in range(r, 30, 3):
                w.write(f"h{i:03d}", 0, [1, True, "s", [i, "n"]] if i in (1, 29) else {"k": i})
    _planned_in_memory(tmp_path, root, "lists or tuples")
    assert spillmerge.open(str(tmp_path / "disk")).value("h029") == [1, True, "s", [29, "n"]]


def test_expected_frames_and_allow_partial_with_an_out_of_core_plan(tmp_path):
    root = str(tmp_path / "spill")
    for r in range(2):
        with spillmerge.SpillWriter(root, rank=r, world_size=3) as w:
            for i in range(r, 60, 2):
                if i != 31:
                    w.write(f"f{i:03d}", 0, np.full(3, i, dtype=np.int32))
    expected = {f"f{i:03d}": 1 for i in range(61)}
    reps = [
        spillmerge.merge(root, str(tmp_path / f"out{b}"), allow_partial=True, expected=expected, **kw)
        for b, kw in enumerate([{}, {"plan_budget": TINY}])
    ]  # fmt: skip
    assert reps[0].frame_gaps == reps[1].frame_gaps == {"f031": [0], "f060": [0]}
    assert reps[0].missing_ranks == reps[1].missing_ranks == [2]
    a, b = output_tree(str(tmp_path / "out0")), output_tree(str(tmp_path / "out1"))
    assert a == b, tree_diff(a, b)


def test_a_killed_out_of_core_merge_is_rebuilt_to_the_same_bytes_through_the_cli(tmp_path):
    exe = shutil.which("spillmerge", path=os.path.dirname(sys.executable)) or "spillmerge"
    root, out, plan_dir = str(tmp_path / "spill"), tmp_path / "out", tmp_path / "plan-tmp"
    with spillmerge.SpillWriter(root) as w:
        for i in range(1500):
            for f in range(2):
                w.write(f"file{i:04d}.mp4", f, torch.full((64,), float(i * 10 + f)))
    spillmerge.merge(root, str(tmp_path / "clean"), chunk_bytes=256)
    flags = ["--chunk-bytes", "256", "--plan-budget", "40KiB", "--plan-dir", str(plan_dir), "--no-progress"]
    # One-row output chunks and one thread: slow enough to kill in the middle of the copy.
    proc = subprocess.Popen([exe, "merge", root, "--out", str(out), "--threads", "1", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    chunks = out / "columns" / "_value" / "values" / "c"
    deadline = time.time() + 120
    while time.time() < deadline and not (chunks.exists() and len(os.listdir(chunks)) >= 500):
        time.sleep(0.02)
    proc.kill()
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the merge finished before it could be killed"
    left = os.listdir(plan_dir)  # a killed process cannot clean up: its work folder stays, named
    assert len(left) == 1 and left[0].startswith(f"spillmerge-plan-{proc.pid}-")
    p = subprocess.run([exe, "merge", root, "--out", str(out), *flags], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert os.listdir(plan_dir) == left  # the rebuild removed its own
    a, b = output_tree(str(tmp_path / "clean")), output_tree(str(out))
    assert a == b, tree_diff(a, b)


_PART = """
import json, sys
import spillmerge
root, out, i, plan_dir, threads = sys.argv[1:6]
rep = spillmerge.merge(root, out, part=(int(i), 3), timeout=120, chunk_bytes=256, plan_budget=40 << 10,
                       plan_dir=plan_dir, threads=int(threads), progress=False)
print(json.dumps(rep.notes))
"""


def test_parts_plan_a_range_each_and_a_killed_part_reruns_to_the_same_bytes(tmp_path):
    """Three part processes started at once: each plans (out of core) its own range of filenames
    and publishes it, waiting for the others' summaries between phases, then maps the others'
    ranges; a part killed in the middle of its copy reruns from the published ranges; the
    finalize maps them too and removes them. Byte for byte the one-process merge."""
    root, out, plan_dir = str(tmp_path / "spill"), tmp_path / "out", tmp_path / "plan-tmp"
    with spillmerge.SpillWriter(root, world_size=2, rank=0) as w:
        for i in range(1500):
            for f in range(2):
                w.write(f"file{i:04d}.mp4", f, torch.full((64,), float(i * 10 + f)))
    with spillmerge.SpillWriter(root, world_size=2, rank=1) as w:
        w.write_batch([f"cap{i:04d}" for i in range(300)], {"caption": [f"c {i}" for i in range(300)]})
    spillmerge.merge(root, str(tmp_path / "clean"), chunk_bytes=256)

    def part(i: int, threads: int = 4) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _PART, root, str(out), str(i), str(plan_dir), str(threads)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    procs = [part(i) for i in range(3)]
    notes = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        notes.append(json.loads(stdout))
    for ns in notes:
        assert any(n.startswith("the plan was built in 3 ranges of filenames, one per part") for n in ns), ns
        assert not any("was mapped, not rebuilt" in n for n in ns), ns  # no whole plan published
        # plan_dir and the output share a file system: the work files were linked, not copied
        assert any("are hard links to its work files" in n for n in ns), ns
    assert not (out / "spillmerge-parts" / "plan").exists()
    (key,) = os.listdir(out / "spillmerge-parts" / "ranges")
    ranges = out / "spillmerge-parts" / "ranges" / key / "00003"
    assert sorted(os.listdir(ranges)) == ["00000", "00001", "00002"]
    for r in os.listdir(ranges):
        assert {"a.json", "b.json", "c.json", "names", "file_offsets", "seg", "c0.src"} <= set(os.listdir(ranges / r))
    # Part 1 again, killed in the middle of its copy (one-row chunks, one thread): no record.
    (out / "spillmerge-parts" / "part-00001-of-00003.json").unlink()
    chunks = out / "columns" / "_value" / "values" / "c"
    before = len(os.listdir(chunks))
    for c in os.listdir(chunks)[:50]:  # chunks lost with the crash, of every part
        os.unlink(chunks / c / "0")
    victim = part(1, threads=1)
    deadline = time.time() + 120
    start = {c: (chunks / c / "0").stat().st_mtime_ns for c in os.listdir(chunks) if (chunks / c / "0").exists()}
    while time.time() < deadline and victim.poll() is None:
        changed = sum(1 for c, t in start.items() if (chunks / c / "0").exists()
                      and (chunks / c / "0").stat().st_mtime_ns != t)  # fmt: skip
        if changed >= 100:
            break
        time.sleep(0.02)
    victim.kill()
    victim.communicate(timeout=30)
    assert victim.returncode == -signal.SIGKILL, "the part finished before it could be killed"
    assert before > 400
    # The missing chunks of parts 0 and 2 come back when those parts run again; each part reruns
    # from the published ranges, its own included.
    for i in (0, 1, 2):
        (out / "spillmerge-parts" / f"part-0000{i}-of-00003.json").unlink(missing_ok=True)
        p = part(i)
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        assert any("ranges [0, 1, 2] were mapped, not rebuilt" in n for n in json.loads(stdout)), stdout
    exe = shutil.which("spillmerge", path=os.path.dirname(sys.executable)) or "spillmerge"
    fin = subprocess.run([exe, "merge", root, "--out", str(out), "--finalize", "--plan-dir", str(plan_dir),
                          "--no-progress"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert fin.returncode == 0, fin.stderr
    assert sorted(os.listdir(out / "spillmerge-parts")) == [f"part-0000{i}-of-00003.json" for i in range(3)]
    # and every process's work folder, but the killed one's (named after it)
    assert [n for n in os.listdir(plan_dir) if not n.startswith(f"spillmerge-plan-{victim.pid}-")] == []
    a, b = output_tree(str(tmp_path / "clean")), output_tree(str(out))
    assert a == b, tree_diff(a, b)
    assert spillmerge.verify(str(out)).ok


def _parts_sort_runs(tmp_path):
    """A spill root of ten segments (two writer sessions per rank, one empty) and an output in
    which parts 1 and 2 of 3 ran first, one after the other: each published the runs of its share
    of the segments; part 1 planned every range (parts 0 and 2 were not at work: timeout 0) and
    published them, part 2 mapped them. Returns the root, the output and the one-process merge of
    the same root."""
    root, out, whole = str(tmp_path / "spill"), tmp_path / "out", str(tmp_path / "whole")
    _spill_mixed(root)
    _spill_mixed(root)  # the same keys again: duplicates across sessions, identical
    spillmerge.merge(root, whole, chunk_bytes=256)
    said = ["ranges [0, 2] were planned here, their parts not at work", "ranges [0, 1, 2] were mapped, not rebuilt"]
    for i, note in zip((1, 2), said, strict=True):
        rep = spillmerge.merge(root, str(out), chunk_bytes=256, part=(i, 3), plan_budget=TINY)
        assert any(n.startswith("the plan was built in 3 ranges") and n.endswith(note) for n in rep.notes), rep.notes
    return root, out, whole


def test_parts_share_runs_and_ranges_and_the_output_is_the_same(tmp_path):
    root, out, whole = _parts_sort_runs(tmp_path)
    (key,) = os.listdir(out / "spillmerge-parts" / "runs")
    runs = out / "spillmerge-parts" / "runs" / key
    assert sorted(os.listdir(runs)) == [f"{si:06d}" for si in range(10) if si % 3]  # segment si is part si % 3's
    assert sorted(os.listdir(runs / "000001")) == sorted(
        ["run.json", "names", "name_offsets", "file", "frame", "layout", "offset", "nbytes", "crc", "checks"]
    )
    rep = spillmerge.merge(root, str(out), chunk_bytes=256, part=(0, 3), plan_budget=TINY)
    assert any(n.startswith("the runs of 6 of 10 segments were sorted by the other parts") for n in rep.notes), rep.notes
    assert any(n.endswith("ranges [0, 1, 2] were mapped, not rebuilt") for n in rep.notes), rep.notes
    fin = spillmerge.merge(root, str(out), finalize=True, plan_budget=TINY)
    assert fin.n_frames == rep.n_frames and fin.duplicates > rep.n_frames  # every key of session 2 again
    assert sorted(os.listdir(out / "spillmerge-parts")) == [f"part-0000{i}-of-00003.json" for i in range(3)]
    a, b = output_tree(whole), output_tree(str(out))
    assert a == b, tree_diff(a, b)


def _swap_first_two_names(run):
    off = np.frombuffer((run / "name_offsets").read_bytes(), dtype="<i8")
    names = bytearray((run / "names").read_bytes())
    lens = np.diff(off)
    i = next(i for i in range(len(lens) - 1) if lens[i] == lens[i + 1] and lens[i] > 0)
    a, b, c = int(off[i]), int(off[i + 1]), int(off[i + 2])
    names[a:c] = names[b:c] + names[a:b]
    (run / "names").write_bytes(bytes(names))


def _split_a_character(run):
    """The last two names: one ends in the first byte of "é", the next starts with its second.
    The bytes as a whole are valid UTF-8 and still sorted; each of the two names is not."""
    off = np.frombuffer((run / "name_offsets").read_bytes(), dtype="<i8")
    names = bytearray((run / "names").read_bytes())
    names[int(off[-2]) - 1], names[int(off[-2])] = 0xC3, 0xA9
    (run / "names").write_bytes(bytes(names))


def _edit_array(name, fn):
    def edit(run):
        a = np.frombuffer((run / name).read_bytes(), dtype=np.uint8 if name == "names" else "<i8").copy()
        (run / name).write_bytes(fn(a).tobytes())

    return edit


def _edit_record(key, value):
    def edit(run):
        rec = json.loads((run / "run.json").read_text())
        rec[key] = value
        (run / "run.json").write_text(json.dumps(rec))

    return edit


def _edit_sample(fn):
    def edit(run):
        rec = json.loads((run / "run.json").read_text())
        fn(rec["sample"])
        (run / "run.json").write_text(json.dumps(rec))

    return edit


def _sample_all_first(smp):
    """Every sampled entry said to be the first one's filename (its name with it: the record
    agrees with itself and with the names; only the entries disagree)."""
    n, first = len(smp["files"]), smp["lens"][0]
    smp.update(files=[smp["files"][0]] * n, lens=[first] * n, names=smp["names"][: 2 * first] * n)


def _replace(name, how, up=4):
    def edit(run):  # the outside file lies beside the output (``up`` folders above the run's)
        make_hostile(run / name, run.parents[up] / f"outside-{run.parents[up - 1].name}.bin", how, grow=100 << 20)

    return edit


_DAMAGE = {
    "unsorted names": _swap_first_two_names,
    "a name starting inside a character": _split_a_character,
    "invalid UTF-8": _edit_array("names", lambda a: np.where(np.arange(len(a)) == 0, 0xFF, a)),
    "name offsets out of order": _edit_array("name_offsets", lambda a: np.where(np.arange(len(a)) == 1, a[2] + 1, a)),
    "entries out of order": _edit_array("file", lambda a: a[::-1].copy()),
    "entry naming no filename": _edit_array("file", lambda a: np.where(np.arange(len(a)) == len(a) - 1, 10**9, a)),
    "layout out of range": _edit_array("layout", lambda a: a + 99),
    "offset outside the data": _edit_array("offset", lambda a: a + (1 << 40)),
    "torn array": _edit_array("frame", lambda a: a[:-1]),
    "another segment's run": _edit_record("segment", "rank-00000/elsewhere"),
    "wrong counts": _edit_record("n_rows", 1),
    "sample of other entries": _edit_sample(_sample_all_first),
    "sample of other names": _edit_sample(lambda smp: smp.update(names=smp["names"][:-2] + "7a")),
    "sample names' lengths disagree": _edit_sample(lambda smp: smp["lens"].__setitem__(0, smp["lens"][0] + 1)),
    "a name longer than the record's width": _edit_sample(lambda smp: smp.update(width=max(smp["lens"]) - 1)),
    "sample missing": _edit_record("sample", None),
    "record not JSON": lambda run: (run / "run.json").write_bytes(b"\x00{"),
    "record a FIFO": _replace("run.json", "fifo"),
    "array a FIFO": _replace("frame", "fifo"),
    "array a link out of the output": _replace("crc", "link out of the root"),
    "record /dev/zero": _replace("run.json", "dev zero"),
    "array /dev/zero": _replace("nbytes", "dev zero"),
    "record oversized": _replace("run.json", "oversized"),
    "array oversized": _replace("names", "oversized"),
}


def test_a_damaged_or_hostile_published_run_is_sorted_again_from_the_spill_root(tmp_path):
    # A published run is one more object kind in the output (docs/GUARANTEES.md, threat model):
    # whatever is wrong with it, part 0 never hangs, never reads outside the output, and plans
    # from the spill root instead, to the same bytes.
    root, pristine, whole = _parts_sort_runs(tmp_path)
    (key,) = os.listdir(pristine / "spillmerge-parts" / "runs")
    for what, damage in _DAMAGE.items():
        out = tmp_path / what.replace(" ", "-").replace("/", "").replace("'", "")
        shutil.copytree(pristine, out, symlinks=True)
        shutil.rmtree(out / "spillmerge-parts" / "ranges")  # part 0 plans, from the runs
        damage(out / "spillmerge-parts" / "runs" / key / "000004")
        outside = {p: p.read_bytes() for p in tmp_path.glob("outside-*.bin")}
        rep = spillmerge.merge(root, str(out), chunk_bytes=256, part=(0, 3), plan_budget=TINY)
        damaged = [n for n in rep.notes if n.startswith("planned without the runs the other parts published")]
        assert len(damaged) == 1 and "000004" in damaged[0], (what, rep.notes)
        assert not any("were sorted by the other parts" in n for n in rep.notes), what
        spillmerge.merge(root, str(out), finalize=True, plan_budget=TINY)
        assert {p: p.read_bytes() for p in tmp_path.glob("outside-*.bin")} == outside  # nothing outside touched
        a, b = output_tree(whole), output_tree(str(out))
        assert a == b, (what, tree_diff(a, b))


def _edit_piece(name, fn):
    def edit(rng):
        a = np.frombuffer((rng / name).read_bytes(), dtype="<i8").copy()
        (rng / name).write_bytes(fn(a).tobytes())

    return edit


def _edit_range_doc(fn):
    def edit(rng):
        doc = json.loads((rng / "c.json").read_text())
        fn(doc)
        (rng / "c.json").write_text(json.dumps(doc))

    return edit


_DAMAGE_RANGE = {
    "doc not JSON": lambda rng: (rng / "c.json").write_bytes(b"\x00{"),
    "another range's doc": _edit_range_doc(lambda d: d.update(range=2)),
    "summary disagrees": _edit_range_doc(lambda d: d["a"].update(n_rows=d["a"]["n_rows"] + 1)),
    "summary not ints": _edit_range_doc(lambda d: d["b"].update(present=["x"])),
    "array named outside": _edit_range_doc(lambda d: d["columns"][0].update(src="../../x")),
    "torn array": _edit_piece("seg", lambda a: a[:-1]),
    "file offsets end elsewhere": _edit_piece("file_offsets", lambda a: a + 1),
    "leaf codes of another length": _edit_range_doc(lambda d: d["a"]["first"].append(0)),
    "a column key out of range": _edit_range_doc(lambda d: d["a"]["kinds"].append(10**9)),
    "rows per layout of another shape": _edit_range_doc(lambda d: d["b"]["hist"][0].append(1)),
    "a column set out of range": _edit_range_doc(lambda d: d["b"]["masks_seen"].append(-1)),
    "spans of the runs that leave entries out": _edit_range_doc(lambda d: d["a"]["spans"].__setitem__(3, d["a"]["spans"][3] - 1)),
    "spans of the runs missing": _edit_range_doc(lambda d: d["a"]["spans"].clear()),
    "one array named for two": _edit_range_doc(lambda d: d["columns"][0].update(src="seg")),
    "doc /dev/zero": _replace("c.json", "dev zero", up=5),
    "array /dev/zero": _replace("seg", "dev zero", up=5),
    "array a FIFO": _replace("c0.src", "fifo", up=5),
    "array a link out of the output": _replace("crc", "link out of the root", up=5),
    "array oversized": _replace("names", "oversized", up=5),
}


def _without_pieces(damage):
    def edit(rng):  # the range is not done: its summaries are read as a waiting part reads them
        (rng / "c.json").unlink()
        damage(rng)

    return edit


_DAMAGE_RANGE.update({
    "summary A not JSON, no pieces": _without_pieces(lambda rng: (rng / "a.json").write_bytes(b"[")),
    "summary A of another plan, no pieces": _without_pieces(
        lambda rng: (rng / "a.json").write_text((rng / "a.json").read_text().replace('"key"', '"old-key"'))),
    "summary B oversized, no pieces": _without_pieces(_replace("b.json", "oversized", up=5)),
})  # fmt: skip


def test_a_damaged_or_hostile_published_range_is_planned_again_from_the_spill_root(tmp_path):
    # A published range is one more object kind in the output, like a run: whatever is wrong with
    # it, a part never hangs, never reads outside the output, and plans every range itself.
    root, pristine, whole = _parts_sort_runs(tmp_path)
    (key,) = os.listdir(pristine / "spillmerge-parts" / "ranges")
    for what, damage in _DAMAGE_RANGE.items():
        out = tmp_path / ("range-" + what.replace(" ", "-").replace("'", ""))
        shutil.copytree(pristine, out, symlinks=True)
        damage(out / "spillmerge-parts" / "ranges" / key / "00003" / "00001")
        outside = {p: p.read_bytes() for p in tmp_path.glob("outside-*.bin")}
        rep = spillmerge.merge(root, str(out), chunk_bytes=256, part=(0, 3), plan_budget=TINY)
        damaged = [n for n in rep.notes if n.startswith("planned every range here")]
        assert len(damaged) == 1 and "00001" in damaged[0], (what, rep.notes)
        spillmerge.merge(root, str(out), finalize=True, plan_budget=TINY)
        assert {p: p.read_bytes() for p in tmp_path.glob("outside-*.bin")} == outside  # nothing outside touched
        assert not (out / "spillmerge-parts" / "ranges").exists()
        a, b = output_tree(whole), output_tree(str(out))
        assert a == b, (what, tree_diff(a, b))


def test_two_entries_swapped_in_a_published_range_blame_the_range_not_the_spill_root(tmp_path):
    """A published range is not checked against the spill root: two of its entries whose offsets
    were swapped read other bytes of the spill, which fail their row checksums. The spill's own
    index has no such rows, so the part names the published range, not the (sound) spill root."""
    root, pristine, _ = _parts_sort_runs(tmp_path)
    (key,) = os.listdir(pristine / "spillmerge-parts" / "ranges")
    rng = pristine / "spillmerge-parts" / "ranges" / key / "00003" / "00001"
    seg, off, crc = (np.frombuffer((rng / n).read_bytes(), dtype="<i8").copy() for n in ("seg", "off", "crc"))
    i, j = next((i, j) for i in range(len(off)) for j in range(i + 1, len(off))
                if crc[i] >= 0 and crc[j] >= 0 and seg[i] == seg[j] and off[i] != off[j])  # fmt: skip
    off[[i, j]] = off[[j, i]]
    (rng / "off").unlink()  # (a hard link to the publishing part's work file)
    (rng / "off").write_bytes(off.tobytes())
    for p in range(3):  # every part copies again, from the published ranges
        (pristine / "spillmerge-parts" / f"part-{p:05d}-of-00003.json").unlink(missing_ok=True)
    said = []
    for p in range(3):
        try:
            spillmerge.merge(root, str(pristine), chunk_bytes=256, part=(p, 3), plan_budget=TINY)
        except spillmerge.CorruptSpillError as exc:
            said.append(str(exc))
    assert said, "no part read the swapped entries"
    for text in said:
        assert text.startswith(f"{rng}: the merge plan's entry for ") and "spill is corrupt" not in text, text
        assert text.endswith(f"the plan is damaged, not the spill root; remove {rng.parent.parent.parent} and run the parts again")
    assert spillmerge.verify(root).ok


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-1, 4)), max_size=40), st.integers(1, 6))
def test_pass_1_blocks_folded_in_any_grouping_give_the_whole_tables_leaf_first(entries, cut):
    """Pass 1 checks blocks in threads and folds each block's ``leaf_first`` into the running one:
    the same as ``leaf_first`` of all the entries at once."""
    lp = np.array([e[0] for e in entries], dtype=np.int64)
    code = np.array([e[1] for e in entries], dtype=np.int64)
    whole = _plan.leaf_first(lp, code, 4)
    folded = np.full(4, -1, dtype=np.int64)
    for a in range(0, len(entries), cut):
        folded = _plan_disk._lowest_codes(folded, _plan.leaf_first(lp[a : a + cut], code[a : a + cut], 4))
    assert folded.tolist() == whole.tolist()


def test_blocks_checked_in_threads_come_back_in_order_and_the_first_error_is_the_first_blocks():
    import random
    import time as _time

    def check(i):
        _time.sleep(random.random() / 200)
        if i in (5, 7):
            raise ValueError(i)
        return i

    assert list(_plan_disk._in_order(check, iter(range(5)), 3)) == [0, 1, 2, 3, 4]
    got = []
    with pytest.raises(ValueError, match="5"):
        for r in _plan_disk._in_order(check, iter(range(10)), 3):
            got.append(r)
    assert got == [0, 1, 2, 3, 4]


_RANGE_PART = """
import json, sys, time
import spillmerge
from spillmerge import _plan_disk
root, out, i, stall = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
phase_b = _plan_disk._Builder._phase_b
def slow(*a, **k):  # a large range: pass 2 takes a while
    time.sleep(stall)
    return phase_b(*a, **k)
_plan_disk._Builder._phase_b = slow
rep = spillmerge.merge(root, out, part=(i, 2), chunk_bytes=256, plan_budget=4000, progress=False)
print(json.dumps(rep.notes))
"""


def test_a_part_waits_for_a_range_while_its_part_runs_and_plans_it_when_that_part_dies(tmp_path):
    """Part 0 publishes its phase A and B summaries, then waits for range 1's while part 1 (slowed
    in pass 2) holds its lease; part 1 is killed: part 0 plans range 1 itself and finishes. Part 1
    run again maps both ranges; the output is the one-process merge's."""
    root, out = str(tmp_path / "spill"), tmp_path / "out"
    _spill_mixed(root)
    spillmerge.merge(root, str(tmp_path / "whole"), chunk_bytes=256)

    def part(i: int, stall: float) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _RANGE_PART, root, str(out), str(i), str(stall)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    def wait_for(path, proc):
        deadline = time.monotonic() + 120
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)

    slow = part(1, 600)
    ranges = out / "spillmerge-parts" / "ranges"
    wait_for(ranges, slow)
    (key,) = os.listdir(ranges)
    wait_for(ranges / key / "00002" / "00001" / "a.json", slow)  # part 1 is in pass 2 now
    first = part(0, 0)
    wait_for(ranges / key / "00002" / "00000" / "b.json", first)  # part 0 waits for range 1's
    time.sleep(3)
    assert first.poll() is None  # still waiting: part 1 is at work
    slow.kill()
    slow.communicate(timeout=30)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert any(n.endswith("ranges [1] were planned here, their parts not at work") for n in json.loads(stdout)), stdout
    again = part(1, 0)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert any(n.endswith("ranges [0, 1] were mapped, not rebuilt") for n in json.loads(stdout)), stdout
    spillmerge.merge(root, str(out), finalize=True, plan_budget=TINY)
    a, b = output_tree(str(tmp_path / "whole")), output_tree(str(out))
    assert a == b, tree_diff(a, b)
