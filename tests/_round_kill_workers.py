"""Rank bodies for tests/distributed/test_round_kills.py: 3 gloo ranks run one phase of a merge
round, and one of them SIGKILLs itself in the middle of it; the survivors write what they saw."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch
from _mp_scenarios import _error

WORLD = 3
TIMEOUT = 4.0
"""Every call's timeout: a survivor names the killed rank by then at the latest, never hangs."""


def frames(rank: int) -> dict[str, dict[int, Any]]:
    return {f"r{rank}.mp4": {i: torch.full((16,), float(100 * rank + i)) for i in range(4)}}


def _die(*_: Any, **__: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _spill(base: str) -> Any:
    import spillmerge

    with spillmerge.SpillWriter(f"{base}/spill", chunk_bytes=4096) as w:
        w.update(frames(w.rank))
    return w


def run_phase(phase: str, rank: int) -> Any:
    """``phase`` on this rank; the rank ``victim(phase)`` dies at that phase's step."""
    import spillmerge
    from spillmerge._dist import gather as _gather
    from spillmerge._merge import job as _job
    from spillmerge._merge import opening as _opening
    from spillmerge._merge import scaleout as _scaleout

    base = os.environ["KILL_BASE"]
    kw: dict[str, Any] = {"wait": True, "timeout": TIMEOUT, "progress": False}
    if phase == "merge":  # dst (rank 0, the store's host) dies copying
        w = _spill(base)
        if rank == 0:
            _job.copy_units = _die  # type: ignore[assignment]
        return w.merge(f"{base}/out", **kw) and None
    if phase == "part":  # rank 1 dies writing its part of merge(parallel=True)
        w = _spill(base)
        if rank == 1:
            _scaleout.copy_units = _die  # type: ignore[assignment]
        return w.merge(f"{base}/out", parallel=True, **kw) and None
    if phase == "finalize":  # dst (rank 1) dies finalizing, every part written
        w = _spill(base)
        if rank == 1:
            _opening.finish = _die  # type: ignore[assignment]
        return w.merge(f"{base}/out", parallel=True, dst=1, **kw) and None
    assert phase == "gather"  # rank 2 dies writing its predictions
    if rank == 2:
        _gather._write_all = _die  # type: ignore[assignment]
    got = spillmerge.all_gather(frames(rank), f"{base}/out", root=f"{base}/spill", timeout=TIMEOUT, progress=False)
    return sorted(got.filenames)


def worker(phase: str, rank: int, port: int, base: str) -> None:
    """One rank: join the group, run ``phase``, write ``base/rank-R.json`` (what it returned or
    raised, and when)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    os.environ["KILL_BASE"] = base
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    t0 = time.monotonic()
    try:
        result: dict[str, Any] = {"error": None, "got": run_phase(phase, rank)}
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        result = {"error": _error(exc), "rank_attr": getattr(exc, "rank", None)}
    result["seconds"] = time.monotonic() - t0
    with open(f"{base}/rank-{rank}.json", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    time.sleep(1.0)  # the store's host (rank 0 here) outlives the others' last poll, as torchrun's agent does
    os._exit(0)  # no teardown: the group lost a rank
