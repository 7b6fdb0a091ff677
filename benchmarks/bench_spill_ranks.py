"""W ranks of one node spilling at once: ``SpillWriter`` against two hand-written floors.

    python benchmarks/bench_spill_ranks.py                         # W=4, 1 GiB in all, 5 repeats
    python benchmarks/bench_spill_ranks.py --world 4 --gib 0.25 --repeats 3 --base /work/wt/base

The video workload's spill phase without torch.distributed: W processes (forked once the frames
are in memory, released together by a barrier) each write their share of 384 KiB fp16 frames
(frame ``i`` to rank ``i % W``), durably. Methods, alternated (A B C, then C B A ...):

- ``raw``: one file per rank, ``write()`` of each frame's bytes, one ``fsync`` at the end: the
  floor for putting the bytes on this disk.
- ``direct``: the least a checked, chunked spill needs: each frame CRC-32C'd then written
  straight from its tensor into the current 16 MiB chunk file, every two full chunks fsynced
  together (no staging copy, no threads).
- ``spill``: ``SpillWriter(root, rank, W)``, ``write(name, frame, tensor)`` per frame, then the
  commit (``--base DIR``: the same with the checkout ``DIR`` first on ``sys.path``, and then both
  spills run from a child interpreter each, so they start alike).

Printed per method: the median wall time (barrier to the last rank's commit) and the median CPU
time of all ranks together (user + system of every thread). On a machine with fewer cores than
ranks and threads the CPU time is what sets the wall time; quote ratios of one run and the load.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

FRAME = (3, 256, 256)
CHUNK = 16 << 20


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _raw(frames: list[np.ndarray], mine: range, folder: str, rank: int) -> None:
    with open(f"{folder}/r{rank}.bin", "wb") as fh:
        for i in mine:
            fh.write(frames[i % len(frames)].data)
        fh.flush()
        os.fsync(fh.fileno())


def _direct(frames: list[np.ndarray], mine: range, folder: str, rank: int) -> None:
    import crc32c

    os.makedirs(f"{folder}/r{rank}", exist_ok=True)
    fd, fill, n_chunk, crcs, full = -1, 0, 0, [], []
    for i in mine:
        data = frames[i % len(frames)]
        crcs.append(crc32c.crc32c(data))
        done = 0
        while done < len(data):
            if fd < 0:
                fd = os.open(f"{folder}/r{rank}/c{n_chunk}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                fill, n_chunk = 0, n_chunk + 1
            n = min(len(data) - done, CHUNK - fill)
            os.write(fd, data[done : done + n].data)
            fill, done = fill + n, done + n
            if fill == CHUNK:
                full.append(fd)
                fd = -1
                if len(full) == 2:  # a group commit of two chunks
                    for f in full:
                        os.fsync(f)
                        os.close(f)
                    full = []
    if fd >= 0:
        full.append(fd)
    for f in full:
        os.fsync(f)
        os.close(f)
    dfd = os.open(f"{folder}/r{rank}", os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)


def _spill(frames: list[Any], mine: range, folder: str, rank: int, world: int) -> None:
    import spillmerge

    with spillmerge.SpillWriter(folder, rank=rank, world_size=world) as w:
        for i in mine:
            w.write(f"video{i % 16}.mp4", i // 16, frames[i % len(frames)])


def _rank(method: str, rank: int, world: int, n: int, folder: str, frames: Any, start: Any, out: Any) -> None:
    start.wait()
    c0, t0 = _cpu(), time.perf_counter()
    mine = range(rank, n, world)
    if method == "raw":
        _raw(frames["np"], mine, folder, rank)
    elif method == "direct":
        _direct(frames["np"], mine, folder, rank)
    else:
        _spill(frames["torch"], mine, folder, rank, world)
    out.put((time.perf_counter() - t0, _cpu() - c0))


def _one(method: str, tree: str | None, world: int, n: int, work: str) -> tuple[float, float]:
    """Fork W ranks of ``method`` (with ``tree`` first on sys.path for a spill), release them at
    once; the slowest rank's wall time and the ranks' CPU time."""
    folder = os.path.join(work, method)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    os.sync()  # nothing of the last method left to write back
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(world + 1), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(method, r, world, n, folder, FRAMES, start, out)) for r in range(world)]
    for p in procs:
        p.start()
    start.wait()
    res = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"{method}: a rank exited with {p.exitcode}")
    shutil.rmtree(folder, ignore_errors=True)
    return max(w for w, _ in res), sum(c for _, c in res)


FRAMES: dict[str, Any] = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="a folder on the disk to measure (default: a temp dir)")
    ap.add_argument("--base", default=None, help="also spill with this checkout first on sys.path (method 'base')")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    tensors = [torch.from_numpy(rng.standard_normal(FRAME).astype(np.float16)) for _ in range(64)]
    FRAMES["torch"] = tensors
    FRAMES["np"] = [t.numpy().view(np.uint8).reshape(-1) for t in tensors]
    n = int(args.gib * (1 << 30)) // FRAMES["np"][0].nbytes
    methods = ["raw", "direct", "spill"]
    import spillmerge  # imported before the fork, as by a training script

    spillmerge.SpillWriter  # noqa: B018 - and its lazily imported modules: the clock times spills only

    if args.base:  # a second spillmerge in the same process cannot be imported: run base in a child
        methods.append("base")
    work = args.workdir or tempfile.mkdtemp(prefix="spill-ranks-")
    got: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    for rep in range(args.repeats):
        order = methods if rep % 2 == 0 else methods[::-1]
        for m in order:
            if args.base and m in ("spill", "base"):  # both checkouts the same way: a child interpreter each
                tree = args.base if m == "base" else str(Path(__file__).resolve().parent.parent)
                got[m].append(_child_spill(tree, args.world, n, work))
            else:
                got[m].append(_one(m, None, args.world, n, work))
            print(f"  repeat {rep + 1} {m}: {got[m][-1][0]:.2f} s, CPU {got[m][-1][1]:.2f} s", file=sys.stderr)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    wall = {m: statistics.median(w for w, _ in v) for m, v in got.items()}
    cpu = {m: statistics.median(c for _, c in v) for m, v in got.items()}
    print(f"W={args.world} ranks, {n} frames of 384 KiB ({n * FRAMES['np'][0].nbytes / (1 << 30):.2f} GiB), "
          f"median of {args.repeats}, spillmerge {spillmerge.__file__}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| method | wall | / raw | CPU, all ranks | / raw | per repeat wall |")
    print("|---|---|---|---|---|---|")
    for m in methods:
        reps = ", ".join(f"{w:.2f}" for w, _ in got[m])
        print(f"| {m} | {wall[m]:.2f} s | {wall[m] / wall['raw']:.2f}x | {cpu[m]:.2f} s | {cpu[m] / cpu['raw']:.2f}x | {reps} |")


def _child_spill(tree: str, world: int, n: int, work: str) -> tuple[float, float]:
    """One spill repeat with the checkout ``tree`` first on sys.path, in a child interpreter."""
    import json
    import subprocess

    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]);"
        "import bench_spill_ranks as b, numpy as np, torch; torch.set_num_threads(1);"
        "rng = np.random.default_rng(0);"
        "t = [torch.from_numpy(rng.standard_normal(b.FRAME).astype(np.float16)) for _ in range(64)];"
        "b.FRAMES['torch'] = t; import spillmerge; spillmerge.SpillWriter;"
        "print(json.dumps(b._one('spill', None, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))"
    )
    here = str(Path(__file__).resolve().parent)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code, tree, here, str(world), str(n), work],
                       capture_output=True, text=True, env=env, check=True)  # fmt: skip
    w, c = json.loads(p.stdout.strip().splitlines()[-1])
    return w, c


if __name__ == "__main__":
    main()
