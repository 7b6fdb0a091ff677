"""Writing many keys (issue 22): per-row and per-batch write cost, and end to end against Parquet.

    python benchmarks/bench_write.py                      # rows: 20k; end to end: 100k keys; 3 repeats
    python benchmarks/bench_write.py --e2e 100000 1000000 --repeats 3
    python benchmarks/bench_write.py --quick              # small sizes, 1 repeat: does it work

Every key ``images/NNNNNNN.jpg`` has one frame ``{"logits": fp16[1000], "emb": fp16[512]}`` (3,024
bytes; rows of a fixed random pool). Methods, alternated within each repeat, medians reported:

- ``write()`` per row: ``SpillWriter.write(name, 0, {"logits": logits[i], "emb": emb[i]})`` for
  every row (the loop only; the commit is shown apart), against a hand-written loop copying each
  row's bytes out of the same tensors into one numpy buffer (``logits[i].numpy()`` ...).
- ``write_batch(256)``: ``w.write_batch(names[s:s+256], {"logits": ..., "emb": ...})`` against the
  same copy done a batch at a time (each leaf's whole batch copied into its place in a
  ``(256, 3024)`` numpy block).
- end to end, W=4 processes (spawned once, shared): each rank ``write_batch``es its keys (256 a
  batch) and commits; one process merges (``spillmerge.merge``); a fresh open reads every
  filename and both columns whole (``res.column(leaf)[:]``). Against: each rank writes one Parquet
  file with pyarrow (filename, logits ``fixed_size_list<float16>[1000]``, emb [512]; fsync), then
  polars reads the W files whole and turns both columns into numpy. Bytes written: the spill plus
  the output for spillmerge, the W files for Parquet.

Every process calls ``torch.set_num_threads(1)``. Quote ratios from one run (this VM's absolute
times move with its neighbours).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import tree_bytes  # noqa: E402

LOGITS, EMB, POOL_ROWS, BATCH = 1000, 512, 257, 256


def key_name(i: int) -> str:
    return f"images/{i:07d}.jpg"


def rows(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lp, ep = torch.randn((POOL_ROWS, LOGITS), generator=g).half(), torch.randn((POOL_ROWS, EMB), generator=g).half()
    sel = torch.from_numpy(idx % POOL_ROWS)
    return lp[sel].contiguous(), ep[sel].contiguous()


# ----------------------------------------------------------------------------- per row / batch
def hand_rows(logits: torch.Tensor, emb: torch.Tensor) -> float:
    n = len(logits)
    buf = np.empty(n * 2 * (LOGITS + EMB), np.uint8)
    t = time.perf_counter()
    off = 0
    for i in range(n):
        a = logits[i].numpy().view(np.uint8)
        buf[off : off + a.size] = a
        off += a.size
        b = emb[i].numpy().view(np.uint8)
        buf[off : off + b.size] = b
        off += b.size
    return time.perf_counter() - t


def hand_batches(logits: torch.Tensor, emb: torch.Tensor) -> float:
    n, width = len(logits), 2 * (LOGITS + EMB)
    buf = np.empty((n, width), np.uint8)
    t = time.perf_counter()
    for s in range(0, n, BATCH):
        e = min(n, s + BATCH)
        buf[s:e, : 2 * LOGITS] = logits[s:e].numpy().view(np.uint8)
        buf[s:e, 2 * LOGITS :] = emb[s:e].numpy().view(np.uint8)
    return time.perf_counter() - t


def spill(names: list[str], logits: torch.Tensor, emb: torch.Tensor, batched: bool, root: str) -> tuple[float, float]:
    """(seconds in the write loop, seconds of the commit)."""
    import spillmerge

    with spillmerge.SpillWriter(root, 0, 1) as w:
        t = time.perf_counter()
        if batched:
            for s in range(0, len(names), BATCH):
                w.write_batch(names[s : s + BATCH], {"logits": logits[s : s + BATCH], "emb": emb[s : s + BATCH]})
        else:
            for i, name in enumerate(names):
                w.write(name, 0, {"logits": logits[i], "emb": emb[i]})
        loop = time.perf_counter() - t
    return loop, time.perf_counter() - t - loop


def bench_rows(n: int, repeats: int, tmp: str) -> list[str]:
    names = [key_name(i) for i in range(n)]
    logits, emb = rows(np.arange(n))
    got: dict[str, list[float]] = {
        k: [] for k in ("hand_row", "write", "write_commit", "hand_batch", "batch", "batch_commit")
    }
    for r in range(repeats):
        order = ["row", "batch"] if r % 2 == 0 else ["batch", "row"]
        for kind in order:
            root = os.path.join(tmp, f"rows-{r}-{kind}")
            if kind == "row":
                got["hand_row"].append(hand_rows(logits, emb))
                loop, commit = spill(names, logits, emb, False, root)
                got["write"].append(loop)
                got["write_commit"].append(commit)
            else:
                got["hand_batch"].append(hand_batches(logits, emb))
                loop, commit = spill(names, logits, emb, True, root)
                got["batch"].append(loop)
                got["batch_commit"].append(commit)
            shutil.rmtree(root)
    m = {k: statistics.median(v) / n * 1e6 for k, v in got.items()}
    return [
        f"| `write()` per row | {m['write']:.2f} µs (+ commit {m['write_commit']:.2f}) | hand row copy {m['hand_row']:.2f} µs | **{m['write'] / m['hand_row']:.2f}×** | ≤ 4× |",
        f"| `write_batch(256)` per row | {m['batch']:.2f} µs (+ commit {m['batch_commit']:.2f}) | hand batch copy {m['hand_batch']:.2f} µs | **{m['batch'] / m['hand_batch']:.2f}×** | ≤ 4× |",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------- end to end
def _rank_task(args: tuple[str, int, int, int, str]) -> float:
    method, rank, world, n, root = args
    torch.set_num_threads(1)
    idx = np.arange(rank, n, world)
    names = [key_name(int(i)) for i in idx]
    logits, emb = rows(idx)
    import pyarrow as pa  # imports before the clock starts
    import pyarrow.parquet as pq

    import spillmerge

    t = time.perf_counter()
    if method == "spillmerge":
        with spillmerge.SpillWriter(root, rank, world) as w:
            for s in range(0, len(names), BATCH):
                w.write_batch(names[s : s + BATCH], {"logits": logits[s : s + BATCH], "emb": emb[s : s + BATCH]})
    else:

        def fsl(t: torch.Tensor) -> Any:
            return pa.FixedSizeListArray.from_arrays(pa.array(t.numpy().reshape(-1)), t.shape[1])

        table = pa.table({"filename": names, "logits": fsl(logits), "emb": fsl(emb)})
        path = os.path.join(root, f"rank-{rank}.parquet")
        pq.write_table(table, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t


def _read_task(args: tuple[str, str, int]) -> tuple[float, int]:
    method, path, n = args
    torch.set_num_threads(1)
    import polars as pl  # imports before the clock starts

    import spillmerge

    t = time.perf_counter()
    if method == "spillmerge":
        res = spillmerge.open(path)
        names = res.filenames
        lg, em = np.asarray(res.column("logits")[:]), np.asarray(res.column("emb")[:])
    else:
        df = pl.read_parquet(sorted(str(p) for p in Path(path).glob("*.parquet")))
        names = df["filename"].to_list()
        lg, em = df["logits"].to_numpy(), df["emb"].to_numpy()
    took = time.perf_counter() - t
    assert len(names) == n and lg.shape == (n, LOGITS) and em.shape == (n, EMB)
    return took, int(lg.view(np.uint16)[:, 0].astype(np.int64).sum() % 1000)


def bench_e2e(n: int, world: int, repeats: int, tmp: str, pool: Any) -> list[str]:
    import spillmerge

    got: dict[str, dict[str, list[float]]] = {
        m: {"write": [], "merge": [], "read": [], "bytes": []} for m in ("spillmerge", "parquet")
    }
    checks = set()
    for r in range(repeats):
        for method in ["spillmerge", "parquet"] if r % 2 == 0 else ["parquet", "spillmerge"]:
            base = os.path.join(tmp, f"e2e-{n}-{r}-{method}")
            root, out = os.path.join(base, "spill"), os.path.join(base, "out.zarr")
            os.makedirs(root)
            t = time.perf_counter()
            pool.map(_rank_task, [(method, k, world, n, root) for k in range(world)])
            got[method]["write"].append(time.perf_counter() - t)
            if method == "spillmerge":
                t = time.perf_counter()
                spillmerge.merge(root, out, progress=False)
                got[method]["merge"].append(time.perf_counter() - t)
                written = tree_bytes(Path(root)) + tree_bytes(Path(out))
                took, check = pool.map(_read_task, [(method, out, n)])[0]
            else:
                got[method]["merge"].append(0.0)
                written = tree_bytes(Path(root))
                took, check = pool.map(_read_task, [(method, root, n)])[0]
            got[method]["read"].append(took)
            got[method]["bytes"].append(written)
            checks.add(check)
            shutil.rmtree(base)
    assert len(checks) == 1, "the two methods read back different values"
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in got.items()}
    total = {m: med[m]["write"] + med[m]["merge"] + med[m]["read"] for m in med}
    s, p = med["spillmerge"], med["parquet"]
    return [
        f"| end to end, {n:,} keys, W={world} | spillmerge: write {s['write']:.2f} s + merge {s['merge']:.2f} s + read "
        f"{s['read']:.2f} s = {total['spillmerge']:.2f} s; {s['bytes'] / 2**20:.0f} MiB written | Parquet per rank + "
        f"polars: write {p['write']:.2f} s + read {p['read']:.2f} s = {total['parquet']:.2f} s; {p['bytes'] / 2**20:.0f} MiB "
        f"written | **{total['spillmerge'] / total['parquet']:.2f}×** | ≤ 1× |"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20000, help="rows of the per-row / per-batch measurements")
    ap.add_argument("--e2e", type=int, nargs="*", default=[100000], help="keys of the end-to-end runs")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.e2e, args.repeats = 2000, [4000], 1
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench-write-", dir=os.environ.get("BENCH_TMP"))
    lines = ["| what | spillmerge | baseline (same run) | ratio | target |", "|---|---|---|---|---|"]
    try:
        if args.rows:  # --rows 0: the end-to-end runs only
            lines += bench_rows(args.rows, args.repeats, tmp)
        if args.e2e:
            with mp.get_context("spawn").Pool(args.world) as pool:
                for n in args.e2e:
                    lines += bench_e2e(n, args.world, args.repeats, tmp, pool)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"rows: {args.rows:,}, repeats: {args.repeats} (medians), torch threads 1, {os.cpu_count()} CPUs")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
