"""One rank spilling N MiB of 384 KiB fp16 frames (3x256x256) against a raw ``tofile`` + fsync of
the same bytes: the writer's floor on this disk (issue 41's target: spill/raw <= 1.2).

    python benchmarks/bench_spill_floor.py --mib 512 --repeats 3
    python benchmarks/bench_spill_floor.py --before /path/to/older/checkout   # + that code's spill

Methods alternate within each repeat, each in a fresh process (``--before`` runs the spill with
that checkout first on PYTHONPATH); medians. The spill is timed from opening the writer to the
end of its ``with`` block (commit record durable); raw from the first byte to the fsync's return.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

FRAME = (3, 256, 256)


def _one(method: str, mib: int, workdir: str) -> float:
    import numpy as np

    n = mib * 1024 * 1024 // (2 * FRAME[0] * FRAME[1] * FRAME[2])
    frames = np.random.default_rng(0).standard_normal((16, *FRAME)).astype(np.float16)
    if method == "raw":
        t = time.perf_counter()
        with open(os.path.join(workdir, "raw.bin"), "wb") as f:
            for i in range(n):
                frames[i % 16].tofile(f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t
    import torch

    import spillmerge

    torch.set_num_threads(1)
    tensors = [torch.from_numpy(f) for f in frames]
    t = time.perf_counter()
    with spillmerge.SpillWriter(os.path.join(workdir, "spill"), rank=0, world_size=1) as w:
        for i in range(n):
            w.write("clip.mp4", i, tensors[i % 16])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", help="an older checkout whose spill is timed too")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._one:
        print(_one(a._one[0], a.mib, a._one[1]))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    methods = {"raw": here, "spill": here}
    if a.before:
        methods["spill-before"] = os.path.abspath(a.before)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(a.repeats):
        for m, path in methods.items():
            wd = tempfile.mkdtemp(dir=a.workdir)
            try:
                env = dict(os.environ, PYTHONPATH=path)
                arg = ["raw" if m == "raw" else "spill", wd]
                out = subprocess.run(
                    [sys.executable, __file__, "--mib", str(a.mib), "--_one", *arg],
                    env=env, check=True, capture_output=True, text=True,
                )  # fmt: skip
                times[m].append(float(out.stdout.split()[-1]))
            finally:
                shutil.rmtree(wd, ignore_errors=True)
    raw = statistics.median(times["raw"])
    print(f"{a.mib} MiB, median of {a.repeats}; load: {os.getloadavg()}")
    for m, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{m:13} {med:6.2f} s  {a.mib / 1024 / med:5.2f} GiB/s  {med / raw:5.2f}x raw   {[round(x, 2) for x in ts]}"
        )


if __name__ == "__main__":
    main()
