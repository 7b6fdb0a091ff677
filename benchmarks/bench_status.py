"""What the progress record behind ``spillmerge status`` costs the writer: ``write()`` per row
with the flush thread's progress rewrites and with them switched off, in the same run (best of
5 alternating runs each). The target is a ratio of 1 within noise: the counting and the rewrites
run on the flush thread, never on the caller's.

    PYTHONPATH=. python benchmarks/bench_status.py [--rows N]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch

import spillmerge
from spillmerge._util import progress as _progress


def _per_row_us(rows: int) -> float:
    d = tempfile.mkdtemp(prefix="bench-status-")
    try:
        t = torch.zeros(64)  # 256 B rows, 64 KiB chunks: a chunk (and a journal entry) every 256 rows
        with spillmerge.SpillWriter(d, rank=0, world_size=1, chunk_bytes=1 << 16, fsync=False) as w:
            t0 = time.perf_counter()
            for i in range(rows):
                w.write("f", i, t)
            return (time.perf_counter() - t0) / rows * 1e6
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=60000)
    args = ap.parse_args()
    real = _progress.ProgressWriter.maybe_write
    off = lambda self, **kw: None  # noqa: E731 - the baseline: no progress record is written
    times: dict[str, list[float]] = {"with progress": [], "without": []}
    for _ in range(5):
        _progress.ProgressWriter.maybe_write = real  # type: ignore[method-assign]
        times["with progress"].append(_per_row_us(args.rows))
        _progress.ProgressWriter.maybe_write = off  # type: ignore[method-assign]
        times["without"].append(_per_row_us(args.rows))
    _progress.ProgressWriter.maybe_write = real  # type: ignore[method-assign]
    base = min(times["without"])
    print(f"{'writer':<16} {'us/row (best of 5)':>20} {'ratio':>7}")
    for name, ts in times.items():
        print(f"{name:<16} {min(ts):>20.2f} {min(ts) / base:>7.3f}")


if __name__ == "__main__":
    main()
