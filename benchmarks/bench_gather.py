"""Gather predictions of W gloo ranks to rank 0: spillmerge against the usual peers, one run.

Every method gets the same generated workload (fp16 frames, uneven and shuffled over the ranks,
already in CPU memory when the clock starts), runs in fresh processes, is timed from a barrier
until rank 0 holds the complete result on disk (fsynced), is verified byte-exactly afterwards
(a wrong result is reported as FAILED), and is repeated; medians are printed.

Methods:
  spillmerge          SpillWriter on every rank, then merge on rank 0 (what this project does)
  gather_object       torch.distributed.gather_object of each rank's dict, rank 0 writes .npy files
  all_gather_object   the same with all_gather_object (every rank receives everything)
  chunked_all_gather  all_gather_object in 16 slices (bounded peak, same total)
  torch_save          torch.save per rank to shared disk + torch.load on rank 0, rank 0 writes .npy
  raw_spill           hand-written floor: one flat .bin + JSON index per rank, merge via np.memmap
  disk_limit          one process writes P bytes with fsync, then reads them back cold (the physical limit)

Peak extra memory = max over the timed section of RssAnon + RssShmem from /proc/self/status,
minus the value just before it (anonymous memory; page cache is not counted), sampled every 5 ms
by a thread. The file-mapped column is RssFile the same way: file pages mapped into the process
(spillmerge's merge maps spill chunks: clean page cache the kernel can reclaim). For spillmerge,
rank 0's merge is also measured on its own (peak minus the value just before the merge call).

Usage: python benchmarks/bench_gather.py [--payload-gib 1] [--world-size 4] [--methods a,b] [--out-md F]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import (
    PeakMemory,
    context,
    drop_file_cache,
    expected_by_file,
    free_port,
    make_frame,
    pool,
    tree_bytes,
    verify_spillmerge,
    workload,
)

ALL = [
    "spillmerge",
    "gather_object",
    "all_gather_object",
    "chunked_all_gather",
    "torch_save",
    "raw_spill",
    "disk_limit",
]


# ------------------------------------------------------------------------------------- methods
def _write_npy(out: Path, frames: dict[tuple[str, int], torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for (name, f), t in frames.items():
        by_file.setdefault(name, []).append((f, t))
    for name, items in by_file.items():
        items.sort(key=lambda x: x[0])
        arr = torch.stack([t for _, t in items]).numpy()
        with open(out / f"{name}.npy", "wb") as fh:
            np.save(fh, arr)
            np.save(fh, np.array([f for f, _ in items], dtype=np.int64))
            fh.flush()
            os.fsync(fh.fileno())


def run_spillmerge(rank, world, mine, frames, work: Path, info) -> None:
    import spillmerge

    t0 = time.perf_counter()
    with spillmerge.SpillWriter(str(work / "spill"), rank=rank, world_size=world) as w:
        for (name, f), t in zip(mine, frames, strict=True):
            w.write(name, f, t)
    info["spill_s"] = time.perf_counter() - t0
    merge_mem = PeakMemory()  # rank 0's merge alone: the flat-memory target is about this part
    report = w.merge(str(work / "out"), progress=False, threads=int(os.environ.get("BENCH_MERGE_THREADS", "0")) or None)
    peak = merge_mem.stop()
    if report is not None:
        info["wait_s"], info["merge_s"] = report.wait_seconds, report.merge_seconds
        info["phases"] = report.phases
        info["merge_anon"], info["merge_file"] = peak["anon"], peak["file"]


def run_gather(rank, world, mine, frames, work: Path, info, kind: str) -> None:
    import torch.distributed as dist

    local = dict(zip(mine, frames, strict=True))
    if kind == "gather_object":
        parts = [None] * world if rank == 0 else None
        dist.gather_object(local, parts, dst=0)
    elif kind == "all_gather_object":
        parts = [None] * world
        dist.all_gather_object(parts, local)
    else:  # chunked_all_gather: 16 slices of each rank's dict
        parts = [dict() for _ in range(world)]
        items = list(local.items())
        for c in range(16):
            piece = [None] * world
            dist.all_gather_object(piece, dict(items[c::16]))
            for r in range(world):
                parts[r].update(piece[r])
    if rank == 0:
        info["collective_s"] = time.perf_counter() - info["t0"]  # the rest is writing the result
        merged = {k: v for part in parts for k, v in part.items()}
        _write_npy(work / "out", merged)


def run_torch_save(rank, world, mine, frames, work: Path, info) -> None:
    import torch.distributed as dist

    (work / "saves").mkdir(exist_ok=True)
    path = work / "saves" / f"rank{rank}.pt"
    with open(path, "wb") as fh:
        torch.save(dict(zip(mine, frames, strict=True)), fh)
        fh.flush()
        os.fsync(fh.fileno())
    dist.barrier()
    if rank == 0:
        merged = {}
        for r in range(world):
            merged.update(torch.load(work / "saves" / f"rank{r}.pt", weights_only=True))
        _write_npy(work / "out", merged)


def run_raw(rank, world, mine, frames, work: Path, info) -> None:
    import torch.distributed as dist

    (work / "raw").mkdir(exist_ok=True)
    index = []
    with open(work / "raw" / f"rank{rank}.bin", "wb") as fh:
        off = 0
        for (name, f), t in zip(mine, frames, strict=True):
            b = t.numpy().view(np.uint8).reshape(-1)
            fh.write(b.data)
            index.append([name, f, off, b.nbytes])
            off += b.nbytes
        fh.flush()
        os.fsync(fh.fileno())
    (work / "raw" / f"rank{rank}.json").write_text(json.dumps(index))
    info["spill_s"] = time.perf_counter() - info["t0"]
    dist.barrier()
    if rank == 0:
        entries: dict[str, list] = {}
        maps = {}
        for r in range(world):
            maps[r] = np.memmap(work / "raw" / f"rank{r}.bin", dtype=np.uint8, mode="r")
            for name, f, o, n in json.loads((work / "raw" / f"rank{r}.json").read_text()):
                entries.setdefault(name, []).append((f, r, o, n))
        (work / "out").mkdir()
        for name, items in entries.items():
            items.sort()
            with open(work / "out" / f"{name}.bin", "wb") as fh:
                for _, r, o, n in items:
                    fh.write(maps[r][o : o + n].data)
                fh.flush()
                os.fsync(fh.fileno())


def verify(method: str, work: Path, assignment, p: torch.Tensor) -> bool:
    by_file = expected_by_file(assignment)
    if method == "spillmerge":
        return verify_spillmerge(str(work / "out"), by_file, p)
    for name, fr in by_file.items():
        if method == "raw_spill":
            got = torch.from_numpy(np.fromfile(work / "out" / f"{name}.bin", dtype=np.float16)).reshape(
                len(fr), *p.shape[1:]
            )
        else:
            with open(work / "out" / f"{name}.npy", "rb") as fh:
                got = torch.from_numpy(np.load(fh))
                if np.load(fh).tolist() != fr:
                    return False
        for row, f in enumerate(fr):
            if not torch.equal(got[row].view(torch.int16), make_frame(p, name, f).view(torch.int16)):
                return False
    return True


def _cpu() -> float:
    """User + system CPU seconds of this process, all its threads (the kernel's page-cache copies
    and checksums included; writeback done by the kernel's flusher threads is not)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def rank_main(rank: int, world: int, port: int, method: str, cfg: dict, result: str) -> None:
    import torch.distributed as dist

    import spillmerge  # noqa: F401 - imported before the clock starts, like any user script would

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=1800))  # fmt: skip
    work = Path(cfg["work"])
    shape = tuple(cfg["shape"])
    assignment = workload(cfg["payload"], shape, cfg["files"], world, cfg["seed"])
    mine = assignment[rank]
    p = pool(shape)
    if cfg.get("lazy"):  # spillmerge only: frames made as they are written, so P can exceed RAM
        frames = (make_frame(p, name, f) for name, f in mine)
    else:
        frames = [make_frame(p, name, f) for name, f in mine]  # predictions already in CPU memory
    dist.barrier()
    mem = PeakMemory()
    cpu0 = _cpu()
    t0 = time.perf_counter()
    info: dict = {"t0": t0}
    if method == "spillmerge":
        run_spillmerge(rank, world, mine, frames, work, info)
    elif method in ("gather_object", "all_gather_object", "chunked_all_gather"):
        run_gather(rank, world, mine, frames, work, info, method)
    elif method == "torch_save":
        run_torch_save(rank, world, mine, frames, work, info)
    elif method == "raw_spill":
        run_raw(rank, world, mine, frames, work, info)
    info["wall_s"] = time.perf_counter() - t0
    info["cpu_s"] = _cpu() - cpu0
    del info["t0"]
    peak = mem.stop()
    info["peak_extra"], info["file_extra"] = peak["anon"], peak["file"]
    if rank == 0:
        info["ok"] = verify(method, work, assignment, p)
        info["bytes"] = sum(len(v) for v in assignment.values()) * int(np.prod(shape)) * 2
    with open(f"{result}.{rank}", "w") as fh:
        json.dump(info, fh)
    dist.destroy_process_group()


