"""Nothing lost at the output end: every spelling of a path, one merge per output, no
deletion through links, and a merge killed at any point rebuilt by the next one.

Concurrent and killed merges run in real forked processes (``spillmerge`` imported once, so a
process starts in milliseconds); the CLI runs through its real entry point. Every test keeps a
sentinel folder next to the spill root and the output and checks that nothing in it changed.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_cli import EXE, assert_one_line_error
from test_cli import cli_run as run

import spillmerge
from spillmerge._merge import lease as _lease
from spillmerge._storage import Storage

FORK = mp.get_context("fork")


def _tree(path: Path) -> dict[str, str]:
    """Every file below ``path`` (links not followed) with a digest of its bytes or link target."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def sentinel(tmp_path: Path):
    """A folder next to every spill root and output of the test: it must never change."""
    s = tmp_path / "sentinel"
    (s / "sub").mkdir(parents=True)
    (s / "keep.txt").write_text("do not touch")
    (s / "sub" / "data.bin").write_bytes(os.urandom(4096))
    before = _tree(s)
    yield s
    assert _tree(s) == before, "a file outside the spill root and the output changed"


def _value(tag: int, f: int, frame: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(tag * 1_000_003 + f * 1009 + frame)
    return torch.randn(64, 64, generator=g)


def _spill(root: Path, tag: int, *, world: int = 2, files: int = 3, frames: int = 8) -> dict[str, np.ndarray]:
    """A committed spill root whose values depend on ``tag``; returns filename -> expected rows."""
    for r in range(world):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=world, chunk_bytes=1 << 16) as w:
            for f in range(files):
                for frame in range(r, frames, world):
                    w.write(f"clip {f}.mp4", frame, _value(tag, f, frame))
    return {f"clip {f}.mp4": np.stack([_value(tag, f, k).numpy() for k in range(frames)]) for f in range(files)}


def _assert_holds(out: Path, expected: dict[str, np.ndarray]) -> None:
    assert spillmerge.verify(str(out)).ok
    res = spillmerge.open(str(out))
    assert sorted(res.filenames) == sorted(expected)
    for name, rows in expected.items():
        np.testing.assert_array_equal(np.asarray(res[name][:]), rows)


# ------------------------------------------------------------------------------------ paths
def test_output_inside_the_spill_root_is_refused_however_spelled(tmp_path, sentinel, monkeypatch):
    d = tmp_path / "d"
    root = d / "spill"
    _spill(root, 1)
    before = _tree(root)
    (d / "link").symlink_to(root)
    monkeypatch.chdir(d)
    spellings = [
        str(d / "tmp" / ".." / "spill"),  # `tmp` absent: a templated $JOB/../spill
        str(d / "tmp" / ".." / "spill" / "out.zarr"),
        str(d) + "//spill/./out.zarr",
        "file://" + str(d / "spill" / "x" / ".." / "out.zarr"),
        "spill/out.zarr",  # relative to the working directory
        str(d / "link" / "out.zarr"),  # through a symbolic link to the root
        str(d / "link"),
        str(d),  # an output that contains the root
    ]
    for out in spellings:
        for overwrite in (False, True):
            with pytest.raises(spillmerge.SpillValueError, match="overlap"):
                spillmerge.merge(str(root), out, overwrite=overwrite)
    assert _tree(root) == before
    assert not (d / "tmp").exists()  # `tmp/..` created nothing on the way
    # The CLI, the user's own spelling: one line, exit 1, the spill root intact.
    for extra in ([], ["--overwrite"]):
        p = run("merge", str(root), "--out", str(d / "tmp" / ".." / "spill"), *extra)
        assert_one_line_error(p, "overlap")
    assert _tree(root) == before
    report = spillmerge.merge(str(root), str(tmp_path / "ok.zarr"))
    assert report.n_frames == 24


# ------------------------------------------------------------------------- one merge per output
def _merge_after(delay: float, root: str, out: str, go: Any, q: Any) -> None:
    go.wait(30)
    time.sleep(delay)
    try:
        spillmerge.merge(root, out, progress=False)
        q.put(("ok", root, ""))
    except spillmerge.SpillMergeError as exc:
        q.put((type(exc).__name__, root, str(exc)))


