"""A merge in parts plans once: the stored plan under ``OUT/spillmerge-parts/plan/``, the planner
lease, damage to anything under ``spillmerge-parts/``, and a planner killed while it works."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _mp_scenarios import output_tree, tree_diff
from _planstore_workers import merge_part
from _procs import rank_context
from test_scaleout import OPTS, _spill

import spillmerge
from spillmerge._merge import lease as _lease
from spillmerge._merge import planstore as _planstore
from spillmerge._storage import Storage


def _start(root: Path, out: Path, i: int, n: int, budget: int = 0) -> tuple[Any, Path]:
    """Part ``i`` of ``n`` (the finalize where ``i < 0``) started in its own process; the file its
    notes (or its traceback) go to."""
    result = out.parent / f"{out.name}-{i}-of-{n}.txt"
    proc = rank_context().Process(target=merge_part, args=(str(root), str(out), i, n, budget, str(result)))
    proc.start()
    return proc, result


def _left(out: Path) -> list[str]:
    """What the output's work folders hold: the part records a finished merge keeps, else a leftover."""
    found = []
    for name in ("spillmerge-parts", "spillmerge-lease"):
        for dirpath, _dirs, files in os.walk(out / name):
            found += [os.path.relpath(os.path.join(dirpath, f), out) for f in files]
    return sorted(found)


def test_parts_started_at_once_with_different_plan_budgets_plan_once_and_match_a_whole_merge(tmp_path):
    """Three parts and the finalize started at the same moment as separate processes, one part
    with a 64 KiB plan budget and the others with the default, in several start orders: every
    process ends within its timeout, one of them built the plan, and the output is byte for byte
    a whole merge's."""
    root, one = tmp_path / "spill", tmp_path / "one"
    _spill(root)
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    for attempt, order in enumerate([(0, 1, 2), (2, 1, 0), (1, 0, 2)]):
        out = tmp_path / f"out{attempt}"
        procs = [_start(root, out, -1, 3)] if attempt == 1 else []  # the finalize first, once
        procs += [_start(root, out, i, 3, budget=64 << 10 if i == order[0] else 0) for i in order]
        if attempt != 1:
            procs.append(_start(root, out, -1, 3))
        deadline = time.monotonic() + 300
        for p, _ in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        if any(p.is_alive() for p, _ in procs):
            for p, _ in procs:
                p.kill()
            pytest.fail(f"attempt {attempt}: a process did not end within its timeout (order {order})")
        notes = [result.read_text() for _, result in procs]
        for (p, _), text in zip(procs, notes, strict=True):
            assert p.exitcode == 0, text
        built = sum("built here and stored" in n for n in notes)
        assert built == 1, notes  # one planner; everybody else read its plan
        assert tree_diff(output_tree(str(one)), output_tree(str(out))) == []
        assert _left(out) == [f"spillmerge-parts/part-0000{i}-of-00003.json" for i in range(3)]
        assert spillmerge.verify(str(out)).ok


def _flip(path: Path, at: float) -> None:
    raw = bytearray(path.read_bytes())
    k = min(len(raw) - 1, int(len(raw) * at))
    raw[k] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="session")
def work_folder_states(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Path]]:
    """Read only, shared by the damage cases: a spill root, a whole merge's ``output_tree``, and an
    output of 3 parts as it stands after part 0 and after every part (before the finalize). Session
    scope: this file's tests go to the workers one by one, so each worker builds it at most once."""
    base = tmp_path_factory.mktemp("planstore-states")
    root, one, out = base / "spill", base / "one", base / "out"
    _spill(root, world=2, files=6, frames=5)
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    for i in range(3):
        spillmerge.merge(str(root), str(out), part=(i, 3), **OPTS)  # type: ignore[arg-type]
        if i == 0:
            shutil.copytree(out, base / "after-part-0", symlinks=True)
    return root, output_tree(str(one)), {"between parts": base / "after-part-0", "before finalize": out}


@pytest.mark.parametrize("when", ["between parts", "before finalize"])
@pytest.mark.parametrize(
    "target",
    ["plan/plan.json", "plan/seg.0", "plan/names.0", "plan/name_offsets.0", "plan/c0.src.0", "plan/file_offsets.0",
     "part-00000-of-00003.json"],
)  # fmt: skip
@pytest.mark.parametrize("at", [0.3, 0.6, 0.95])
def test_a_damaged_file_of_the_work_folder_is_named_or_changes_nothing(work_folder_states, tmp_path, target, when, at):
    """One byte of a stored plan file or a part record changed between the parts, or before the
    finalize: the merge ends with a SpillMergeError naming the file, or with the bytes of a whole
    merge; never with a complete output that differs."""
    root, whole, states = work_folder_states
    out = tmp_path / "out"
    shutil.copytree(states[when], out, symlinks=True)  # the parts so far, run once for every case
    victim = out / "spillmerge-parts" / target
    _flip(victim, at)
    try:
        for i in range(1 if when == "between parts" else 3, 3):
            spillmerge.merge(str(root), str(out), part=(i, 3), **OPTS)  # type: ignore[arg-type]
        spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    except spillmerge.SpillMergeError as exc:
        assert victim.name in str(exc), exc
        assert not (out / "spillmerge-complete.json").exists()
        return
    assert tree_diff(whole, output_tree(str(out))) == []
    assert spillmerge.verify(str(out)).ok


