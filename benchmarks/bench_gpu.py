"""The GPU section of issue 6: spillmerge's device-to-host path against the GPU's raw copy
bandwidth, compute/write overlap on the GPU, and GPU memory of spilling vs ``all_gather_object``.

Run on a machine with a CUDA GPU (one is enough):

    .venv/bin/python benchmarks/bench_gpu.py --out benchmarks/results/<date>-gpu

Tables (each ratio against a baseline measured in the same run):

1. **Copy bandwidth.** Raw device-to-host copies into pinned memory (one large copy, and copies of
   one frame each into a pinned buffer, which is what the writer does), a pageable copy for
   reference, and spillmerge: ``SpillWriter.write()`` of CUDA frames (time in ``write()`` until
   the copies are complete; then end to end with ``close()``) with the spill root on ``--root``
   (default /dev/shm, so the disk does not hide the copy path).
2. **Overlap.** A loop that runs a matmul of about ``--step-ms`` on the GPU and produces one frame
   per step, with and without ``write()`` of that frame: slowdown in percent.
3. **GPU memory.** ``torch.cuda.max_memory_allocated`` above the level before, for spilling the
   predictions (CUDA tensors written directly) and for ``all_gather_object`` of the same
   predictions moved to CPU first, in a world-size-1 NCCL group, at two payloads.

``--dry-run`` runs the same code on CPU with gloo (no CUDA: the GPU columns read n/a) to check the
script on a machine without a GPU; its figures are not GPU measurements.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import spillmerge

MiB = 1 << 20
FRAME = (3, 256, 256)  # fp16: 384 KiB per frame


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Clock:
    """Wall time of a section, synchronising the device at both ends when there is one."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __enter__(self) -> Clock:
        self.sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sync()
        self.seconds = time.perf_counter() - self.t0


def frames_on(dev: torch.device, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(FRAME, generator=g).half().to(dev) for _ in range(n)]