def _race(roots: list[str], out: str, delays: list[float]) -> list[tuple[str, str, str]]:
    """Start one merge per root into ``out`` at once (after ``delays``); their outcomes."""
    go, q = FORK.Event(), FORK.Queue()
    return _start_together([(_merge_after, (d, r, out, go, q)) for r, d in zip(roots, delays, strict=True)], go, q)


def _start_together(calls: list[tuple[Any, tuple[Any, ...]]], go: Any, q: Any) -> list[Any]:
    """Fork one process per call, release them together with ``go``; what each put on ``q``."""
    procs = [FORK.Process(target=f, args=args) for f, args in calls]
    for p in procs:
        p.start()
    go.set()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("same_root", [False, True], ids=["different roots", "same root"])
def test_two_merges_into_one_output_never_both_write(tmp_path, sentinel, same_root):
    a, b = tmp_path / "a", tmp_path / "b"
    exp = {"a": _spill(a, 1, files=4, frames=40)}
    exp["b"] = exp["a"] if same_root else _spill(b, 2, files=4, frames=40)
    roots = [str(a), str(a if same_root else b)]
    outcomes = []
    for attempt in range(6):  # both orders, several offsets
        out = tmp_path / f"out{attempt}.zarr"
        order = roots if attempt % 2 == 0 else roots[::-1]
        results = _race(order, str(out), [0.0, random.uniform(0.0, 0.05)])
        kinds = sorted(r[0] for r in results)
        outcomes.append(kinds)
        winners = [r for r in results if r[0] == "ok"]
        assert len(winners) == 1, results  # never two merges writing one output
        loser = next(r for r in results if r[0] != "ok")
        assert loser[0] in ("OutputBusyError", "OutputExistsError"), loser
        if loser[0] == "OutputBusyError":
            # Names the holder: its pid, or (caught while the holder's lease record is still being
            # written, so no pid can be read yet) the record that is being written.
            assert "one merge per output" in loser[2], loser
            assert ("merge (pid" in loser[2]) or ("lease record under" in loser[2] and "is being written" in loser[2])
        _assert_holds(out, exp["a"] if winners[0][1] == str(a) else exp["b"])
        assert not (out / _lease.LEASE_DIR).exists()  # a finished output carries no lock files
    # Whether a race overlapped is up to the scheduler (the loser may also come after the winner's
    # marker: OutputExistsError); the guarantee above holds for every attempt either way. A busy
    # output is raised deterministically in test_a_busy_output_names_its_holder_and_a_part_is_exclusive.
    assert all(k in (["OutputBusyError", "ok"], ["OutputExistsError", "ok"]) for k in outcomes), outcomes


def test_a_busy_output_names_its_holder_and_a_part_is_exclusive(tmp_path, sentinel):
    root, out = tmp_path / "s", tmp_path / "o.zarr"
    _spill(root, 3)
    out.mkdir()
    dst = Storage(str(out))
    with _lease.whole(dst):
        with pytest.raises(spillmerge.OutputBusyError, match=f"merge \\(pid {os.getpid()} on ") as info:
            spillmerge.merge(str(root), str(out))
        assert info.value.holders and info.value.path == str(out)
        with pytest.raises(spillmerge.OutputBusyError):  # a part waits for no whole merge either
            spillmerge.merge(str(root), str(out), part=(0, 2))
        p = run("merge", str(root), "--out", str(out))
        assert_one_line_error(p, "is being written by merge (pid", "one merge per output")
    with _lease.part(dst, 1, 2):
        spillmerge.merge(str(root), str(out), part=(0, 2))  # parts share the output
        with pytest.raises(spillmerge.OutputBusyError, match=r"part 1/2 \(pid"):
            spillmerge.merge(str(root), str(out), part=(1, 2))
        with pytest.raises(spillmerge.OutputBusyError, match=r"part 1/2"):
            spillmerge.merge(str(root), str(out), overwrite=True)
    spillmerge.merge(str(root), str(out), part=(1, 2))
    report = spillmerge.merge(str(root), str(out), finalize=True)
    assert report.n_frames == 24
    marker = json.loads((out / "spillmerge-complete.json").read_text())
    assert marker["written_by"]["pid"] == os.getpid() and marker["written_by"]["role"] == "finalize"
    assert marker["spill_root"] == str(root) and len(marker["plan"]) == 32


