"""Where part 0's plan goes (issue 24): P parts of a merge in parts at once on an existing spill
root, then the finalize, with wall-clock timers around the steps of part 0's out-of-core plan.

    python benchmarks/bench_billion.py --n 10000000 --spill-only --keep-spill --workdir /tmp/bb
    python benchmarks/bench_plan_steps.py --root /tmp/bb/n10000000/spill --parts 2 --repeats 3
    python benchmarks/bench_plan_steps.py --root /tmp/bb/n10000000/spill --parts 1 --ranges 4
    python benchmarks/bench_plan_steps.py --root /tmp/bb/n1000000/spill --parts 4 --s3

``--s3``: the output goes to a moto S3 server on 127.0.0.1 (its own process; the spill root stays
on local disk, as on a shared file system), so the parts share their runs and ranges of the plan
through the object store; per part the bytes and ranged reads it made of ``spillmerge-parts/``
(the other parts' runs and ranges, and its own on a rerun) are counted around the storage's
``read_into``.

To compare two checkouts, run this script from each in turn, alternating (``cd`` into the
checkout and set ``PYTHONPATH`` to it: the parts are forked from a process that imported
spillmerge from there), and quote ratios of the same run.

Each part is a fresh process (forked after ``import torch, spillmerge``; one torch thread). Part
0's steps are timed by wrapping ``_plan_disk._Builder`` and ``_plan`` functions (the timers add
a few microseconds per call, ~1,000 calls at 10^7 keys): ``_runs`` (step 1: its share of the
segments sorted, the other parts' runs taken: it includes waiting for them), ``_merge_names``
(step 2), pass 1's ``_entries`` / ``resolve_duplicates`` / ``pair_codes``, ``run`` (the whole
plan; ``run - _runs`` is what part 0 does alone), the phases of the plan in ranges
(``_phase_a``: names and pass 1, ``_phase_b``: pass 2, ``_phase_c``: the per-row arrays; summed
over the ranges) and the ``fingerprint``. ``--ranges N`` plans in N ranges of filenames
(``_plan_disk.RANGES``). Per part: the report's phases. Printed as one table per repeat, plus
the medians.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import functools
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import spillmerge  # noqa: E402
from spillmerge import _merge, _plan, _plan_disk  # noqa: E402
from spillmerge._storage._fsspec import FsspecStorage  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = ["_runs", "_merge_names", "_entries", "resolve_duplicates", "pair_codes", "_phase_a", "_phase_b", "_phase_c",
         "run", "fingerprint"]  # fmt: skip


def _timed(owner: Any, name: str, totals: dict[str, float]) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            totals[name] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def _part(i: int, n: int, root: str, out: str, q: Any, ranges: int, so: dict[str, Any] | None) -> None:
    totals: dict[str, float] = collections.defaultdict(float)
    read_into = FsspecStorage.read_into

    def counted(self: Any, pieces: Any, buf: Any) -> None:
        mine = [p for p in pieces if p[0].startswith("spillmerge-parts/")]
        totals["parts bytes"] += sum(b - a for _, a, b in mine)
        totals["parts reads"] += len(mine)
        read_into(self, pieces, buf)

    FsspecStorage.read_into = counted  # type: ignore[method-assign]
    if hasattr(_plan_disk, "RANGES"):  # a checkout before the plan in ranges has none
        _plan_disk.RANGES = ranges
    if i == 0:
        for name in ("_runs", "_merge_names", "_entries", "_phase_a", "_phase_b", "_phase_c", "run"):
            if hasattr(_plan_disk._Builder, name):
                _timed(_plan_disk._Builder, name, totals)
        _timed(_plan, "resolve_duplicates", totals)
        _timed(_plan, "pair_codes", totals)
        _timed(_merge, "fingerprint", totals)  # _merge calls it by this name
    copy = _merge._copy  # its CPU seconds, every thread of the process (time.process_time)

    def timed_copy(*a: Any, **k: Any) -> Any:
        c = time.process_time()
        try:
            return copy(*a, **k)
        finally:
            totals["copy cpu"] += time.process_time() - c

    _merge._copy = timed_copy
    t, c = time.perf_counter(), time.process_time()
    rep = spillmerge.merge(root, out, part=(i, n), progress=False, out_storage_options=so)
    totals["cpu"] = time.process_time() - c
    q.put((i, time.perf_counter() - t, dict(rep.phases), dict(totals)))


def one(root: str, parts: int, out: str, ranges: int, so: dict[str, Any] | None = None) -> dict[str, Any]:
    remove(out, so)
    q: Any = mp.Queue()
    t0 = time.perf_counter()
    procs = [mp.Process(target=_part, args=(i, parts, root, out, q, ranges, so)) for i in range(parts)]
    for p in procs:
        p.start()
    got = sorted((q.get() for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"a part failed (exit code {p.exitcode})")
    t1 = time.perf_counter()
    spillmerge.merge(root, out, finalize=True, progress=False, out_storage_options=so)
    t2 = time.perf_counter()
    remove(out, so)
    return {"parts": got, "finalize": t2 - t1, "wall": t2 - t0}


def remove(out: str, so: dict[str, Any] | None) -> None:
    if so is None:
        shutil.rmtree(out, ignore_errors=True)
        return
    import s3fs

    fs = s3fs.S3FileSystem(**so)
    if fs.exists(out):
        fs.rm(out, recursive=True)  # keep the server's memory flat


def table(r: dict[str, Any]) -> list[str]:
    steps = r["parts"][0][3]
    alone = steps.get("run", 0.0) - steps.get("_runs", 0.0)
    lines = [
        "| part | seconds | plan | copy | index | CPU s | copy CPU s | read of spillmerge-parts/ (MiB, reads) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, seconds, phases, tot in r["parts"]:
        lines.append(
            f"| {i} | {seconds:.1f} | {phases.get('plan', 0):.1f} | {phases.get('copy', 0):.1f} | "
            f"{phases.get('index', 0):.1f} | {tot.get('cpu', 0):.1f} | {tot.get('copy cpu', 0):.1f} | "
            f"{tot.get('parts bytes', 0) / 2**20:.1f}, {int(tot.get('parts reads', 0))} |"
        )
    lines += [""] + [
        f"part {i} phases: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) for i, _s, phases, _t in r["parts"]
    ]
    lines += [
        "",
        "part 0's plan: " + ", ".join(f"{k} {steps.get(k, 0.0):.2f} s" for k in STEPS) + f"; run - _runs {alone:.2f} s",
        f"finalize {r['finalize']:.2f} s, wall {r['wall']:.1f} s",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="a spill root (bench_billion.py --spill-only --keep-spill)")
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ranges", type=int, default=1, help="ranges of filenames the plan is built in")
    ap.add_argument("--out", help="where the output goes (removed after each repeat; default a temporary folder)")
    ap.add_argument("--s3", action="store_true", help="the output on a moto S3 server on 127.0.0.1")
    args = ap.parse_args()
    mp.set_start_method("fork")
    out = args.out or tempfile.mkdtemp(prefix="bench-plan-steps-")
    so = None
    if args.s3:
        import boto3
        from bench_s3 import start_moto

        proc, endpoint = start_moto()
        atexit.register(proc.kill)
        boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="b", aws_secret_access_key="b", region_name="us-east-1"
        ).create_bucket(Bucket="bench")
        so = {"key": "b", "secret": "b", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        out = "s3://bench/out.zarr"
    runs = []
    print(f"# spillmerge from {spillmerge.__file__}, {args.parts} parts, {args.ranges} ranges, {args.root} -> {out}")
    for k in range(args.repeats):
        runs.append(one(args.root, args.parts, out, args.ranges, so))
        print(f"\n## repeat {k + 1}\n")
        print("\n".join(table(runs[-1])), flush=True)
    if args.repeats > 1:
        med = {s: statistics.median(r["parts"][0][3].get(s, 0.0) for r in runs) for s in STEPS}
        walls = statistics.median(r["wall"] for r in runs)
        print("\n## medians\n")
        print(", ".join(f"{k} {v:.2f} s" for k, v in med.items()) + f"; wall {walls:.1f} s")


if __name__ == "__main__":
    main()