def disk_limit(cfg: dict) -> dict:
    buf = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8)
    path = Path(cfg["work"]) / "limit.bin"
    mem = PeakMemory()
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(cfg["payload"] // buf.nbytes):
            fh.write(buf.data)
        fh.flush()
        os.fsync(fh.fileno())
    write_s = time.perf_counter() - t0
    drop_file_cache(path)  # read back from the disk, not from the page cache
    t0 = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as fh:
        while got := fh.readinto(buf.data):
            n += got
    read_s = time.perf_counter() - t0
    peak = mem.stop()
    return {
        "wall_s": write_s,
        "read_s": read_s,
        "peak_extra": peak["anon"],
        "file_extra": peak["file"],
        "ok": n == cfg["payload"] // buf.nbytes * buf.nbytes,
        "bytes": cfg["payload"],
    }


def run_method(method: str, world: int, cfg: dict) -> list[dict]:
    work = Path(cfg["workdir"]) / f"{method}-{time.time_ns()}"
    work.mkdir(parents=True)
    cfg = {**cfg, "work": str(work)}
    try:
        if method == "disk_limit":
            res = [disk_limit(cfg)]
            res[0]["written"] = tree_bytes(work)
            return res
        ctx = context()
        result = str(work) + ".result"
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, method, cfg, result)) for r in range(world)]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join(3600)
        for pr in procs:
            if pr.is_alive():  # a hung collective: do not leave it behind
                pr.kill()
                pr.join()
        if any(pr.exitcode != 0 for pr in procs):
            return [{"ok": False, "error": f"exit codes {[pr.exitcode for pr in procs]}"}]
        res = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(world)]
        res[0]["written"] = tree_bytes(work)  # everything the method put on storage: spills and result
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for r in range(world):
            Path(f"{work}.result.{r}").unlink(missing_ok=True)
        os.sync()  # the next method starts with nothing of this one left to write back


