#!/usr/bin/env python
"""spillmerge vs ``torch.distributed.gather_object``: wall time and peak extra memory per rank.

One invocation generates one workload (fp16 frames, uneven frame counts per filename, frames
spread unevenly and shuffled over W gloo ranks on 127.0.0.1) and runs every method on it, each
repeat of each method in a fresh set of ``torch.multiprocessing.spawn`` processes, so that peak
memory is per method. It prints a markdown table (median over repeats).

What is timed (rank 0's clock, from a gloo barrier that follows the generation of the frames, which
every rank already holds in CPU memory as a list of tensors):

* ``spillmerge``: every rank ``with SpillWriter(root) as w: w.write(...)`` for each of its frames
  (this includes the run-id agreement over gloo, chunk fsyncs, index and commit record), then
  ``w.merge(out)``; rank 0 stops when ``merge`` returns (it waited on storage for every rank's
  commit record, wrote the merged Zarr store and fsync'd it).
* ``gather_object``: every rank builds ``{(filename, frame_idx): tensor}`` and calls
  ``dist.gather_object(..., dst=0)``; rank 0 then merges the W dicts, and per filename sorts the
  frames, stacks them and ``np.save``s the array (plus its frame indices) into a directory,
  fsyncing each file and the directory; rank 0 stops when that is done.

Other ranks stop their clock when their own part returns. Correctness is checked after the timed
section (untimed) on rank 0 against frames regenerated from their seeds: every frame, bit-exact.
A method with any wrong output or error is reported as FAILED and not scored.

Memory: a thread samples ``/proc/self/status`` (VmRSS, RssAnon) every ~5 ms; the kernel's VmHWM is
reset (``/proc/self/clear_refs``) just before the timed section and read after it, which catches
peaks the sampler misses (pickle holds the GIL). Peak extra = peak RSS in the timed section minus
RSS just before it.

Smoke test: ``python benchmarks/bench_gather.py --payload-gib 0.05 --repeats 1``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

METHODS = ("spillmerge", "gather_object")
MIB = 1 << 20
GIB = 1 << 30


# --------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Config:
    world_size: int = 4
    payload_gib: float = 1.0
    frame_shape: tuple[int, ...] = (3, 256, 256)
    files: int = 16
    seed: int = 0
    timeout: float = 1800.0

    @property
    def frame_bytes(self) -> int:
        return 2 * int(np.prod(self.frame_shape))  # fp16


@dataclass(frozen=True)
class Workload:
    filenames: list[str]
    counts: list[int]  # frames per filename (frames 0..count-1)
    assignment: list[list[tuple[int, int]]]  # per rank, shuffled (file id, frame idx)

    @property
    def n_frames(self) -> int:
        return sum(self.counts)


def build_workload(cfg: Config) -> Workload:
    """Deterministic in ``cfg``: uneven frame counts per file, uneven shuffled split over ranks."""
    rng = random.Random(cfg.seed)
    n = max(cfg.files, round(cfg.payload_gib * GIB / cfg.frame_bytes))
    weights = [rng.uniform(0.5, 1.5) for _ in range(cfg.files)]
    total = sum(weights)
    counts = [max(1, int(n * w / total)) for w in weights]
    i = 0
    while sum(counts) < n:  # hand out the remainder round robin
        counts[i % cfg.files] += 1
        i += 1
    filenames = [f"videos/clip {i:03d}.mp4" if i % 3 else f"video_{i:03d}.mp4" for i in range(cfg.files)]
    keys = [(f, k) for f, c in enumerate(counts) for k in range(c)]
    rng.shuffle(keys)
    rank_weights = [rng.uniform(0.5, 1.5) for _ in range(cfg.world_size)]
    assignment: list[list[tuple[int, int]]] = [[] for _ in range(cfg.world_size)]
    for key, r in zip(keys, rng.choices(range(cfg.world_size), rank_weights, k=len(keys)), strict=True):
        assignment[r].append(key)
    return Workload(filenames, counts, assignment)


def make_frame(cfg: Config, file_id: int, frame: int) -> torch.Tensor:
    """The fake prediction: deterministic in (seed, file, frame)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{cfg.seed}/{file_id}/{frame}".encode()))
    return torch.randn(cfg.frame_shape, generator=g).to(torch.float16)