def _hold_leases(out: str, role: str, rounds: int, go: Any, active: Any, q: Any) -> None:
    """Take and give back (tidying the lease folder) one lease ``rounds`` times; report what
    refused it and whether a whole merge ever shared the output with anyone."""
    dst, refusals, overlaps = Storage(out), [], 0
    go.wait()
    for _ in range(rounds):
        try:
            lease = _lease.whole(dst) if role == "merge" else _lease.part(dst, int(role), 4)
        except spillmerge.OutputBusyError as exc:
            refusals.append(str(exc))
            continue
        with lease:
            with active.get_lock():
                active.value += 1000 if role == "merge" else 1
                # a whole merge alone, or parts only: never both, never two whole merges
                overlaps += active.value not in (1000,) and active.value >= 1000
            time.sleep(random.uniform(0, 0.002))
            with active.get_lock():
                active.value -= 1000 if role == "merge" else 1
    q.put((role, refusals, overlaps))


@pytest.mark.parametrize("roles", [["0", "1", "2", "3"], ["merge", "0", "1", "merge"]], ids=["parts", "parts and merges"])
def test_leases_taken_and_tidied_at_once_refuse_only_real_conflicts(tmp_path, roles):
    # Found in CI: a part finishing (tidying the lease folder away, briefly holding the output's
    # lock alone) made a part starting that instant fail with OutputBusyError naming nobody.
    out = tmp_path / "o.zarr"
    out.mkdir()
    go, q, active = FORK.Event(), FORK.Queue(), FORK.Value("i", 0)
    results = _start_together([(_hold_leases, (str(out), r, 150, go, active, q)) for r in roles], go, q)
    for role, refusals, overlaps in results:
        assert overlaps == 0, role
        if "merge" not in roles:
            assert refusals == [], (role, refusals[:3])  # parts share the output: never busy
        for why in refusals:  # only a real holder refuses, and the error names it
            assert "one merge per output" in why and ("merge (pid" in why or "part " in why), why
    assert not (out / _lease.LEASE_DIR).exists()  # the last one out tidied up


def test_object_store_lease_conditional_create_expiry_and_takeover(backend):
    if backend.name == "local":
        pytest.skip("local disks use flock; covered above")
    dst = Storage(backend.url("out.zarr"), backend.options)
    first = _lease.whole(dst)
    try:
        with pytest.raises(spillmerge.OutputBusyError, match="expires in"):
            _lease.whole(dst)
        with pytest.raises(spillmerge.OutputBusyError):
            _lease.finalize(dst)
        first.check()
    finally:
        first.release()
    # A holder that died: its lease object stays until it expires, then is taken over.
    dead = _lease.Holder("dead", "merge", "elsewhere", 4242, "2026-01-01T00:00:00Z", time.time() + 60)
    dst.put(f"{_lease.LEASE_DIR}/merge.json", dead.to_json())
    with pytest.raises(spillmerge.OutputBusyError, match="pid 4242 on elsewhere"):
        _lease.part(dst, 0, 1)
    dead = _lease.Holder("dead", "merge", "elsewhere", 4242, "2026-01-01T00:00:00Z", time.time() - 1)
    dst.put(f"{_lease.LEASE_DIR}/merge.json", dead.to_json())
    taker = _lease.whole(dst)
    try:
        taker.check()
        # Someone else takes it over (it expired in their eyes): we stop before the next step.
        other = _lease.Holder("other", "merge", "h2", 7, "2026-01-01T00:00:00Z", time.time() + 60)
        dst.put(f"{_lease.LEASE_DIR}/merge.json", other.to_json())
        with pytest.raises(spillmerge.LeaseLostError, match="taken over by merge \\(pid 7 on h2"):
            taker.check()
    finally:
        taker.release()
    assert dst.get_or_none(f"{_lease.LEASE_DIR}/merge.json") is not None  # not ours: left alone


def test_merges_on_an_object_store_take_the_lease(backend):
    if backend.name == "local":
        pytest.skip("covered by the local tests")
    root, out = backend.url("s"), backend.url("o.zarr")
    for r in range(2):
        with spillmerge.SpillWriter(root, rank=r, world_size=2, storage_options=backend.options) as w:
            w.write("a", r, torch.ones(3) * r)
    dst = Storage(out, backend.options)
    with _lease.finalize(dst):
        with pytest.raises(spillmerge.OutputBusyError, match="finalize"):
            spillmerge.merge(root, out, storage_options=backend.options)
    spillmerge.merge(root, out, storage_options=backend.options)
    assert dst.listdir(_lease.LEASE_DIR) == []  # released: the lease object is gone
    assert spillmerge.open(out, storage_options=backend.options).frames("a").tolist() == [0, 1]


