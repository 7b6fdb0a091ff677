"""Shared pieces of the benchmarks: the generated workload, the memory sampler, sizes, processes.

Imported by bench_gather.py, bench_parts.py and suite.py (the benchmarks folder is on sys.path when
one of them runs as a script, and in the processes they spawn).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

MiB = 1 << 20
GiB = 1 << 30
POOL = 64


# ------------------------------------------------------------------------------------- sizes
def parse_size(text: str) -> int:
    """'1GiB', '128MiB', '512M', '0.5G' or plain bytes."""
    units = {"k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def fmt_size(n: float) -> str:
    if n >= GiB and n % GiB == 0:
        return f"{n / GiB:.0f} GiB"
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB"


# ---------------------------------------------------------------------------------- workload
def workload(
    payload: int, shape: tuple[int, ...], files: int, world: int, seed: int
) -> dict[int, list[tuple[str, int]]]:
    """Keys (filename, frame) per rank: files of uneven length, shuffled, ranks of uneven share."""
    frame_bytes = int(np.prod(shape)) * 2
    n = max(world, payload // frame_bytes)
    rng = random.Random(seed)
    weights = [rng.uniform(0.5, 1.5) for _ in range(files)]
    counts = [max(1, int(n * w / sum(weights))) for w in weights]
    keys = [(f"video_{i:03d}.mp4", f) for i, c in enumerate(counts) for f in range(c)]
    rng.shuffle(keys)
    rank_w = [rng.uniform(0.7, 1.3) for _ in range(world)]
    out: dict[int, list[tuple[str, int]]] = {r: [] for r in range(world)}
    for k in keys:
        out[rng.choices(range(world), rank_w)[0]].append(k)
    return out


def pool(shape: tuple[int, ...], kind: str = "random", size: int = POOL) -> torch.Tensor:
    """``size`` fp16 frames to draw from. ``random``: normal noise (incompressible mantissas).
    ``smooth``: prediction-like maps (a low-resolution random field, upsampled, squashed to [0, 1]
    and quantised to 1/256 steps), which compress the way real segmentation outputs do."""
    g = torch.Generator().manual_seed(0)
    if kind == "random":
        return torch.randn((size, *shape), generator=g).half()
    if kind != "smooth":
        raise ValueError(f"unknown pool kind {kind!r}")
    c, h, w = shape[0], shape[-2], shape[-1]
    low = torch.randn((size, c, max(h // 32, 2), max(w // 32, 2)), generator=g) * 3
    up = torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    return (torch.round(torch.sigmoid(up) * 256) / 256).half().reshape(size, *shape)


def make_frame(p: torch.Tensor, name: str, frame: int) -> torch.Tensor:
    """A unique frame per key, cheap to rebuild for verification: a pool frame stamped with the key."""
    file_id = int(name[6:9])
    t = p[(file_id * 7919 + frame) % len(p)].clone()
    t.view(-1)[:4].view(torch.int16)[:] = torch.tensor([file_id, frame & 0x7FFF, frame >> 15, 12345], dtype=torch.int16)
    return t


def expected_by_file(assignment: dict[int, list[tuple[str, int]]]) -> dict[str, list[int]]:
    by_file: dict[str, list[int]] = {}
    for name, f in sorted(k for ks in assignment.values() for k in ks):
        by_file.setdefault(name, []).append(f)
    return by_file


def verify_spillmerge(out: str, by_file: dict[str, list[int]], p: torch.Tensor) -> bool:
    """Every filename, frame list and frame byte of a merged store equals the generated workload."""
    import spillmerge

    res = spillmerge.open(out)
    if sorted(res.filenames) != sorted(by_file):
        return False
    for name, fr in by_file.items():
        if res.frames(name).tolist() != fr:
            return False
        got = torch.from_numpy(np.ascontiguousarray(res[name][...])).view(torch.int16)
        for row, f in enumerate(fr):
            if not torch.equal(got[row], make_frame(p, name, f).view(torch.int16)):
                return False
    return True


# ------------------------------------------------------------------------------------- memory
def _status() -> tuple[int, int]:
    """(anonymous, file-mapped) resident bytes of this process. Anonymous includes shmem (both
    are memory the process holds that the kernel cannot drop); file-mapped pages are clean page
    cache mapped in (mmapped inputs), which the kernel reclaims under pressure."""
    anon = file = 0
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith((b"RssAnon:", b"RssShmem:")):
                anon += int(line.split()[1]) * 1024
            elif line.startswith(b"RssFile:"):
                file = int(line.split()[1]) * 1024
    return anon, file


class PeakMemory:
    """Peak extra memory over a section: sampled every 5 ms by a thread, minus the value at start."""

    def __init__(self, interval: float = 0.005) -> None:
        self.base_anon, self.base_file = _status()
        self.peak_anon, self.peak_file = self.base_anon, self.base_file
        self._t0 = time.perf_counter()
        self.peak_anon_at = 0.0  # seconds after the start when the anonymous peak was sampled
        self._interval = interval
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="bench-peak-memory")
        self._t.start()

    def _sample(self) -> None:
        a, f = _status()
        if a > self.peak_anon:
            self.peak_anon, self.peak_anon_at = a, time.perf_counter() - self._t0
        self.peak_file = max(self.peak_file, f)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._t.join()
        self._sample()
        return {
            "anon": self.peak_anon - self.base_anon, "file": self.peak_file - self.base_file,
            "anon_at_s": self.peak_anon_at,
        }  # fmt: skip


# ------------------------------------------------------------------------------------ storage
def tree_bytes(path: str | Path) -> int:
    """Bytes of all files under ``path`` (what a method left on storage)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return total


