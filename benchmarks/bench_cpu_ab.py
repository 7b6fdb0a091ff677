"""CPU time of two spillmerge checkouts on the many-keys and video workloads, alternated A B A B.

    python benchmarks/bench_cpu_ab.py --a /tmp/old-checkout --b . --repeats 3 --out results.md

On a VM shared with other jobs, wall times drift by 2-4x between minutes (bench_gather.py's raw
spill, the same code, took 3.5-12 s in one hour here); the CPU time a process spends is far less
sensitive to how many other processes share the cores. Each measurement is a fresh process
running one checkout (``PYTHONPATH``), in one process and one torch thread (W = 1: what every
rank does, without the gloo wait), timing each phase with ``time.process_time()`` (every thread of
the process: the writer's flush thread and the merge's workers included) and ``perf_counter()``:

- ``manykeys``: N filenames x 1 frame of ``{logits fp16[1000], emb fp16[512]}`` (bench_manykeys.py's
  values): ``write()`` each, commit, ``merge``, ``open``, 200 rows by filename (each leaf's row), the logits column.
- ``video``: P bytes of fp16 3x256x256 frames in 16 files (bench_gather.py's frame shape):
  ``write()`` each, commit, ``merge``, ``open``, every file's frames read whole.

Checkouts alternate per repeat (A B, then B A ...). Medians and B / A ratios per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time
import numpy as np
import torch
torch.set_num_threads(1)
import spillmerge

work, case, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
T, W = time.process_time, time.perf_counter
out = {}
def phase(name, t0, w0):
    out[name] = (T() - t0, W() - w0)
    return T(), W()

g = torch.Generator().manual_seed(0)
if case == "manykeys":
    logits = torch.randn((257, 1000), generator=g).half()
    emb = torch.randn((257, 512), generator=g).half()
    values = [(f"images/{i:07d}.jpg", {"logits": logits[i % 257].clone(), "emb": emb[i % 257].clone()}) for i in range(n)]
else:
    frame_bytes = 3 * 256 * 256 * 2
    frames = max(16, n // frame_bytes)
    pool = [torch.randn((3, 256, 256), generator=g).half() for _ in range(8)]
    values = [(f"video_{i % 16:02d}.mp4", pool[i % 8]) for i in range(frames)]
t0, w0 = T(), W()
with spillmerge.SpillWriter(f"{work}/spill", 0, 1) as w:
    counts = {}
    for name, v in values:
        f = counts.get(name, 0)
        counts[name] = f + 1
        w.write(name, f, v)
t0, w0 = phase("spill", t0, w0)
w.merge(f"{work}/out.zarr", progress=False)
t0, w0 = phase("merge", t0, w0)
res = spillmerge.open(f"{work}/out.zarr")
t0, w0 = phase("open", t0, w0)
if case == "manykeys":
    for i in range(0, n, max(1, n // 200)):
        row = res[f"images/{i:07d}.jpg"]  # leaf views (format 2 has no value())
        assert row["logits"][0].shape == (1000,) and row["emb"][0].shape == (512,)
    t0, w0 = phase("values", t0, w0)
    col = res.column("logits")[:]
    assert col.shape == (n, 1000)
    t0, w0 = phase("column", t0, w0)
else:
    for name in res.filenames:
        a = res[name][:]
        assert a.shape[1:] == (3, 256, 256)
    t0, w0 = phase("read", t0, w0)
print(json.dumps(out))
"""


def run_one(tree: str, case: str, n: int, workdir: str) -> dict[str, list[float]]:
    work = tempfile.mkdtemp(dir=workdir)
    try:
        env = {**os.environ, "PYTHONPATH": tree}
        proc = subprocess.run([sys.executable, "-c", CHILD, work, case, str(n)], env=env, capture_output=True,
                              text=True, cwd=tree)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"{tree} {case}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def git_head(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                              check=True).stdout.strip()[:90]  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="checkout A (the baseline), a directory holding spillmerge/")
    ap.add_argument("--b", required=True, help="checkout B")
    ap.add_argument("--keys", type=int, default=100_000, help="manykeys: number of filenames")
    ap.add_argument("--video-bytes", type=int, default=256 << 20, help="video: payload in bytes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="also write the tables here (markdown)")
    args = ap.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="spillmerge-cpu-ab-")
    os.makedirs(workdir, exist_ok=True)
    cases = {"manykeys": args.keys, "video": args.video_bytes}
    runs: dict[tuple[str, str], list[dict[str, list[float]]]] = {}
    load = []
    for rep in range(args.repeats):
        order = [("A", args.a), ("B", args.b)] if rep % 2 == 0 else [("B", args.b), ("A", args.a)]
        for case, n in cases.items():
            for tag, tree in order:
                load.append(os.getloadavg()[0])
                runs.setdefault((case, tag), []).append(run_one(tree, case, n, workdir))
                print(f"  repeat {rep + 1} {case} {tag}: {runs[(case, tag)][-1]}", file=sys.stderr)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    lines = [f"A = {args.a} ({git_head(args.a)})", f"B = {args.b} ({git_head(args.b)})", "",
             f"One process, one torch thread, {args.repeats} repeats alternated (A B, B A ...); "
             f"load average (1 min) during the runs {min(load):.1f}-{max(load):.1f}.", ""]  # fmt: skip
    for case, n in cases.items():
        size = f"{n:,} keys" if case == "manykeys" else f"{n / 2**20:.0f} MiB"
        lines += [f"### {case} ({size})", "", "| phase | A CPU s (median) | B CPU s (median) | B / A CPU | A wall s | B wall s | B / A wall |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        phases = list(runs[(case, "A")][0])
        for ph in [*phases, "total"]:
            med = {}
            for tag in ("A", "B"):
                if ph == "total":
                    cpu = statistics.median(sum(r[p][0] for p in phases) for r in runs[(case, tag)])
                    wall = statistics.median(sum(r[p][1] for p in phases) for r in runs[(case, tag)])
                else:
                    cpu = statistics.median(r[ph][0] for r in runs[(case, tag)])
                    wall = statistics.median(r[ph][1] for r in runs[(case, tag)])
                med[tag] = (cpu, wall)
            (ca, wa), (cb, wb) = med["A"], med["B"]
            lines.append(f"| {ph} | {ca:.2f} | {cb:.2f} | {cb / ca:.2f}x | {wa:.2f} | {wb:.2f} | {wb / wa:.2f}x |")
        per_run = [sum(r[p][0] for p in phases) for r in runs[(case, "B")]]
        base = [sum(r[p][0] for p in phases) for r in runs[(case, "A")]]
        lines += ["", f"total CPU per repeat, A: {', '.join(f'{x:.2f}' for x in base)}; "
                  f"B: {', '.join(f'{x:.2f}' for x in per_run)}", ""]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
