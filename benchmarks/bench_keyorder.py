"""Peak memory and time of the key-order pass of the merge plan (``_format.keyorder.output_orders``)
alone, on a synthetic merge of N files, two spillmerge trees alternated in one run (A B A B ...).

    python benchmarks/bench_keyorder.py --before /work/wt/base --after . --files 1000000,4000000 \\
        --repeats 2 --workdir /tmp/x --out benchmarks/results/DIR

Each file is one frame of a dict ``{"score", "label"}`` (not in sorted key order: its two layouts
carry positions), so two index rows; 2 segments (ranks) hold alternate files; the files come in 8
runs of 2 key orders (the output is 8 runs whatever N); ``--clash-every K``: every K-th file has
a second frame in the other order (its layouts clash: it is walked in row order). Every
measurement is a fresh process with ``PYTHONPATH`` = its tree, ``torch.set_num_threads(1)``; the
segments' index and the per-segment file numbers (maps of files, as the plan gives them) are
built before the measurement starts. glibc's mmap threshold is fixed at 128 KiB unless
``--default-malloc``: a freed temporary then leaves and the next one's pages count (the memory to
read), but every temporary's pages also fault anew (read times from a ``--default-malloc``
run). A tree whose ``output_orders`` takes ``new`` gets the plan's allocator
(``_merge.plansql.alloc`` over a work folder). Prints a markdown table: peak anonymous and
file-backed memory over the call (``common.PeakMemory``), wall and CPU seconds
(``process_time``: what stays comparable on a shared VM), and the ratios 4x files / 1x and
after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import functools, hashlib, inspect, json, os, sys, time
from types import SimpleNamespace as NS
import numpy as np
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[3])
from common import PeakMemory
from spillmerge._format.keyorder import output_orders
from spillmerge._merge import plansql
n, work, clash = int(sys.argv[1]), sys.argv[2], int(sys.argv[4])
orders = [(("score", 0), ("label", 1)), (("label", 0), ("score", 1))]
layouts = [NS(leaf=(k,), pos=(p,)) for o in orders for k, p in o]  # layout 2*o + leaf
segments, file_ids = [], []
for r in range(2):
    files = np.arange(r, n, 2, dtype=np.int64)
    idx = np.zeros((2 * len(files), 6), dtype=np.int64)
    idx[:, 0] = np.repeat(np.arange(len(files)), 2)  # the segment's file number
    o = (files * 8 // n) % 2  # 8 runs of files, 2 orders
    idx[:, 2] = np.repeat(2 * o, 2) + np.tile([0, 1], len(files))
    if clash:  # a second frame of every clash-th file, in the other order: its layouts clash
        c = np.flatnonzero(files % clash == 0)
        more = np.zeros((2 * len(c), 6), dtype=np.int64)
        more[:, 0] = np.repeat(c, 2)
        more[:, 2] = np.repeat(2 * (1 - o[c]), 2) + np.tile([0, 1], len(c))
        idx = np.concatenate([idx, more])
    ids = plansql.alloc(work, "file_ids", len(files), np.int64)
    ids[:] = files
    segments.append(NS(layouts=layouts, index=idx, filenames=None))
    file_ids.append(ids)
kw = {}
if "new" in inspect.signature(output_orders).parameters:
    kw["new"] = functools.partial(plansql.alloc, work)
names = range(n)  # only its length is read when file_ids are given
pm = PeakMemory()
t, c = time.perf_counter(), time.process_time()
res = output_orders(names, segments, file_ids, **kw)
s, cpu = time.perf_counter() - t, time.process_time() - c
mem = pm.stop()
print(json.dumps({"s": s, "cpu_s": cpu, "anon": mem["anon"], "file": mem["file"], "runs": len(res["runs"]),
                  "digest": hashlib.sha1(repr(res).encode()).hexdigest(), "tree": plansql.__file__}))
"""


def run(tree: str, n: int, work: Path, clash: int, fixed_malloc: bool) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # a fixed mmap threshold: glibc's dynamic one rises after the input's large frees, and the
    # call's temporaries would then reuse heap pages already resident (no peak to see)
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    if fixed_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(work), here, str(clash)], env=env, check=True, cwd=work,
                         capture_output=True, text=True).stdout  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--files", default="1000000,4000000")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/bench-keyorder")
    ap.add_argument("--out", default=None)
    ap.add_argument("--default-malloc", action="store_true", help="glibc's own mmap threshold (times as in use)")
    ap.add_argument("--clash-every", type=int, default=0, help="every K-th file also has a frame in the other order")
    a = ap.parse_args()
    sizes = [int(x) for x in a.files.split(",")]
    got: dict[tuple[str, int], list[dict]] = {}
    for r in range(a.repeats):
        for n in sizes:
            for which in ("before", "after") if r % 2 == 0 else ("after", "before"):
                res = run(getattr(a, which), n, Path(a.workdir) / which, a.clash_every, not a.default_malloc)
                got.setdefault((which, n), []).append(res)
                print(f"repeat {r + 1} {which} {n}: {json.dumps(res)}", file=sys.stderr, flush=True)
    MiB = 1 << 20
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("s", "cpu_s", "anon", "file")} for k, v in got.items()}
    lines = ["| tree | files | peak anon MiB | peak file MiB | s | CPU s | runs |", "|---|---|---|---|---|---|---|"]
    for which in ("before", "after"):
        for n in sizes:
            m = med[(which, n)]
            lines.append(f"| {which} | {n:,} | {m['anon'] / MiB:.1f} | {m['file'] / MiB:.1f} | {m['s']:.2f} "
                         f"| {m['cpu_s']:.2f} | {got[(which, n)][0]['runs']} |")  # fmt: skip
    lo, hi = sizes[0], sizes[-1]
    lines.append("")
    for which in ("before", "after"):
        lines.append(f"- {which}: peak anon {hi:,} / {lo:,} files = "
                     f"{med[(which, hi)]['anon'] / max(med[(which, lo)]['anon'], 1):.2f}x")  # fmt: skip
    for n in sizes:
        b, f = med[("before", n)], med[("after", n)]
        same = {x["digest"] for x in got[("before", n)] + got[("after", n)]}
        lines.append(f"- {n:,} files: after / before time {f['s'] / b['s']:.2f}x (CPU {f['cpu_s'] / b['cpu_s']:.2f}x), peak anon "
                     f"{f['anon'] / max(b['anon'], 1):.3f}x; same result: {len(same) == 1}")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "table.md").write_text(text + "\n", encoding="utf-8")
        raw = {f"{w} {n}": v for (w, n), v in got.items()}
        (Path(a.out) / "raw.json").write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
