"""Reading a merged output row by row, at random, and as Parquet; and what `import spillmerge` costs.

One run prints one table, every ratio against a baseline measured in the same run (issue 22):

  in order     every file of a detection output (boxes, scores, labels ragged; a class name str;
               an embedding fp16[256]) through `res[f][leaf][0]`, against a loop slicing the same
               rows out of in-memory numpy arrays (values + offsets) with one dict lookup per file
               (target <= 10x); also with the chunk cache off (`cache_bytes=0`)
  random row   one row of each kind (fixed, ragged, str, bytes, list of str) of a freshly opened
               output with the cache off, median and p90 of 50 (target <= 2 ms)
  parquet      `res.to_parquet(path)` against pyarrow writing the same table from memory
  import       `import spillmerge` in a fresh interpreter (does it import torch?), against
               `import torch`

Usage: python benchmarks/bench_read.py [--files 100000] [--out benchmarks/results/DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

import spillmerge

LEAVES = ("boxes", "scores", "labels", "cls", "emb")
NAMES = ["person", "bicycle", "car", "motorcycle", "traffic light", "dog", "cat", "zebra"]


def build(work: Path, n: int) -> str:
    """One rank's detection outputs for ``n`` images (plus a bytes and a list-of-str leaf for the
    random-row table), merged."""
    root, out = work / "spill", work / "out.zarr"
    rng = np.random.default_rng(0)
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(n):
            k = int(rng.integers(0, 12))
            w.write(f"img_{i:07d}.jpg", 0, {
                "boxes": torch.from_numpy(rng.random((k, 4), dtype=np.float32)),
                "scores": torch.from_numpy(rng.random(k, dtype=np.float32)),
                "labels": torch.from_numpy(rng.integers(0, 80, k)),
                "cls": NAMES[i % len(NAMES)],
                "emb": torch.from_numpy(rng.standard_normal(256, dtype=np.float32).astype(np.float16)),
                "png": rng.integers(0, 255, 64 + k * 16, dtype=np.uint8).tobytes(),
                "words": [NAMES[(i + j) % len(NAMES)] for j in range(k % 5)],
            })  # fmt: skip
    spillmerge.merge(str(root), str(out), progress=False)
    return str(out)


def best_of(fn, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def in_order(out: str) -> dict[str, float]:
    res = spillmerge.open(out)
    files = res.filenames
    flat = {leaf: (res.column(leaf).values, res.column(leaf).offsets) for leaf in ("boxes", "scores", "labels")}
    cls = res.column("cls").to_list()
    emb = np.asarray(res.column("emb"))
    index = {f: i for i, f in enumerate(files)}
    (bv, bo), (sv, so), (lv, lo) = flat["boxes"], flat["scores"], flat["labels"]

    def numpy_loop() -> None:
        for f in files:
            i = index[f]
            bv[bo[i] : bo[i + 1]], sv[so[i] : so[i + 1]], lv[lo[i] : lo[i + 1]], cls[i], emb[i]  # noqa: B018

    def spillmerge_loop(store: spillmerge.MergedStore) -> None:
        for f in files:
            v = store[f]
            for leaf in LEAVES:
                v[leaf][0]  # noqa: B018

    times = {}
    for _ in range(3):  # alternated, best of each; CPU time beside wall time (a shared machine)
        c = time.process_time()
        times["numpy"] = min(times.get("numpy", 1e9), best_of(numpy_loop, 1))
        times["numpy_cpu"] = min(times.get("numpy_cpu", 1e9), time.process_time() - c)
        fresh = spillmerge.open(out)  # a cold cache: the loop decodes every chunk once
        c = time.process_time()
        times["cached"] = min(times.get("cached", 1e9), best_of(lambda s=fresh: spillmerge_loop(s), 1))
        times["cached_cpu"] = min(times.get("cached_cpu", 1e9), time.process_time() - c)
    sample = files[: max(1, len(files) // 20)]  # without the cache every row decodes its chunk: a sample
    nocache = spillmerge.open(out, cache_bytes=0)
    t = time.perf_counter()
    for f in sample:
        v = nocache[f]
        for leaf in LEAVES:
            v[leaf][0]  # noqa: B018
    times["nocache"] = (time.perf_counter() - t) / len(sample) * len(files)
    return {k: v / len(files) for k, v in times.items()}


def random_rows(out: str) -> dict[str, tuple[str, float, float, int]]:
    rng = np.random.default_rng(1)
    res = spillmerge.open(out, cache_bytes=0)
    rows = {}
    for leaf in ("emb", "boxes", "cls", "png", "words"):
        col = res.column(leaf)
        ts = []
        for i in rng.integers(0, len(col), 50):
            t = time.perf_counter()
            col[int(i)]  # noqa: B018
            ts.append(time.perf_counter() - t)
        rows[leaf] = (col.kind, statistics.median(ts), float(np.percentile(ts, 90)), int(col.zarr.chunks[0]))
    return rows


def parquet(out: str, work: Path) -> dict[str, float]:
    res = spillmerge.open(out)
    table = res.to_arrow()
    ours = best_of(lambda: res.to_parquet(work / "ours.parquet"))
    theirs = best_of(lambda: pq.write_table(table, work / "pyarrow.parquet"))
    assert pq.read_table(work / "ours.parquet").equals(pq.read_table(work / "pyarrow.parquet"))
    return {"to_parquet": ours, "pyarrow": theirs, "rows": table.num_rows}


def import_times() -> dict[str, object]:
    def run(code: str) -> float:
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            ts.append(time.perf_counter() - t)
        return min(ts)

    torch_loaded = subprocess.run(
        [sys.executable, "-c", "import sys, spillmerge; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    return {
        "spillmerge": run("import spillmerge"),
        "torch": run("import torch"),
        "python": run("pass"),
        "torch_loaded": torch_loaded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--out", help="folder for results.md")
    ap.add_argument("--in-order-only", action="store_true", help="only the files-in-order row (an A/B of it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-read-"))
    try:
        t = time.perf_counter()
        out = build(work, args.files)
        built = time.perf_counter() - t
        order = in_order(out)
        if args.in_order_only:
            print(
                f"files in order: {order['cached'] * 1e6:.2f} us/file, numpy slices + dict {order['numpy'] * 1e6:.2f} "
                f"us/file: **{order['cached'] / order['numpy']:.1f}x**; CPU {order['cached_cpu'] * 1e6:.2f} vs "
                f"{order['numpy_cpu'] * 1e6:.2f} us/file: {order['cached_cpu'] / order['numpy_cpu']:.1f}x "
                f"(load {os.getloadavg()[0]:.1f})"
            )
            return
        rand = random_rows(out)
        pqt = parquet(out, work)
        imp = import_times()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    us = 1e6
    lines = [
        f"# Reading, {args.files:,} files x 1 frame (detection outputs), one run",
        "",
        f"Output written and merged in {built:.1f} s. Ratios are within this run; load average at the end "
        f"{os.getloadavg()[0]:.1f} (2 CPUs shared).",
        "",
        "| what | spillmerge | baseline | ratio | target |",
        "|---|---|---|---|---|",
        f"| files in order, `res[f][leaf][0]` x 5 leaves | {order['cached'] * us:.1f} us/file (CPU "
        f"{order['cached_cpu'] * us:.1f}) | numpy slices + dict: {order['numpy'] * us:.2f} us/file (CPU "
        f"{order['numpy_cpu'] * us:.2f}) | **{order['cached'] / order['numpy']:.1f}x** (CPU "
        f"{order['cached_cpu'] / order['numpy_cpu']:.1f}x) | <= 10x |",
        f"| same, cache off (`cache_bytes=0`, 5% sample) | {order['nocache'] * us:.0f} us/file | same | "
        f"{order['nocache'] / order['numpy']:.0f}x | - |",
    ]
    for leaf, (kind, med, p90, k) in rand.items():
        lines.append(f"| one random row, {kind} (`{leaf}`, {k:,} units per chunk), cache off | median {med * 1e3:.2f} ms, "
                     f"p90 {p90 * 1e3:.2f} ms | - | - | <= 2 ms |")  # fmt: skip
    lines += [
        f"| `to_parquet` ({pqt['rows']:,} rows, batch by batch) | {pqt['to_parquet']:.2f} s | pyarrow `write_table` "
        f"of the same table in memory: {pqt['pyarrow']:.2f} s | **{pqt['to_parquet'] / pqt['pyarrow']:.2f}x** | stated |",
        f"| `import spillmerge` (torch imported: {imp['torch_loaded']}) | {imp['spillmerge']:.2f} s | `import torch`: "
        f"{imp['torch']:.2f} s (bare interpreter {imp['python']:.2f} s) | "
        f"**{imp['spillmerge'] / imp['torch']:.2f}x** | no torch |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.md").write_text(text)


if __name__ == "__main__":
    main()
