"""Scale-out merge (``part=(i, n)`` + ``finalize``, the CLI's ``--part`` / ``--finalize``) and the
output codecs. The multi-rank ``parallel=True`` run is in test_multirank.py (one shared spawn)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from _helpers import make_hostile, raw_bytes, zarr_filenames
from _mp_scenarios import output_tree, tree_diff
from test_cli import assert_one_line_error
from test_cli import cli_run as run

import spillmerge
from spillmerge._format import output as FO
from spillmerge._storage import Storage

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip
OPTS = {"chunk_bytes": 8192, "codec": "zstd"}


def _value(i: int, frame: int) -> object:
    """Uneven files: sizes differ by file so the split has something to balance; some dict values."""
    g = torch.Generator().manual_seed(i * 1000 + frame)
    t = torch.randint(-1000, 1000, (4 + 60 * (i % 4), 8), generator=g).to(torch.bfloat16)
    if i % 3 == 0:
        return {"pred": t, "meta": {"score": frame / 7, "box": np.full(4, frame, dtype=np.float32)}}
    return t


def _spill(root: Path, world: int = 3, files: int = 8, frames: int = 12) -> None:
    for r in range(world):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=world, chunk_bytes=4096) as w:
            for i in range(files):
                for f in range(r, frames + i, world):
                    w.write(f"clip {i}.mp4", f, _value(i, f))


def _parts(root: Path, out: Path, n: int, **kw: object) -> list[spillmerge.MergeReport]:
    return [spillmerge.merge(str(root), str(out), part=(i, n), **{**OPTS, **kw}) for i in range(n)]  # type: ignore[arg-type]


def _snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every object of the output but the lease folder: relative path -> (bytes, mtime_ns)."""
    return {
        str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in out.rglob("*")
        if p.is_file() and p.relative_to(out).parts[0] != "spillmerge-lease"
    }


def _is_chunk(rel: str) -> bool:
    """A chunk object of an output array: a column's ``values``, ``offsets``, ``shapes`` or
    ``valid``, an ``index/`` array, a list's ``offsets`` (what parts write: each its values chunks
    and its share of the index chunks; the documents and the marker are the finalizer's)."""
    p = Path(rel).parts
    return p[0] in ("columns", "index", "lists") and "c" in p[2:] and p[-1] != "zarr.json"


def _parts_observed(
    root: Path, out: Path, n: int, **kw: object
) -> tuple[list[spillmerge.MergeReport | BaseException], list[set[str]]]:
    """Run the parts one after another and record what each wrote: the objects it created or
    changed. A part that raises is recorded with its exception."""
    reps: list[spillmerge.MergeReport | BaseException] = []
    written: list[set[str]] = []
    for i in range(n):
        before = _snapshot(out) if out.exists() else {}
        try:
            reps.append(spillmerge.merge(str(root), str(out), part=(i, n), **kw))  # type: ignore[arg-type]
        except spillmerge.SpillMergeError as exc:
            reps.append(exc)
        after = _snapshot(out)
        written.append({k for k, v in after.items() if before.get(k) != v})
    return reps, written


