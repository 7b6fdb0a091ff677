"""One rank spilling large frames against a raw ``tofile`` + ``fsync`` of the same bytes.

    python benchmarks/bench_spill.py                       # 1 GiB of 384 KiB fp16 frames, 3 repeats
    python benchmarks/bench_spill.py --gib 0.25 --repeats 2 --profile

Methods, alternated within each repeat (A B A B), medians and per-repeat ratios printed:

- ``raw``: one file, every frame's bytes written in turn (``ndarray.tofile`` on the open file),
  then one ``fsync``: the floor for putting these bytes on this disk durably.
- ``spill``: ``SpillWriter(root, 0, 1)``, ``write(name, frame, tensor)`` per frame (16 files, frames
  in order), then the commit (``close``): what ``write()`` costs, durability included. Each spill
  runs in a fresh process (``--flush-threads 1,2``: one method per value; ``--base DIR``: one
  more with the checkout ``DIR`` on ``PYTHONPATH``, e.g. today's main).

``--profile`` wraps the flush path's steps (waiting for a staging buffer in ``write()``, the
flush workers' writes and fsyncs, the commit) in timers and prints where the spill's time went.

Frames come from a pool of 64 random fp16 frames (3x256x256: 384 KiB), already in memory when
the clock starts. Every process calls ``torch.set_num_threads(1)``. Other work on this VM moves
absolute times: quote the ratios of one run, and the load (``uptime``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pool  # noqa: E402

SHAPE = (3, 256, 256)
FILES = 16


def run_raw(frames: torch.Tensor, n: int, path: str) -> float:
    arrs = [f.numpy() for f in frames]
    t = time.perf_counter()
    with open(path, "wb") as fh:
        for i in range(n):
            arrs[i % len(arrs)].tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t


def run_spill(frames: torch.Tensor, n: int, root: str, **kw: Any) -> tuple[float, float]:
    """(seconds in the write loop, seconds of the commit)."""
    import spillmerge

    per_file = -(-n // FILES)
    t = time.perf_counter()
    w = spillmerge.SpillWriter(root, 0, 1, **kw)
    with w:
        for i in range(n):
            w.write(f"video_{i // per_file:03d}.mp4", i % per_file, frames[i % len(frames)])
        loop = time.perf_counter() - t
    return loop, time.perf_counter() - t - loop


class Timers:
    """Seconds spent inside wrapped functions, summed per label over every thread."""

    def __init__(self) -> None:
        self.total: dict[str, float] = collections.defaultdict(float)
        self._lock = threading.Lock()

    def wrap(self, owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with self._lock:
                    self.total[label] += time.perf_counter() - t

        setattr(owner, name, timed)


def profile(frames: torch.Tensor, n: int, root: str) -> None:
    import google_crc32c

    from spillmerge._storage import local as _local
    from spillmerge._write import flush as _flush
    from spillmerge._write import staging as _staging
    from spillmerge._write import writer as _writer

    timers = Timers()
    timers.wrap(_flush.BufferPool, "acquire", "write(): waiting for a staging buffer")
    timers.wrap(_staging.Staging, "_block", "write(): block CRC-32C (caller's thread)")
    timers.wrap(_local.LocalStorage, "put", "flush workers: put (write + fsync when asked)")
    timers.wrap(_local.os, "fsync", "any thread: os.fsync")
    timers.wrap(_writer.SpillWriter, "_write_index", "commit: index and small objects")
    timers.wrap(_writer.SpillWriter, "close", "commit: close() in all")
    for mod in ("_syncfs",):
        if hasattr(_local, mod):
            timers.wrap(_local, mod, "commit: syncfs")
    loop, commit = run_spill(frames, n, root)
    print(f"profile: loop {loop:.2f} s, commit {commit:.2f} s; inside (threads overlap):")
    for k, v in sorted(timers.total.items(), key=lambda kv: -kv[1]):
        print(f"  {v:7.2f} s  {k}")
    del google_crc32c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="a folder on the disk to measure (default: a temp dir)")
    ap.add_argument("--profile", action="store_true", help="one more spill with timers on the flush path")
    ap.add_argument("--flush-threads", default="", help="comma list: one spill method per value (default: the writer's)")
    ap.add_argument("--base", default=None, help="a checkout of another version: its spill runs as one more method")
    ap.add_argument("--child", nargs=3, metavar=("ROOT", "N", "FLUSH_THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    frames = pool(SHAPE)
    if args.child:  # one spill in this fresh process (the version on PYTHONPATH): its times as JSON
        root, n_child, ft = args.child
        kw = {"flush_threads": int(ft)} if int(ft) else {}
        print(json.dumps(run_spill(frames, int(n_child), root, **kw)))
        return
    frame_bytes = frames[0].numel() * 2
    n = int(args.gib * (1 << 30)) // frame_bytes
    tmp = tempfile.mkdtemp(prefix="bench-spill-", dir=args.workdir)
    spills = [f"spill-ft{x}" for x in args.flush_threads.split(",") if x] or ["spill"]
    if args.base:
        spills.append("base")
    got: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for r in range(args.repeats):
            # Each method takes each place in turn: the one run right after the raw write ran
            # 1.2-1.3x slower whatever its code (main against itself, 2026-11-28), so a fixed
            # middle place is a bias, not a measurement.
            methods = ["raw", *spills]
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            for m in order:
                where = os.path.join(tmp, f"{m}-{r}")
                if m == "raw":
                    got["raw"].append(run_raw(frames, n, where))
                    os.unlink(where)
                else:
                    ft = m[8:] if m.startswith("spill-ft") else "0"
                    here = str(Path(__file__).resolve().parents[1])
                    env = {**os.environ, "PYTHONPATH": args.base if m == "base" else here}
                    cmd = [sys.executable, __file__, "--child", where, str(n), ft]
                    loop, commit = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True).stdout)
                    got[m].append(loop + commit)
                    got[f"{m} loop"].append(loop)
                    got[f"{m} commit"].append(commit)
                    shutil.rmtree(where)
        if args.profile:
            profile(frames, n, os.path.join(tmp, "profile"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    gib = n * frame_bytes / (1 << 30)
    print(f"{n} frames of {frame_bytes >> 10} KiB ({gib:.2f} GiB), {args.repeats} repeats, load {os.getloadavg()}")
    print(f"raw tofile+fsync: median {med['raw']:.2f} s ({gib / med['raw']:.2f} GiB/s)")
    for m in spills:
        per = [s / r for s, r in zip(got[m], got["raw"], strict=True)]
        print(
            f"{m} write+commit: median {med[m]:.2f} s (loop {med[m + ' loop']:.2f} s, commit "
            f"{med[m + ' commit']:.2f} s); / raw: {med[m] / med['raw']:.2f}x (per repeat "
            f"{', '.join(f'{x:.2f}' for x in per)})"
        )


if __name__ == "__main__":
    main()
