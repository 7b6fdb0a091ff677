"""Ragged predictions (issue 14): detection outputs and token sequences, spillmerge vs gather_object.

    python benchmarks/bench_ragged.py                             # W=4, P=1 GiB per workload, 3 repeats
    python benchmarks/bench_ragged.py --payload 256MiB --repeats 3
    python benchmarks/bench_ragged.py --quick                     # P=16 MiB, 1 repeat: does it work

Two workloads of about P bytes of values each, frames of files of ``--frames-per-file`` frames,
shuffled and dealt to W ranks:

- ``detection``: ``{"boxes": float32 (k, 4), "scores": float32 (k,), "labels": int64 (k,)}``, k
  uniform in 0..100 (28 bytes per box, ~1.4 KB per frame);
- ``tokens``: ``{"tokens": int64 (L,)}``, L uniform in 1..2048 (~8 KB per frame).

Every value is distinct (pool slices stamped with the frame's global number) and already in CPU
memory when the clock starts (after a barrier). Methods, each in fresh processes (W gloo ranks on
loopback), alternated and rotated repeat by repeat:

- ``spillmerge``: ``SpillWriter`` on every rank, ``w.write`` per frame, then ``w.merge(out)``
  (the merge runs on rank 0; wall time on rank 0 from the barrier until the merged store is
  complete and synced);
- ``gather_object``: ``dist.gather_object`` of each rank's dict ``{filename: {frame: value}}`` to
  rank 0 (the call alone: nothing is written, which favours it).

Columns: rank 0's wall time (median and every run), rank 0's peak extra anonymous memory
(RssAnon + RssShmem sampled every 5 ms, minus the value at the barrier, so the predictions a rank
already holds are not counted) and the other ranks' maximum. After the clock stops, rank 0 checks
the merged store (row count, 500 sampled rows through ``res[filename][leaf][i]``, and the same rows
through ``res.column(leaf)`` where this build has it) and gather_object's result (every frame
present). Every process calls ``torch.set_num_threads(1)``. Quote ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import MiB, PeakMemory, fmt_size, parse_size, run_ranks  # noqa: E402

METHODS = ["spillmerge", "gather_object"]
WORKLOADS = ["detection", "tokens"]
MEAN_BYTES = {"detection": 50 * 28, "tokens": 1024.5 * 8}
POOL = 4096


# ---------------------------------------------------------------------------------- workload
def n_frames(workload: str, payload: int) -> int:
    return max(1, int(payload / MEAN_BYTES[workload]))


def key(g: int, per_file: int) -> tuple[str, int]:
    return f"videos/clip_{g // per_file:05d}.mp4", g % per_file


def _pools() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "boxes": torch.rand((POOL, 4), generator=gen) * 640,
        "scores": torch.rand((POOL,), generator=gen),
        "labels": torch.randint(0, 91, (POOL,), generator=gen),
        "tokens": torch.randint(0, 50_000, (POOL,), generator=gen),
    }


def value(workload: str, g: int, pools: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The prediction of global frame ``g``: a function of ``g`` only (for verification)."""
    s = (g * 31) % 997
    if workload == "detection":
        k = (g * 7919 + 13) % 101
        boxes = pools["boxes"][s : s + k].clone()
        boxes[:, 0] = float(g)  # exact in float32 below 2**24
        return {
            "boxes": boxes,
            "scores": pools["scores"][s : s + k].clone(),
            "labels": pools["labels"][s : s + k].clone(),
        }
    n = 1 + (g * 7919 + 13) % 2048
    tokens = pools["tokens"][s : s + n].clone()
    tokens[0] = g
    return {"tokens": tokens}