# -------------------------------------------------------------------------------- links
def test_a_linked_files_folder_is_never_written_or_deleted_through(tmp_path, sentinel):
    root, out, victim = tmp_path / "s", tmp_path / "o.zarr", tmp_path / "victim"
    exp = _spill(root, 4)
    spillmerge.merge(str(root), str(out), part=(0, 1))
    # Someone replaces columns/ (the part's chunks) by a link to another folder holding look-alikes.
    os.rename(out / "columns", victim)
    (victim / "important.txt").write_text("precious")
    (out / "columns").symlink_to(victim)
    before = _tree(victim)
    (out / "spillmerge-parts" / "part-00000-of-00001.json").unlink()  # the part must run again
    with pytest.raises(spillmerge.UnsafePathError, match="columns is a symbolic link"):
        spillmerge.merge(str(root), str(out), part=(0, 1))
    p = run("merge", str(root), "--out", str(out), "--finalize")
    assert_one_line_error(p, "is a symbolic link")
    assert _tree(victim) == before
    # With overwrite the links themselves go (not their targets) and the output is rebuilt.
    spillmerge.merge(str(root), str(out), part=(0, 1), overwrite=True)
    spillmerge.merge(str(root), str(out), finalize=True)
    assert _tree(victim) == before and not (out / "columns").is_symlink()
    _assert_holds(out, exp)
    # A whole merge's overwrite removes a linked folder as a link too.
    (out / "spillmerge-complete.json").unlink()
    os.rename(out / "index", tmp_path / "victim-index")
    (out / "index").symlink_to(tmp_path / "victim-index")
    before_index = _tree(tmp_path / "victim-index")
    spillmerge.merge(str(root), str(out))
    assert _tree(tmp_path / "victim-index") == before_index and _tree(victim) == before
    _assert_holds(out, exp)


def test_overwrite_deletes_only_what_the_merge_wrote(tmp_path, sentinel):
    root, out = tmp_path / "s", tmp_path / "o.zarr"
    exp = _spill(root, 5)
    spillmerge.merge(str(root), str(out))
    (out / "NOTES.md").write_text("the user's own notes")
    spillmerge.merge(str(root), str(out), overwrite=True)
    assert (out / "NOTES.md").read_text() == "the user's own notes"
    _assert_holds(out, exp)


# ----------------------------------------------------------------------------- killed merges
def test_a_merge_killed_while_writing_its_first_document_is_rebuilt(tmp_path, sentinel):
    root, out = tmp_path / "s", tmp_path / "o.zarr"
    exp = _spill(root, 6)
    # What today's release leaves when killed during its first, non-atomic write of zarr.json.
    out.mkdir()
    (out / "zarr.json").write_bytes(b'{\n  "attributes": {\n    "spill')
    with pytest.raises(spillmerge.IncompleteOutputError):
        spillmerge.open(str(out))
    spillmerge.merge(str(root), str(out))
    _assert_holds(out, exp)
    # The same state after the lease folder landed (this release), with a torn temporary name.
    (out / "spillmerge-complete.json").unlink()
    (out / "zarr.json").write_bytes(b"")
    (out / "zarr.json.tmp-1-2").write_bytes(b"{")
    (out / "spillmerge-complete.json.part-1-2").write_bytes(b"{")  # a merge with fsync=False
    (out / _lease.LEASE_DIR).mkdir()
    p = run("merge", str(root), "--out", str(out))
    assert p.returncode == 0, p.stderr
    _assert_holds(out, exp)
    assert not [x.name for x in out.iterdir() if "-1-2" in x.name]  # its temporary names removed
    # A folder holding something else is still never touched.
    other = tmp_path / "other"
    other.mkdir()
    (other / "zarr.json").write_text("{not ours")
    (other / "data.csv").write_text("1,2")
    with pytest.raises(spillmerge.OutputExistsError, match="not a spillmerge output"):
        spillmerge.merge(str(root), str(other))
    assert sorted(x.name for x in other.iterdir()) == ["data.csv", "zarr.json"]


