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
  filename and both columns whole (``res.column(leaf)[:]``). Against: each rank streams one
  Parquet file with ``pyarrow.parquet.ParquetWriter`` (filename, logits
  ``fixed_size_list<float16>[1000]``, emb [512]), a row group of 65,536 rows written as it comes
  (what a user would hand-write: one ``pq.write_table`` of a rank's whole table held ~3.9 GiB a
  rank at 1M keys), fsync; then polars reads the W files whole and turns both columns into
  numpy. Bytes written: the spill plus the output for spillmerge, the W files for Parquet. Peak
  extra anonymous memory (sampled every 5 ms, over what the process held before): the largest
  rank while writing (its rows, already in memory, are not counted), the merging process, the
  reading process.

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
from common import PeakMemory, tree_bytes  # noqa: E402

LOGITS, EMB, POOL_ROWS, BATCH, ROW_GROUP = 1000, 512, 257, 256, 65536


def key_name(i: int) -> str:
    return f"images/{i:07d}.jpg"


def rows(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lp, ep = torch.randn((POOL_ROWS, LOGITS), generator=g).half(), torch.randn((POOL_ROWS, EMB), generator=g).half()
    sel = torch.from_numpy(idx % POOL_ROWS)
    return lp[sel].contiguous(), ep[sel].contiguous()


# ----------------------------------------------------------------------------- per row / batch
def hand_rows(logits: torch.Tensor, emb: torch.Tensor) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of the hand-written row copy."""
    n = len(logits)
    buf = np.empty(n * 2 * (LOGITS + EMB), np.uint8)
    c = time.process_time()
    t = time.perf_counter()
    off = 0
    for i in range(n):
        a = logits[i].numpy().view(np.uint8)
        buf[off : off + a.size] = a
        off += a.size
        b = emb[i].numpy().view(np.uint8)
        buf[off : off + b.size] = b
        off += b.size
    return time.perf_counter() - t, time.process_time() - c


def hand_batches(logits: torch.Tensor, emb: torch.Tensor) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of the hand-written batch copy."""
    n, width = len(logits), 2 * (LOGITS + EMB)
    buf = np.empty((n, width), np.uint8)
    c = time.process_time()
    t = time.perf_counter()
    for s in range(0, n, BATCH):
        e = min(n, s + BATCH)
        buf[s:e, : 2 * LOGITS] = logits[s:e].numpy().view(np.uint8)
        buf[s:e, 2 * LOGITS :] = emb[s:e].numpy().view(np.uint8)
    return time.perf_counter() - t, time.process_time() - c


def spill(
    names: list[str], logits: torch.Tensor, emb: torch.Tensor, batched: bool, root: str
) -> tuple[float, float, float]:
    """(seconds in the write loop, seconds of the commit, process CPU seconds of the loop: the
    caller's thread and the flush thread)."""
    import spillmerge

    with spillmerge.SpillWriter(root, 0, 1) as w:
        c = time.process_time()
        t = time.perf_counter()
        if batched:
            for s in range(0, len(names), BATCH):
                w.write_batch(names[s : s + BATCH], {"logits": logits[s : s + BATCH], "emb": emb[s : s + BATCH]})
        else:
            for i, name in enumerate(names):
                w.write(name, 0, {"logits": logits[i], "emb": emb[i]})
        loop = time.perf_counter() - t
        cpu = time.process_time() - c
    return loop, time.perf_counter() - t - loop, cpu


def bench_rows(n: int, repeats: int, tmp: str) -> list[str]:
    names = [key_name(i) for i in range(n)]
    logits, emb = rows(np.arange(n))
    kinds = ("hand_row", "write", "write_commit", "hand_batch", "batch", "batch_commit")
    got: dict[str, list[float]] = {k: [] for k in kinds + tuple(f"{k}_cpu" for k in kinds)}
    for r in range(repeats):
        order = ["row", "batch"] if r % 2 == 0 else ["batch", "row"]
        for kind in order:
            root = os.path.join(tmp, f"rows-{r}-{kind}")
            hand, ours = ("hand_row", "write") if kind == "row" else ("hand_batch", "batch")
            wall, cpu = (hand_rows if kind == "row" else hand_batches)(logits, emb)
            got[hand].append(wall)
            got[f"{hand}_cpu"].append(cpu)
            loop, commit, cpu = spill(names, logits, emb, kind == "batch", root)
            got[ours].append(loop)
            got[f"{ours}_commit"].append(commit)
            got[f"{ours}_cpu"].append(cpu)
            shutil.rmtree(root)
    m = {k: statistics.median(v) / n * 1e6 for k, v in got.items() if v}
    # the same repeat's pair, ratio by ratio: the quietest pair is the one whose hand copy was fastest
    per = {
        ours: [o / h for o, h in zip(got[ours], got[hand], strict=True)]
        for ours, hand in (("write", "hand_row"), ("batch", "hand_batch"))
    }
    quiet = {
        ours: per[ours][int(np.argmin(got[hand]))] for ours, hand in (("write", "hand_row"), ("batch", "hand_batch"))
    }

    def line(what: str, ours: str, hand: str, label: str) -> str:
        return (
            f"| {what} | {m[ours]:.2f} µs (+ commit {m[ours + '_commit']:.2f}); CPU {m[ours + '_cpu']:.2f} µs | "
            f"{label} {m[hand]:.2f} µs; CPU {m[hand + '_cpu']:.2f} µs | **{m[ours] / m[hand]:.2f}×** (per repeat "
            f"{', '.join(f'{x:.2f}' for x in per[ours])}; quietest {quiet[ours]:.2f}×; CPU "
            f"{m[ours + '_cpu'] / m[hand + '_cpu']:.2f}×) | ≤ 4× |"
        )

    return [
        line("`write()` per row", "write", "hand_row", "hand row copy"),
        line("`write_batch(256)` per row", "batch", "hand_batch", "hand batch copy"),
    ]


# ---------------------------------------------------------------------------------- end to end
def _rank_task(args: tuple[str, int, int, int, str]) -> tuple[float, int]:
    """(seconds, peak extra anonymous bytes) of one rank writing its keys."""
    method, rank, world, n, root = args
    torch.set_num_threads(1)
    idx = np.arange(rank, n, world)
    names = [key_name(int(i)) for i in idx]
    logits, emb = rows(idx)
    import pyarrow as pa  # imports before the clock starts
    import pyarrow.parquet as pq

    import spillmerge

    mem = PeakMemory()
    t = time.perf_counter()
    if method == "spillmerge":
        with spillmerge.SpillWriter(root, rank, world) as w:
            for s in range(0, len(names), BATCH):
                w.write_batch(names[s : s + BATCH], {"logits": logits[s : s + BATCH], "emb": emb[s : s + BATCH]})
    else:

        def fsl(t: torch.Tensor) -> Any:
            return pa.FixedSizeListArray.from_arrays(pa.array(t.numpy().reshape(-1)), t.shape[1])

        path = os.path.join(root, f"rank-{rank}.parquet")
        schema = pa.schema(
            [("filename", pa.string()), ("logits", pa.list_(pa.float16(), LOGITS)), ("emb", pa.list_(pa.float16(), EMB))]
        )
        with pq.ParquetWriter(path, schema) as pw:  # one row group at a time: memory of one group
            for s in range(0, len(names), ROW_GROUP):
                e = s + ROW_GROUP
                pw.write_table(pa.table({"filename": names[s:e], "logits": fsl(logits[s:e]), "emb": fsl(emb[s:e])}))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    took = time.perf_counter() - t
    return took, mem.stop()["anon"]


def _read_task(args: tuple[str, str, int]) -> tuple[float, int, int]:
    """(seconds, a check of what was read, peak extra anonymous bytes)."""
    method, path, n = args
    torch.set_num_threads(1)
    import polars as pl  # imports before the clock starts

    import spillmerge

    mem = PeakMemory()
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
    peak = mem.stop()["anon"]
    assert len(names) == n and lg.shape == (n, LOGITS) and em.shape == (n, EMB)
    return took, int(lg.view(np.uint16)[:, 0].astype(np.int64).sum() % 1000), peak


def bench_e2e(n: int, world: int, repeats: int, tmp: str, pool: Any) -> list[str]:
    import spillmerge

    keys = ("write", "merge", "read", "bytes", "write_mem", "merge_mem", "read_mem")
    got: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in ("spillmerge", "parquet")}
    checks = set()
    for r in range(repeats):
        for method in ["spillmerge", "parquet"] if r % 2 == 0 else ["parquet", "spillmerge"]:
            base = os.path.join(tmp, f"e2e-{n}-{r}-{method}")
            root, out = os.path.join(base, "spill"), os.path.join(base, "out.zarr")
            os.makedirs(root)
            load = os.getloadavg()[0]
            t = time.perf_counter()
            ranks = pool.map(_rank_task, [(method, k, world, n, root) for k in range(world)])
            g = got[method]
            g["write"].append(time.perf_counter() - t)
            g["write_mem"].append(max(m for _, m in ranks))
            if method == "spillmerge":
                mem = PeakMemory()
                t = time.perf_counter()
                spillmerge.merge(root, out, progress=False)
                g["merge"].append(time.perf_counter() - t)
                g["merge_mem"].append(mem.stop()["anon"])
                written = tree_bytes(Path(root)) + tree_bytes(Path(out))
                took, check, read_mem = pool.map(_read_task, [(method, out, n)])[0]
            else:
                g["merge"].append(0.0)
                g["merge_mem"].append(0)
                written = tree_bytes(Path(root))
                took, check, read_mem = pool.map(_read_task, [(method, root, n)])[0]
            g["read"].append(took)
            g["read_mem"].append(read_mem)
            g["bytes"].append(written)
            # as it goes: a run killed later (memory at 1M keys) keeps what it measured
            print(
                f"# {n:,} keys, repeat {r}, {method} (load {load:.1f}): write {g['write'][-1]:.2f} s, merge "
                f"{g['merge'][-1]:.2f} s, read {took:.2f} s = {g['write'][-1] + g['merge'][-1] + took:.2f} s, "
                f"{written / 2**20:.0f} MiB written; peak extra anon: rank {g['write_mem'][-1] / 2**20:.0f} MiB, "
                f"merge {g['merge_mem'][-1] / 2**20:.0f} MiB, read {read_mem / 2**20:.0f} MiB",
                flush=True,
            )
            checks.add(check)
            shutil.rmtree(base)
    assert len(checks) == 1, "the two methods read back different values"
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in got.items()}
    total = {m: med[m]["write"] + med[m]["merge"] + med[m]["read"] for m in med}
    # per repeat: spillmerge's total / Parquet's total (the two ran next to each other)
    per = [
        sum(got["spillmerge"][k][i] for k in ("write", "merge", "read"))
        / sum(got["parquet"][k][i] for k in ("write", "merge", "read"))
        for i in range(repeats)
    ]
    s, p = med["spillmerge"], med["parquet"]
    mib = 2**20
    return [
        f"| end to end, {n:,} keys, W={world} | spillmerge: write {s['write']:.2f} s + merge {s['merge']:.2f} s + read "
        f"{s['read']:.2f} s = {total['spillmerge']:.2f} s; {s['bytes'] / mib:.0f} MiB written; peak extra anon "
        f"{s['write_mem'] / mib:.0f} MiB a rank, merge {s['merge_mem'] / mib:.0f} MiB, read {s['read_mem'] / mib:.0f} MiB "
        f"| Parquet per rank (streamed) + polars: write {p['write']:.2f} s + read {p['read']:.2f} s = "
        f"{total['parquet']:.2f} s; {p['bytes'] / mib:.0f} MiB written; peak extra anon {p['write_mem'] / mib:.0f} MiB "
        f"a rank, read {p['read_mem'] / mib:.0f} MiB | **{total['spillmerge'] / total['parquet']:.2f}×** (per repeat "
        f"{', '.join(f'{x:.2f}' for x in per)}) | ≤ 1× |"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20000, help="rows of the per-row / per-batch measurements")
    ap.add_argument("--e2e", type=int, nargs="*", default=[100000], help="keys of the end-to-end runs")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="folder for results.md")
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
    head = f"rows: {args.rows:,}, repeats: {args.repeats} (medians), torch threads 1, {os.cpu_count()} CPUs"
    text = head + f"; load average at the end {os.getloadavg()[0]:.1f}\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.md").write_text(text)


if __name__ == "__main__":
    main()