def frames_of(rank: int, world: int, m: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(m)[rank::world]


# ---------------------------------------------------------------------------------- processes
def _check_store(out: str, cfg: dict[str, Any], pools: dict[str, torch.Tensor]) -> bool:
    import spillmerge

    res = spillmerge.open(out)
    m, per_file = cfg["m"], cfg["per_file"]
    if res.header["n_frames"] != m:
        return False
    rng = np.random.default_rng(1)
    sample = rng.choice(m, size=min(500, m), replace=False)
    for g in sample.tolist():
        name, f = key(g, per_file)
        want = value(cfg["workload"], g, pools)
        got = res[name]
        for leaf, t in want.items():
            v = np.asarray(got[leaf][f])
            if v.dtype != t.numpy().dtype or v.shape != tuple(t.shape) or v.tobytes() != t.numpy().tobytes():
                return False
    if hasattr(res, "column"):  # rows are in (filename, frame) order = global frame order here
        leaf = "boxes" if cfg["workload"] == "detection" else "tokens"
        col = res.column(leaf)
        for g in sample[:100].tolist():
            t = value(cfg["workload"], g, pools)[leaf]
            if np.asarray(col[g]).tobytes() != t.numpy().tobytes():
                return False
    return True


def rank_main(rank: int, world: int, port: int, method: str, cfg: dict[str, Any], result: str) -> None:
    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pools = _pools()
    mine = frames_of(rank, world, cfg["m"]).tolist()
    preds: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for g in mine:
        name, f = key(g, cfg["per_file"])
        preds.setdefault(name, {})[f] = value(cfg["workload"], g, pools)
    out = f"{cfg['work']}/out.zarr"
    dist.barrier()
    mem = PeakMemory()
    t0 = time.perf_counter()
    ok = True
    if method == "spillmerge":
        with spillmerge.SpillWriter(f"{cfg['work']}/spill") as w:
            for name, frames in preds.items():
                for f, v in frames.items():
                    w.write(name, f, v)
        w.merge(out, progress=False)
    else:
        parts: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(preds, parts, dst=0)
    wall = time.perf_counter() - t0
    peak = mem.stop()
    if rank == 0:  # after the clock
        if method == "spillmerge":
            ok = _check_store(out, cfg, pools)
        else:
            assert parts is not None
            ok = sum(len(fr) for p in parts for fr in p.values()) == cfg["m"]
    with open(f"{result}.{rank}", "w") as fh:
        json.dump({"wall_s": wall, "anon": peak["anon"], "ok": ok}, fh)
    dist.barrier()
    dist.destroy_process_group()


def run_method(method: str, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return run_ranks(rank_main, method, world, cfg, cfg["timeout"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--payload", default="1GiB", help="bytes of values per workload (about)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--frames-per-file", type=int, default=64)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--quick", action="store_true", help="P = 16 MiB, 1 repeat")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out-md", default=None, help="also write the tables to this file")
    args = ap.parse_args()
    if args.quick:
        args.payload, args.repeats = "16MiB", 1
    payload = parse_size(args.payload)
    workdir = args.workdir or tempfile.mkdtemp(prefix="spillmerge-ragged-")
    lines: list[str] = []
    try:
        for wl in [w for w in WORKLOADS if w in args.workloads.split(",")]:
            m = n_frames(wl, payload)
            cfg = {
                "workload": wl,
                "m": m,
                "per_file": args.frames_per_file,
                "workdir": workdir,
                "timeout": args.timeout,
            }
            rows: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in METHODS}
            for rep in range(args.repeats):
                k = rep % len(METHODS)
                for meth in METHODS[k:] + METHODS[:k]:
                    res = run_method(meth, args.world, cfg)
                    rows[meth].append(res)
                    msg = "FAILED " + res[0]["error"] if "error" in res[0] else f"{res[0]['wall_s']:.2f} s"
                    print(f"  {wl} repeat {rep + 1} {meth}: {msg}", file=sys.stderr, flush=True)
            first = len(lines)
            lines.append(f"\n### {wl}: {m:,} frames (~{fmt_size(payload)}), {args.frames_per_file} frames per file, "
                         f"W={args.world} gloo ranks, median of {args.repeats} (alternated)\n")  # fmt: skip
            lines.append("| method | rank 0 wall (median) | runs (s) | vs gather_object | rank-0 peak extra anon "
                         "| other ranks (max) | verified |")  # fmt: skip
            lines.append("|---|---|---|---|---|---|---|")
            med: dict[str, float] = {}
            for meth in METHODS:
                ok = [r for r in rows[meth] if "error" not in r[0]]
                walls = [r[0]["wall_s"] for r in ok]
                med[meth] = statistics.median(walls) if walls else float("nan")
            for meth in METHODS:
                ok = [r for r in rows[meth] if "error" not in r[0]]
                walls = [r[0]["wall_s"] for r in ok]
                a0 = max((r[0]["anon"] for r in ok), default=0)
                ao = max((x["anon"] for r in ok for x in r[1:]), default=0)
                ver = all(r[0]["ok"] for r in ok) and len(ok) == len(rows[meth])
                lines.append(f"| {meth} | {med[meth]:.2f} s | {', '.join(f'{w:.2f}' for w in walls)} | "
                             f"{med[meth] / med['gather_object']:.2f}x | {a0 / MiB:.0f} MiB ({a0 / payload:.2f}x P) | "
                             f"{ao / MiB:.0f} MiB | {'yes' if ver else 'NO'} |")  # fmt: skip
            lines.append(f"\ngather_object / spillmerge: {med['gather_object'] / med['spillmerge']:.2f}x")
            print("\n".join(lines[first:]), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out_md:
        Path(args.out_md).write_text(f"Command: `{' '.join(sys.argv)}`\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