def _merge_forever(root: str, out: str, kwargs: dict[str, Any]) -> None:
    spillmerge.merge(root, out, progress=False, **kwargs)


def _n_objects(out: str) -> int:
    return sum(len(files) for _, _, files in os.walk(out))


def _stop_after(p: Any, out: str, n: int) -> None:
    """SIGSTOP ``p`` once ``out`` holds ``n`` objects (or once it has exited): the kill point is
    chosen by what the merge has written, not by a sleep that a loaded machine stretches."""
    while p.is_alive() and _n_objects(out) < n:
        time.sleep(0.001)
    if p.is_alive():
        os.kill(p.pid, signal.SIGSTOP)


@pytest.mark.parametrize("mode", ["whole", "parts"])
def test_a_merge_killed_at_random_points_is_rebuilt_by_the_next(tmp_path, sentinel, mode):
    root = tmp_path / "s"
    exp = _spill(root, 7, files=6, frames=48)
    steps = [{}] if mode == "whole" else [{"part": (0, 2)}, {"part": (1, 2)}, {"finalize": True}]
    probe, written = str(tmp_path / "probe.zarr"), []  # objects in the output after each step
    for kwargs in steps:
        _merge_forever(str(root), probe, kwargs)
        written.append(_n_objects(probe))
    rng = random.Random(17)
    interrupted = 0
    for i in range(12):
        out = str(tmp_path / f"o{i}.zarr")
        victim = rng.randrange(len(steps))
        for k, kwargs in enumerate(steps):
            if k != victim:
                _merge_forever(str(root), out, kwargs)
                continue
            before = written[k - 1] if k else 0
            p = FORK.Process(target=_merge_forever, args=(str(root), out, kwargs))
            p.start()
            _stop_after(p, out, before + rng.randrange(1, max(2, written[k] - before)))
            # Stopped, it cannot finish: count the runs really cut before their completion marker.
            interrupted += p.is_alive() and not os.path.exists(os.path.join(out, "spillmerge-complete.json"))
            os.kill(p.pid, signal.SIGKILL)
            p.join(30)
            # The next merge (the same call again, no overwrite, nothing deleted by hand) rebuilds.
            try:
                _merge_forever(str(root), out, kwargs)
            except spillmerge.OutputExistsError:
                assert os.path.exists(os.path.join(out, "spillmerge-complete.json"))  # it had finished
        _assert_holds(Path(out), exp)
    # Every run holds the guarantee above whether its stop landed mid-merge or after the merge
    # finished (a loaded machine can let it write several objects between two polls): count what
    # happened instead of requiring a share of it (>= 6 failed once at 5 under load). At least
    # one run must have been cut before its marker, or the rebuild was not exercised at all; the
    # cut at a fixed point is test_a_merge_killed_while_writing_its_first_document_is_rebuilt.
    assert interrupted >= 1, interrupted


def test_cli_entry_point_reports_busy_output(tmp_path):
    root, out = tmp_path / "s", tmp_path / "o.zarr"
    _spill(root, 8)
    out.mkdir()
    with _lease.finalize(Storage(str(out))):
        p = run("merge", str(root), "--out", str(out), "--part", "0/2")
        assert p.returncode == 0, p.stderr  # a part shares the output with a finalize
        p = run("merge", str(root), "--out", str(out), "--finalize")
        assert_one_line_error(p, "is being written by finalize (pid")
    assert os.path.exists(EXE) or EXE == "spillmerge"


def test_an_overwrite_that_meets_a_corrupt_spill_keeps_the_complete_output(tmp_path, sentinel):
    # The output may hold the only sound copy of a frame whose spill bytes rotted: it goes only
    # once every source row of its replacement has been read and checked.
    root, out = tmp_path / "s", tmp_path / "o.zarr"
    exp = _spill(root, 7)
    spillmerge.merge(str(root), str(out))
    chunk = sorted(root.glob("rank-00001/*/data/c/0"))[0]
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    chunk.write_bytes(bytes(raw))
    before = _tree(out)
    with pytest.raises(spillmerge.CorruptSpillError, match="rank 1"):
        spillmerge.merge(str(root), str(out), overwrite=True)
    assert _tree(out) == before
    _assert_holds(out, exp)
