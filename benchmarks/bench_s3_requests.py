"""S3 requests and objects per GiB (issue 24): bench_billion's payload written to and merged on a
local moto server, every request counted from the server's own request log, phase by phase.

    python benchmarks/bench_s3_requests.py --n 1000000 --out benchmarks/results/2026-11-24-scale-s3

N keys x 1 frame of ``{emb fp16[64], label int64, caption str}``, W=4 writer processes with
``write_batch`` (as ``bench_billion.py``) to ``s3://bench/spill``; one ``merge`` to
``s3://bench/out.zarr``; then ``open`` and 100 random lookups. moto holds the objects in memory;
its request log (one line per HTTP request, werkzeug's) is split at each phase's start and end.
The per-GiB figures divide by the bytes stored (spill) or written (output).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_billion as B  # noqa: E402
import numpy as np  # noqa: E402
from bench_s3 import free_port  # noqa: E402

GiB = 1 << 30


def _count(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    # werkzeug colours some lines (206, 404 ...) with ANSI escapes inside the quotes
    for m in re.findall(r'"(?:\x1b\[[0-9;]*m)*(PUT|GET|HEAD|POST|DELETE) ', text):
        out[m] = out.get(m, 0) + 1
    return out


def _objects(s3: Any, bucket: str, prefix: str) -> tuple[int, int]:
    n = size = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            n += 1
            size += o["Size"]
    return n, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--session-keys", type=int, default=250_000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--workdir", default="/tmp/bench-s3-requests")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = work / "moto.log"
    log = log_path.open("w")
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    srv = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    ep = f"http://127.0.0.1:{port}"
    # s3fs in the writer processes (forked from here) takes the endpoint and keys from the environment
    os.environ.update(AWS_ENDPOINT_URL=ep, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1")
    import boto3

    s3 = boto3.client("s3", endpoint_url=ep, region_name="us-east-1")
    for _ in range(100):
        try:
            s3.create_bucket(Bucket="bench")
            break
        except Exception:  # noqa: BLE001 - the server is still starting
            time.sleep(0.2)
    opts = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": ep, "region_name": "us-east-1"}}
    marks: list[tuple[str, int, float]] = []

    def mark(label: str) -> None:
        log.flush()
        time.sleep(0.5)  # the server writes its log line after answering
        marks.append((label, log_path.stat().st_size, time.perf_counter()))

    import spillmerge

    mark("start")
    ranks = B._parallel(
        B.spill_rank,
        [{"root": "s3://bench/spill", "n": args.n, "world": B.W, "rank": r, "session_keys": args.session_keys}
         for r in range(B.W)],
    )  # fmt: skip
    if not all(r["ok"] for r in ranks):
        raise RuntimeError(ranks)
    mark("spill")
    rep = spillmerge.merge("s3://bench/spill", "s3://bench/out.zarr", storage_options=opts, progress=False)
    mark("merge")
    res = spillmerge.open("s3://bench/out.zarr", storage_options=opts)
    mark("open")
    rng = np.random.default_rng(1)
    for i in rng.integers(0, args.n, 100).tolist():
        assert res[B.key_name(i)]["caption"][0] == f"a photo, number {i}"
    mark("100 lookups")
    text = log_path.read_text()
    phases: dict[str, Any] = {}
    for (_, a, ta), (label, b, tb) in zip(marks[:-1], marks[1:], strict=True):
        phases[label] = {"requests": _count(text[a:b]), "s": tb - ta}
    stored = {"spill": _objects(s3, "bench", "spill/"), "output": _objects(s3, "bench", "out.zarr/")}
    srv.terminate()
    srv.wait()
    _report(args, phases, stored, rep.n_frames)


def _report(args: argparse.Namespace, phases: dict[str, Any], stored: dict[str, tuple[int, int]], n_frames: int) -> None:
    (so, sb), (oo, ob) = stored["spill"], stored["output"]
    lines = [
        f"# S3 requests and objects per GiB on moto (issue 24), N = {args.n:,}",
        "",
        f"Command: `python benchmarks/bench_s3_requests.py {' '.join(sys.argv[1:])}`; load {os.getloadavg()[0]:.1f}; "
        f"{n_frames:,} rows merged. Spill root: {so:,} objects, {sb / GiB:.3f} GiB "
        f"(**{so / (sb / GiB):,.0f} objects per GiB**); output: {oo:,} objects, {ob / GiB:.3f} GiB "
        f"(**{oo / (ob / GiB):,.0f} objects per GiB**).",
        "",
        "| phase | wall (s) | requests by method | total | per GiB |",
        "|---|---|---|---|---|",
    ]
    per = {"spill": sb, "merge": ob}
    for label, p in phases.items():
        total = sum(p["requests"].values())
        gib = per.get(label)
        shown = f"{total / (gib / GiB):,.0f} per GiB of the {'spill root' if label == 'spill' else 'output'}" if gib else ""
        lines.append(f"| {label} | {p['s']:.1f} | {p['requests']} | {total:,} | {shown} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "README.md").write_text(text + "\n")
        Path(args.out, "results.json").write_text(json.dumps({"phases": phases, "stored": stored}, indent=1))


if __name__ == "__main__":
    main()
