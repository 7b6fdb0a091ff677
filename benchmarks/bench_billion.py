"""Toward a billion rows (issue 24): merge memory per process flat in the number of keys.

    python benchmarks/bench_billion.py --n 1000000 10000000 --parts 1 2 4 --before-n 1000000 \\
        --out benchmarks/results/2026-11-24-plan-billion --workdir /tmp/h-plan/bench
    python benchmarks/bench_billion.py --quick          # N = 20,000 with a tiny plan budget: does it work

Every key ``images/NNNNNNNNN.jpg`` has one frame ``{"emb": fp16[64], "label": int64 (0-d),
"caption": str}`` (about 150 bytes). W=4 writer processes (no process group: each is given its
rank) write their keys, dealt round-robin, with ``SpillWriter.write_batch`` in batches of 4,096.
Then, each in fresh processes (a fork server that imported torch and spillmerge; one torch
thread each):

- ``merge``: ``spillmerge.merge(root, out)`` with the default budgets: wall time, phases, peak
  extra anonymous memory (RssAnon + RssShmem sampled every 5 ms; file-mapped pages are reported
  apart as peak file-mapped), objects and bytes written.
- ``before`` (only at ``--before-n``): the same merge with ``plan_budget`` = 1 TiB (a checkout
  whose plan depends on the budget plans in memory then).
- ``parts P``: P processes run ``merge(part=(i, P))`` at once, then one ``finalize``; wall from
  the first start to the finalize's end, the largest part's peak memory, and which processes read
  a plan another one built (``mapped``).

Quote ratios from one run: other engineers' jobs share the 2-core VM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import MiB, PeakMemory, context  # noqa: E402

W = 4
BATCH = 4096
EMB = 64
TIB = 1 << 40


def key_name(i: int) -> str:
    return f"images/{i:09d}.jpg"


def spill_rank(root: str, n: int, world: int, rank: int, session_keys: int | None) -> dict[str, Any]:
    """One writer: its keys in batches with ``write_batch``, in one writer session (segment), or
    a new session every ``session_keys`` keys (bounded segments)."""
    import spillmerge

    torch.set_num_threads(1)
    keys = np.arange(rank, n, world, dtype=np.int64)
    per = session_keys or len(keys) or 1
    mem = PeakMemory()
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, max(len(keys), 1), per):
        with spillmerge.SpillWriter(root, rank=rank, world_size=world) as w:
            for a in range(s, min(s + per, len(keys)), BATCH):
                idx = keys[a : min(a + BATCH, s + per)]
                emb = torch.from_numpy((idx[:, None] % 1000 + np.arange(EMB)[None, :]).astype(np.float16))
                w.write_batch(
                    [key_name(int(i)) for i in idx],
                    {"emb": emb, "label": torch.from_numpy(idx % 1000),
                     "caption": [f"a photo, number {i}" for i in idx]},
                )  # fmt: skip
    wall = time.perf_counter() - t0
    return {"ok": True, "wall_s": wall, "cpu_s": time.process_time() - c0, "anon": mem.stop()["anon"]}


def merge_one(root: str, out: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    import spillmerge

    torch.set_num_threads(1)
    mem = PeakMemory()
    t0, c0 = time.perf_counter(), time.process_time()
    rep = spillmerge.merge(root, out, progress=False, **kwargs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = mem.stop()
    return {
        "ok": True, "wall_s": wall, "cpu_s": cpu, "anon": peak["anon"], "file": peak["file"], "phases": rep.phases,
        "anon_at_s": peak["anon_at_s"],
        "n_frames": rep.n_frames, "notes": rep.notes,
    }  # fmt: skip


def open_lookup(out: str, n: int) -> dict[str, Any]:
    """In a fresh process: ``spillmerge.open`` and 200 lookups of random filenames (cold blocks:
    random keys rarely share one), each ``res[f]`` timed alone."""
    import statistics

    import spillmerge

    t = time.perf_counter()
    res = spillmerge.open(out)
    t_open = time.perf_counter() - t
    rng = np.random.default_rng(1)
    lookup = []
    for i in rng.integers(0, n, 200).tolist():
        t = time.perf_counter()
        v = res[key_name(i)]
        lookup.append(time.perf_counter() - t)
        if int(np.asarray(v["label"][0])) != i % 1000:
            return {"ok": False, "error": f"{key_name(i)}: wrong label"}
    return {"ok": True, "open_s": t_open, "lookup_ms_median": statistics.median(lookup) * 1e3,
            "lookup_ms_p90": sorted(lookup)[179] * 1e3}  # fmt: skip


def _parallel(fn: Any, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``fn(**job)`` for every job at once, each in a fresh process."""
    ctx = context()
    results = [f"/tmp/bench-billion-{os.getpid()}-{i}-{time.time_ns()}.json" for i in range(len(jobs))]
    procs = [ctx.Process(target=_child, args=(fn, job, res)) for job, res in zip(jobs, results, strict=True)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out = []
    for p, res in zip(procs, results, strict=True):
        try:
            out.append(json.loads(Path(res).read_text()))
            os.unlink(res)
        except (FileNotFoundError, json.JSONDecodeError):
            out.append({"ok": False, "error": f"exit code {p.exitcode}"})
    return out


def _child(fn: Any, kwargs: dict[str, Any], result: str) -> None:
    import traceback

    try:
        out = fn(**kwargs)
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = {"ok": False, "error": traceback.format_exc(limit=8)}
    Path(result).write_text(json.dumps(out))


def _objects(path: str) -> tuple[int, int]:
    n = size = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            n += 1
            size += os.stat(os.path.join(dirpath, f)).st_size
    return n, size


def _check(out: str, n: int) -> bool:
    """A few keys read back equal to what was written."""
    import spillmerge

    res = spillmerge.open(out)
    for i in (0, n // 3, n - 1):
        v = res[key_name(i)]
        emb = np.asarray(v["emb"][0])
        if int(np.asarray(v["label"][0])) != i % 1000 or v["caption"][0] != f"a photo, number {i}":
            return False
        if not np.array_equal(emb, (i % 1000 + np.arange(EMB)).astype(np.float16)):
            return False
    return len(res.filenames) == n


def run_n(n: int, args: argparse.Namespace, log: Any, save: Any) -> dict[str, Any]:
    work = Path(args.workdir) / f"n{n}"
    root = str(work / "spill")
    spilled = work / "spill.json"
    if args.reuse_spill and spilled.exists():  # a spill root kept by an earlier --keep-spill run
        row: dict[str, Any] = {**json.loads(spilled.read_text()), "merges": {}}
        log(f"N={n}: reusing the spill root of {row['spill_s']:.1f} s ({row['spill_objects']} objects)")
    else:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        t0 = time.perf_counter()
        ranks = _parallel(
            spill_rank,
            [{"root": root, "n": n, "world": W, "rank": r, "session_keys": args.session_keys} for r in range(W)],
        )
        spill_wall = time.perf_counter() - t0
        if not all(r["ok"] for r in ranks):
            raise RuntimeError(ranks)
        spill_objects, spill_bytes = _objects(root)
        log(f"N={n}: spill {spill_wall:.1f} s ({spill_objects} objects, {spill_bytes / MiB:.0f} MiB)")
        row = {"n": n, "spill_s": spill_wall, "spill_rank_s": max(r["wall_s"] for r in ranks),
               "spill_cpu_s": sum(r["cpu_s"] for r in ranks),
               "spill_objects": spill_objects, "spill_bytes": spill_bytes, "merges": {}}  # fmt: skip
        spilled.write_text(json.dumps({k: v for k, v in row.items() if k != "merges"}))
    save(row)
    if args.spill_only:
        return row
    variants: list[tuple[str, dict[str, Any]]] = [("merge", dict(args.merge_kwargs))]
    if n in args.before_n:
        variants.insert(0, ("before (in-memory plan)", {**args.merge_kwargs, "plan_budget": TIB}))
    for label, kw in variants:
        out = str(work / "out")
        (res,) = _parallel(merge_one, [{"root": root, "out": out, "kwargs": kw}])
        if not res["ok"]:
            raise RuntimeError(res)
        res["objects"], res["bytes"] = _objects(out)
        res["checked"] = _check(out, n)
        if label == "merge":
            (res["open_lookup"],) = _parallel(open_lookup, [{"out": out, "n": n}])
        row["merges"][label] = res
        log(f"N={n}: {label} {res['wall_s']:.1f} s, peak anon {res['anon'] / MiB:.0f} MiB, ok={res['checked']}")
        shutil.rmtree(out)
        save(row)
    if n in args.parts_n:
        for p in [p for p in args.parts if p > 1]:
            out = str(work / "out")
            t = time.perf_counter()
            parts = _parallel(
                merge_one,
                # timeout: parts wait for the plan another part stores (older code: the commit
                # barrier only, which is met at once)
                [{"root": root, "out": out, "kwargs": {**args.merge_kwargs, "part": (i, p), "timeout": 3600}}
                 for i in range(p)],
            )  # fmt: skip
            parts_wall = time.perf_counter() - t
            (fin,) = _parallel(
                merge_one,
                [{"root": root, "out": out, "kwargs": {**args.merge_kwargs, "finalize": True, "timeout": 3600}}],
            )
            if not all(r["ok"] for r in [*parts, fin]):
                raise RuntimeError([*parts, fin])
            objects, size = _objects(out)
            res = {"wall_s": time.perf_counter() - t, "parts_s": parts_wall, "finalize_s": fin["wall_s"],
                   "anon": max(r["anon"] for r in [*parts, fin]), "file": max(r["file"] for r in [*parts, fin]),
                   "part_phases": [r["phases"] for r in parts], "finalize_phases": fin["phases"],
                   "mapped": [any(s in n for n in r["notes"] for s in ("was mapped, not rebuilt", "was read, not rebuilt"))
                              for r in [*parts, fin]],
                   "anon_each": [r["anon"] for r in [*parts, fin]],
                   "objects": objects, "bytes": size, "checked": _check(out, n)}  # fmt: skip
            row["merges"][f"parts {p}"] = res
            log(f"N={n}: parts {p}: {res['wall_s']:.1f} s (parts {parts_wall:.1f} s), ok={res['checked']}")
            shutil.rmtree(out)
            save(row)
    if not args.keep_spill:
        shutil.rmtree(work)
    return row


def _cpu_text(r: dict[str, Any], m: dict[str, Any]) -> str:
    """Process CPU time per key, spill (all writers) + merge (its threads too); the load on a
    shared VM moves wall time more than CPU time."""
    if "cpu_s" not in m or "spill_cpu_s" not in r:
        return "-"
    sp, mg = r["spill_cpu_s"] / r["n"] * 1e6, m["cpu_s"] / r["n"] * 1e6
    return f"{sp + mg:.1f} us ({sp:.1f}, {mg:.1f})"


def _phases(ph: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in ph.items() if v >= 0.05)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, runtime: float, log_lines: list[str]) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    load = os.getloadavg()[0]
    lines = [
        "# Toward a billion rows (issue 24): the merge in bounded memory, 2026-11-24",
        "",
        f"Command: `python benchmarks/bench_billion.py {' '.join(sys.argv[1:])}`",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, numpy {np.__version__}, spillmerge commit {commit}, load {load:.2f} "
        "(other engineers' jobs share the VM: quote ratios)",
        "",
        f"N keys x 1 frame of {{emb fp16[{EMB}], label int64, caption str}}, W={W} writers with write_batch "
        f"({BATCH} per batch), "
        + (f"a new writer session every {args.session_keys:,} keys" if args.session_keys else "one session per writer")
        + ", one merge process unless parts.",
        "",
        "| N | merge | wall (s) | spill + merge per key | CPU per key (spill, merge) | peak extra anon | "
        "peak file-mapped | objects | output | phases (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for label, m in r["merges"].items():
            per_key = (r["spill_s"] + m["wall_s"]) / r["n"] * 1e6
            cpu = _cpu_text(r, m)
            ph = m.get("phases") or m.get("finalize_phases") or {}
            if "part_phases" in m:
                ph_s = (
                    f"parts {m['parts_s']:.1f}, finalize {m['finalize_s']:.1f}; part 0: {_phases(m['part_phases'][0])}"
                    + (f"; part 1: {_phases(m['part_phases'][1])}" if len(m["part_phases"]) > 1 else "")
                    + f"; finalize: {_phases(m['finalize_phases'])}"
                    + (f"; plan mapped by {sum(m['mapped'])} of {len(m['mapped'])}" if "mapped" in m else "")
                    + (
                        "; peak anon per process (parts, finalize): "
                        + "/".join(f"{a / MiB:.0f}" for a in m["anon_each"]) + " MiB"
                        if "anon_each" in m else ""
                    )
                )
            else:
                ph_s = _phases(ph) + (f"; anon peak at {m['anon_at_s']:.1f} s" if "anon_at_s" in m else "")
            lines.append(
                f"| {r['n']:,} | {label} | {m['wall_s']:.1f} | {per_key:.1f} us | {cpu} | {m['anon'] / MiB:.0f} MiB | "
                f"{m['file'] / MiB:.0f} MiB | {m['objects']:,} | {m['bytes'] / MiB:.0f} MiB | {ph_s} |"
            )
    opened = [(r["n"], r["merges"]["merge"]["open_lookup"]) for r in rows
              if r["merges"].get("merge", {}).get("open_lookup", {}).get("ok")]  # fmt: skip
    if opened:
        lines += ["", "| N | `open` (fresh process) | lookup `res[f]` median | p90 | targets |"]
        lines.append("|---|---|---|---|---|")
        for n, o in opened:
            lines.append(f"| {n:,} | {o['open_s']:.3f} s | {o['lookup_ms_median']:.2f} ms | {o['lookup_ms_p90']:.2f} ms "
                         "| <= 1 s, <= 5 ms |")  # fmt: skip
    lines += ["", "| N | spill (4 writers) | spill objects | spill bytes |", "|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['n']:,} | {r['spill_s']:.1f} s | {r['spill_objects']:,} | {r['spill_bytes'] / MiB:.0f} MiB |"
        )
    by_n = {r["n"]: r for r in rows}
    if len(rows) >= 2 and all("merge" in r["merges"] for r in (rows[0], rows[-1])):
        lo, hi = rows[0], rows[-1]
        ml, mh = lo["merges"]["merge"], hi["merges"]["merge"]
        tl = (lo["spill_s"] + ml["wall_s"]) / lo["n"]
        th = (hi["spill_s"] + mh["wall_s"]) / hi["n"]
        lines += [
            "",
            "| ratio | value | target |",
            "|---|---|---|",
            f"| merge peak anon, N={hi['n']:,} / N={lo['n']:,} | {mh['anon'] / max(ml['anon'], 1):.2f}x | <= 1.10x |",
            f"| spill + merge per key, N={hi['n']:,} / N={lo['n']:,} | {th / tl:.2f}x | <= 1.2x |",
        ]
        if "cpu_s" in ml and "cpu_s" in mh and "spill_cpu_s" in lo and "spill_cpu_s" in hi:
            cl = (lo["spill_cpu_s"] + ml["cpu_s"]) / lo["n"]
            ch = (hi["spill_cpu_s"] + mh["cpu_s"]) / hi["n"]
            lines.append(f"| spill + merge CPU per key, N={hi['n']:,} / N={lo['n']:,} | {ch / cl:.2f}x | |")
            lines.append(f"| merge CPU per key, N={hi['n']:,} / N={lo['n']:,} | "
                         f"{mh['cpu_s'] / hi['n'] / (ml['cpu_s'] / lo['n']):.2f}x | |")  # fmt: skip
        for p in args.parts:
            key = "merge" if p == 1 else f"parts {p}"
            if key in hi["merges"]:
                lines.append(f"| merge wall, {p} part(s) / 1 at N={hi['n']:,} | "
                             f"{hi['merges'][key]['wall_s'] / mh['wall_s']:.2f}x | |")  # fmt: skip
    for n in args.before_n:
        if n in by_n and {"before (in-memory plan)", "merge"} <= by_n[n]["merges"].keys():
            b, a = by_n[n]["merges"]["before (in-memory plan)"], by_n[n]["merges"]["merge"]
            lines.append(f"| after / before at N={n:,}: peak anon | {a['anon'] / max(b['anon'], 1):.2f}x | |")
            lines.append(f"| after / before at N={n:,}: merge wall | {a['wall_s'] / b['wall_s']:.2f}x | |")
    lines += ["", f"Runtime {runtime:.0f} s.", "", "<details><summary>progress</summary>", "", "```", *log_lines,
              "```", "</details>", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument(
        "--parts-n", type=int, nargs="*", default=None, help="N at which to run the parts (default: largest)"
    )
    ap.add_argument("--before-n", type=int, nargs="*", default=None, help="N at which to also run the in-memory plan")
    ap.add_argument("--plan-budget", type=int, default=None)
    ap.add_argument("--memory-budget", type=int, default=None, help="merge(memory_budget=): the copy's chunks in flight")
    ap.add_argument(
        "--session-keys",
        type=int,
        default=None,
        help="each writer starts a new session (segment) every this many keys (default: one session)",
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--spill-only", action="store_true", help="spill and keep the roots (implies --keep-spill)")
    ap.add_argument("--keep-spill", action="store_true", help="keep <workdir>/n<N>/spill for --reuse-spill")
    ap.add_argument("--reuse-spill", action="store_true", help="merge the spill roots an earlier run kept")
    ap.add_argument("--out", default=None)
    ap.add_argument("--workdir", default="/tmp/bench-billion")
    args = ap.parse_args()
    if args.quick:
        args.n, args.plan_budget = [20_000, 40_000], 1 << 20
    args.keep_spill = args.keep_spill or args.spill_only
    args.parts_n = [max(args.n)] if args.parts_n is None else args.parts_n
    args.before_n = [min(args.n)] if args.before_n is None else args.before_n
    args.merge_kwargs = {} if args.plan_budget is None else {"plan_budget": args.plan_budget}
    if args.memory_budget is not None:
        args.merge_kwargs["memory_budget"] = args.memory_budget
    log_lines: list[str] = []

    def log(msg: str) -> None:
        line = f"{datetime.datetime.now(datetime.UTC):%H:%M:%S} {msg} (load {os.getloadavg()[0]:.1f})"
        log_lines.append(line)
        print(line, flush=True)

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []

    def save(row: dict[str, Any]) -> None:
        """Results so far, written after every step (a run cut short still reports what it did)."""
        done = [r for r in rows if r is not row] + [row]
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            Path(args.out, "README.md").write_text(report(done, args, time.perf_counter() - t0, log_lines))
            Path(args.out, "results.json").write_text(json.dumps(done, indent=1, default=str))

    for n in args.n:
        rows.append(run_n(n, args, log, save))
        save(rows[-1])
    print(report(rows, args, time.perf_counter() - t0, log_lines))


if __name__ == "__main__":
    main()