# --------------------------------------------------------------------------------------- memory
_FIELDS = ("VmRSS", "RssAnon", "VmHWM")


def _read_status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in _FIELDS:
                out[key] = int(rest.split()[0]) * 1024
    return out


class MemSampler(threading.Thread):
    """Peak RSS of this process between start() and stop(), relative to RSS at start()."""

    def __init__(self, interval: float = 0.005) -> None:
        super().__init__(daemon=True, name="mem-sampler")
        self.interval = interval
        self._stop_event = threading.Event()
        self.samples = 0

    def begin(self) -> None:
        try:  # reset VmHWM to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        s = _read_status()
        self.base_rss, self.base_anon = s["VmRSS"], s.get("RssAnon", 0)
        self.peak_rss, self.peak_anon = self.base_rss, self.base_anon
        self.start()

    def _sample(self) -> None:
        s = _read_status()
        self.peak_rss = max(self.peak_rss, s["VmRSS"])
        self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))
        self.samples += 1

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self._sample()

    def end(self) -> dict[str, Any]:
        self._stop_event.set()
        self.join()
        self._sample()
        hwm = _read_status().get("VmHWM", 0) if self.hwm_reset else 0
        peak = max(self.peak_rss, hwm)
        return {
            "base_rss": self.base_rss,
            "peak_extra_rss": peak - self.base_rss,
            "peak_extra_rss_sampled": self.peak_rss - self.base_rss,
            "peak_extra_anon_sampled": self.peak_anon - self.base_anon,
            "hwm_used": self.hwm_reset and hwm > self.peak_rss,
            "samples": self.samples,
        }


# -------------------------------------------------------------------------------------- methods
def run_spillmerge(rank: int, cfg: Config, wl: Workload, mine: list, frames: list, run_dir: Path) -> dict:
    import spillmerge

    t0 = time.perf_counter()
    with spillmerge.SpillWriter(str(run_dir / "spill"), rank=rank, world_size=cfg.world_size) as w:
        for (f, k), t in zip(mine, frames, strict=True):
            w.write(wl.filenames[f], k, t)
    t1 = time.perf_counter()
    report = w.merge(str(run_dir / "out.zarr"), progress=False)
    t2 = time.perf_counter()
    phases = {"spill": t1 - t0}
    if report is not None:
        phases.update(merge_call=t2 - t1, merge_wait=report.wait_seconds, merge_work=report.merge_seconds)
    return phases


def run_gather_object(rank: int, cfg: Config, wl: Workload, mine: list, frames: list, run_dir: Path) -> dict:
    import torch.distributed as dist

    t0 = time.perf_counter()
    obj = {(wl.filenames[f], k): t for (f, k), t in zip(mine, frames, strict=True)}
    gathered: list[Any] | None = [None] * cfg.world_size if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    t1 = time.perf_counter()
    phases: dict[str, Any] = {"gather": t1 - t0}
    if rank == 0:
        assert gathered is not None
        merged: dict[tuple[str, int], torch.Tensor] = {}
        for d in gathered:
            merged.update(d)
        by_file: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for (name, k), t in merged.items():
            by_file.setdefault(name, []).append((k, t))
        out = run_dir / "out-npy"
        out.mkdir()
        index = {}
        for i, name in enumerate(sorted(by_file)):
            items = sorted(by_file[name], key=lambda kt: kt[0])
            arr = torch.stack([t for _, t in items]).numpy()
            for suffix, data in ((".npy", arr), (".frames.npy", np.array([k for k, _ in items], dtype=np.int64))):
                with open(out / f"{i:03d}{suffix}", "wb") as fh:
                    np.save(fh, data)
                    fh.flush()
                    os.fsync(fh.fileno())
            index[name] = f"{i:03d}"
            del arr, items
        with open(out / "index.json", "w") as fh:
            json.dump(index, fh)
            fh.flush()
            os.fsync(fh.fileno())
        dfd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        phases["write"] = time.perf_counter() - t1
        phases["_result"] = merged  # kept for the (untimed) check; stripped before reporting
    return phases


RUNNERS = {"spillmerge": run_spillmerge, "gather_object": run_gather_object}