_KILLED = """
import sys, time
import spillmerge
from spillmerge._merge import opening as _merge
from spillmerge._storage import Storage
stage = sys.argv[3]
if stage == "build":
    planned = _merge.fingerprint  # called once the plan is built, before it is stored
    def slow(*a, **k):
        time.sleep(300)
        return planned(*a, **k)
    _merge.fingerprint = slow
else:
    put = type(Storage(sys.argv[2])).put
    def slow_put(self, rel, data, **k):
        put(self, rel, data, **k)
        if rel.endswith("plan/frame_idx.0"):
            time.sleep(300)  # some arrays of the plan written, plan.json not yet
    type(Storage(sys.argv[2])).put = slow_put
spillmerge.merge(sys.argv[1], sys.argv[2], part=(1, 3), chunk_bytes=8192, codec="zstd", plan_dir=sys.argv[4])
"""


@pytest.mark.parametrize("stage", ["build", "store"])
def test_a_planner_killed_while_building_or_storing_the_plan_reruns_to_the_same_bytes(tmp_path, stage):
    """SIGKILL of the part that builds the plan, while it builds it or while it stores it: the
    half-written plan is never used, a rerun gives a whole merge's bytes, and after the finalize
    nothing is left in the work folders or the planner's temporary folder."""
    root, one, out, work = tmp_path / "spill", tmp_path / "one", tmp_path / "out", tmp_path / "work"
    work.mkdir()
    _spill(root)
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(root), str(out), stage, str(work)])
    deadline = time.monotonic() + 120
    stored = out / "spillmerge-parts" / "plan" / "frame_idx.0"
    while not (out.is_dir() and _lease.held(Storage(str(out)), _planstore.PLANNER)) or (
        stage == "store" and not stored.exists()
    ):
        assert proc.poll() is None and time.monotonic() < deadline, "the planner never got there"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    assert not (out / "spillmerge-parts" / "plan" / "plan.json").exists()
    reps = [spillmerge.merge(str(root), str(out), part=(i, 3), plan_dir=str(work), **OPTS) for i in (2, 1, 0)]  # type: ignore[arg-type]
    assert "built here and stored" in "|".join(reps[0].notes) and "was read" in "|".join(reps[1].notes)
    spillmerge.merge(str(root), str(out), finalize=True, plan_dir=str(work), **OPTS)  # type: ignore[arg-type]
    assert tree_diff(output_tree(str(one)), output_tree(str(out))) == []
    assert _left(out) == [f"spillmerge-parts/part-0000{i}-of-00003.json" for i in range(3)]
    assert os.listdir(work) == []
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


def test_parts_that_disagree_on_an_option_of_the_plan_are_told_which(tmp_path):
    """A part record carries the options that decide the plan: a part run with another duplicate
    policy is refused with a message naming that option; another plan budget plans alike."""
    root, out = tmp_path / "spill", tmp_path / "out"
    _spill(root, world=2, files=4, frames=4)
    spillmerge.merge(str(root), str(out), part=(0, 2), plan_budget=64 << 10, **OPTS)  # type: ignore[arg-type]
    with pytest.raises(spillmerge.PlanMismatchError, match="codec='blosc-lz4' here, 'zstd' there"):
        spillmerge.merge(str(root), str(out), part=(1, 2), chunk_bytes=8192, codec="blosc-lz4")
    spillmerge.merge(str(root), str(out), part=(1, 2), plan_budget=1 << 30, **OPTS)  # type: ignore[arg-type]
    rep = spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert rep.parts == 2


STORED = ["plan.json", "names.0", "c0.src.0"]
"""Stored plan files attacked below: the manifest, the filenames, a column's rows (every array is read alike)."""