def _leaves(x: object, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(x, dict):
        return [leaf for k in sorted(x) for leaf in _leaves(x[k], (*path, k))]
    return [(path, x)]


def _rows(v: Any) -> list[tuple[str, tuple[int, ...], bytes]]:
    """Every row of a leaf view as (torch dtype, shape, raw bytes)."""
    ts = [v.to_torch(i) for i in range(len(v))] if v.kind == "ragged" else list(v.to_torch())
    return [(str(t.dtype), tuple(t.shape), raw_bytes(t)) for t in ts]


def _same_values(a: str, b: str) -> None:
    ra, rb = spillmerge.open(a), spillmerge.open(b)
    assert ra.filenames == rb.filenames
    for name in ra.filenames:
        assert ra.frames(name).tolist() == rb.frames(name).tolist()
        la, lb = _leaves(ra[name]), _leaves(rb[name])
        assert [p for p, _ in la] == [p for p, _ in lb], name
        for (path, u), (_, v) in zip(la, lb, strict=True):
            assert len(u) == len(ra.frames(name)) and _rows(u) == _rows(v), (name, path)


def test_cli_parts_then_finalize_equal_one_process_merge(tmp_path):
    root, one, out = tmp_path / "spill", tmp_path / "one.zarr", tmp_path / "out.zarr"
    _spill(root)
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    common = ["--codec", "zstd", "--chunk-bytes", "8KiB", "--no-progress"]
    for i in (0, 1):
        p = run("merge", str(root), "--out", str(out), "--part", f"{i}/3", *common)
        assert p.returncode == 0, p.stderr
        assert f"part {i}/3: merged" in p.stdout
    # A missing part: one line naming it, exit 1, nothing lost.
    p = run("merge", str(root), "--out", str(out), "--finalize")  # codec and chunk size: from the parts
    assert_one_line_error(p, "1 of 3 part(s)", "part 2/3", "--part I/3")
    # Part 0 stored the plan (part 1 read it); nothing else of the missing part's is there.
    assert sorted(os.listdir(out / "spillmerge-parts")) == [
        "part-00000-of-00003.json", "part-00001-of-00003.json", "plan"
    ]  # fmt: skip
    p = run("merge", str(root), "--out", str(out), "--part", "2/3", *common)
    assert p.returncode == 0, p.stderr
    p = run("merge", str(root), "--out", str(out), "--finalize", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "in 3 parts with zstd" in p.stdout
    assert "plan" not in os.listdir(out / "spillmerge-parts")  # the finalize removed it
    # Object for object what one process writes (the root header's timestamp aside).
    assert tree_diff(output_tree(str(one)), output_tree(str(out))) == []
    _same_values(str(one), str(out))
    # Plain zarr reads it; the consolidated metadata is what zarr's own consolidation writes.
    g = zarr.open_group(str(out), mode="r")
    names = zarr_filenames(g)
    assert names == sorted(f"clip {i}.mp4" for i in range(8))
    # 'clip 1.mp4' holds plain tensors: its layout is one column, of bfloat16 values, zstd-compressed.
    (col,) = g.attrs["spillmerge"]["file_layouts"][int(g["index/file_layout"][1])]
    arr = g[f"columns/{col}/values"]
    assert g[f"columns/{col}"].attrs["spillmerge"]["dtype"] == "bfloat16"
    assert arr.metadata.codecs[1].to_dict()["name"] == "zstd"
    ours = json.loads((out / "zarr.json").read_text())
    shutil.copytree(out, tmp_path / "z")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr warns about the marker and the part records
        zarr.consolidate_metadata(str(tmp_path / "z"))
    assert ours == json.loads((tmp_path / "z" / "zarr.json").read_text())
    p = run("verify", str(out))
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout
    p = run("merge", "--part", "3/3", str(root), "--out", str(out))
    assert p.returncode == 2 and "not in 0/N" in p.stderr


def test_part_rerun_is_idempotent_and_repairs_a_crashed_part(tmp_path):
    root, one, out = tmp_path / "spill", tmp_path / "one", tmp_path / "out"
    _spill(root)
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    whole = spillmerge.open(str(one)).header
    reps, written = _parts_observed(root, out, 3, **OPTS)
    assert all(isinstance(r, spillmerge.MergeReport) for r in reps), reps
    reps_ok = [r for r in reps if isinstance(r, spillmerge.MergeReport)]
    # The split is by bytes over whole output chunks: every part got chunks, the parts add up to
    # the whole, none dominates.
    assert all(r.nbytes > 0 and r.parts == 3 for r in reps_ok) and [r.part for r in reps_ok] == [0, 1, 2]
    assert sum(r.nbytes for r in reps_ok) == whole["nbytes"] and max(r.nbytes for r in reps_ok) < 0.6 * whole["nbytes"]
    # A part writes its own chunks and its record (the first one also the root document marking
    # the folder), nothing else; no two parts write one chunk; together they write every chunk
    # the one-process merge writes.
    mine = [{p for p in w if _is_chunk(p)} for w in written]
    plan = {p for p in written[0] if p.startswith("spillmerge-parts/plan/")}
    assert "spillmerge-parts/plan/plan.json" in plan  # part 0 stores the plan; the others read it
    assert [any("was read, not rebuilt" in n for n in r.notes) for r in reps_ok] == [False, True, True]
    for i, w in enumerate(written):
        assert mine[i], i
        assert w == mine[i] | {f"spillmerge-parts/part-0000{i}-of-00003.json"} | (
            {"zarr.json", *plan} if i == 0 else set()
        )
    assert sum(len(m) for m in mine) == len(set().union(*mine))
    assert set().union(*mine) == {p for p in _snapshot(one) if _is_chunk(p)}
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = spillmerge.merge(str(root), str(out), part=(1, 3), **OPTS)  # type: ignore[arg-type]
    assert any("already complete" in n for n in again.notes) and "already complete" in str(again)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing rewritten
    # A crash of part 1 after some chunks: no record, a torn chunk, a chunk never written.
    (out / "spillmerge-parts" / "part-00001-of-00003.json").unlink()
    key = json.loads((out / "spillmerge-parts" / "part-00000-of-00003.json").read_text())  # sanity: readable
    assert key["kind"] == "merge-part" and key["parts"] == 3
    assert len(mine[1]) >= 2, mine[1]
    torn_rel, lost_rel = sorted(mine[1])[:2]
    torn, lost = out / torn_rel, out / lost_rel
    torn.write_bytes(torn.read_bytes()[:10])
    lost.unlink()
    crashed = _snapshot(out)
    others = {p: crashed[p] for p in mine[0] | mine[2]}
    with pytest.raises(spillmerge.MissingPartsError, match="part 1/3") as info:
        spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert info.value.missing == [1] and info.value.parts == 3
    spillmerge.merge(str(root), str(out), part=(1, 3), **OPTS)  # type: ignore[arg-type]
    now = _snapshot(out)
    # The rerun rewrote every chunk of its own, whole (the torn and the lost one as the one-process
    # merge wrote them), and left every other part's chunk alone: same bytes, same mtime.
    assert now[torn_rel][0] == (one / torn_rel).read_bytes() and now[lost_rel][0] == (one / lost_rel).read_bytes()
    assert all(now[p][1] != crashed[p][1] for p in mine[1] - {torn_rel, lost_rel})
    assert {p: now[p] for p in others} == others
    rep = spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert rep.parts == 3 and rep.part is None and rep.n_files == 8
    assert tree_diff(output_tree(str(one)), output_tree(str(out))) == []
    assert spillmerge.verify(str(out)).ok
    # A complete output: parts and finalize refuse without overwrite, like the one-process merge.
    with pytest.raises(spillmerge.OutputExistsError, match="complete merge"):
        spillmerge.merge(str(root), str(out), part=(0, 3), **OPTS)  # type: ignore[arg-type]
    with pytest.raises(spillmerge.OutputExistsError, match="complete merge"):
        spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def after_part_0(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Path]:
    """Read only, shared by the stored-plan damage tests: a spill root of 2 ranks, a whole merge's
    ``output_tree`` and an output after part 0 of 2 (the stored plan written). A test damages a copy
    (``_after_part_0``). Session scope: this file's tests go to the workers one by one, so each
    worker builds it at most once."""
    base = tmp_path_factory.mktemp("scaleout-part0")
    root, one, out = base / "spill", base / "one", base / "out"
    _spill(root, world=2, files=4, frames=4)
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    spillmerge.merge(str(root), str(out), part=(0, 2), **OPTS)  # type: ignore[arg-type]
    return root, output_tree(str(one)), out


def _after_part_0(state: tuple[Path, dict[str, Any], Path], tmp_path: Path) -> tuple[Path, dict[str, Any], Path]:
    """The spill root, the whole merge's tree and a copy of the output after part 0, the test's own."""
    root, whole, out = state
    shutil.copytree(out, tmp_path / "out", symlinks=True)
    return root, whole, tmp_path / "out"


def test_a_damaged_stored_plan_is_planned_again(after_part_0, tmp_path):
    root, whole, out = _after_part_0(after_part_0, tmp_path)
    seg = out / "spillmerge-parts" / "plan" / "seg.0"
    seg.write_bytes(seg.read_bytes()[:-8])  # a torn array: it fails its digest, never used
    rep = spillmerge.merge(str(root), str(out), part=(1, 2), **OPTS)  # type: ignore[arg-type]
    assert any(n.startswith("the stored plan was not used:") and "plan/seg.0" in n for n in rep.notes), rep.notes
    assert any("built here and stored" in n for n in rep.notes), rep.notes
    rep = spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert any("was read, not rebuilt" in n for n in rep.notes)
    assert tree_diff(whole, output_tree(str(out))) == []
    # No stored plan at all (removed by hand) and nobody planning: a finalize with a long timeout
    # plans at once rather than waiting for one.
    _parts(root, out, 2, overwrite=True)
    shutil.rmtree(out / "spillmerge-parts" / "plan")
    t = time.monotonic()
    rep = spillmerge.merge(str(root), str(out), finalize=True, timeout=120, **OPTS)  # type: ignore[arg-type]
    assert time.monotonic() - t < 60 and not any("was read" in n for n in rep.notes)
    assert tree_diff(whole, output_tree(str(out))) == []


@pytest.mark.parametrize(
    ("victim", "why"),
    [("name_offsets.0", "offsets that do not rise"), ("seg.0", "first element is not the one plan.json names"),
     ("c0.src.0", "more than a block holds")],
)  # fmt: skip
def test_a_stored_plan_forged_with_matching_digests_is_checked_block_by_block(after_part_0, tmp_path, victim, why):
    # plan.json's digests are not a signature: a block rewritten with its digest (and plan.json's
    # own) recomputed still meets the checks a part makes as it reads: offsets rise, a block
    # starts with the element plan.json names, a block holds no more than a block's bytes.
    from spillmerge._merge import planstore

    root, whole, out = _after_part_0(after_part_0, tmp_path)
    folder = out / "spillmerge-parts" / "plan"
    doc = json.loads((folder / "plan.json").read_text())
    name, _ = victim.rsplit(".", 1)
    spec = doc["body"]["arrays"][name]
    if why == "more than a block holds":
        spec["rows"] = planstore.BLOCK_BYTES  # int64 rows: 8x a block
    else:
        a = np.frombuffer((folder / victim).read_bytes(), dtype=spec["dtype"]).copy()
        if name == "name_offsets":
            a[1], a[2] = a[2], a[1]  # two offsets swapped: no longer rising
        else:
            a[0] = a[0] + 1  # another segment, valid, not the first element plan.json names
        (folder / victim).write_bytes(a.tobytes())
        spec["blake2b"][0] = planstore.digest(a.tobytes())
    doc["digest"] = planstore._body_digest(doc["body"])
    (folder / "plan.json").write_text(json.dumps(doc, sort_keys=True))
    rep = spillmerge.merge(str(root), str(out), part=(1, 2), **OPTS)  # type: ignore[arg-type]
    assert any(n.startswith("the stored plan was not used:") and why in n for n in rep.notes), rep.notes
    spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert tree_diff(whole, output_tree(str(out))) == []


def test_a_stored_plan_pointing_out_of_range_is_never_used(after_part_0, tmp_path):
    # The stored plan's rows are not checked again against the spill root: an array rewritten to
    # the same size fails its digest and the plan is built again from the spill root.
    root, whole, out = _after_part_0(after_part_0, tmp_path)
    seg = out / "spillmerge-parts" / "plan" / "seg.0"
    raw = np.frombuffer(seg.read_bytes(), dtype=np.uint8).copy()
    raw[:] = 0x7F  # the same size, every segment number far past the segments there are
    seg.write_bytes(raw.tobytes())
    rep = spillmerge.merge(str(root), str(out), part=(1, 2), **OPTS)  # type: ignore[arg-type]
    assert any("plan/seg.0: fails its digest" in n for n in rep.notes), rep.notes
    spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert tree_diff(whole, output_tree(str(out))) == []


@pytest.mark.parametrize("target", ["plan.json", "seg.0"])
@pytest.mark.parametrize("attack", ["fifo", "link out of the root", "dev zero", "oversized"])
def test_a_hostile_published_plan_is_planned_again_or_refused(after_part_0, tmp_path, target, attack):
    # The stored plan is one more object kind in the output (docs/GUARANTEES.md, threat model):
    # a part meeting a FIFO, a link, /dev/zero or an oversized object there never hangs, never
    # reads outside the output, and either plans itself or stops with a SpillMergeError.
    root, whole, out = _after_part_0(after_part_0, tmp_path)
    victim = out / "spillmerge-parts" / "plan" / target
    outside = tmp_path / "outside.bin"
    make_hostile(victim, outside, attack, grow=300 << 20 if target == "plan.json" else 8)  # past the limits
    kept = outside.read_bytes()
    try:
        rep = spillmerge.merge(str(root), str(out), part=(1, 2), **OPTS)  # type: ignore[arg-type]
    except spillmerge.SpillMergeError as exc:
        assert "spillmerge-parts/plan" in str(exc), exc
    else:
        assert not any("was read, not rebuilt" in n for n in rep.notes), rep.notes  # planned itself
        spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
        assert tree_diff(whole, output_tree(str(out))) == []
    assert outside.read_bytes() == kept  # nothing outside the output written or removed


_PART1 = """
import sys, time
import spillmerge
t = time.monotonic()
try:
    spillmerge.merge(sys.argv[1], sys.argv[2], part=(1, 2), timeout=120)
except spillmerge.DuplicateFrameError:
    print(time.monotonic() - t)
"""


def test_parts_stop_waiting_for_the_plan_when_the_planner_fails(tmp_path):
    """The planner fails (conflicting duplicates) and leaves a failure record of no plan; a part
    waiting for its plan stops waiting, plans itself and fails the same way, long before its
    timeout."""
    root, out = tmp_path / "spill", tmp_path / "out"
    for r in range(2):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=2) as w:
            w.write("same.mp4", 0, torch.full((4,), float(r)))  # different content on both ranks
    waiting = subprocess.Popen([sys.executable, "-c", _PART1, str(root), str(out)], stdout=subprocess.PIPE, text=True)
    with pytest.raises(spillmerge.DuplicateFrameError):
        spillmerge.merge(str(root), str(out), part=(0, 2))
    stdout, _ = waiting.communicate(timeout=120)
    assert waiting.returncode == 0 and float(stdout) < 60, stdout
    assert sorted(os.listdir(out / "spillmerge-parts")) == [f"part-0000{i}-of-00002.failed.json" for i in range(2)]
    # The failure records name no plan: a finalize counts them as missing parts, not failed ones.
    with pytest.raises(spillmerge.MissingPartsError, match="part 0/2"):
        spillmerge.merge(str(root), str(out), finalize=True, on_duplicate="last")


_SLOW_PART0 = """
import sys, time
import spillmerge
from spillmerge._merge import opening as _merge
planned = _merge.fingerprint  # called once the plan is built, before it is stored
def slow(*a, **k):
    time.sleep(float(sys.argv[3]))  # a large plan: the planner holds its lease for a while first
    return planned(*a, **k)
_merge.fingerprint = slow
spillmerge.merge(sys.argv[1], sys.argv[2], part=(0, 2))
"""


def _part0_planning(root, out, seconds: float) -> subprocess.Popen:
    """Part 0 in its own process, its plan taking ``seconds`` more; returned once it holds the
    planner lease."""
    from spillmerge._merge import lease as _lease
    from spillmerge._merge import planstore as _planstore

    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PART0, str(root), str(out), str(seconds)])
    deadline = time.monotonic() + 120
    while not (os.path.isdir(out) and _lease.held(Storage(str(out)), _planstore.PLANNER)):
        assert proc.poll() is None and time.monotonic() < deadline, "part 0 never took the planner lease"
        time.sleep(0.05)
    return proc