def run_all(methods: list[str], world: int, cfg: dict, repeats: int) -> dict[str, list[list[dict]]]:
    """Every method ``repeats`` times, interleaved so drift on the machine hits every method alike,
    the order rotated by one each repeat so no method always runs first (the first run after a
    cleanup, or of the whole suite, is often slower on this VM's disk). Returns method -> one list
    per repeat of per-rank result dicts (rank 0 first)."""
    rows: dict[str, list[list[dict]]] = {m: [] for m in methods}
    for rep in range(repeats):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:
            t0 = time.perf_counter()
            res = run_method(m, world, cfg)
            rows[m].append(res)
            status = "ok" if res[0].get("ok") else f"FAILED {res[0].get('error', 'wrong result')}"
            print(f"  repeat {rep + 1}/{repeats} {m}: {res[0].get('wall_s', float('nan')):.2f} s {status} "
                  f"({time.perf_counter() - t0:.0f} s with process start and verification)", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--payload-gib", type=float, default=1.0)
    ap.add_argument("--frame-shape", default="3x256x256")
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="spillmerge,gather_object", help=f"comma list of {','.join(ALL)} or 'all'")
    ap.add_argument("--workdir", default=None, help="where spills and outputs go (default: a temp dir)")
    ap.add_argument("--out-md", help="also write the table here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    methods = ALL if args.methods == "all" else args.methods.split(",")
    for m in methods:
        if m not in ALL:
            sys.exit(f"unknown method {m!r}; choose from {ALL}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="spillmerge-bench-")
    cfg = {
        "payload": int(args.payload_gib * (1 << 30)),
        "shape": [int(x) for x in args.frame_shape.split("x")],
        "files": args.files,
        "seed": args.seed,
        "workdir": workdir,
    }
    rows = run_all(methods, args.world_size, cfg, args.repeats)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)

    payload = cfg["payload"]
    mib = 1 << 20
    base = None
    if "spillmerge" in rows and all(r[0].get("ok") for r in rows["spillmerge"]):
        base = statistics.median(r[0]["wall_s"] for r in rows["spillmerge"])
    lines = [
        f"W={args.world_size} gloo ranks, payload {payload / (1 << 30):.2f} GiB of fp16 {args.frame_shape} frames, "
        f"{args.files} files, median of {args.repeats} runs (rank 0 wall time from barrier to result fsynced on disk)",
        "",
        "| method | wall | vs spillmerge | CPU, all ranks | rank-0 peak extra (anon) | rank-0 peak extra file-mapped | others' peak extra anon (max) | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        runs = rows[m]
        if not all(r[0].get("ok") for r in runs):
            lines.append(f"| {m} | FAILED | | | | | | no |")
            continue
        wall = statistics.median(r[0]["wall_s"] for r in runs)
        r0 = statistics.median(r[0]["peak_extra"] for r in runs)
        others = statistics.median(max((x["peak_extra"] for x in r[1:]), default=0) for r in runs)
        ratio = f"{wall / base:.2f}x" if base else "-"
        rss = statistics.median(r[0].get("file_extra", 0) for r in runs)
        cpu = statistics.median(sum(x.get("cpu_s", 0.0) for x in r) for r in runs)
        lines.append(
            f"| {m} | {wall:.2f} s | {ratio} | {cpu:.2f} s | {r0 / mib:.0f} MiB ({r0 / payload:.2f}x P) | "
            f"{rss / mib:.0f} MiB | {others / mib:.0f} MiB ({others / payload:.2f}x P) | yes |"
        )
    if "spillmerge" in rows and base:
        runs = rows["spillmerge"]
        sp = statistics.median(r[0]["spill_s"] for r in runs)
        wt = statistics.median(r[0]["wait_s"] for r in runs)
        mg = statistics.median(r[0]["merge_s"] for r in runs)
        lines += [
            "",
            f"spillmerge split on rank 0: spill {sp:.2f} s, wait for other ranks {wt:.2f} s, merge {mg:.2f} s",
        ]
        phases = [r[0].get("phases", {}) for r in runs]
        if phases[0]:
            parts = ", ".join(f"{k} {statistics.median(p.get(k, 0.0) for p in phases):.2f} s" for k in phases[0])
            lines.append(f"merge phases (median): {parts}")
    if "raw_spill" in rows and all(r[0].get("ok") for r in rows["raw_spill"]):
        sp = statistics.median(r[0]["spill_s"] for r in rows["raw_spill"])
        wall = statistics.median(r[0]["wall_s"] for r in rows["raw_spill"])
        lines.append(f"raw_spill split on rank 0 (medians): spill {sp:.2f} s, the rest (barrier, merge) {wall - sp:.2f} s")
    text = "\n".join(lines)
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text + "\n")


if __name__ == "__main__":
    main()