def test_a_stored_plan_file_that_is_no_plain_file_is_refused_or_rebuilt_never_followed(tmp_path):
    """Every attack of tests/storage/test_untrusted_storage.py (a FIFO, a folder, a link out of the output,
    a link to /dev/zero, a truncated file, a file 4 GiB longer, junk) on each kind of stored plan
    file, between part 0 and part 1 of 2: part 1 and the finalize (in a child under a time limit,
    an address-space cap and an audit of every open) end within seconds, follow no link, open no
    FIFO blocking, and either refuse with a SpillMergeError naming the file or rebuild the plan and
    write a whole merge's rows."""
    from test_untrusted_storage import ATTACKS, _copy, _data

    root, one, base = tmp_path / "spill", tmp_path / "one", tmp_path / "part0"
    _spill(root, world=2, files=4, frames=4)
    spillmerge.merge(str(root), str(one), progress=False)
    want = _data(spillmerge.open(str(one)))
    spillmerge.merge(str(root), str(base), part=(0, 2), progress=False)
    assert (base / "spillmerge-parts" / "plan" / "plan.json").is_file()
    outside = tmp_path / "outside"
    outside.mkdir()
    cases = []
    for i, name in enumerate(STORED):
        for j, (attack, fn) in enumerate(ATTACKS.items()):
            out = tmp_path / "cases" / f"{i}-{j}" / "out"
            _copy(base, out)
            fn(out / "spillmerge-parts" / "plan" / name, outside)
            cases.append({"id": f"{name}|{attack}", "target": "parts", "root": str(root), "out": str(out),
                          "scratch": str(out.parent / "unused")})  # fmt: skip
    spec, res = tmp_path / "cases.json", tmp_path / "result.json"
    spec.write_text(json.dumps(cases))
    # the child forks from the rank processes' forkserver (torch and spillmerge imported once)
    from _procs import join_all, rank_context
    from _untrusted_workers import main as run_cases

    child = rank_context().Process(target=run_cases, args=(str(spec), str(res)))
    child.start()
    join_all([child], timeout=900)
    assert child.exitcode == 0, child.exitcode
    bad = []
    for case_id, results in json.loads(res.read_text()).items():
        r = results["parts"]
        if r["followed"]:
            bad.append(f"{case_id}: {r['followed']}")
        if r["ok"]:
            if r["value"] != json.loads(json.dumps(want)):
                bad.append(f"{case_id}: a complete output that differs from a whole merge")
        elif r["error"] == "HANG" or r["error"].startswith("ESCAPED"):
            bad.append(f"{case_id}: {r['error']}: {r['message']}")
        elif case_id.split("|")[0] not in r["message"]:
            bad.append(f"{case_id}: refused without naming the file: {r['message']}")
        if r["seconds"] > 15:
            bad.append(f"{case_id}: took {r['seconds']} s")
    assert not bad, "\n".join(bad)


def test_each_part_reads_its_share_of_the_stored_plan_and_the_finalize_almost_none(tmp_path, monkeypatch):
    """The stored plan in small blocks (the arrays of 6,000 keys in ~90 blocks each): each of 4
    parts fetches about a quarter of the row table's and the index arrays' blocks, every block
    is fetched about once over all the parts, the finalize fetches a few, and the output is a
    whole merge's bytes."""
    monkeypatch.setattr(_planstore, "BLOCK_BYTES", 512)
    root, one, out = tmp_path / "spill", tmp_path / "one", tmp_path / "out"
    n, world = 6000, 2
    for r in range(world):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=world, chunk_bytes=1 << 16) as w:
            keys = list(range(r, n, world))
            w.write_batch(
                [f"img/{k:06d}.jpg" for k in keys],
                {"emb": np.arange(len(keys) * 8, dtype=np.float16).reshape(-1, 8), "label": np.array(keys)},
            )
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    fetched: dict[str, list[tuple[str, int]]] = {}
    block = _planstore.StoredArray.block

    def spy(self, k):
        if self._cache.get((self._rel, k)) is None:
            fetched.setdefault(who, []).append((self._rel.rsplit("/", 1)[1], k))
        return block(self, k)

    monkeypatch.setattr(_planstore.StoredArray, "block", spy)
    for i in (1, 0, 2, 3):  # part 1 builds and stores the plan; the others read it
        who = f"part {i}"
        rep = spillmerge.merge(str(root), str(out), part=(i, 4), **OPTS)  # type: ignore[arg-type]
        assert any(("built here" if i == 1 else _planstore.READ) in m for m in rep.notes), rep.notes
    specs = json.loads((out / "spillmerge-parts" / "plan" / "plan.json").read_text())["body"]["arrays"]
    who = "finalize"
    spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert tree_diff(output_tree(str(one)), output_tree(str(out))) == []
    for name in ("seg", "offset", "nbytes", "crc", "c0.src", "c1.src", "frame_idx", "rank", "names", "name_offsets"):
        blocks = len(specs[name]["blake2b"])
        assert blocks >= 40, (name, blocks)
        got = {p: len({k for a, k in fetched.get(p, []) if a == name}) for p in ("part 0", "part 2", "part 3")}
        if name in ("seg", "offset", "nbytes", "crc", "c0.src", "c1.src"):  # what the copy reads
            for p, k in got.items():
                assert 0 < k <= blocks // 4 + 3, (name, p, k, blocks)  # a quarter and the edges
        # an index array of one chunk is one part's to write (it reads that array whole)
        assert sum(got.values()) <= blocks + 6, (name, got, blocks)  # and the first and last, checked
    finals = fetched.get("finalize", [])
    assert len(finals) <= 12, finals  # the names' last offsets, a list's or column's last offset