def test_with_timeout_0_a_part_waits_for_the_plan_while_the_planner_runs(tmp_path):
    """The default ``timeout=0``: part 1 started while part 0 plans waits for the stored plan and
    reads it instead of planning everything again; when the planner dies (its lease goes with
    it), part 1 stops waiting and plans (and stores) itself; with nobody planning it plans at once."""
    root = tmp_path / "spill"
    _spill(root, world=2)
    out = tmp_path / "out"
    part0 = _part0_planning(root, out, 4)
    rep = spillmerge.merge(str(root), str(out), part=(1, 2))
    assert any("was read, not rebuilt" in n for n in rep.notes), rep.notes
    assert part0.wait(120) == 0
    fin = spillmerge.merge(str(root), str(out), finalize=True)
    one = spillmerge.merge(str(root), str(tmp_path / "one"))
    assert fin.n_frames == one.n_frames
    assert tree_diff(output_tree(str(tmp_path / "one")), output_tree(str(out))) == []

    out2 = tmp_path / "out2"
    part0 = _part0_planning(root, out2, 300)
    got: list = []
    waiting = threading.Thread(target=lambda: got.append(spillmerge.merge(str(root), str(out2), part=(1, 2))))
    waiting.start()
    time.sleep(2)
    assert waiting.is_alive()  # waiting for the plan of a planner at work
    part0.kill()
    part0.wait(60)
    waiting.join(120)
    assert not waiting.is_alive() and got and not any("was read" in n for n in got[0].notes)

    t = time.monotonic()  # nobody planning at all: part 1 plans at once
    rep = spillmerge.merge(str(root), str(tmp_path / "out3"), part=(1, 2))
    assert time.monotonic() - t < 30 and not any("was read" in n for n in rep.notes)


