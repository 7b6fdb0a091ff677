"""Object-store benchmark against a loopback S3 server (moto, in its own process).

Measures, in one run:
  * spill throughput of SpillWriter to s3:// against raw s3fs PUTs of the same bytes in objects
    of the same size with the same concurrency (target >= 0.8x);
  * merge time s3 -> s3 for many filenames (default 1,000);
  * time to open the merged output and read one array (target <= 1 s for 1,000 filenames),
    with spillmerge.open and with plain zarr.

Usage: python benchmarks/bench_s3.py [--payload-mib 256] [--files 1000] [--out-md FILE]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--payload-mib", type=int, default=256)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--frames-per-file", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out-md")
    args = ap.parse_args()
    torch.set_num_threads(1)

    import boto3
    import s3fs
    import zarr

    import spillmerge

    proc, endpoint = start_moto()
    try:
        boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="b", aws_secret_access_key="b", region_name="us-east-1"
        ).create_bucket(Bucket="bench")
        opts = {"key": "b", "secret": "b", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        fs = s3fs.S3FileSystem(**opts)
        chunk = args.chunk_mib << 20
        n_chunks = max(1, (args.payload_mib << 20) // chunk)
        payload = n_chunks * chunk
        frame = torch.randn(3, 256, 256).half()
        n_frames = payload // (frame.numel() * 2)
        blob = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()

        def raw_puts(rep: int) -> float:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(fs.pipe_file, [f"bench/raw{rep}/obj{i}" for i in range(n_chunks)], [blob] * n_chunks))
            took = time.perf_counter() - t0
            fs.rm(f"bench/raw{rep}", recursive=True)  # keep the server's memory flat: moto slows as it fills
            return took

        def spill(rep: int) -> float:
            t0 = time.perf_counter()
            with spillmerge.SpillWriter(
                f"s3://bench/spill{rep}", rank=0, world_size=1, storage_options=opts, chunk_bytes=chunk
            ) as w:
                for i in range(n_frames):
                    w.write(f"video{i % 16:02d}.mp4", i // 16, frame)
            took = time.perf_counter() - t0
            fs.rm(f"bench/spill{rep}", recursive=True)
            return took

        # Interleaved, first one then the other first: whichever runs second on the same server
        # was measured up to 1.5x slower, so a fixed order would bias the ratio.
        raw_t, spill_t = [], []
        for rep in range(args.repeats):
            if rep % 2 == 0:
                raw_t.append(raw_puts(rep))
                spill_t.append(spill(rep))
            else:
                spill_t.append(spill(rep))
                raw_t.append(raw_puts(rep))
        raw, spill = float(np.median(raw_t)), float(np.median(spill_t))

        # Many filenames: merge s3 -> s3, then open.
        small = torch.randn(64, 64).half()
        with spillmerge.SpillWriter("s3://bench/many", rank=0, world_size=1, storage_options=opts) as w:
            for i in range(args.files):
                for f in range(args.frames_per_file):
                    w.write(f"clip_{i:05d}.mp4", f, small)
        t0 = time.perf_counter()
        report = spillmerge.merge("s3://bench/many", "s3://bench/many.zarr", storage_options=opts)
        merge_t = time.perf_counter() - t0
        open_t, zopen_t = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = spillmerge.open("s3://bench/many.zarr", storage_options=opts)
            res[res.filenames[-1]][:]
            open_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            g = zarr.open_group("s3://bench/many.zarr", mode="r", storage_options=opts)
            key = g["index/keys"][-1]
            g[f"files/{key}"][:]
            zopen_t.append(time.perf_counter() - t0)
        mib = payload / (1 << 20)
        lines = [
            f"Object store (moto S3 server on 127.0.0.1, own process), {mib:.0f} MiB payload in {args.chunk_mib} MiB objects, "
            f"median of {args.repeats}:",
            "",
            "| measurement | time | throughput | ratio |",
            "|---|---|---|---|",
            f"| raw s3fs PUTs, 4 in flight | {raw:.2f} s | {mib / raw:.0f} MiB/s | 1.00 |",
            f"| spillmerge spill (SpillWriter to s3://) | {spill:.2f} s | {mib / spill:.0f} MiB/s | {raw / spill:.2f}x raw (target >= 0.8) |",
            f"| merge s3 -> s3, {args.files} filenames x {args.frames_per_file} frames | {merge_t:.2f} s | "
            f"{report.nbytes / (1 << 20) / merge_t:.1f} MiB/s | - |",
            f"| spillmerge.open + read one array ({args.files} filenames) | {np.median(open_t):.3f} s | - | target <= 1 s |",
            f"| plain zarr.open_group + read one array | {np.median(zopen_t):.3f} s | - | - |",
            "",
            "per repeat (order alternating): raw "
            + ", ".join(f"{t:.2f}" for t in raw_t)
            + " s; spill "
            + ", ".join(f"{t:.2f}" for t in spill_t)
            + " s; ratio "
            + ", ".join(f"{r / t:.2f}" for r, t in zip(raw_t, spill_t, strict=True)),
        ]
        text = "\n".join(lines)
        print(text)
        if args.out_md:
            with open(args.out_md, "w") as f:
                f.write(text + "\n")
    finally:
        proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
