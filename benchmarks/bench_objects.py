"""Python-object payloads through ``spillmerge.gather`` / ``all_gather`` and the drop-ins
(``spillmerge.gather_object`` / ``all_gather_object``) against torch's ``gather_object`` /
``all_gather_object``.

    python benchmarks/bench_objects.py --payload 16MiB --repeats 3 --workdir /tmp/x
    python benchmarks/bench_objects.py --workload coco --repeats 3
    python benchmarks/bench_objects.py --workload coco --floor

``--workload`` picks the payload, each built in the format a real project gathers:

- ``testlist`` (default): torch's object-collective test list, repeated to ``--payload``.
- ``coco``: detectron2's ``COCOEvaluator``: 5,000 per-image dicts ``{image_id, instances}`` whose
  ``instances`` (from ``instances_to_coco_json``) hold 192k dicts ``{image_id, category_id, bbox:
  [4 floats], score}`` in all (0-76 per image), ``gather_object`` to rank 0.
- ``llm``: LLM generation eval, vLLM ``CompletionOutput``-like: 20,000 outputs ``{text, token_ids:
  list[int], logprob, finish_reason}`` keyed by prompt id, ``gather_object`` to rank 0.
- ``megatron``: Megatron-LM ``GPTDataset`` samples: 8,883 dicts ``{tokens, labels, position_ids:
  int64[L], loss_mask: float32[L]}`` of ragged lengths, 256 MiB in all, ``all_gather_object``.
  ``--collective all_gather_object`` (or ``gather_object``) runs a workload through the other one.

For these the methods are torch's collective, the drop-in (``dropin``: the same call with
``spillmerge.``), and ``gather`` / ``all_gather`` (one file per image, prompt or sample, then
``iter_values`` into the list the collective gives). ``--floor``: one process, ``pickle.dumps`` +
``pickle.loads`` of every rank's list against ``SpillWriter.write`` of each item + ``merge`` +
``iter_values`` (CPU seconds of the process, so the load of a shared machine counts less).

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
anonymous memory (sampled). Prints a markdown table with ratios from this run. For the real-format
workloads also CPU: each rank's process CPU seconds over the same span (its threads included),
summed over the ranks, and rank 0's; on a loaded machine it moves less than wall time does.
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
WORKLOADS = {
    # workload: (torch's collective, the drop-in, spillmerge's gather, items over all ranks)
    "coco": ("gather_object", "dropin", "gather", 5000),
    "llm": ("gather_object", "dropin", "gather", 20000),
    "megatron": ("all_gather_object", "dropin", "all_gather", 8883),
}
COCO_INSTANCES = 192_000
MEGATRON_BYTES = 256 << 20


def coco_images(rank: int, world: int) -> list[dict[str, Any]]:
    """detectron2's ``COCOEvaluator._predictions`` of rank ``rank``: ``{"image_id", "instances"}``
    per image, the instances as ``instances_to_coco_json`` makes them (XYWH boxes as lists of
    Python floats, ``category_id`` an int, ``score`` a float); 0-76 per image, 38.4 on average."""
    import random

    n = WORKLOADS["coco"][3]
    rnd = random.Random(rank)
    mean = COCO_INSTANCES / n
    out = []
    for img in range(rank * n // world, (rank + 1) * n // world):
        k = rnd.randrange(0, int(2 * mean))
        instances = [
            {
                "image_id": img,
                "category_id": rnd.randrange(1, 91),
                "bbox": [rnd.uniform(0, 600), rnd.uniform(0, 400), rnd.uniform(1, 200), rnd.uniform(1, 200)],
                "score": rnd.random(),
            }
            for _ in range(k)
        ]
        out.append({"image_id": img, "instances": instances})
    return out


def llm_outputs(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Rank ``rank``'s generation outputs keyed by prompt id (vLLM's ``request_id`` is a str):
    ``CompletionOutput``'s ``text``, ``token_ids``, ``cumulative_logprob`` (as ``logprob``) and
    ``finish_reason``; 20-400 tokens, about 4 characters each."""
    import random

    n = WORKLOADS["llm"][3]
    rnd = random.Random(rank)
    words = ["the", " model", " answer", " is", " 42", ".", " However", ",", " we", " note", "\n", " é", " 数"]
    out = {}
    for p in range(rank * n // world, (rank + 1) * n // world):
        k = rnd.randrange(20, 400)
        out[f"prompt-{p:06d}"] = {
            "text": "".join(rnd.choice(words) for _ in range(k)),
            "token_ids": [rnd.randrange(0, 128_000) for _ in range(k)],
            "logprob": -rnd.random() * 50,
            "finish_reason": "stop" if rnd.random() < 0.9 else "length",
        }
    return out


def megatron_samples(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s ``GPTDataset`` samples: ``tokens``, ``labels``, ``position_ids`` int64 and
    ``loss_mask`` float32 of one ragged length per sample (28 bytes a token, 256 MiB over all)."""
    n = WORKLOADS["megatron"][3]
    g = torch.Generator().manual_seed(rank)
    mean = MEGATRON_BYTES // n // 28
    out = []
    for _ in range(rank * n // world, (rank + 1) * n // world):
        length = int(torch.randint(mean // 2, mean * 3 // 2, (), generator=g))
        tokens = torch.randint(0, 50_000, (length + 1,), generator=g)
        out.append({
            "tokens": tokens[:-1].clone(),
            "labels": tokens[1:].clone(),
            "loss_mask": torch.ones(length, dtype=torch.float32),
            "position_ids": torch.arange(length, dtype=torch.int64),
        })  # fmt: skip
    return out


def workload_obj(workload: str, rank: int, world: int) -> Any:
    return {"coco": coco_images, "llm": llm_outputs, "megatron": megatron_samples}[workload](rank, world)


def as_files(workload: str, obj: Any) -> dict[str, tuple[int, Any]]:
    """The files ``gather`` / ``all_gather`` take for a rank's object: one per image, prompt or
    sample, named so that they sort in the collective's order."""
    if workload == "coco":
        return {f"{img['image_id']:08d}": (0, img) for img in obj}
    if workload == "llm":
        return {k: (0, v) for k, v in obj.items()}
    return {f"{i:08d}": (0, s) for i, s in enumerate(obj)}  # renamed per rank by the caller


def workload_main(rank: int, world: int, port: int, method: str, cfg: dict[str, Any], result: str) -> None:
    """One rank of a real-format workload (``WORKLOADS``)."""
    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    workload = cfg["workload"]
    coll = cfg.get("collective") or WORKLOADS[workload][0]
    obj = workload_obj(workload, rank, world)
    files = as_files(workload, obj)
    if workload == "megatron":  # sample indices over all ranks, in rank order
        base = rank * WORKLOADS["megatron"][3] // world
        files = {f"{base + i:08d}": v for i, (_, v) in enumerate(sorted(files.items()))}
    out_path = f"{cfg['work']}/out.zarr"
    dist.barrier()
    mem = PeakMemory()
    t0, c0 = time.perf_counter(), time.process_time()
    got: list[Any] | None = None
    if method in ("gather", "all_gather"):
        fn = spillmerge.gather if method == "gather" else spillmerge.all_gather
        store = fn(files, out_path, progress=False)
        if store is not None:
            vals = [v for _, _, v in store.iter_values(as_torch=True)]
            got = vals
    else:
        lib: Any = spillmerge if method == "dropin" else dist
        if coll == "gather_object":
            parts: list[Any] | None = [None] * world if rank == 0 else None
            lib.gather_object(obj, parts, dst=0)
        else:
            parts = [None] * world
            lib.all_gather_object(parts, obj)
        got = parts
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = mem.stop()
    n = 0 if got is None else len(got)
    if got is not None and cfg.get("check"):  # outside the timed part: what came back is what went in
        want = [workload_obj(workload, r, world) for r in range(world)]
        if method in ("gather", "all_gather"):
            want = [v for w in want for _, (_, v) in sorted(as_files(workload, w).items())]
        _check_equal(got, want)
    with open(f"{result}.{rank}", "w") as fh:
        json.dump({"wall_s": wall, "cpu_s": cpu, "anon": peak["anon"], "values": n}, fh)
    dist.barrier()
    dist.destroy_process_group()


def _check_equal(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want), (list(got)[:5], list(want)[:5])
        for k in want:
            _check_equal(got[k], want[k])
    elif isinstance(want, list):
        assert type(got) is list and len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _check_equal(a, b)
    else:
        assert type(got) is type(want) and got == want, (got, want)


def floor_main(workload: str, world: int, repeats: int, workdir: str) -> None:
    """One process: pickle round trip of every rank's object against spillmerge's write + merge +
    ``iter_values`` of the same files (CPU seconds; methods alternated)."""
    import pickle as pk

    import spillmerge

    objs = [workload_obj(workload, r, world) for r in range(world)]
    files = [as_files(workload, o) for o in objs]
    times: dict[str, list[float]] = {"pickle": [], "spillmerge": []}
    for rep in range(repeats):
        for m in ["pickle", "spillmerge"] if rep % 2 == 0 else ["spillmerge", "pickle"]:
            work = tempfile.mkdtemp(dir=workdir)
            t0 = time.process_time()
            if m == "pickle":
                back = [pk.loads(pk.dumps(o, protocol=pk.HIGHEST_PROTOCOL)) for o in objs]
                n = sum(map(len, back))
            else:
                with spillmerge.SpillWriter(f"{work}/spill", 0, 1, fsync=False) as w:
                    for r, fs in enumerate(files):
                        for name, (frame, v) in fs.items():
                            w.write(f"{r}-{name}" if workload == "megatron" else name, frame, v)
                spillmerge.merge(f"{work}/spill", f"{work}/out.zarr", progress=False, fsync=False)
                n = sum(1 for _ in spillmerge.open(f"{work}/out.zarr").iter_values(as_torch=True))
            times[m].append(time.process_time() - t0)
            shutil.rmtree(work, ignore_errors=True)
            print(f"  repeat {rep + 1} {m}: {times[m][-1]:.2f} CPU s ({n} values)", file=sys.stderr)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"\n{workload}, one process, median of {repeats} (CPU s), load {os.getloadavg()[0]:.1f}\n")
    print("| pickle dumps+loads | spillmerge write+merge+iter_values | ratio |\n|---|---|---|")
    print(f"| {med['pickle']:.2f} s | {med['spillmerge']:.2f} s | {med['spillmerge'] / med['pickle']:.2f}x |")


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
    return run_ranks(workload_main if cfg.get("workload") else rank_main, method, world, cfg)


def workload_report(
    workload: str, coll: str, world: int, repeats: int, rows: dict[str, list[list[dict[str, Any]]]]
) -> None:
    ours = "all_gather" if coll == "all_gather_object" else "gather"
    print(f"\nW={world} gloo ranks, {workload} through {coll}, median of {repeats} (methods alternated), "
          f"load {os.getloadavg()[0]:.1f}\n")  # fmt: skip
    print("| method | slowest rank's wall (median) | runs | CPU, all ranks (median) | rank 0's CPU (median) "
          "| other ranks' CPU (max) | rank 0 peak extra anon | other ranks' (max) | values |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    med: dict[str, float] = {}
    cpu: dict[str, float] = {}
    cpu0: dict[str, float] = {}
    recv: dict[str, int] = {}
    send: dict[str, int] = {}
    for m, runs in rows.items():
        ok = [r for r in runs if "error" not in r[0]]
        walls = [max(x["wall_s"] for x in r) for r in ok]
        med[m] = statistics.median(walls) if walls else float("nan")
        cpu[m] = statistics.median([sum(x["cpu_s"] for x in r) for r in ok]) if ok else float("nan")
        cpu0[m] = statistics.median([r[0]["cpu_s"] for r in ok]) if ok else float("nan")
        cpu_send = max((x["cpu_s"] for r in ok for x in r[1:]), default=float("nan"))
        recv[m] = max((r[0]["anon"] for r in ok), default=0)
        send[m] = max((x["anon"] for r in ok for x in r[1:]), default=0)
        n = max((x["values"] for r in ok for x in r), default=0)
        errs = [r[0]["error"] for r in runs if "error" in r[0]]
        print(f"| {m} | {med[m]:.2f} s | {', '.join(f'{w:.2f}' for w in walls)} | {cpu[m]:.2f} s | {cpu0[m]:.2f} s "
              f"| {cpu_send:.2f} s | {recv[m] / MiB:.0f} MiB | {send[m] / MiB:.0f} MiB | {n} |{' ' + errs[0] if errs else ''}")  # fmt: skip
    print()
    for m in (ours, "dropin"):
        if m in med and coll in med:
            print(f"{m} / {coll}: time {med[m] / med[coll]:.2f}x, CPU {cpu[m] / cpu[coll]:.2f}x (rank 0 "
                  f"{cpu0[m] / cpu0[coll]:.2f}x), rank 0 memory {recv[m] / max(recv[coll], 1):.2f}x, "
                  f"other ranks {send[m] / max(send[coll], 1):.2f}x")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--payload", default="16MiB", help="pickled bytes over all ranks (default 16MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--workload", default="testlist", choices=["testlist", *WORKLOADS])
    ap.add_argument("--floor", action="store_true", help="one process: pickle against write + merge + iter_values")
    ap.add_argument("--check", action="store_true", help="check every value that came back (outside the timing)")
    ap.add_argument("--collective", choices=["gather_object", "all_gather_object"], default=None,
                    help="for a --workload: the collective, instead of the one its project calls")  # fmt: skip
    args = ap.parse_args()
    if args.workload != "testlist":
        workdir = args.workdir or tempfile.mkdtemp(prefix="spillmerge-objects-")
        os.makedirs(workdir, exist_ok=True)
        try:
            if args.floor:
                floor_main(args.workload, args.world, args.repeats, workdir)
                return
            coll = args.collective or WORKLOADS[args.workload][0]
            ours = "all_gather" if coll == "all_gather_object" else "gather"
            wl_methods = [coll, "dropin", ours]
            if args.methods != ",".join(METHODS):
                wl_methods = [m for m in wl_methods if m in args.methods.split(",")]
            cfg = {"workload": args.workload, "collective": coll, "workdir": workdir, "check": args.check}
            got: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in wl_methods}
            for rep in range(args.repeats):
                k = rep % len(wl_methods)
                for m in wl_methods[k:] + wl_methods[:k]:
                    res = run_method(m, args.world, cfg)
                    got[m].append(res)
                    wall = max(r.get("wall_s", float("nan")) for r in res)
                    print(f"  repeat {rep + 1} {m}: {wall:.2f} s {res[0].get('error', '')}", file=sys.stderr)
            workload_report(args.workload, coll, args.world, args.repeats, got)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
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