def test_a_second_part_0_is_refused_before_it_plans_and_leaves_no_failure_record(tmp_path):
    """Part 0 holds its lease while it plans: another part 0 on the same output fails at once
    with OutputBusyError, and writes no failure record (which would tell the parts waiting for the
    plan that part 0 failed)."""
    root, out = tmp_path / "spill", tmp_path / "out"
    _spill(root, world=2)
    part0 = _part0_planning(root, out, 300)
    try:
        with pytest.raises(spillmerge.OutputBusyError, match="part 0/2"):
            spillmerge.merge(str(root), str(out), part=(0, 2))
        parts = out / "spillmerge-parts"
        assert not parts.exists() or not any(p.name.endswith(".failed.json") for p in parts.iterdir())
    finally:
        part0.kill()
        part0.wait(60)


def test_parts_of_different_plans_never_mix(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out"
    _spill(root, world=2)
    _parts(root, out, 2)
    # Other output settings, or another part count: refused before anything is written.
    with pytest.raises(spillmerge.PlanMismatchError, match="different merge plan") as info:
        spillmerge.merge(str(root), str(out), part=(0, 2), chunk_bytes=8192, codec="blosc-lz4")
    assert info.value.parts == [0, 1] and "part-00000-of-00002.json" in str(info.value)
    with pytest.raises(spillmerge.PlanMismatchError, match="part count"):
        spillmerge.merge(str(root), str(out), part=(2, 3), **OPTS)  # type: ignore[arg-type]
    # The spill root changes between the parts and the finalize (a rank reran and committed more).
    with spillmerge.SpillWriter(str(root), rank=1, world_size=2) as w:
        w.write("late.mp4", 0, torch.ones(3, 8))  # float32: a column of its own next to the bfloat16 one
    with pytest.raises(spillmerge.PlanMismatchError, match="part 0/2 .* part 1/2"):
        spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    # Refusing deletes nothing (the finalize planned the changed root itself: the stored plan is
    # of the old one).
    assert len(os.listdir(out / "spillmerge-parts")) == 3
    with pytest.raises(spillmerge.PlanMismatchError):
        spillmerge.merge(str(root), str(out), part=(0, 2), **OPTS)  # type: ignore[arg-type]
    # overwrite: the new plan's parts replace the old records; finalize prunes the columns the new
    # plan does not have (an older merge's, and the old plan's own `_value`, now split by dtype).
    (out / "columns" / "leftover").mkdir()
    (out / "columns" / "leftover" / "zarr.json").write_text("{}")
    old_columns = set(os.listdir(out / "columns"))
    _parts(root, out, 3, overwrite=True)
    assert sorted(os.listdir(out / "spillmerge-parts")) == [f"part-0000{i}-of-00003.json" for i in range(3)] + ["plan"]
    spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert not (out / "columns" / "leftover").exists()
    spillmerge.merge(str(root), str(tmp_path / "one"), **OPTS)  # type: ignore[arg-type]
    assert set(os.listdir(out / "columns")) == set(os.listdir(tmp_path / "one" / "columns"))
    assert "_value" in old_columns and not (out / "columns" / "_value").exists()
    assert tree_diff(output_tree(str(tmp_path / "one")), output_tree(str(out))) == []
    assert spillmerge.open(str(out)).filenames[-1] == "late.mp4"


def test_a_failed_part_is_named_and_the_other_parts_are_kept(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=2, chunk_bytes=4096) as w:
        for f in range(4):
            w.write("bad.mp4", f, torch.full((1024,), float(f)))
    with spillmerge.SpillWriter(str(root), rank=1, world_size=2, chunk_bytes=4096) as w:
        for i in range(6):
            w.write(f"good{i}.mp4", 0, torch.full((512,), float(i)))
    chunk = next(root.glob("rank-00000/seg-*/data/c/1"))
    raw = bytearray(chunk.read_bytes())
    raw[7] ^= 1
    chunk.write_bytes(bytes(raw))
    # Output chunks of 1024 values (a quarter of chunk_bytes: small rows), one frame of bad.mp4 each:
    # every part gets chunks, and only the one holding frame 1 reads the damaged bytes.
    opts = {"chunk_bytes": 16384}
    reps, written = _parts_observed(root, out, 3, **opts)
    failed = [i for i, r in enumerate(reps) if isinstance(r, BaseException)]
    assert len(failed) == 1 and isinstance(reps[failed[0]], spillmerge.CorruptSpillError), reps
    bad = failed[0]
    records = sorted(os.listdir(out / "spillmerge-parts"))
    assert f"part-{bad:05d}-of-00003.failed.json" in records and len(records) == 4 and "plan" in records
    # What the good parts wrote: their chunks, each of them still there, untouched, to the end.
    kept = {p for i, w in enumerate(written) if i != bad for p in w if _is_chunk(p)}
    assert all(any(_is_chunk(p) for p in w) for i, w in enumerate(written) if i != bad), written
    good = {p: _snapshot(out)[p] for p in kept}
    t = time.perf_counter()
    with pytest.raises(
        spillmerge.PartFailedError, match=f"part {bad}/3: CorruptSpillError: .*checksum mismatch"
    ) as info:
        spillmerge.merge(str(root), str(out), finalize=True, timeout=30, **opts)  # type: ignore[arg-type]
    assert time.perf_counter() - t < 10  # at once, not at the timeout
    assert list(info.value.failures) == [bad] and isinstance(info.value, spillmerge.RankFailedError)
    assert {p: v for p, v in _snapshot(out).items() if p in kept} == good
    # A failure record of another plan (an older merge) does not count: the part is just missing.
    failure = out / "spillmerge-parts" / f"part-{bad:05d}-of-00003.failed.json"
    rec = json.loads(failure.read_text())
    assert rec["kind"] == "merge-part-failure" and rec["error_type"] == "CorruptSpillError"
    failure.write_text(json.dumps({**rec, "plan": "0" * 32}))
    with pytest.raises(spillmerge.PartsTimeout, match=f"part {bad}/3") as info2:
        spillmerge.merge(str(root), str(out), finalize=True, timeout=0.3, **opts)  # type: ignore[arg-type]
    assert info2.value.missing == [bad] and info2.value.waited_s >= 0.3
    # The spill is repaired; the failed part reruns alone and clears its failure record.
    raw[7] ^= 1
    chunk.write_bytes(bytes(raw))
    spillmerge.merge(str(root), str(out), part=(bad, 3), **opts)  # type: ignore[arg-type]
    assert not failure.exists()
    assert {p: v for p, v in _snapshot(out).items() if p in kept} == good
    rep = spillmerge.merge(str(root), str(out), finalize=True, **opts)  # type: ignore[arg-type]
    assert rep.n_files == 7 and spillmerge.verify(str(out)).ok
    assert {p: v for p, v in _snapshot(out).items() if p in kept} == good
    assert spillmerge.open(str(out))["bad.mp4"][3][0] == 3.0


def test_parts_never_touch_a_folder_they_did_not_write(tmp_path):
    root = tmp_path / "spill"
    _spill(root, world=1, files=2, frames=2)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    for kw in ({"part": (0, 2)}, {"finalize": True}, {"part": (0, 2), "overwrite": True}):
        with pytest.raises(spillmerge.OutputExistsError, match="not a spillmerge output"):
            spillmerge.merge(str(root), str(mine), **kw)  # type: ignore[arg-type]
    assert os.listdir(mine) == ["thesis.tex"]
    with pytest.raises(spillmerge.MissingPartsError, match="no parts found"):
        spillmerge.merge(str(root), str(tmp_path / "nothing"), finalize=True)
    with pytest.raises(spillmerge.SpillValueError, match="not both"):
        spillmerge.merge(str(root), str(tmp_path / "x"), finalize=True, part=(0, 1))
    with pytest.raises(spillmerge.SpillValueError, match="0 <= i < n"):
        spillmerge.merge(str(root), str(tmp_path / "x"), part=(2, 2))
    with pytest.raises(spillmerge.SpillValueError, match="codec must be one of"):
        spillmerge.merge(str(root), str(tmp_path / "x"), codec="gzip")


def test_parts_on_every_backend(backend, tmp_path):
    root, out, one = backend.url("spill"), backend.url("out"), backend.url("one")
    for session in range(2):  # four segments, in write order: rank 0, rank 1, rank 0, rank 1
        for r in range(2):
            with spillmerge.SpillWriter(root, rank=r, world_size=2, storage_options=backend.options) as w:
                for i in range(5):
                    w.write(f"v{i}/x.mp4", r, torch.arange(i + 3, dtype=torch.float16) + r + session)
                    w.write(f"s{session}/{i}.jpg", 0, torch.arange(i + 3, dtype=torch.float16) + r)
    work = tmp_path / "plan"  # the planner's temporary folder: pytest removes it even when the test fails
    work.mkdir()
    # Part 2 first: it builds and stores the plan; parts 0 and 1 and the finalize read it.
    so = {"storage_options": backend.options, "codec": "blosc-lz4", "plan_dir": str(work), "plan_budget": 1000,
          "on_duplicate": "last"}  # fmt: skip
    read = []
    for i in (2, 0, 1):
        rep = spillmerge.merge(root, out, part=(i, 3), **so)  # type: ignore[arg-type]
        read.append(any("was read, not rebuilt" in n for n in rep.notes))
    assert read == [False, True, True]
    rep = spillmerge.merge(root, out, finalize=True, **so)  # type: ignore[arg-type]
    assert rep.parts == 3 and rep.n_frames == 20 and any("was read, not rebuilt" in n for n in rep.notes)
    left = [rel for rel, _ in Storage(out, backend.options).find("spillmerge-parts")]
    assert sorted(left) == [f"spillmerge-parts/part-0000{i}-of-00003.json" for i in range(3)]  # no plan left
    assert os.listdir(work) == []
    spillmerge.merge(root, one, **so)  # type: ignore[arg-type]
    a, b = spillmerge.open(out, backend.options), spillmerge.open(one, backend.options)
    for name in a.filenames:  # rows of one shape per file
        assert np.array_equal(a[name][:], b[name][:]) and a.frames(name).tolist() == ([0] if "jpg" in name else [0, 1])
    assert spillmerge.verify(out, backend.options).ok


@pytest.mark.parametrize("codec", spillmerge.CODECS)
def test_every_codec_round_trips_every_dtype(tmp_path, codec):
    root, out = tmp_path / "s", tmp_path / "o"
    g = torch.Generator().manual_seed(0)
    expected = {}
    with spillmerge.SpillWriter(str(root), chunk_bytes=4096) as w:
        for i, dt in enumerate(DTYPES):
            for f in range(5):
                raw = torch.randint(
                    0, 256, (3 * 7 * torch.empty(0, dtype=dt).element_size(),), generator=g, dtype=torch.uint8
                )
                t = (raw % 2).bool()[:21].reshape(3, 7) if dt == torch.bool else raw.view(dt).reshape(3, 7)
                if f == 0:
                    t = torch.zeros_like(t)  # compressible
                expected[(str(dt), f)] = t
                w.write(str(dt), f, t)
            # A leaf of its own (a plain 1-d float32 value would clash with the 2-d ones: one ndim
            # per leaf), present in one file only.
            w.write("zeros", i, {"zeros": torch.zeros(512)})
    rep = spillmerge.merge(str(root), str(out), codec=codec, chunk_bytes=1024)
    assert rep.codec == codec
    res = spillmerge.open(str(out))
    grp = zarr.open_group(str(out), mode="r")
    # Plain zarr: each file's column from its layout; the file's rows from frame_offsets, a row's
    # values through the column's offsets where it has them (rows of other files are absent).
    names = zarr_filenames(grp)
    off = grp["index/frame_offsets"][:]
    layouts = grp.attrs["spillmerge"]["file_layouts"]
    cols = {name: layouts[int(lay)] for name, lay in zip(names, grp["index/file_layout"][:], strict=True)}
    assert cols["zeros"] == ["zeros"]
    for (name, f), want in expected.items():
        got = res[name].to_torch()[f]
        assert got.dtype == want.dtype and raw_bytes(got) == raw_bytes(want), (codec, name, f)
        (col,) = cols[name]
        assert grp[f"columns/{col}"].attrs["spillmerge"]["dtype"] == str(want.dtype).removeprefix("torch.")
        row = int(off[names.index(name)]) + f
        if f"columns/{col}/offsets" in grp:
            o = grp[f"columns/{col}/offsets"][row : row + 2]
            assert o[1] - o[0] == 1
            row = int(o[0])
        plain = np.asarray(grp[f"columns/{col}/values"][row])  # raw bits for dtypes numpy lacks
        assert plain.tobytes() == raw_bytes(want), (codec, name, f)
    doc = json.loads((out / "columns" / "zeros" / "values" / "zarr.json").read_text())
    names_ = [c["name"] for c in doc["codecs"]]
    assert names_ == {"none": ["bytes", "crc32c"], "blosc-lz4": ["bytes", "blosc", "crc32c"],
                      "zstd": ["bytes", "zstd", "crc32c"]}[codec]  # fmt: skip
    # offsets (and every other layout array) are never compressed.
    doc = json.loads((out / "columns" / "zeros" / "offsets" / "zarr.json").read_text())
    assert [c["name"] for c in doc["codecs"]] == ["bytes", "crc32c"]
    # Chunk for chunk the bytes zarr itself writes with the same codec chain.
    for name in ("zeros", "torch.bfloat16"):
        (col,) = cols[name]
        arr = grp[f"columns/{col}/values"]
        ref = zarr.create_array(
            store=str(tmp_path / "ref" / col), shape=arr.shape, chunks=arr.chunks, dtype=arr.dtype,
            serializer=arr.metadata.codecs[0], compressors=list(arr.metadata.codecs[1:]), fill_value=arr.fill_value,
            config={"write_empty_chunks": True},
        )  # fmt: skip
        ref[...] = arr[...]
        mine = out / "columns" / col / "values"
        ours = {p.relative_to(mine): p.read_bytes() for p in mine.rglob("c/**/*") if p.is_file()}
        theirs = {
            p.relative_to(tmp_path / "ref" / col): p.read_bytes()
            for p in (tmp_path / "ref" / col).rglob("c/**/*")
            if p.is_file()
        }
        assert ours == theirs and len(ours) >= (2 if name == "zeros" else 1), (codec, name)
    chunk = out / "columns" / "zeros" / "values" / "c" / "0" / "0"
    assert (chunk.stat().st_size < 200) == (codec != "none")  # 2 KiB of zeros
    assert spillmerge.verify(str(out)).ok
    chunk.write_bytes(chunk.read_bytes()[:-5] + b"XXXXX")
    rep2 = spillmerge.verify(str(out))
    assert not rep2.ok and "zeros" in rep2.problems[0] and FO.COMPLETE_NAME in os.listdir(out)


def test_index_chunks_are_the_bytes_zarr_writes_for_every_index_array(tmp_path):
    """The index chunks written without zarr (``_indexchunks``) are, object for object, the bytes
    zarr writes for the same elements: filenames and their heads, offsets, rows, a ragged
    column's offsets and shapes, a column's ``valid``, a list's offsets; a one-process merge
    writes every one of them, and so does a merge in parts (the finalize none)."""
    from spillmerge._merge import documents as Z
    from spillmerge._merge import index as _indexchunks
    from spillmerge._merge import opening as _merge
    from spillmerge._merge.options import MergeOptions

    root, one, out = tmp_path / "spill", tmp_path / "one", tmp_path / "out"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(300):  # a few index chunks per array at the small chunk sizes below
            value = {"t": torch.ones(i % 3 + 1, i % 2 + 1), "s": f"é{i}", "o": None if i % 4 else i}
            if i % 5 == 0:
                value["l"] = [torch.full((j + 1,), float(j)) for j in range(i % 3)]
            w.write(f"f{i:04d}é.jpg", 0, value)
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    job = _merge.Job.open(str(root), str(one) + "-plan", MergeOptions(**OPTS))  # type: ignore[arg-type]
    try:
        docs = Z.output_docs(job.plan, 1, job.options.chunk_bytes, job.options.codec)
        chunks = _indexchunks.index_chunks(job.plan, docs)
        paths = {c.path for c in chunks}
        assert {"index/filenames", "index/filename_heads", "index/frame_idx", "index/file_layout"} <= paths
        assert any(p.endswith("/shapes") for p in paths) and any(p.endswith("/valid") for p in paths)
        assert any(p.startswith("lists/") for p in paths) and any(p.endswith("/offsets") for p in paths)
        # zarr itself writes the same elements into arrays of the same documents: the same bytes
        ref = tmp_path / "ref"
        with zarr.config.set({"array.write_empty_chunks": True}):
            for path in sorted(paths):
                (ref / path).mkdir(parents=True)
                (ref / path / "zarr.json").write_text(json.dumps(docs[path]))
                arr = zarr.open_array(str(ref / path), mode="r+")
                for c in (c for c in chunks if c.path == path):
                    arr[c.lo : c.hi] = c.elements()
        for c in chunks:
            mine = b"".join(a.tobytes() for a in c.encode())
            assert mine == (ref / c.key).read_bytes() == (one / c.key).read_bytes(), c.key
        stored = {str(p.relative_to(one)) for p in one.rglob("*") if p.is_file() and "/c/" in str(p.relative_to(one))}
        assert {c.key for c in chunks} == {s for s in stored if "/values/" not in s}
    finally:
        job.close()
    _parts(root, out, 3)
    before = {k: v for k, v in _snapshot(out).items() if _is_chunk(k)}
    assert set(before) == {
        str(p.relative_to(one)) for p in one.rglob("*") if p.is_file() and _is_chunk(str(p.relative_to(one)))
    }
    spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert {k: v for k, v in _snapshot(out).items() if _is_chunk(k)} == before  # the finalize wrote no chunk
    assert tree_diff(output_tree(str(one)), output_tree(str(out))) == []
    # A part of a release before the shares: its record does not say it wrote index chunks (and it
    # did not), so the finalize writes that part's share.
    out2 = tmp_path / "out2"
    _parts(root, out2, 3)
    rec = out2 / "spillmerge-parts" / "part-00001-of-00003.json"
    doc = json.loads(rec.read_text())
    assert doc.pop("index") is True
    rec.write_text(json.dumps(doc))
    theirs = {c.key for c in _indexchunks.share(chunks, 1, 3)}
    assert theirs
    for key in theirs:
        (out2 / key).unlink()
    spillmerge.merge(str(root), str(out2), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert tree_diff(output_tree(str(one)), output_tree(str(out2))) == []


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_small_and_large_rows_cut_by_chunk_edges_come_back_as_written(tmp_path, codec):
    """Rows of 400 B and of 40 KB (five times a chunk of 8 KiB: cut by its edges) in one column,
    from two ranks: the copy gathers the small ones with numpy and takes the large ones row by row
    (views, not copies of whole rows); every value reads back as written, with every codec."""
    root, out = tmp_path / "spill", tmp_path / "out"
    want = {}
    for r in range(2):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=2, chunk_bytes=1 << 16) as w:
            for i in range(r, 60, 2):
                t = torch.arange(10_000 if i % 7 == 0 else 100, dtype=torch.float32) + i
                w.write(f"f{i:03d}", 0, t)
                want[f"f{i:03d}"] = t.numpy()
    spillmerge.merge(str(root), str(out), chunk_bytes=8192, codec=codec)
    res = spillmerge.open(str(out))
    assert sorted(res) == sorted(want)
    for name, value in want.items():
        assert np.array_equal(np.asarray(res[name][0]), value), name
    assert spillmerge.verify(str(out)).ok


def test_the_part_0_probe_reads_only_a_live_holder_and_is_not_fooled_by_hostile_lease_files(tmp_path):
    """``_lease.held`` (what a waiting part asks): held while part 0's lease is, free once it is
    released; a FIFO or a link out of the root in the lock's place, a lease object that expired,
    or one too large reads as not held, at once and without blocking."""
    from spillmerge._merge import lease as _lease

    out = tmp_path / "out"
    out.mkdir()
    storage = Storage(str(out))
    name = "part-00000-of-00002"  # part 0 of 2's lease
    assert not _lease.held(storage, name)
    with _lease.part(storage, 0, 2):
        assert _lease.held(storage, name)
    assert not _lease.held(storage, name)
    lock = out / _lease.LEASE_DIR / f"{name}.lock"
    lock.parent.mkdir(exist_ok=True)
    if lock.exists():
        lock.unlink()
    os.mkfifo(lock)
    assert not _lease.held(storage, name)
    lock.unlink()
    lock.symlink_to("/dev/zero")
    assert not _lease.held(storage, name)
    lock.unlink()
    obj = out / _lease.LEASE_DIR / f"{name}.json"
    rec = {"owner": "x", "role": "part 0/2", "host": "h", "pid": 1, "since": "2026-01-01T00:00:00Z"}
    obj.write_text(json.dumps({**rec, "expires": time.time() - 1}))
    assert not _lease.held(storage, name)  # expired: its holder died
    obj.write_text(json.dumps({**rec, "expires": time.time() + 60}))
    assert _lease.held(storage, name)  # an object-store holder (no working flock here)
    obj.write_text(json.dumps({**rec, "expires": time.time() + 60, "pad": "x" * (1 << 20)}))
    assert not _lease.held(storage, name)  # too large to be a lease record
