"""Before/after of the read paths over the same outputs: ``iter_values`` (bench_objects' coco,
llm and megatron values; ``as_torch=True`` as ``gather`` reads them), ``value()`` per file, and
``to_arrow``.

    python ab_read.py WORK BEFORE AFTER [--repeats 3]

builds the outputs once under WORK (with the spillmerge on ``sys.path``), then reads them in
fresh processes with ``PYTHONPATH`` = BEFORE and AFTER alternated (A B B A ...), one thread, and
prints CPU seconds (medians) and the ratio after / before per read.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
BENCH = HERE.parents[2]
READS = ("iter_values", "value", "to_arrow")


def build(work: Path) -> None:
    sys.path.insert(0, str(BENCH))
    import bench_objects as B

    import spillmerge

    for wl in ("coco", "llm", "megatron"):
        out = work / f"{wl}.zarr"
        if out.exists():
            continue
        with spillmerge.SpillWriter(str(work / f"{wl}-spill"), 0, 1, fsync=False) as w:
            for r in range(2):
                for name, (frame, v) in B.as_files(wl, B.workload_obj(wl, r, 4)).items():
                    w.write(f"{r}-{name}", frame, v)
        spillmerge.merge(str(work / f"{wl}-spill"), str(out), progress=False, fsync=False)


def read(work: Path) -> dict[str, float]:
    import torch

    import spillmerge

    torch.set_num_threads(1)
    got: dict[str, float] = {}
    for wl in ("coco", "llm", "megatron"):
        path = str(work / f"{wl}.zarr")
        t0 = time.process_time()
        n = sum(1 for _ in spillmerge.open(path).iter_values())
        got[f"{wl} iter_values ({n} values)"] = time.process_time() - t0
        t0 = time.process_time()
        sum(1 for _ in spillmerge.open(path).iter_values(as_torch=True))
        got[f"{wl} iter_values(as_torch=True)"] = time.process_time() - t0
        res = spillmerge.open(path)
        t0 = time.process_time()
        for f in res.filenames:
            res.value(f)
        got[f"{wl} value() per file"] = time.process_time() - t0
        t0 = time.process_time()
        spillmerge.open(path).to_arrow()
        got[f"{wl} to_arrow"] = time.process_time() - t0
    return got


def main() -> None:
    if sys.argv[1] == "--read":
        print(json.dumps(read(Path(sys.argv[2]))))
        return
    work, before, after = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    work.mkdir(parents=True, exist_ok=True)
    build(work)
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for rep in range(repeats):
        for which in ("before", "after") if rep % 2 == 0 else ("after", "before"):
            env = dict(os.environ, PYTHONPATH=before if which == "before" else after)
            out = subprocess.run(
                [sys.executable, str(HERE), "--read", str(work)], env=env, capture_output=True, text=True, check=True
            )
            runs[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"median of {repeats} (CPU s), load {os.getloadavg()[0]:.1f} (2 CPUs shared)\n")
    print("| read | before | after | after / before |\n|---|---|---|---|")
    for key in runs["before"][0]:
        b = statistics.median(r[key] for r in runs["before"])
        a = statistics.median(r[key] for r in runs["after"])
        print(f"| {key} | {b:.3f} s | {a:.3f} s | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