# --------------------------------------------------------------------------------- verification
def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def _expected(cfg: Config, wl: Workload, file_id: int, frame: int) -> np.ndarray:
    return make_frame(cfg, file_id, frame).numpy()


def verify_spillmerge(cfg: Config, wl: Workload, run_dir: Path, phases: dict) -> str:
    import spillmerge

    res = spillmerge.open(str(run_dir / "out.zarr"))
    if sorted(res.filenames) != sorted(wl.filenames):
        return f"filenames differ: got {len(res.filenames)}, want {len(wl.filenames)}"
    for f, name in enumerate(wl.filenames):
        frames = res.frames(name)
        if frames.tolist() != list(range(wl.counts[f])):
            return f"{name!r}: frame indices differ ({len(frames)} rows, want {wl.counts[f]})"
        arr = res[name].numpy()
        if arr.shape != (wl.counts[f], *cfg.frame_shape) or arr.dtype != np.float16:
            return f"{name!r}: got {arr.shape} {arr.dtype}, want {(wl.counts[f], *cfg.frame_shape)} float16"
        for k in range(wl.counts[f]):
            if not _same(arr[k], _expected(cfg, wl, f, k)):
                return f"{name!r} frame {k}: bytes differ"
    return ""


def verify_gather_object(cfg: Config, wl: Workload, run_dir: Path, phases: dict) -> str:
    merged = phases.pop("_result")
    want_keys = {(name, k) for f, name in enumerate(wl.filenames) for k in range(wl.counts[f])}
    if set(merged) != want_keys:
        return f"gathered keys differ: {len(merged)} gathered, {len(want_keys)} expected"
    index = json.loads((run_dir / "out-npy" / "index.json").read_text())
    if sorted(index) != sorted(wl.filenames):
        return "written filenames differ"
    for f, name in enumerate(wl.filenames):
        on_disk = np.load(run_dir / "out-npy" / f"{index[name]}.npy", mmap_mode="r")
        frames = np.load(run_dir / "out-npy" / f"{index[name]}.frames.npy")
        if frames.tolist() != list(range(wl.counts[f])):
            return f"{name!r}: written frame indices differ"
        for k in range(wl.counts[f]):
            want = _expected(cfg, wl, f, k)
            if not _same(merged[(name, k)].numpy(), want):
                return f"gathered {name!r} frame {k}: bytes differ"
            if not _same(np.asarray(on_disk[k]), want):
                return f"written {name!r} frame {k}: bytes differ"
    return ""


VERIFIERS = {"spillmerge": verify_spillmerge, "gather_object": verify_gather_object}


