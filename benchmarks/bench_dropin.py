"""The drop-ins against torch's object collectives on a small payload: each rank gathers
``--items`` COCO-like instance dicts ``{image_id, category_id, bbox: [4 floats], score}`` to
rank 0 (``gather_object``) and to every rank (``all_gather_object``).

    python benchmarks/bench_dropin.py --world 2 --items 1000 --repeats 3

One spawn of W gloo ranks on loopback runs every call; methods alternate (rotated each repeat).
A call's time: from a barrier until every rank has returned (the next barrier). Its CPU time:
the CPU seconds (``time.process_time``, every thread) the call took, summed over the ranks: on a
shared, loaded machine the wall time mostly measures the other processes, the CPU time does not.
The default root (``/dev/shm`` where present). Prints per method the median and the fastest of
the repeats (the fastest is the least disturbed by other processes) and the median CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import free_port  # noqa: E402

PAIRS = [("gather_object", "spillmerge.gather_object"), ("all_gather_object", "spillmerge.all_gather_object")]


def payload(rank: int, n: int) -> list[dict[str, object]]:
    return [
        {
            "image_id": rank * n + i,
            "category_id": i % 80,
            "bbox": [1.0 * i, 2.5, 30.25, 40.0],
            "score": 0.5 + (i % 50) / 100,
        }
        for i in range(n)
    ]


def _call(method: str, rank: int, world: int, obj: object) -> list[object] | None:
    import torch.distributed as dist

    import spillmerge

    lib, name = (spillmerge, method.split(".")[1]) if method.startswith("spillmerge.") else (dist, method)
    if name == "gather_object":
        out = [None] * world if rank == 0 else None
        lib.gather_object(obj, out, dst=0)
        return out
    out = [None] * world
    lib.all_gather_object(out, obj)
    return out


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, result: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    obj = payload(rank, args.items)
    methods = [m for pair in PAIRS for m in pair]
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    _call("all_gather_object", rank, world, obj)  # warm-up: the gloo groups
    _call("spillmerge.all_gather_object", rank, world, obj)
    for rep in range(args.repeats):
        order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
        for m in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            got = _call(m, rank, world, obj)
            c1 = time.process_time()
            dist.barrier()
            times[m].append(time.perf_counter() - t0)
            cpu[m].append(c1 - c0)
            if got is not None:
                assert got == [payload(r, args.items) for r in range(world)], m
    every: list[dict[str, list[float]]] = [{}] * world
    dist.all_gather_object(every, cpu)
    if rank == 0:
        total = {m: [sum(c[m][i] for c in every) for i in range(args.repeats)] for m in methods}
        Path(result).write_text(json.dumps({"wall": times, "cpu": total}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(args.world, free_port(), args, result), nprocs=args.world, start_method="spawn")
        got = json.loads(Path(result).read_text())
    med = {m: statistics.median(v) for m, v in got["wall"].items()}
    cpu = {m: statistics.median(v) for m, v in got["cpu"].items()}
    low = {m: min(v) for m, v in got["wall"].items()}
    print(f"W={args.world}, {args.items} dicts per rank, median of {args.repeats} (load: {os.getloadavg()[0]:.1f})")
    print(
        "| call | torch s | spillmerge s | ratio | fastest: torch s | spillmerge s | CPU s (all ranks): torch | spillmerge |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for torch_m, ours in PAIRS:
        print(
            f"| {torch_m} | {med[torch_m]:.4f} | {med[ours]:.4f} | {med[ours] / med[torch_m]:.1f}x "
            f"| {low[torch_m]:.4f} | {low[ours]:.4f} | {cpu[torch_m]:.4f} | {cpu[ours]:.4f} |"
        )


if __name__ == "__main__":
    main()
