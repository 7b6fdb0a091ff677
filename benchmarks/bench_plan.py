"""The merge plan alone: this checkout's ``_plan.build`` against another checkout's, same roots.

    python benchmarks/bench_plan.py --base /work/wt/base --n 1000000 --repeats 3
    python benchmarks/bench_plan.py --base /work/wt/base --n 20000 --repeats 1      # does it work

A spill root of ``--n`` keys x 1 frame of ``{"emb": fp16[64], "label": int, "caption": str}`` is
written by W=4 ranks (one process, ``SpillWriter(rank=r, world_size=4)``) in batches of 1,024
keys, keys shuffled and dealt to the ranks. Then, in fresh processes, methods alternated repeat
by repeat, each checkout (``PYTHONPATH``) loads the committed segments (``load_all``, not timed)
and calls its ``_plan.build`` (timed), the way ``spillmerge.merge`` plans in memory; this
checkout's gets ``memory_limit=--budget``. Memory is sampled every 5 ms over the build
(benchmarks/common.py ``PeakMemory``: anonymous + shmem resident bytes beyond those at its start;
file-mapped pages reported apart). Both plans' ``_plan.fingerprint`` must agree. Ratios are
new / base within one run. ``--base-root``: the same keys written by the base checkout's writer
(``--write-root DIR`` writes one with the checkout on ``PYTHONPATH``), for a base whose spill
format differs; the fingerprints then differ by the format and are not compared.
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import functools, json, sys, time
sys.path.insert(0, {bench!r})
from common import PeakMemory
from spillmerge._merge import plan as _plan
from spillmerge._format import spill as FS
from spillmerge._spill.barrier import wait_for_commits
from spillmerge._spill.root import same_bytes
try:
    from spillmerge._spill.lazy import load_all
except ImportError:  # a checkout from before segments were read lazily in their own module
    from spillmerge._spill.root import load_all
from spillmerge._storage import Storage
root, budget, side = sys.argv[1], int(sys.argv[2]), sys.argv[3]
storage = Storage(root)
state = wait_for_commits(storage, world_size=None, run_id=None, timeout=0.0, progress=False)
segments = sorted(state.committed, key=lambda s: (FS.segment_sort_key(s.name)[1], s.rank, s.name))
loaded = load_all(storage, segments)
kw = {{"memory_limit": budget}} if side == "new" else {{}}
mem = PeakMemory()
t = time.perf_counter()
plan = _plan.build(loaded, "error", same_bytes=functools.partial(same_bytes, storage), **kw)
dt = time.perf_counter() - t
peak = mem.stop()
fp = _plan.fingerprint(plan)
print(json.dumps({{"s": dt, "anon": peak["anon"], "file": peak["file"], "fp": fp, "rows": plan.n_frames,
                  "module": _plan.__file__}}))
"""


def write_root(root: str, n: int, world: int = 4, batch: int = 1024) -> None:
    import numpy as np
    import torch

    import spillmerge

    rng = np.random.default_rng(0)
    order = rng.permutation(n)
    emb_pool = torch.from_numpy(rng.standard_normal((4096, 64)).astype(np.float16))
    for rank in range(world):
        mine = order[rank::world]
        with spillmerge.SpillWriter(root, rank=rank, world_size=world) as w:
            for a in range(0, len(mine), batch):
                ids = mine[a : a + batch]
                w.write_batch(
                    [f"images/{i:08d}.jpg" for i in ids.tolist()],
                    {
                        "emb": emb_pool[torch.from_numpy(ids % 4096)],
                        "label": torch.from_numpy(ids % 1000),
                        "caption": [f"a photo of item {i}" for i in ids.tolist()],
                    },
                )


def run(checkout: str, root: str, budget: int, side: str) -> dict:
    env = dict(os.environ, PYTHONPATH=checkout)
    code = CHILD.format(bench=str(HERE))
    r = subprocess.run([sys.executable, "-c", code, root, str(budget), side], env=env, cwd=checkout,
                       capture_output=True, text=True, timeout=3600)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"{side} failed: {r.stderr[-3000:]}")
    out = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    assert out["module"].startswith(checkout), out
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="/work/wt/base")
    ap.add_argument("--new", default=str(HERE.parent))
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=512 << 20, help="this checkout's memory_limit (bytes)")
    ap.add_argument("--root", help="an existing root written by this script (kept)")
    ap.add_argument("--base-root", help="the same keys written by the base checkout (kept); default: --root")
    ap.add_argument("--write-root", help="only write a root of --n keys here (with the checkout on PYTHONPATH)")
    args = ap.parse_args()
    if args.write_root:
        write_root(args.write_root, args.n)
        return 0
    work = None
    root = args.root
    if root is None:
        work = tempfile.mkdtemp(prefix="bench-plan-")
        root = os.path.join(work, "spill")
        t = time.perf_counter()
        write_root(root, args.n)
        print(f"root of {args.n} keys written in {time.perf_counter() - t:.1f} s", flush=True)
    res: dict[str, list[dict]] = {"base": [], "new": []}
    try:
        for rep in range(args.repeats):
            sides = ["base", "new"] if rep % 2 == 0 else ["new", "base"]
            for side in sides:
                where = args.base_root if side == "base" and args.base_root else root
                r = run(args.base if side == "base" else args.new, where, args.budget, side)
                res[side].append(r)
                print(f"repeat {rep} {side:4}: plan {r['s']:.2f} s, peak anon +{r['anon'] >> 20} MiB, "
                      f"file-mapped +{r['file'] >> 20} MiB, {r['rows']} rows", flush=True)  # fmt: skip
        fps = {r["fp"] for v in res.values() for r in v}
        if args.base_root:  # another spill format: each side's fingerprints must agree among themselves
            fps = {len({r["fp"] for r in res["base"]}) * len({r["fp"] for r in res["new"]})}
        t_base = statistics.median(r["s"] for r in res["base"])
        t_new = statistics.median(r["s"] for r in res["new"])
        m_base = int(statistics.median(r["anon"] for r in res["base"]))
        m_new = int(statistics.median(r["anon"] for r in res["new"]))
        print(f"n={args.n}: plan time new/base = {t_new / t_base:.2f} ({t_new:.2f} s / {t_base:.2f} s, medians); "
              f"peak anon new/base = {m_new / max(m_base, 1):.2f} ({m_new >> 20} / {m_base >> 20} MiB); "
              f"budget {args.budget >> 20} MiB; fingerprints {'agree' if len(fps) == 1 else 'DIFFER'}")  # fmt: skip
        return 0 if len(fps) == 1 else 1
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
