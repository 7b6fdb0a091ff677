"""Rank bodies for tests/distributed/test_guards_multirank.py (spawned: importable on their own, no pytest).

The collective merge learns of a failed rank in two ways: its failure record on storage (dst's
``_commit_watch``) and its failure key in the process group's store (``publish_failure``). Each
scenario disables one, so the other alone must name the rank, long before the merge's timeout.
"""

from __future__ import annotations

from typing import Any

import torch
from _mp_scenarios import _error, run_scenarios

WORLD = 2
MERGE_TIMEOUT = 30.0  # only reached when the mechanism under test is broken


def _fail_or_merge(rank: int, root: str, out: str, run_id: str) -> dict[str, Any]:
    import spillmerge

    try:
        with spillmerge.SpillWriter(root, run_id=run_id) as w:
            w.write(f"r{rank}.mp4", 0, torch.ones(4))
            if rank == 1:
                raise ValueError(f"rank 1 blew up in {run_id}")
    except ValueError as exc:
        return {"raised": str(exc)}
    try:
        rep = w.merge(out, timeout=MERGE_TIMEOUT, progress=False)
        return {"error": {"type": None, "report": repr(rep)}}
    except spillmerge.SpillMergeError as exc:
        return {"error": _error(exc)}


def scenario_store_only(rank: int, world: int, base: str) -> dict[str, Any]:
    """Node-local roots: dst cannot see rank 1's failure record, only its failure key."""
    return _fail_or_merge(rank, f"{base}/store_only/node-{rank}", f"{base}/store_only/out", "store-only")


def scenario_storage_only(rank: int, world: int, base: str) -> dict[str, Any]:
    """A shared root, and rank 1 publishes no failure key: only its failure record tells."""
    from spillmerge._write import segment as _segment

    publish = _segment.publish_failure
    if rank == 1:
        _segment.publish_failure = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        return _fail_or_merge(rank, f"{base}/storage_only/spill", f"{base}/storage_only/out", "storage-only")
    finally:
        _segment.publish_failure = publish  # type: ignore[assignment]


SCENARIOS = {"store_only": scenario_store_only, "storage_only": scenario_storage_only}


def worker(rank: int, world: int, port: int, base: str) -> None:
    run_scenarios(rank, world, port, base, SCENARIOS, barrier_between=True)