def best(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed runs (copy bandwidth: the machine's capability, not its noise)."""
    return min(fn() for _ in range(repeats))


# -------------------------------------------------------------------------------- bandwidth
def raw_copies(dev: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """Seconds per ``nbytes`` for the baseline copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)  # resident before timing
    frame_bytes = 2 * FRAME[0] * FRAME[1] * FRAME[2]
    frame_src = src[: (nbytes // frame_bytes) * frame_bytes].view(-1, frame_bytes)

    def bulk_pinned() -> float:
        with Clock(dev) as c:
            pinned.copy_(src, non_blocking=True)
        return c.seconds

    def frames_pinned() -> float:
        dst = pinned[: frame_src.numel()].view(-1, frame_bytes)
        with Clock(dev) as c:
            for i in range(len(frame_src)):
                dst[i].copy_(frame_src[i], non_blocking=True)
        return c.seconds * nbytes / frame_src.numel()

    def bulk_pageable() -> float:
        with Clock(dev) as c:
            pageable.copy_(src)
        return c.seconds

    bulk_pinned()  # warm-up
    return {
        "raw pinned, one copy": best(bulk_pinned, repeats),
        "raw pinned, one copy per frame": best(frames_pinned, repeats),
        "raw pageable, one copy": best(bulk_pageable, repeats),
    }


def spill_copies(dev: torch.device, nbytes: int, root: str, repeats: int, chunk_bytes: int) -> dict[str, float]:
    """spillmerge's write() path: seconds per ``nbytes`` until the copies are done, and with close()."""
    pool = frames_on(dev, 64)
    frame_bytes = pool[0].numel() * 2
    n = nbytes // frame_bytes
    in_write, end_to_end = [], []
    for r in range(repeats + 1):  # the first run warms up (CUDA stream, pinned allocations)
        path = os.path.join(root, f"spill-{r}")
        with Clock(dev) as total, spillmerge.SpillWriter(path, chunk_bytes=chunk_bytes) as w:
            with Clock(dev) as copies:
                for i in range(n):
                    w.write("pred.mp4", i, pool[i % len(pool)])
        shutil.rmtree(path, ignore_errors=True)
        if r:
            in_write.append(copies.seconds * nbytes / (n * frame_bytes))
            end_to_end.append(total.seconds * nbytes / (n * frame_bytes))
    return {"spillmerge write() (copies done)": min(in_write), "spillmerge write() + close()": min(end_to_end)}


# ---------------------------------------------------------------------------------- overlap
def overlap(dev: torch.device, root: str, steps: int, step_ms: float, repeats: int, size: int) -> dict[str, float]:
    """Loop time without and with write() of each step's output frame (median of ``repeats``)."""
    a = torch.randn(max(size, 768), size, device=dev)  # rows enough for one 3x256x256 frame
    b = torch.randn(size, size, device=dev)
    for _ in range(3):  # warm-up (cuBLAS handles, clocks) before calibrating
        a @ b
    with Clock(dev) as c:  # calibrate: matmuls per step so one step takes about step_ms
        for _ in range(10):
            a @ b
    per = max(1, round(step_ms / 1000 / (c.seconds / 10)))
    head = torch.empty(FRAME, dtype=torch.float16, device=dev)

    def steps_with(w: spillmerge.SpillWriter | None) -> float:
        with Clock(dev) as c:
            for i in range(steps):
                y = a
                for _ in range(per):
                    y = y @ b
                pred = head.copy_(y[: FRAME[0] * FRAME[1], : FRAME[2]].reshape(FRAME)).clone()  # a fresh output
                if w is not None:
                    w.write("pred.mp4", i, pred)
        return c.seconds

    def loop(write: bool, path: str) -> float:
        if not write:
            return steps_with(None)
        with spillmerge.SpillWriter(path) as w:  # close() flushes the tail outside the timed loop
            seconds = steps_with(w)
        shutil.rmtree(path, ignore_errors=True)
        return seconds

    loop(True, os.path.join(root, "warm"))
    base, spill = [], []
    for r in range(repeats):  # interleaved so drift hits both equally
        base.append(loop(False, ""))
        spill.append(loop(True, os.path.join(root, f"ov-{r}")))
    return {
        "matmuls_per_step": per,
        "size": size,
        "step_ms": 1000 * statistics.median(base) / steps,
        "without": statistics.median(base),
        "with": statistics.median(spill),
    }


# --------------------------------------------------------------------------------- per key
def per_key(dev: torch.device, root: str, n: int, batch: int, repeats: int) -> list[tuple[str, float, str, float]]:
    """Microseconds a key for CUDA outputs of small rows, the loop only (synchronised at its end,
    the commit apart), alternated with the floor each method is compared with.

    Rows: bench_write.py's frame ``{"logits": fp16[1000], "emb": fp16[512]}`` (3,024 B), and a
    detection output: a list of per-image dicts ``{"boxes": fp32[k, 4], "scores": fp32[k],
    "labels": int64[k]}``, k in 0..20, as torchvision returns them. Floors: what a user does
    before ``gather_object`` today, ``.cpu()`` of every tensor, into a list."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(n, 1000, generator=g).half().to(dev)
    emb = torch.randn(n, 512, generator=g).half().to(dev)
    ks = torch.randint(0, 21, (n,), generator=g).tolist()
    dets = [
        {"boxes": torch.rand(k, 4, generator=g).to(dev), "scores": torch.rand(k, generator=g).to(dev),
         "labels": torch.randint(0, 91, (k,), generator=g).to(dev)}
        for k in ks
    ]  # fmt: skip
    names = [f"images/{i:07d}.jpg" for i in range(n)]
    clock = Clock(dev)

    def timed(fn) -> float:
        with clock:
            fn()
        return clock.seconds * 1e6 / n

    def spill(body) -> float:
        path = os.path.join(root, f"pk-{time.perf_counter_ns()}")
        with spillmerge.SpillWriter(path) as w:
            us = timed(lambda: body(w))
        shutil.rmtree(path, ignore_errors=True)
        return us

    def rows_cpu() -> None:
        out = []
        for i in range(n):
            out.append({"logits": logits[i].cpu(), "emb": emb[i].cpu()})

    def rows_write(w) -> None:
        for i in range(n):
            w.write(names[i], 0, {"logits": logits[i], "emb": emb[i]})

    def batch_cpu() -> None:
        out = []
        for s in range(0, n, batch):
            out.append({"logits": logits[s : s + batch].cpu(), "emb": emb[s : s + batch].cpu()})

    def batch_write(w) -> None:
        for s in range(0, n, batch):
            w.write_batch(names[s : s + batch], {"logits": logits[s : s + batch], "emb": emb[s : s + batch]})

    def dets_cpu() -> None:
        out = []
        for s in range(0, n, batch):
            out.append([{k: v.cpu() for k, v in d.items()} for d in dets[s : s + batch]])

    def dets_write(w) -> None:
        for s in range(0, n, batch):
            w.write_batch(names[s : s + batch], dets[s : s + batch])

    pairs = [
        ("write() per key, {logits, emb}", lambda: spill(rows_write), ".cpu() per key", lambda: timed(rows_cpu)),
        (f"write_batch({batch}), {{logits, emb}}", lambda: spill(batch_write), f".cpu() per batch of {batch}",
         lambda: timed(batch_cpu)),
        (f"write_batch({batch}), detection dicts", lambda: spill(dets_write), ".cpu() of every tensor",
         lambda: timed(dets_cpu)),
    ]  # fmt: skip
    for _, method, _, floor in pairs:  # warm-up: CUDA streams, pinned blocks, templates
        method()
        floor()
    got: dict[int, tuple[list[float], list[float]]] = {i: ([], []) for i in range(len(pairs))}
    for _ in range(repeats):
        for i, (_, method, _, floor) in enumerate(pairs):
            got[i][0].append(method())
            got[i][1].append(floor())
    return [
        (name, statistics.median(got[i][0]), floor_name, statistics.median(got[i][1]))
        for i, (name, _, floor_name, _) in enumerate(pairs)
    ]


# ---------------------------------------------------------------------------------- memory
def gpu_memory(dev: torch.device, payloads: list[int], root: str) -> list[dict]:
    """Peak allocator bytes above the level before, for spilling and for all_gather_object."""
    import torch.distributed as dist

    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    rows = []
    try:
        for nbytes in payloads:
            preds = frames_on(dev, nbytes // (2 * FRAME[0] * FRAME[1] * FRAME[2]))
            payload = sum(t.numel() * 2 for t in preds)
            row: dict = {"payload": payload}  # whole frames: about nbytes
            for method in ("spill", "all_gather_object"):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                if method == "spill":
                    path = os.path.join(root, f"mem-{nbytes}")
                    with spillmerge.SpillWriter(path) as w:
                        for i, t in enumerate(preds):
                            w.write("pred.mp4", i, t)
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    mine = {("pred.mp4", i): t.cpu() for i, t in enumerate(preds)}  # what users do first
                    got: list = [None]
                    dist.all_gather_object(got, mine)
                    assert len(got[0]) == len(preds)
                    del got, mine
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    row[method] = torch.cuda.max_memory_allocated() - before
                row[method + "_s"] = time.perf_counter() - t0
            rows.append(row)
            del preds
    finally:
        dist.destroy_process_group()
    return rows


# ----------------------------------------------------------------------------------- report
def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def report(args, dev, bw: dict, nbytes: int, ov: dict, mem: list[dict], pk: list) -> str:
    lines = [f"# GPU measurements ({'DRY RUN on CPU: not GPU figures' if args.dry_run else 'CUDA'})", ""]
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        lines.append(f"- GPU: {p.name}, {p.total_memory / (1 << 30):.0f} GiB; CUDA {torch.version.cuda}")
    lines += [
        f"- torch {torch.__version__}, spillmerge {spillmerge.__version__}, Python {platform.python_version()},"
        f" {os.cpu_count()} CPU cores; spill root {args.root}",
        f"- command: `{' '.join(sys.argv)}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"## 1. Device-to-host bandwidth ({nbytes // MiB} MiB of fp16 3x256x256 frames, best of {args.repeats})",
        "",
        "| path | throughput | vs raw pinned, one copy per frame |",
        "|---|---|---|",
    ]
    ref = bw["raw pinned, one copy per frame"]
    for name, s in bw.items():
        lines.append(f"| {name} | {gbps(nbytes, s)} | {ref / s:.2f}x |")
    lines += overlap_lines(args, ov)
    lines += [
        "",
        "## 3. GPU memory: max_memory_allocated above the level before (world size 1, "
        f"{'NCCL' if dev.type == 'cuda' else 'gloo'})",
        "",
        "| payload P | spill (CUDA tensors written) | all_gather_object (of .cpu() copies) | time spill | time gather |",
        "|---|---|---|---|---|",
    ]
    for r in mem:
        cells = [
            f"{r[m] / MiB:.0f} MiB ({r[m] / r['payload']:.2f}x P)" if m in r else "n/a (no CUDA)"
            for m in ("spill", "all_gather_object")
        ]
        lines.append(
            f"| {r['payload'] / MiB:.0f} MiB | {cells[0]} | {cells[1]} | {r['spill_s']:.2f} s | {r['all_gather_object_s']:.2f} s |"
        )
    return "\n".join(lines + per_key_lines(args, pk)) + "\n"


def overlap_lines(args, ov: dict) -> list[str]:
    slow = 100 * (ov["with"] / ov["without"] - 1)
    return [
        "",
        f"## 2. Overlap: {args.steps} steps of ~{ov['step_ms']:.1f} ms GPU compute"
        f" ({ov['matmuls_per_step']} matmuls of {ov['size']}x{ov['size']}), one 384 KiB frame each (median of {args.repeats})",
        "",
        "| loop | seconds | slowdown |",
        "|---|---|---|",
        f"| compute only | {ov['without']:.3f} | |",
        f"| compute + write() | {ov['with']:.3f} | {slow:+.1f} % |",
    ]


def per_key_lines(args, pk: list) -> list[str]:
    lines = [
        "",
        f"## 4. Per key: CUDA outputs of small rows, {args.keys} keys (median of {args.repeats}, alternated)",
        "",
        "| method | us / key | floor | us / key | method / floor |",
        "|---|---|---|---|---|",
    ]
    for name, us, floor_name, floor_us in pk:
        lines.append(f"| {name} | {us:.2f} | {floor_name} | {floor_us:.2f} | {us / floor_us:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--payload-mib", type=int, default=1024, help="bytes per bandwidth measurement (default 1024)")
    ap.add_argument("--mem-payloads-mib", default="256,1024", help="payloads of the memory table")
    ap.add_argument("--chunk-mib", type=int, default=16, help="SpillWriter chunk_bytes in the bandwidth table")
    ap.add_argument("--steps", type=int, default=400, help="overlap loop steps")
    ap.add_argument("--step-ms", type=float, default=5.0, help="GPU compute per step")
    ap.add_argument("--matmul", type=int, default=2048, help="matrix size of the overlap's compute")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keys", type=int, default=16384, help="keys of the per-key table")
    ap.add_argument("--batch", type=int, default=256, help="write_batch size of the per-key table")
    ap.add_argument("--only", choices=["perkey", "overlap"], help="run one table (4 or 2)")
    ap.add_argument("--root", help="where spills go (default /dev/shm when it has room, else the temp dir)")
    ap.add_argument("--out", help="folder for results.md")
    ap.add_argument("--dry-run", action="store_true", help="CPU and gloo, small sizes: check the script only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.dry_run:
        dev = torch.device("cpu")
        args.payload_mib, args.mem_payloads_mib, args.steps, args.step_ms, args.matmul = 32, "16,32", 20, 20.0, 256
        args.keys = 2048
    elif not torch.cuda.is_available():
        sys.exit("bench_gpu.py: no CUDA device here (use --dry-run to check the script on CPU)")
    else:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    nbytes = args.payload_mib * MiB
    if args.root is None:  # a container's /dev/shm is often 64 MiB
        room = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        need = 2 * max([nbytes] + [int(x) * MiB for x in args.mem_payloads_mib.split(",")])
        args.root = "/dev/shm" if room >= need else tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="spillmerge-gpu-", dir=args.root) as root:
        if args.only == "overlap":
            ov = overlap(dev, root, args.steps, args.step_ms, args.repeats, args.matmul)
            print("\n".join([f"# spillmerge {spillmerge.__file__}", *overlap_lines(args, ov)]))
            return
        print("per key ...", file=sys.stderr)
        pk = per_key(dev, root, args.keys, args.batch, args.repeats)
        if args.only == "perkey":
            print("\n".join([f"# spillmerge {spillmerge.__file__}", *per_key_lines(args, pk)]))
            return
        print("bandwidth ...", file=sys.stderr)
        bw = raw_copies(dev, nbytes, args.repeats)
        bw.update(spill_copies(dev, nbytes, root, args.repeats, args.chunk_mib * MiB))
        print("overlap ...", file=sys.stderr)
        ov = overlap(dev, root, args.steps, args.step_ms, args.repeats, args.matmul)
        print("memory ...", file=sys.stderr)
        mem = gpu_memory(dev, [int(x) * MiB for x in args.mem_payloads_mib.split(",")], root)
    text = report(args, dev, bw, nbytes, ov, mem, pk)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "results.md").write_text(text)


if __name__ == "__main__":
    main()
