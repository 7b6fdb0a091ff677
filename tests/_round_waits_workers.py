"""Rank bodies for tests/distributed/test_round_waits.py: a rank that fails before its part of
``merge(parallel=True)`` opens, and a rank whose ``SpillWriter`` is refused under a launcher's run
id, in 3 gloo ranks; every scenario runs in the same processes."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from _mp_scenarios import run_scenarios
from _round_workers import TIMEOUT, attempt, frames

WORLD = 3


def spill(root: str, rank: int, tag: str, **options: Any) -> Any:
    """Rank ``rank``'s writer under ``root``, closed, holding frames 0-3 of its own file."""
    import spillmerge

    with spillmerge.SpillWriter(root, chunk_bytes=4096, **options) as w:
        for i in range(4):
            w.write(f"{tag}-r{rank}.mp4", i, torch.full((16,), float(100 * rank + i)))
    return w


def part_fails_before_it_opens(rank: int, world: int, base: str) -> dict[str, Any]:
    """``merge(parallel=True, wait=True)`` where rank 1 passes ``threads=0``: its part fails
    before it has a plan (so before any part record of this plan). ``dst`` names part 1 at once,
    rank 2 hears it from ``dst``; none waits out the timeout. The same writer's next call merges."""
    import spillmerge

    w = spill(f"{base}/par/spill", rank, "par")
    kw: dict[str, Any] = {"parallel": True, "wait": True, "timeout": TIMEOUT, "progress": False, "chunk_bytes": 4096}
    failed = attempt(lambda: w.merge(f"{base}/par/out", **kw, **({"threads": 0} if rank == 1 else {})) and None)
    dist.barrier()  # rank 1 calls again only once the others' call ended
    after = attempt(lambda: w.merge(f"{base}/par/out", **kw) and None)
    if rank == 0 and after["error"] is None:
        after["got"] = frames(spillmerge.open(f"{base}/par/out"))
    return {"failed": failed, "after": after}


def direct_writer_refused(rank: int, world: int, base: str) -> dict[str, Any]:
    """Under a launcher's run id, rank 1's ``SpillWriter(...)`` raises (a bad option): the others'
    merge names rank 1 at once, and the next round, whose writers every rank creates, merges
    every rank's frames (rank 1 did not fall one writer session behind)."""
    import spillmerge

    os.environ["TORCHELASTIC_RUN_ID"] = "direct-refused"
    kw: dict[str, Any] = {"wait": True, "timeout": TIMEOUT, "progress": False}
    try:
        if rank == 1:
            refused = attempt(lambda: spill(f"{base}/direct/one", rank, "one", on_duplicate="bogus") and None)
        else:
            one = spill(f"{base}/direct/one", rank, "one")
            refused = attempt(lambda: one.merge(f"{base}/direct/one.out", **kw) and None)
        dist.barrier()  # rank 1's next writer starts only once the others' round ended
        w = spill(f"{base}/direct/two", rank, "two")
        after = attempt(lambda: w.merge(f"{base}/direct/two.out", **kw) and None)
    finally:
        del os.environ["TORCHELASTIC_RUN_ID"]
    if rank == 0 and after["error"] is None:
        after["got"] = frames(spillmerge.open(f"{base}/direct/two.out"))
    return {"refused": refused, "after": after}


SCENARIOS = {
    "part_fails_before_it_opens": part_fails_before_it_opens,
    "direct_writer_refused": direct_writer_refused,
}


def worker(rank: int, world: int, port: int, base: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes`` (the rank comes first)."""
    run_scenarios(rank, world, port, base, SCENARIOS, barrier_between=True)
