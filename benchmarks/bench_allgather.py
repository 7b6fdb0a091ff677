"""All-gather semantics (issue 15): every rank ends up reading every value once.

    python benchmarks/bench_allgather.py                       # W=4, P=1 GiB, 3 repeats
    python benchmarks/bench_allgather.py --payload 256MiB --repeats 3

Methods, interleaved and rotated each repeat, in W gloo ranks on loopback, predictions already in
CPU memory (fp16 frames, the gather comparison's workload):

- ``all_gather``: ``spillmerge.all_gather(preds, out)``, then every rank reads every file's array
  (one file at a time, dropped after reading: what a rank must hold is the user's choice).
- ``all_gather_object``: ``dist.all_gather_object``, then every rank touches every value.
- ``gather``: ``spillmerge.gather(preds, out)`` (one call) ...
- ``writer_loop``: ... against the equivalent ``SpillWriter`` loop + ``merge`` (the 1.05x target).

Wall time is per rank from a barrier until that rank has read everything (the table shows the
slowest rank); memory is each rank's peak extra anonymous memory (RssAnon + RssShmem, sampled
every 5 ms). Prints a markdown table; quote ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import MiB, PeakMemory, fmt_size, make_frame, parse_size, pool, run_ranks, workload  # noqa: E402

METHODS = ["all_gather", "all_gather_object", "gather", "writer_loop"]


def _preds(mine: list[tuple[str, int]], p: torch.Tensor) -> dict[str, dict[int, torch.Tensor]]:
    out: dict[str, dict[int, torch.Tensor]] = {}
    for name, f in mine:
        out.setdefault(name, {})[f] = make_frame(p, name, f)
    return out


def rank_main(rank: int, world: int, port: int, method: str, cfg: dict[str, Any], result: str) -> None:
    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shape = tuple(cfg["shape"])
    mine = workload(cfg["payload"], shape, cfg["files"], world, cfg["seed"])[rank]
    preds = _preds(mine, pool(shape))
    out = f"{cfg['work']}/out.zarr"
    dist.barrier()
    mem = PeakMemory()
    t0 = time.perf_counter()
    read = 0
    if method == "all_gather":
        store = spillmerge.all_gather(preds, out, progress=False)
        for name in store.filenames:  # every value once, one file at a time
            read += np.asarray(store[name][:]).nbytes
    elif method == "all_gather_object":
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, preds)
        for part in parts:
            for frames in part.values():
                for t in frames.values():
                    read += t.numel() * t.element_size()
    elif method == "gather":
        spillmerge.gather(preds, out, progress=False)
    else:  # writer_loop: what gather replaces
        with spillmerge.SpillWriter(f"{out}.spill") as w:
            w.update(preds)
        w.merge(out, wait=True, overwrite=True, progress=False)
        w.remove_spill(everything=rank == 0)
    wall = time.perf_counter() - t0
    peak = mem.stop()
    with open(f"{result}.{rank}", "w") as fh:
        json.dump({"wall_s": wall, "anon": peak["anon"], "read": read}, fh)
    dist.barrier()
    dist.destroy_process_group()


def run_method(method: str, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return run_ranks(rank_main, method, world, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--payload", default="1GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--frame-shape", default="3x256x256")
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    payload = parse_size(args.payload)
    workdir = args.workdir or tempfile.mkdtemp(prefix="spillmerge-allgather-")
    cfg = {"payload": payload, "shape": [int(x) for x in args.frame_shape.split("x")], "files": args.files,
           "seed": 0, "workdir": workdir}  # fmt: skip
    rows: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in METHODS}
    try:
        for rep in range(args.repeats):
            k = rep % len(METHODS)
            for m in METHODS[k:] + METHODS[:k]:
                res = run_method(m, args.world, cfg)
                rows[m].append(res)
                print(
                    f"  repeat {rep + 1} {m}: {max(r.get('wall_s', float('nan')) for r in res):.2f} s", file=sys.stderr
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    med: dict[str, float] = {}
    print(f"\nW={args.world} gloo ranks, P={fmt_size(payload)}, median of {args.repeats} (methods interleaved)\n")
    print("| method | slowest rank's wall (median) | runs | peak extra anon, max over ranks | read per rank |")
    print("|---|---|---|---|---|")
    for m in METHODS:
        ok = [r for r in rows[m] if "error" not in r[0]]
        walls = [max(x["wall_s"] for x in r) for r in ok]
        med[m] = statistics.median(walls) if walls else float("nan")
        anon = max((x["anon"] for r in ok for x in r), default=0)
        read = max((x["read"] for r in ok for x in r), default=0)
        print(f"| {m} | {med[m]:.2f} s | {', '.join(f'{w:.2f}' for w in walls)} | {anon / MiB:.0f} MiB "
              f"({anon / payload:.2f}x P) | {fmt_size(read) if read else '-'} |")  # fmt: skip
    print(f"\nall_gather_object / all_gather: {med['all_gather_object'] / med['all_gather']:.2f}x (goal >= 5x)")
    print(f"gather / writer_loop: {med['gather'] / med['writer_loop']:.2f}x (goal <= 1.05x)")


if __name__ == "__main__":
    main()
