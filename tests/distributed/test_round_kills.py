"""A rank SIGKILLed in each phase of a merge round (``SpillWriter.merge(wait=True)``, a part of
``merge(parallel=True)``, its finalize, ``all_gather``), with real gloo ranks: every survivor
names it by its timeout at the latest, none hangs, and a re-run merges everything committed."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from _procs import free_port, join_all, rank_context
from _round_kill_workers import TIMEOUT, WORLD, worker

import spillmerge

CTX = rank_context()
ALL = {f"r{r}.mp4": [0, 1, 2, 3] for r in range(WORLD)}
VICTIM = {"merge": 0, "part": 1, "finalize": 1, "gather": 2}
"""The rank that dies in each phase."""


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[Any]]]:
    """Every phase run at once, each by its own ``WORLD`` ranks on its own port and folder (a
    group that lost a rank is unusable, and the survivors spend most of the time waiting for it):
    phase -> (folder, its processes), joined within the timeout and some seconds of slack."""
    ports: set[int] = set()
    while len(ports) < len(VICTIM):
        ports.add(free_port())
    t0 = time.monotonic()
    runs = {}
    for phase, port in zip(VICTIM, sorted(ports), strict=True):
        base = tmp_path_factory.mktemp(phase)
        runs[phase] = (base, [CTX.Process(target=worker, args=(phase, r, port, str(base))) for r in range(WORLD)])
    for _, procs in runs.values():
        for p in procs:
            p.start()
    join_all([p for _, procs in runs.values() for p in procs], timeout=TIMEOUT + 60)
    assert time.monotonic() - t0 < TIMEOUT + 45
    return runs


def _frames(out: Path) -> dict[str, list[int]]:
    store = spillmerge.open(str(out))
    return {n: store.frames(n).tolist() for n in store.filenames}


@pytest.mark.parametrize("phase", list(VICTIM))
def test_a_rank_killed_in_each_phase_is_named_by_every_survivor_and_a_rerun_merges(killed, phase):
    base, procs = killed[phase]
    victim = VICTIM[phase]
    assert procs[victim].exitcode == -signal.SIGKILL, [p.exitcode for p in procs]
    got = {r: json.loads((base / f"rank-{r}.json").read_text()) for r in range(WORLD) if r != victim}
    for r, res in got.items():
        assert res["error"] is not None and res["seconds"] < TIMEOUT + 10, (r, res)
        assert f"rank {victim}" in res["error"]["msg"] or f"[{victim}]" in res["error"]["msg"], (phase, r, res)
    committed = ALL if phase != "gather" else {n: f for n, f in ALL.items() if n != f"r{victim}.mp4"}
    spillmerge.merge(str(base / "spill"), str(base / "out"), overwrite=True, allow_partial=phase == "gather")
    assert _frames(base / "out") == committed
