"""The suite's parts beyond the gather comparison. Each measurement runs in a fresh process.

  overlap      a loop alternating simulated compute with SpillWriter.write(), against the same
               loop without writing
  chunk_run    spill + merge of one payload with a given chunk size
  codec_*      merge of one spill with each output codec (when this build has ``codec=``)
  procs_*      merge with 1, 2, 4 independent processes (when this build has ``--part``)

suite.py calls these; they are not meant to be run on their own.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import PeakMemory, expected_by_file, make_frame, pool, tree_bytes, verify_spillmerge, workload

CODECS = ["none", "blosc-lz4", "zstd"]
CLI = [sys.executable, "-c", "import sys; from spillmerge.cli import main; sys.exit(main())"]


# ------------------------------------------------------------------------------------ overlap
def _calibrate_matmul(step_s: float) -> tuple[int, float]:
    """Matmuls of 256x256 float32 per step so one step of compute takes about ``step_s``."""
    a = torch.randn(256, 256)
    for _ in range(20):
        a @ a
    t0 = time.perf_counter()
    for _ in range(200):
        a @ a
    per = (time.perf_counter() - t0) / 200
    return max(1, round(step_s / per)), per


def overlap(
    root: str, kind: str, step_s: float, frames_per_step: int, steps: int, repeats: int, shape: list[int]
) -> dict:
    """Median loop time with and without ``write()`` of ``frames_per_step`` frames after each
    compute step; baseline and writing runs alternate so drift hits both alike."""
    import spillmerge

    p = pool(tuple(shape))
    a = torch.randn(256, 256)
    n_mm, per_mm = _calibrate_matmul(step_s) if kind == "matmul" else (0, 0.0)

    def compute() -> None:
        if kind == "sleep":  # the CPU is idle while a GPU would compute
            time.sleep(step_s)
        else:  # the CPU itself is busy (one thread, as every benchmark process)
            for _ in range(n_mm):
                a @ a

    in_write = 0.0

    def loop(w: spillmerge.SpillWriter | None) -> float:
        nonlocal in_write
        in_write = 0.0
        t0 = time.perf_counter()
        k = 0
        for s in range(steps):
            compute()
            if w is not None:
                t1 = time.perf_counter()
                for _ in range(frames_per_step):
                    w.write(f"video_{s % 16:03d}.mp4", k, p[k % len(p)])
                    k += 1
                in_write += time.perf_counter() - t1
        return time.perf_counter() - t0

    base, with_w, close, peaks, writes = [], [], [], [], []
    frame_bytes = int(np.prod(shape)) * 2
    for rep in range(repeats):
        base.append(loop(None))
        seg = Path(root) / f"rep{rep}"
        mem = PeakMemory()
        w = spillmerge.SpillWriter(str(seg), rank=0, world_size=1)
        w.__enter__()
        with_w.append(loop(w))
        writes.append(in_write)
        t0 = time.perf_counter()
        w.__exit__(None, None, None)  # flush the last chunk, index, commit record, fsyncs
        close.append(time.perf_counter() - t0)
        peaks.append(mem.stop()["anon"])
        frames = w.stats()["frames"]
        shutil.rmtree(seg, ignore_errors=True)
        if frames != steps * frames_per_step:
            return {"ok": False, "error": f"writer counted {frames} frames, wrote {steps * frames_per_step}"}
    return {
        "ok": True,
        "kind": kind,
        "step_s": step_s,
        "matmuls_per_step": n_mm,
        "matmul_s": per_mm,
        "frames_per_step": frames_per_step,
        "steps": steps,
        "bytes": steps * frames_per_step * frame_bytes,
        "base_s": base,
        "write_s": with_w,
        "close_s": close,
        "in_write_s": writes,
        "writer_anon": peaks,
    }


# ----------------------------------------------------------------------------- spill / merge
def spill(root: str, payload: int, shape: list[int], world: int, kind: str, chunk_bytes: int | None, seed: int) -> dict:
    """Write the workload as ``world`` ranks one after another (independent writers, as in a SLURM
    array), timing the spill of all of them, writer close (durable commit) included."""
    import spillmerge

    p = pool(tuple(shape), kind, size=128)
    assignment = workload(payload, tuple(shape), 16, world, seed)
    kw = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    frames = {r: [make_frame(p, name, f) for name, f in keys] for r, keys in assignment.items()}  # before the clock
    mem = PeakMemory()
    t0 = time.perf_counter()
    for rank in range(world):
        with spillmerge.SpillWriter(root, rank=rank, world_size=world, **kw) as w:
            for (name, f), t in zip(assignment[rank], frames[rank], strict=True):
                w.write(name, f, t)
    wall = time.perf_counter() - t0
    nbytes = sum(len(v) for v in assignment.values()) * int(np.prod(shape)) * 2
    return {"ok": True, "spill_s": wall, "bytes": nbytes, "spill_anon": mem.stop()["anon"], "spilled": tree_bytes(root)}


def merge_verify(
    root: str, out: str, payload: int, shape: list[int], world: int, kind: str, seed: int, **merge_kw: object
) -> dict:
    """spillmerge.merge(root, out, **merge_kw) timed with its memory, then the output verified."""
    import spillmerge

    mem = PeakMemory()
    t0 = time.perf_counter()
    report = spillmerge.merge(root, out, progress=False, **merge_kw)
    wall = time.perf_counter() - t0
    peak = mem.stop()
    p = pool(tuple(shape), kind, size=128)
    ok = verify_spillmerge(out, expected_by_file(workload(payload, tuple(shape), 16, world, seed)), p)
    return {
        "ok": ok,
        "merge_s": wall,
        "merge_anon": peak["anon"],
        "merge_file": peak["file"],
        "bytes": report.nbytes,
        "out_bytes": tree_bytes(out),
        "phases": report.phases,
    }


def verify_only(out: str, payload: int, shape: list[int], world: int, kind: str, seed: int) -> dict:
    p = pool(tuple(shape), kind, size=128)
    return {"ok": verify_spillmerge(out, expected_by_file(workload(payload, tuple(shape), 16, world, seed)), p)}


def chunk_run(work: str, payload: int, shape: list[int], chunk_bytes: int, seed: int) -> dict:
    """Spill (one writer) and merge the same payload with ``chunk_bytes`` for both the spill chunks
    and the output chunks."""
    root, out = f"{work}/spill", f"{work}/out"
    s = spill(root, payload, shape, 1, "random", chunk_bytes, seed)
    m = merge_verify(root, out, payload, shape, 1, "random", seed, chunk_bytes=chunk_bytes)
    return {**s, **m, "chunk_bytes": chunk_bytes, "out_files": sum(len(f) for _, _, f in os.walk(out))}


# -------------------------------------------------------------------------- feature detection
def has_codec() -> bool:
    import spillmerge

    return "codec" in inspect.signature(spillmerge.merge).parameters


def cli_merge_help() -> str:
    r = subprocess.run([*CLI, "merge", "--help"], capture_output=True, text=True, timeout=120)
    return r.stdout + r.stderr


def has_parts(help_text: str) -> bool:
    return "--part" in help_text and "--finalize" in help_text


def _part_base(help_text: str) -> int:
    """0 unless the help text says parts count from 1."""
    return 1 if "1-based" in help_text.lower() else 0


# ------------------------------------------------------------------------------ merge processes
def procs_merge(root: str, out: str, n: int, help_text: str) -> dict:
    """Merge ``root`` with ``n`` independent CLI processes (``--part i/n``, all at once) and then
    ``--finalize``; n == 1 is the plain ``spillmerge merge``. Times include process start."""
    t0 = time.perf_counter()
    if n == 1:
        r = subprocess.run([*CLI, "merge", root, "--out", out], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        return {"ok": r.returncode == 0, "error": r.stderr[-2000:], "wall_s": wall, "parts_s": wall, "finalize_s": 0.0}
    base = _part_base(help_text)
    for attempt in (base, 1 - base):  # the other numbering if the first is refused
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        procs = [
            subprocess.Popen(
                [*CLI, "merge", root, "--out", out, "--part", f"{i + attempt}/{n}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for i in range(n)
        ]
        errs = [pr.communicate()[1] for pr in procs]
        parts_s = time.perf_counter() - t0
        if all(pr.returncode == 0 for pr in procs):
            break
    else:
        return {"ok": False, "error": " | ".join(e[-500:] for e in errs), "wall_s": float("nan")}
    t1 = time.perf_counter()
    r = subprocess.run([*CLI, "merge", root, "--out", out, "--finalize"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    return {
        "ok": r.returncode == 0,
        "error": r.stderr[-2000:],
        "wall_s": wall,
        "parts_s": parts_s,
        "finalize_s": time.perf_counter() - t1,
        "first_part": attempt,
    }


def cli_start_s() -> float:
    """Seconds to start the CLI and print its version: the fixed cost every merge process pays."""
    t0 = time.perf_counter()
    subprocess.run([*CLI, "--version"], capture_output=True, check=True)
    return time.perf_counter() - t0
