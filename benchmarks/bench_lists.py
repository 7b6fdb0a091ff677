"""Lists of tensors (issue 23, format 4): write, merge and read a list-of-N-tensors payload with two
spillmerge trees, alternated in one run (A B A B ...), as format 3 (one column per item position)
against format 4 (one child column with list offsets).

    python benchmarks/bench_lists.py --before /tmp/x/before --after . --frames 400 --items 100 \\
        --repeats 3 --workdir /tmp/x/work --out benchmarks/results/DIR

Each frame of file ``f{i % 20}`` is a dict ``{"scores": [N float32 tensors of shapes (k % 7 + 1,
k % 3 + 1)], "n": i}`` whose list length varies by row (N - i % 5). Every method runs in a fresh
process with ``PYTHONPATH`` = its tree (one rank, ``torch.set_num_threads(1)``). Times: the
writer's session (``write`` of every frame + close), ``merge``, and ``value()`` of every row;
also the output's columns and objects. Prints a markdown table with medians and after / before
ratios from this run; writes it and the raw figures to ``--out``.
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
import json, os, sys, time
import torch
torch.set_num_threads(1)
import spillmerge
frames, items, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(0)
rows = [(f"f{i % 20}", i, {"scores": [torch.randn(k % 7 + 1, k % 3 + 1, generator=g) for k in range(items - i % 5)], "n": i})
        for i in range(frames)]
root, out = os.path.join(work, "spill"), os.path.join(work, "out")
t = time.perf_counter()
with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
    for name, f, v in rows:
        w.write(name, f, v)
t_write = time.perf_counter() - t
t = time.perf_counter()
spillmerge.merge(root, out, progress=False)
t_merge = time.perf_counter() - t
t = time.perf_counter()
res = spillmerge.open(out)
got = [res.value(name, f) for name, f, _ in rows]
t_read = time.perf_counter() - t
assert all(len(a["scores"]) == len(v["scores"]) for a, (_, _, v) in zip(got, rows))
objects = sum(len(fs) for _, _, fs in os.walk(out))
columns = len([d for d in os.listdir(os.path.join(out, "columns")) if d != "zarr.json"])
print(json.dumps({"write": t_write, "merge": t_merge, "read": t_read, "columns": columns, "objects": objects,
                  "format": res.format_version}))
"""


def run(tree: str, frames: int, items: int, work: Path) -> dict[str, float]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    # cwd: the work folder, so that ``-c`` (which puts the cwd first on sys.path) imports the tree's spillmerge
    got = subprocess.run([sys.executable, "-c", CHILD, str(frames), str(items), str(work)], env=env, check=True,
                         capture_output=True, text=True, cwd=work)  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    return json.loads(got.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="tree of the baseline spillmerge (format 3)")
    ap.add_argument("--after", default=".", help="tree of the spillmerge measured (format 4)")
    ap.add_argument("--frames", type=int, default=400)
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    figures: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(a.repeats):
        for which in (("before", "after") if r % 2 == 0 else ("after", "before")):
            fig = run(getattr(a, which), a.frames, a.items, Path(a.workdir) / which)
            figures[which].append(fig)
            print(which, json.dumps(fig), flush=True)
    lines = [f"{a.frames} frames, lists of {a.items} - (i % 5) float32 tensors; {a.repeats} alternated repeats; "
             f"load {os.getloadavg()[0]:.1f}", "",
             "| median | before (format 3) | after (format 4) | after / before | quickest: before, after, ratio |",
             "|---|---|---|---|---|"]  # fmt: skip
    for key in ("write", "merge", "read", "columns", "objects"):
        b = statistics.median(f[key] for f in figures["before"])
        c = statistics.median(f[key] for f in figures["after"])
        bq, cq = min(f[key] for f in figures["before"]), min(f[key] for f in figures["after"])
        unit = " s" if key in ("write", "merge", "read") else ""
        lines.append(f"| {key} | {b:.3g}{unit} | {c:.3g}{unit} | {c / b:.2f}x | {bq:.3g}, {cq:.3g}, {cq / bq:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lists.md").write_text(table + "\n")
        (out / "lists.json").write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