# ------------------------------------------------------------------------------------ processes
def _rank_main(rank: int, method: str, cfg: Config, port: int, run_dir: str) -> None:
    import torch.distributed as dist

    import spillmerge  # noqa: F401 - imported before the baseline so import memory is not counted

    torch.set_num_threads(1)
    run = Path(run_dir)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=cfg.world_size,
        timeout=datetime.timedelta(seconds=cfg.timeout),
    )
    try:
        wl = build_workload(cfg)
        mine = wl.assignment[rank]
        tg = time.perf_counter()
        frames = [make_frame(cfg, f, k) for f, k in mine]
        gen_seconds = time.perf_counter() - tg
        gc.collect()
        sampler = MemSampler()
        sampler.begin()
        dist.barrier()
        t0 = time.perf_counter()
        phases = RUNNERS[method](rank, cfg, wl, mine, frames, run)
        seconds = time.perf_counter() - t0
        mem = sampler.end()
        result: dict[str, Any] = {
            "rank": rank,
            "frames": len(mine),
            "gen_seconds": gen_seconds,
            "seconds": seconds,
            "mem": mem,
            "error": "",
        }
        dist.barrier()
        if rank == 0:
            del frames
            gc.collect()
            tv = time.perf_counter()
            try:
                result["error"] = VERIFIERS[method](cfg, wl, run, phases)
            except Exception:  # a crash while checking is a wrong output too
                result["error"] = "verification raised:\n" + traceback.format_exc()
            result["verify_seconds"] = time.perf_counter() - tv
        phases.pop("_result", None)
        result["phases"] = phases
        (run / f"result-rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(method: str, cfg: Config, run_dir: Path) -> dict[str, Any]:
    """One repeat of one method in fresh processes. Returns per-rank results or an error."""
    import torch.multiprocessing as mp

    run_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    ctx = mp.spawn(_rank_main, args=(method, cfg, _free_port(), str(run_dir)), nprocs=cfg.world_size, join=False)
    deadline = time.monotonic() + cfg.timeout + 120
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                return {"error": f"timed out after {cfg.timeout + 120:.0f} s"}
    except Exception as exc:  # ProcessRaisedException / ProcessExitedException
        return {"error": f"{type(exc).__name__}: {exc}"}
    ranks = []
    for r in range(cfg.world_size):
        path = run_dir / f"result-rank{r}.json"
        if not path.exists():
            return {"error": f"rank {r} wrote no result"}
        ranks.append(json.loads(path.read_text()))
    err = ranks[0].get("error", "")
    return {"ranks": ranks, "error": err, "process_seconds": time.perf_counter() - t0}


# -------------------------------------------------------------------------------------- report
def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(method: str, runs: list[dict[str, Any]], payload: int) -> dict[str, Any]:
    errors = [r["error"] for r in runs if r.get("error")]
    if errors or not runs:
        return {"method": method, "status": "FAILED", "error": errors[0] if errors else "no runs"}
    walls = [r["ranks"][0]["seconds"] for r in runs]
    r0 = [r["ranks"][0]["mem"]["peak_extra_rss"] for r in runs]
    r0_anon = [r["ranks"][0]["mem"]["peak_extra_anon_sampled"] for r in runs]
    others = [max((x["mem"]["peak_extra_rss"] for x in r["ranks"][1:]), default=0) for r in runs]
    phase_names = sorted({k for r in runs for k in r["ranks"][0]["phases"]})
    phases = {
        k: _median([r["ranks"][0]["phases"][k] for r in runs if k in r["ranks"][0]["phases"]]) for k in phase_names
    }
    return {
        "method": method,
        "status": "ok",
        "wall": _median(walls),
        "walls": walls,
        "rank0_extra": _median(r0),
        "rank0_extra_anon": _median(r0_anon),
        "others_extra": _median(others),
        "phases": phases,
        "payload": payload,
    }


def _mem(b: float, payload: int) -> str:
    return f"{b / MIB:,.0f} MiB ({b / payload:.2f}× payload)"


def render(cfg: Config, wl: Workload, summaries: list[dict[str, Any]], repeats: int, command: str) -> str:
    payload = wl.n_frames * cfg.frame_bytes
    per_rank = [len(a) for a in wl.assignment]
    lines = [
        f"Workload: {wl.n_frames} fp16 frames of {'×'.join(map(str, cfg.frame_shape))} "
        f"({payload / GIB:.3f} GiB payload) in {cfg.files} files "
        f"({min(wl.counts)}–{max(wl.counts)} frames each), W={cfg.world_size} gloo ranks "
        f"(frames per rank: {', '.join(map(str, per_rank))}), median of {repeats} run(s), each in fresh processes.",
        "",
        f"Command: `{command}`",
        "",
        "| method | status | wall, median (s) | runs (s) | rank-0 peak extra RSS | other ranks peak extra RSS (max) | gather_object time / this |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {s["method"]: s for s in summaries}
    g = by.get("gather_object")
    for s in summaries:
        if s["status"] != "ok":
            lines.append(f"| {s['method']} | FAILED | – | – | – | – | – |")
            continue
        ratio = f"{g['wall'] / s['wall']:.2f}×" if g and g["status"] == "ok" else "–"
        lines.append(
            f"| {s['method']} | ok | {s['wall']:.2f} | {', '.join(f'{w:.2f}' for w in s['walls'])} | "
            f"{_mem(s['rank0_extra'], payload)} | {_mem(s['others_extra'], payload)} | {ratio} |"
        )
    lines += ["", "Rank-0 phase medians (s) and sampled anonymous-memory peak:", ""]
    for s in summaries:
        if s["status"] == "ok":
            ph = ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items())
            lines.append(f"- {s['method']}: {ph}; rank-0 peak extra RssAnon {_mem(s['rank0_extra_anon'], payload)}")
        else:
            err = s["error"].strip().splitlines()
            lines.append(f"- {s['method']}: FAILED: {err[-1] if err else '?'}")
    sm = by.get("spillmerge")
    if sm and g and sm["status"] == "ok" and g["status"] == "ok":
        lines += [
            "",
            f"gather_object / spillmerge wall time: **{g['wall'] / sm['wall']:.2f}×**; "
            f"rank-0 peak extra memory: spillmerge {sm['rank0_extra'] / MIB:,.0f} MiB "
            f"({sm['rank0_extra'] / (256 * MIB):.2f}× the 256 MiB target), "
            f"gather_object {g['rank0_extra'] / MIB:,.0f} MiB.",
        ]
    return "\n".join(lines) + "\n"


def _parse_shape(text: str) -> tuple[int, ...]:
    parts = text.replace("x", ",").replace("×", ",").split(",")
    shape = tuple(int(p) for p in parts if p.strip())
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"bad frame shape {text!r}")
    return shape


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python benchmarks/bench_gather.py --payload-gib 0.05 --repeats 1",
    )
    ap.add_argument("--world-size", type=int, default=4, help="gloo ranks (default 4)")
    ap.add_argument("--payload-gib", type=float, default=1.0, help="total payload in GiB (default 1.0)")
    ap.add_argument(
        "--frame-shape", type=_parse_shape, default=(3, 256, 256), help="fp16 frame shape (default 3,256,256)"
    )
    ap.add_argument("--files", type=int, default=16, help="number of filenames (default 16)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per method, median reported (default 3)")
    ap.add_argument("--workdir", help="directory for spill roots and outputs (default: a new one under /tmp)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list from {','.join(METHODS)}")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-run timeout in seconds (default 1800)")
    ap.add_argument("--out-md", help="also write the markdown report here")
    ap.add_argument("--out-json", help="also write the raw per-run results here")
    args = ap.parse_args(argv)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        ap.error(f"unknown method(s) {unknown}; choose from {','.join(METHODS)}")
    if args.world_size < 1 or args.files < 1 or args.repeats < 1 or args.payload_gib <= 0:
        ap.error("--world-size, --files, --repeats and --payload-gib must be positive")
    cfg = Config(args.world_size, args.payload_gib, args.frame_shape, args.files, args.seed, args.timeout)
    wl = build_workload(cfg)
    payload = wl.n_frames * cfg.frame_bytes

    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # children inherit it: loopback only
    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="spillmerge-bench-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "benchmarks/bench_gather.py", *(argv if argv is not None else sys.argv[1:])])
    print(
        f"# {wl.n_frames} frames, {payload / GIB:.3f} GiB, W={cfg.world_size}, methods {methods}, "
        f"{args.repeats} repeat(s), workdir {workdir}",
        file=sys.stderr,
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    try:
        for rep in range(args.repeats):
            order = methods if rep % 2 == 0 else methods[::-1]  # alternate to spread drift
            for method in order:
                run_dir = workdir / f"{method}-{rep}"
                if run_dir.exists():
                    shutil.rmtree(run_dir)
                res = run_once(method, cfg, run_dir)
                shutil.rmtree(run_dir, ignore_errors=True)
                runs[method].append(res)
                if res.get("error"):
                    msg = res["error"]
                else:
                    r0 = res["ranks"][0]
                    msg = (
                        f"{r0['seconds']:.2f} s, rank-0 extra {r0['mem']['peak_extra_rss'] / MIB:.0f} MiB, "
                        f"verified in {r0.get('verify_seconds', 0):.1f} s"
                    )
                print(f"# repeat {rep} {method}: {msg}", file=sys.stderr, flush=True)
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    summaries = [summarize(m, runs[m], payload) for m in methods]
    text = render(cfg, wl, summaries, args.repeats, command)
    for s in summaries:
        if s["status"] != "ok":
            text += f"\n{s['method']} FAILED:\n\n```\n{s['error'].strip()}\n```\n"
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text)
    if args.out_json:
        meta = {"config": asdict(cfg), "n_frames": wl.n_frames, "payload": payload, "host": platform.node()}
        Path(args.out_json).write_text(json.dumps({"meta": meta, "runs": runs, "summaries": summaries}, indent=1))
    return 0 if all(s["status"] == "ok" for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
