"""A rank SIGKILLed in each phase of a merge round (``SpillWriter.merge(wait=True)``, a part of
``merge(parallel=True)``, its finalize, ``all_gather``), with real gloo ranks: every survivor
names it by its timeout at the latest, none hangs, and a re-run merges everything committed."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from _procs import free_port, join_all, rank_context
from _round_kill_workers import TIMEOUT, WORLD, worker

import spillmerge

CTX = rank_context()
ALL = {f"r{r}.mp4": [0, 1, 2, 3] for r in range(WORLD)}


def _run(phase: str, base: Path, victim: int) -> dict[int, dict]:
    """Every rank runs ``phase``; ``victim`` dies in it. The survivors' results, after checking
    that each ended within the timeout and some seconds of slack."""
    port = free_port()
    t0 = time.monotonic()
    procs = [CTX.Process(target=worker, args=(phase, r, port, str(base))) for r in range(WORLD)]
    for p in procs:
        p.start()
    join_all(procs, timeout=TIMEOUT + 60)
    assert procs[victim].exitcode == -signal.SIGKILL, [p.exitcode for p in procs]
    assert time.monotonic() - t0 < TIMEOUT + 45
    got = {r: json.loads((base / f"rank-{r}.json").read_text()) for r in range(WORLD) if r != victim}
    for r, res in got.items():
        assert res["error"] is not None and res["seconds"] < TIMEOUT + 10, (r, res)
    return got


def _frames(out: Path) -> dict[str, list[int]]:
    store = spillmerge.open(str(out))
    return {n: store.frames(n).tolist() for n in store.filenames}


@pytest.mark.parametrize("phase", ["merge", "part", "finalize", "gather"])
def test_a_rank_killed_in_each_phase_is_named_by_every_survivor_and_a_rerun_merges(tmp_path, phase):
    victim = {"merge": 0, "part": 1, "finalize": 1, "gather": 2}[phase]
    got = _run(phase, tmp_path, victim)
    for r, res in got.items():
        assert f"rank {victim}" in res["error"]["msg"] or f"[{victim}]" in res["error"]["msg"], (phase, r, res)
    committed = ALL if phase != "gather" else {n: f for n, f in ALL.items() if n != f"r{victim}.mp4"}
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out"), overwrite=True, allow_partial=phase == "gather")
    assert _frames(tmp_path / "out") == committed
