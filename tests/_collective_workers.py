"""Rank bodies for tests/distributed/test_object_collectives.py: torch's object-collective test list (read
from the installed torch, ``_object_list``) sent with torch's pattern (rank r sends item r % 5)
through ``spillmerge.all_gather`` / ``gather`` and through ``all_gather_object`` /
``gather_object`` in the same 4-rank gloo group; every round runs in the same processes."""

from __future__ import annotations

from typing import Any

from _helpers import value_diffs as same
from _mp_scenarios import run_scenarios
from _object_list import create_collectives_object_test_list

WORLD = 4
TIMEOUT = 120.0


def _round(rank: int, world: int, base: str, name: str, shift: int, every_rank: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import spillmerge

    obj = create_collectives_object_test_list()[(rank + shift) % 5]
    out = f"{base}/{name}/out.zarr"
    preds = {f"rank-{rank}": (0, obj)}
    if every_rank:
        store = spillmerge.all_gather(preds, out, allow_pickle=True, progress=False, timeout=TIMEOUT)
        want: list[Any] = [None] * world
        dist.all_gather_object(want, obj)
    else:
        store = spillmerge.gather(preds, out, allow_pickle=True, progress=False, timeout=TIMEOUT)
        want = [None] * world if rank == 0 else []
        dist.gather_object(obj, want if rank == 0 else None, dst=0)
    if store is None:
        return {"got_store": False, "diffs": []}
    diffs = [d for s in range(world) for d in same(store.value(f"rank-{s}"), want[s], f"rank {s}")]
    # every value in order, read in bulk: the list gather_object / all_gather_object returns
    in_order = list(store.iter_values())
    if [(n, f) for n, f, _ in in_order] != [(f"rank-{s}", 0) for s in range(world)]:
        diffs.append(f"iter_values gave rows {[(n, f) for n, f, _ in in_order]}")
    diffs += same([v for _, _, v in in_order], want, "iter_values")
    return {"got_store": True, "diffs": diffs, "items": sorted({(s + shift) % 5 for s in range(world)})}


def all_gather_items(rank: int, world: int, base: str) -> dict[str, Any]:
    return _round(rank, world, base, "ag0", 0, every_rank=True)


def all_gather_items_shifted(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank r sends item (r + 1) % 5: with 4 ranks, the pattern alone never sends item 4."""
    return _round(rank, world, base, "ag1", 1, every_rank=True)


def gather_items(rank: int, world: int, base: str) -> dict[str, Any]:
    return _round(rank, world, base, "g0", 0, every_rank=False)


def whole_list_as_one_value_and_as_frames(rank: int, world: int, base: str) -> dict[str, Any]:
    """Each rank sends the whole list as one value (objects inside a list: pickled at depth) and
    each item as a frame of one file (kinds differ between the frames of a file)."""
    import torch.distributed as dist

    import spillmerge

    items = create_collectives_object_test_list()
    preds: dict[str, Any] = {f"list-{rank}": {0: items}, f"frames-{rank}": dict(enumerate(items))}
    store = spillmerge.all_gather(preds, f"{base}/whole/out.zarr", allow_pickle=True, progress=False, timeout=TIMEOUT)
    want: list[Any] = [None] * world
    dist.all_gather_object(want, items)
    diffs = []
    for s in range(world):
        diffs += same(store.value(f"list-{s}"), want[s], f"list-{s}")
        diffs += [d for i in range(5) for d in same(store.value(f"frames-{s}", i), want[s][i], f"frames-{s}[{i}]")]
    expected = {(f"list-{s}", 0): want[s] for s in range(world)}
    expected.update({(f"frames-{s}", i): want[s][i] for s in range(world) for i in range(5)})
    in_order = list(store.iter_values())
    if [(n, f) for n, f, _ in in_order] != sorted(expected):
        diffs.append(f"iter_values gave rows {[(n, f) for n, f, _ in in_order]}")
    diffs += [d for n, f, v in in_order for d in same(v, expected.get((n, f)), f"iter_values {n}[{f}]")]
    return {"got_store": True, "diffs": diffs}


SCENARIOS = {
    "ag0": all_gather_items,
    "ag1": all_gather_items_shifted,
    "g0": gather_items,
    "whole": whole_list_as_one_value_and_as_frames,
}


def worker(rank: int, world: int, port: int, base: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes`` (the rank comes first)."""
    run_scenarios(rank, world, port, base, SCENARIOS, barrier_between=True)