def drop_file_cache(path: str | Path) -> None:
    """Ask the kernel to drop a file's clean cached pages (no root needed), so a read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def context() -> Any:
    """Fresh processes for every measurement, started from a fork server that has already imported
    torch and spillmerge (0.1 s per process instead of 2-10 s for spawn + import on 2 cores). The
    fork server itself never runs torch ops, so its children start with clean memory and no
    threads; every process measures memory against its own baseline anyway."""
    # spillmerge's modules compiled to bytecode once, as installing a wheel does: an editable
    # checkout under PYTHONDONTWRITEBYTECODE would compile every module a rank first imports in
    # each fresh process (20-60 ms a rank), a cost no installed user pays and torch never does.
    import compileall

    import spillmerge

    compileall.compile_dir(os.path.dirname(spillmerge.__file__), quiet=1)
    if os.environ.get("BENCH_START") == "spawn":  # the slow way, to check the fork server changes nothing
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "zarr", "spillmerge", "common", "bench_gather", "bench_parts"])
    return ctx


def _child(fn: Callable[..., dict], kwargs: dict, result: str) -> None:
    torch.set_num_threads(1)
    try:
        out = fn(**kwargs)
    except BaseException:  # noqa: BLE001 - reported to the parent as a failed run
        out = {"ok": False, "error": traceback.format_exc(limit=5)}
    Path(result).write_text(json.dumps(out))


def in_process(fn: Callable[..., dict], timeout: float = 3600, **kwargs: Any) -> dict:
    """Run ``fn(**kwargs)`` in a fresh spawned process (clean memory, torch with 1 thread) and
    return its JSON-able dict; a crash becomes ``{"ok": False, "error": ...}``."""
    ctx = context()
    fd, result = __import__("tempfile").mkstemp(prefix="bench-result-", suffix=".json")
    os.close(fd)
    try:
        pr = ctx.Process(target=_child, args=(fn, kwargs, result))
        pr.start()
        pr.join(timeout)
        if pr.is_alive():
            pr.kill()
            pr.join()
            return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
        text = Path(result).read_text()
        if pr.exitcode != 0 or not text:
            return {"ok": False, "error": f"exit code {pr.exitcode}"}
        return json.loads(text)
    finally:
        os.unlink(result)


def now() -> float:
    return time.perf_counter()


def run_ranks(target: Any, method: str, world: int, cfg: dict[str, Any], timeout: float = 3600) -> list[dict[str, Any]]:
    """Run ``target(rank, world, port, method, cfg + {"work"}, result)`` in ``world`` fresh
    processes (a gloo group on loopback), in a scratch folder under ``cfg["workdir"]`` removed
    afterwards; each rank's JSON result (``{result}.{rank}``), or one ``{"error"}`` row when a rank
    failed or hung (the others are killed)."""
    import shutil

    work = Path(cfg["workdir"]) / f"{method}-{time.time_ns()}"
    work.mkdir(parents=True)
    result = str(work) + ".result"
    try:
        ctx = context()
        port = free_port()
        procs = [ctx.Process(target=target, args=(r, world, port, method, {**cfg, "work": str(work)}, result))
                 for r in range(world)]  # fmt: skip
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join(timeout)
        if any(pr.exitcode != 0 for pr in procs):
            for pr in procs:
                if pr.is_alive():
                    pr.kill()
            return [{"error": f"exit codes {[pr.exitcode for pr in procs]}"}]
        return [json.loads(Path(f"{result}.{r}").read_text()) for r in range(world)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for r in range(world):
            Path(f"{result}.{r}").unlink(missing_ok=True)
        os.sync()
