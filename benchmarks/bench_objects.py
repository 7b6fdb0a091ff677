"""Mixed-kinds payloads (issue 23): torch's object-collective test list, repeated, through
``spillmerge.gather`` / ``all_gather`` against ``gather_object`` / ``all_gather_object``.

    python benchmarks/bench_objects.py --payload 16MiB --repeats 3 --workdir /tmp/x

The list is read from the installed torch (tests/_object_list.py: never copied into the tree).
Rank r sends item (r + j) % 5 of a fresh list as the value of file ``r{r}-{j}``, j = 0, 1, ...
until the rank's share of the payload (measured as the pickled size, what the torch collectives
move) is reached. ``allow_pickle=True`` (the list holds plain-class objects). Methods, interleaved
and rotated each repeat, in W gloo ranks on loopback:

- ``gather``: ``spillmerge.gather``, then rank 0 reads every value in order into a list, as
  ``gather_object`` returns one (``store.iter_values()``; ``store.value`` per file when the
  spillmerge under test predates it, for a before/after run against an older tree).
- ``gather_object``: ``dist.gather_object`` to rank 0.
- ``all_gather``: ``spillmerge.all_gather``, then every rank reads every value.
- ``all_gather_object``: ``dist.all_gather_object``.

``--methods gather,gather_object`` runs only those (at 1 GiB all_gather_object needs the payload's
objects on every rank at once: more memory than a small machine has).

Wall time: from a barrier until the slowest rank has everything; memory: each rank's peak extra
anonymous memory (sampled). Prints a markdown table with ratios from this run.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402
from common import MiB, PeakMemory, fmt_size, parse_size, run_ranks  # noqa: E402

METHODS = ["gather", "gather_object", "all_gather", "all_gather_object"]


def _preds(rank: int, share: int) -> dict[str, tuple[int, Any]]:
    from _object_list import create_collectives_object_test_list

    out: dict[str, tuple[int, Any]] = {}
    # Each item of the list pickles to the same size every time (a fresh 3x3 float tensor, the
    # same dicts and strings): measured once per item, so that making a 1 GiB payload does not
    # pickle it all once more (minutes per rank, outside the timed part but not outside the run).
    sizes = [len(pickle.dumps(item)) for item in create_collectives_object_test_list()]
    size, j = 0, 0
    while size < share:
        k = (rank + j) % 5
        item = create_collectives_object_test_list()[k]
        size += sizes[k]
        out[f"r{rank}-{j:08d}"] = (0, item)
        j += 1
    return out


def rank_main(rank: int, world: int, port: int, method: str, cfg: dict[str, Any], result: str) -> None:
    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    preds = _preds(rank, cfg["payload"] // world)
    out = f"{cfg['work']}/out.zarr"
    dist.barrier()
    mem = PeakMemory()
    t0 = time.perf_counter()
    n = 0
    if method in ("gather", "all_gather"):
        fn = spillmerge.gather if method == "gather" else spillmerge.all_gather
        store = fn(preds, out, allow_pickle=True, progress=False)
        if store is not None and hasattr(store, "iter_values"):
            values = [v for _, _, v in store.iter_values()]  # the list gather_object would give
            n = len(values)
        elif store is not None:
            values = [store.value(name) for name in store.filenames]
            n = len(values)
    elif method == "gather_object":
        parts: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(preds, parts, dst=0)
        n = sum(len(p) for p in parts) if parts is not None else 0
    else:
        got: list[Any] = [None] * world
        dist.all_gather_object(got, preds)
        n = sum(len(p) for p in got)
    wall = time.perf_counter() - t0
    peak = mem.stop()
    with open(f"{result}.{rank}", "w") as fh:
        json.dump({"wall_s": wall, "anon": peak["anon"], "values": n}, fh)
    dist.barrier()
    dist.destroy_process_group()


def run_method(method: str, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return run_ranks(rank_main, method, world, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--payload", default="16MiB", help="pickled bytes over all ranks (default 16MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    args = ap.parse_args()
    methods = [m for m in METHODS if m in args.methods.split(",")]
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown or not methods:
        ap.error(f"--methods: unknown {sorted(unknown)}; choose from {METHODS}")
    payload = parse_size(args.payload)
    workdir = args.workdir or tempfile.mkdtemp(prefix="spillmerge-objects-")
    os.makedirs(workdir, exist_ok=True)
    cfg = {"payload": payload, "workdir": workdir}
    rows: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in methods}
    try:
        for rep in range(args.repeats):
            k = rep % len(methods)
            for m in methods[k:] + methods[:k]:
                res = run_method(m, args.world, cfg)
                rows[m].append(res)
                print(f"  repeat {rep + 1} {m}: {max(r.get('wall_s', float('nan')) for r in res):.2f} s", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    med: dict[str, float] = {}
    anon: dict[str, int] = {}
    print(f"\nW={args.world} gloo ranks, torch's object list repeated to P={fmt_size(payload)} (pickled), "
          f"median of {args.repeats} (methods interleaved)\n")  # fmt: skip
    print("| method | slowest rank's wall (median) | runs | peak extra anon, max over ranks | values read (max rank) |")
    print("|---|---|---|---|---|")
    for m in methods:
        ok = [r for r in rows[m] if "error" not in r[0]]
        walls = [max(x["wall_s"] for x in r) for r in ok]
        med[m] = statistics.median(walls) if walls else float("nan")
        anon[m] = max((x["anon"] for r in ok for x in r), default=0)
        n = max((x["values"] for r in ok for x in r), default=0)
        print(f"| {m} | {med[m]:.2f} s | {', '.join(f'{w:.2f}' for w in walls)} | {anon[m] / MiB:.0f} MiB | {n} |")
    print()
    for ours, theirs in (("gather", "gather_object"), ("all_gather", "all_gather_object")):
        if ours in med and theirs in med:
            print(f"{ours} / {theirs}: time {med[ours] / med[theirs]:.2f}x, "
                  f"peak memory {anon[ours] / max(anon[theirs], 1):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
