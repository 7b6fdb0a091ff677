"""The benchmark suite of issue 6, in one command: gather comparison, targets, overlap, chunk sizes,
codecs, merge processes, and (with --flat) the rank-0 memory flatness check at 4 GiB.

    python benchmarks/suite.py                       # W=4, P=1 GiB, 3 repeats (~12 min, quiet machine)
    python benchmarks/suite.py --flat                # the same plus the 4 GiB flatness check (~+1.5 min)
    python benchmarks/suite.py --parts flat --out benchmarks/results/<earlier run>   # add it later
    python benchmarks/suite.py --payload 128MiB --repeats 1 --out /tmp/smoke          # smoke run

Writes results.md (every table, the machine, the command), chart.png (time and peak memory per
method) and results.json (every raw measurement) into --out (default benchmarks/results/<UTC time>).
Running it again on an existing --out replaces the parts it runs and keeps the others.
See benchmarks/README.md for what each table means and how memory is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gather  # noqa: E402
import bench_parts  # noqa: E402
from common import GiB, MiB, fmt_size, in_process, parse_size  # noqa: E402

ALL_PARTS = ["gather", "overlap", "chunks", "codecs", "procs"]
EXTRA_PARTS = ["flat"]
CHUNK_SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
MERGE_PROCS = [1, 2, 4]
TARGETS = {"raw": 1.25, "gather_object": 3.0, "all_gather_object": 8.0, "merge_anon": 256 * MiB, "overlap": 5.0}

# Seconds per GiB of payload and per repeat (medians seen on the 2-core CI VM kind when quiet),
# used only for the runtime estimate printed at the start.
EST_GATHER_PER_GIB = 85.0  # the 7 methods' work plus frame generation and verification, at W=4
EST_GATHER_START = 5.0  # 7 x starting W processes from the fork server, cleaning up
EST_PER_PROCESS = 1.0  # one fresh process from the fork server


# ------------------------------------------------------------------------------------ helpers
def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def mib(n: float) -> str:
    return f"{n / MiB:.0f} MiB"


def rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / MiB / seconds:.0f} MiB/s" if seconds and seconds == seconds else "-"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine_info(argv: list[str], workdir: str) -> dict:
    import torch
    import zarr

    import spillmerge

    mem = next((int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "spillmerge"],
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
        commit += " (spillmerge/ modified)" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    fs = "?"
    best = ""
    real = os.path.realpath(workdir)
    for line in open("/proc/mounts"):
        dev, mnt, typ = line.split()[:3]
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fs = mnt, f"{typ} on {dev}"
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/suite.py", *argv]),
        "cpu": f"{os.cpu_count()} cores, {cpu}",
        "ram": f"{mem / GiB:.1f} GiB",
        "kernel": platform.release(),
        "workdir_fs": fs,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "zarr": zarr.__version__,
        "numpy": np.__version__,
        "spillmerge": f"{spillmerge.__version__} at {commit}",
        "load": " ".join(open("/proc/loadavg").read().split()[:3]),
    }


def estimate(parts: list[str], a: argparse.Namespace) -> float:
    g = a.payload / GiB
    t = 0.0
    if "gather" in parts:
        t += a.repeats * (EST_GATHER_START * max(1.0, a.world / 4) + EST_GATHER_PER_GIB * g * max(1.0, a.world / 4))
    if "overlap" in parts:
        runs = len(a.overlap_frames) + 1  # sleep at every rate, matmul at the target's rate
        t += runs * (EST_PER_PROCESS + a.repeats * (2 * overlap_steps(a) * a.step_ms / 1000 + 1.5))
    tp = a.table_payload / GiB
    if "chunks" in parts:
        t += len(CHUNK_SIZES) * a.repeats * (EST_PER_PROCESS + 5.0 * tp)
    if "codecs" in parts:
        t += 2 * (EST_PER_PROCESS + 3 * tp) + 2 * 3 * a.repeats * (EST_PER_PROCESS + 8.0 * tp)
    if "procs" in parts:
        t += EST_PER_PROCESS + 3 * g + len(MERGE_PROCS) * (a.repeats * (2 * EST_PER_PROCESS + 3 * g) + 5 * g + 2)
    if "flat" in parts:
        for p in (a.payload, a.flat_payload):
            t += a.flat_repeats * (8.0 + 12.0 * p / GiB)
    return t


def overlap_steps(a: argparse.Namespace) -> int:
    frame = int(np.prod(a.shape)) * 2
    return max(40, min(a.overlap_steps, a.payload // (max(a.overlap_frames) * frame)))


# -------------------------------------------------------------------------------------- parts
def part_gather(a: argparse.Namespace, work: str) -> dict:
    cfg = {"payload": a.payload, "shape": a.shape, "files": 16, "seed": 0, "workdir": work}
    rows = bench_gather.run_all(bench_gather.ALL, a.world, cfg, a.repeats)
    return {"world": a.world, "payload": a.payload, "repeats": a.repeats, "rows": rows}


def part_overlap(a: argparse.Namespace, work: str) -> dict:
    """The sleep loop at every spill rate of --overlap-frames, the matmul loop at the highest (the
    target's rate)."""
    steps = overlap_steps(a)
    out: dict[str, dict[str, dict]] = {"sleep": {}, "matmul": {}}
    runs = [("sleep", n) for n in a.overlap_frames] + [("matmul", max(a.overlap_frames))]
    for kind, n in runs:
        log(f"  overlap ({kind}): {steps} steps of {a.step_ms:g} ms + {n} frames, x{a.repeats} with and without")
        r = in_process(bench_parts.overlap, root=f"{work}/overlap-{kind}-{n}", kind=kind, step_s=a.step_ms / 1000,
                       frames_per_step=n, steps=steps, repeats=a.repeats, shape=a.shape)  # fmt: skip
        out[kind][str(n)] = r
        if r.get("ok"):
            log(f"    {med(r['base_s']):.2f} s -> {med(r['write_s']):.2f} s")
    return out


def part_chunks(a: argparse.Namespace, work: str) -> dict:
    rows: dict[str, list[dict]] = {}
    for rep in range(a.repeats):
        for cb in CHUNK_SIZES:
            d = f"{work}/chunks-{cb}-{rep}"
            r = in_process(
                bench_parts.chunk_run, work=d, payload=a.table_payload, shape=a.shape, chunk_bytes=cb, seed=1
            )
            shutil.rmtree(d, ignore_errors=True)
            rows.setdefault(str(cb), []).append(r)
            log(f"  chunk {mib(cb)} repeat {rep + 1}: spill {r.get('spill_s', float('nan')):.2f} s, "
                f"merge {r.get('merge_s', float('nan')):.2f} s {'ok' if r.get('ok') else 'FAILED'}")  # fmt: skip
    return {"payload": a.table_payload, "rows": rows}


def part_codecs(a: argparse.Namespace, work: str) -> dict:
    available = bench_parts.has_codec()
    codecs = bench_parts.CODECS if available else ["default"]
    out: dict = {"payload": a.table_payload, "available": available, "data": {}}
    for kind in ("random", "smooth"):
        root = f"{work}/codec-{kind}"
        s = in_process(bench_parts.spill, root=root, payload=a.table_payload, shape=a.shape, world=1, kind=kind,
                       chunk_bytes=None, seed=2)  # fmt: skip
        rows: dict[str, list[dict]] = {}
        if s.get("ok"):
            for rep in range(a.repeats):
                for codec in codecs:
                    o = f"{work}/codec-out-{kind}-{codec}"
                    kw = {} if codec == "default" else {"codec": codec}
                    r = in_process(bench_parts.merge_verify, root=root, out=o, payload=a.table_payload, shape=a.shape,
                                   world=1, kind=kind, seed=2, **kw)  # fmt: skip
                    shutil.rmtree(o, ignore_errors=True)
                    rows.setdefault(codec, []).append(r)
                    log(f"  codec {codec} on {kind} repeat {rep + 1}: merge {r.get('merge_s', float('nan')):.2f} s, "
                        f"{r.get('out_bytes', 0) / MiB:.0f} MiB out {'ok' if r.get('ok') else 'FAILED'}")  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
        out["data"][kind] = {"spill": s, "rows": rows}
    return out


def part_procs(a: argparse.Namespace, work: str) -> dict:
    help_text = bench_parts.cli_merge_help()
    available = bench_parts.has_parts(help_text)
    root = f"{work}/procs-spill"
    s = in_process(bench_parts.spill, root=root, payload=a.payload, shape=a.shape, world=a.world, kind="random",
                   chunk_bytes=None, seed=3)  # fmt: skip
    out: dict = {"payload": a.payload, "world": a.world, "available": available, "spill": s, "rows": {}}
    if not s.get("ok"):
        return out
    out["cli_start_s"] = med([bench_parts.cli_start_s() for _ in range(3)])
    counts = MERGE_PROCS if available else [1]
    for rep in range(a.repeats):
        for n in counts:
            o = f"{work}/procs-out-{n}"
            shutil.rmtree(o, ignore_errors=True)
            r = bench_parts.procs_merge(root, o, n, help_text)
            if r["ok"] and rep == 0:  # every process count's output verified once
                r["ok"] = in_process(bench_parts.verify_only, out=o, payload=a.payload, shape=a.shape,
                                     world=a.world, kind="random", seed=3)["ok"]  # fmt: skip
                r["verified"] = True
            shutil.rmtree(o, ignore_errors=True)
            out["rows"].setdefault(str(n), []).append(r)
            log(f"  merge with {n} process(es) repeat {rep + 1}: {r['wall_s']:.2f} s {'ok' if r['ok'] else 'FAILED'}")
    shutil.rmtree(root, ignore_errors=True)
    return out


def part_flat(a: argparse.Namespace, work: str) -> dict:
    rows: dict[str, list[dict]] = {}
    for p in sorted({a.payload, a.flat_payload}):
        cfg = {"payload": p, "shape": a.shape, "files": 16, "seed": 4, "workdir": work, "lazy": True}
        for rep in range(a.flat_repeats):
            res = bench_gather.run_method("spillmerge", a.world, cfg)
            rows.setdefault(str(p), []).append(
                res[0] | {"others_anon": max((x.get("peak_extra", 0) for x in res[1:]), default=0)}
            )
            log(f"  flat {fmt_size(p)} repeat {rep + 1}: rank-0 merge anon peak "
                f"{res[0].get('merge_anon', float('nan')) / MiB:.0f} MiB {'ok' if res[0].get('ok') else 'FAILED'}")  # fmt: skip
    return {"world": a.world, "rows": rows}


PARTS = {"gather": part_gather, "overlap": part_overlap, "chunks": part_chunks, "codecs": part_codecs,
         "procs": part_procs, "flat": part_flat}  # fmt: skip


# ----------------------------------------------------------------------------------- markdown
def ok_runs(runs: list) -> bool:
    return bool(runs) and all(r[0].get("ok") for r in runs)


def gather_stats(g: dict) -> dict[str, dict]:
    """Per method: medians over repeats of rank 0's wall and memory, the others' max memory."""
    out = {}
    for m, runs in g["rows"].items():
        if not ok_runs(runs):
            out[m] = {
                "ok": False,
                "error": next((r[0].get("error") for r in runs if not r[0].get("ok")), "wrong result"),
            }
            continue
        out[m] = {
            "ok": True,
            "wall": med([r[0]["wall_s"] for r in runs]),
            "walls": [r[0]["wall_s"] for r in runs],
            "anon0": med([r[0]["peak_extra"] for r in runs]),
            "file0": med([r[0].get("file_extra", 0) for r in runs]),
            "anon_others": med([max((x["peak_extra"] for x in r[1:]), default=0) for r in runs]),
            "written": med([r[0].get("written", 0) for r in runs]),
            "bytes": runs[0][0].get("bytes") or g["payload"],
            "read": med([r[0]["read_s"] for r in runs]) if "read_s" in runs[0][0] else None,
        }
        if m == "spillmerge":
            for k in ("spill_s", "wait_s", "merge_s", "merge_anon", "merge_file"):
                out[m][k] = med([r[0].get(k, float("nan")) for r in runs])
            out[m]["merge_anon_max"] = max(r[0].get("merge_anon", 0) for r in runs)
            phases = [r[0].get("phases", {}) for r in runs]
            out[m]["phases"] = {k: med([p.get(k, float("nan")) for p in phases]) for k in phases[0]}
    return out


def paired(g: dict, num: str, den: str) -> list[float]:
    """num/den wall ratio within each repeat (same minute of machine drift)."""
    a, b = g["rows"].get(num, []), g["rows"].get(den, [])
    return [x[0]["wall_s"] / y[0]["wall_s"] for x, y in zip(a, b, strict=False) if x[0].get("ok") and y[0].get("ok")]


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**PASS**" if ok else "**MISS**")


def render_targets(res: dict) -> list[str]:
    lines = ["## Targets", "", "| target | measured | ratio / value | result |", "|---|---|---|---|"]
    g = res.get("gather")
    if g:
        st = gather_stats(g)
        sm = st.get("spillmerge", {})
        P = fmt_size(g["payload"])

        def row(label: str, other: str, want: float, spill_over: bool) -> str:
            o = st.get(other, {})
            if not (sm.get("ok") and o.get("ok")):
                return f"| {label} | a method failed | - | **MISS** |"
            if spill_over:
                r, per = sm["wall"] / o["wall"], paired(g, "spillmerge", other)
                good = r <= want
            else:
                r, per = o["wall"] / sm["wall"], paired(g, other, "spillmerge")
                good = r >= want
            per_s = ", ".join(f"{x:.2f}" for x in per)
            return (f"| {label} | spillmerge {sm['wall']:.2f} s, {other} {o['wall']:.2f} s | "
                    f"**{r:.2f}x** (per repeat: {per_s}) | {verdict(good)} |")  # fmt: skip

        W = g["world"]
        lines.append(row(f"spillmerge end to end <= {TARGETS['raw']}x the raw spill (W={W}, P={P})", "raw_spill",
                         TARGETS["raw"], True))  # fmt: skip
        lines.append(row(f">= {TARGETS['gather_object']:.0f}x faster than gather_object", "gather_object",
                         TARGETS["gather_object"], False))  # fmt: skip
        lines.append(row(f">= {TARGETS['all_gather_object']:.0f}x faster than all_gather_object", "all_gather_object",
                         TARGETS["all_gather_object"], False))  # fmt: skip
        if sm.get("ok"):
            v = sm["merge_anon_max"]
            lines.append(f"| rank 0's anonymous peak during merge <= 256 MiB at P={P} | max over {g['repeats']} "
                         f"repeats | **{mib(v)}** ({v / g['payload']:.3f}x P) | {verdict(v <= TARGETS['merge_anon'])} |")  # fmt: skip
    f = res.get("flat")
    if f:
        for p, runs in sorted(f["rows"].items(), key=lambda kv: int(kv[0])):
            if all(r.get("ok") for r in runs):
                v = max(r["merge_anon"] for r in runs)
                lines.append(f"| flatness: the same at P={fmt_size(int(p))} (frames made as written) | max over "
                             f"{len(runs)} | **{mib(v)}** ({v / int(p):.3f}x P) | {verdict(v <= TARGETS['merge_anon'])} |")  # fmt: skip
            else:
                lines.append(f"| flatness at P={fmt_size(int(p))} | FAILED | - | **MISS** |")
    elif g:
        lines.append(
            "| the same at P=4 GiB (flat) | not run: add `--flat`, or `--parts flat --out <this folder>` | - | n/a |"
        )
    ov = res.get("overlap", {}).get("sleep", {})
    if ov:
        # Every spill rate measured, each with its own verdict: the target names no rate, only one
        # "the disk sustains" (all of these are far below the disk's rate in the gather table).
        got, bad, lim = [], [], TARGETS["overlap"]
        for n, o in sorted(ov.items(), key=lambda kv: int(kv[0])):
            if not o.get("ok"):
                bad.append(f"{n} frames/step FAILED")
                continue
            b, w = med(o["base_s"]), med(o["write_s"])
            slow, mbs = (w / b - 1) * 100, o["bytes"] / MiB / b
            got.append(f"{mbs:.0f} MiB/s: **{slow:+.1f} %**")
            (bad if slow > lim else []).append(f"{mbs:.0f} MiB/s")
        step = next(iter(ov.values())).get("step_s", 0) * 1000
        if not bad:
            result = verdict(True)
        elif len(bad) == len(ov):
            result = verdict(False)
        else:
            result = f"**MISS** at {', '.join(bad)}; PASS below"
        lines.append(
            f"| compute/write loop <= {lim:.0f} % slower than without writing ({step:g} ms sleep per step, "
            f"spill rate as listed) | loop time with / without `write()` | {'; '.join(got)} | {result} |"
        )
    lines.append("")
    return lines


def render_gather(g: dict) -> list[str]:
    st = gather_stats(g)
    P = g["payload"]
    raw = st.get("raw_spill", {})
    base = raw.get("wall") if raw.get("ok") else None
    lines = [
        "## Gathering to rank 0: every method",
        "",
        f"W={g['world']} gloo ranks on loopback, payload {fmt_size(P)} of fp16 frames (3x256x256: the nearest whole "
        "number of frames, a little less), 16 files of uneven length, "
        f"keys shuffled over ranks of uneven share, median of {g['repeats']} repeats (methods interleaved). "
        "Wall time on rank 0 from a barrier (frames already in CPU memory) until the complete result is "
        "fsynced on disk; every output verified byte for byte afterwards.",
        "",
        "| method | wall (median) | runs | vs raw spill | rank-0 peak extra anon | rank-0 peak extra file-mapped "
        "| others' peak extra anon (max) | bytes written | verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in bench_gather.ALL:
        s = st.get(m)
        if s is None:
            continue
        if not s["ok"]:
            lines.append(f"| {m} | FAILED | | | | | | | no: {str(s['error'])[:120]} |")
            continue
        runs = ", ".join(f"{x:.2f}" for x in s["walls"])
        vs = f"{s['wall'] / base:.2f}x" if base else "-"
        P = s["bytes"]
        lines.append(
            f"| {m} | {s['wall']:.2f} s | {runs} | {vs} | {mib(s['anon0'])} ({s['anon0'] / P:.2f}x P) | "
            f"{mib(s['file0'])} | {mib(s['anon_others'])} ({s['anon_others'] / P:.2f}x P) | "
            f"{s['written'] / GiB:.2f} GiB ({s['written'] / P:.1f}x P) | yes |"
        )
    d = st.get("disk_limit", {})
    if d.get("ok"):
        lines += ["", f"Disk: one process writes {fmt_size(P)} with fsync at {rate(P, d['wall'])} and reads it back "
                  f"cold (page cache dropped with fadvise) at {rate(P, d['read'])}."]  # fmt: skip
    sm = st.get("spillmerge", {})
    if sm.get("ok"):
        ph = ", ".join(f"{k} {v:.2f} s" for k, v in sm["phases"].items())
        lines += [
            "",
            f"spillmerge on rank 0 (medians): spill {sm['spill_s']:.2f} s (the `with` block, commit included), "
            f"wait for the other ranks {sm['wait_s']:.2f} s, merge {sm['merge_s']:.2f} s. Merge phases: {ph}. "
            f"Rank 0's merge alone: peak extra anon {mib(sm['merge_anon'])}, file-mapped {mib(sm['merge_file'])}.",
        ]
    lines.append("")
    return lines


def render_overlap(o: dict) -> list[str]:
    lines = [
        "## Overlap: compute loop with and without write()",
        "",
        "One process (one torch thread). Each step: simulated compute, then `write()` of N fp16 frames "
        "(3x256x256, 384 KiB each). *sleep* stands for GPU compute (CPU idle, the flush thread has a core); "
        "*matmul* keeps one CPU core busy (256x256 float32 matmuls calibrated to the step time). Baseline: "
        "the same loop without a writer; with and without alternate, medians. Slowdown of the loop itself (until "
        "the last `write()` returns; the target), the part of the loop spent inside `write()` calls (copying into "
        "staging, waiting for a free buffer), and the slowdown including the writer's exit (flush of the last "
        "chunk, index, commit record, their fsyncs: the price of durability, paid once per job).",
        "",
        "| compute | steps x step | frames/step | spill rate | loop without write | loop with write | slowdown "
        "| of which inside write() | + exit (commit, fsync) | slowdown incl. exit | writer peak anon |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, n, r in [
        (k, n, r) for k in ("sleep", "matmul") for n, r in sorted(o.get(k, {}).items(), key=lambda kv: int(kv[0]))
    ]:
        if not r.get("ok"):
            lines.append(f"| {kind} | FAILED: {str(r.get('error'))[:200]} | {n} | | | | | | | | |")
            continue
        b, w, c = med(r["base_s"]), med(r["write_s"]), med(r["close_s"])
        lines.append(
            f"| {kind} | {r['steps']} x {r['step_s'] * 1000:.0f} ms | {r['frames_per_step']} | "
            f"{r['bytes'] / MiB / b:.0f} MiB/s ({fmt_size(r['bytes'])}) | {b:.2f} s | {w:.2f} s | "
            f"**{(w / b - 1) * 100:+.1f} %** | {med(r.get('in_write_s', [])):.2f} s | {c:.2f} s | {((w + c) / b - 1) * 100:+.1f} % | {mib(max(r['writer_anon']))} |"
        )
    lines.append("")
    return lines


def render_chunks(c: dict) -> list[str]:
    P = c["payload"]
    lines = [
        "## Chunk size",
        "",
        f"One writer spills {fmt_size(P)} of random fp16 frames (commit included), then one process merges it "
        "(fsync included); `chunk_bytes` is the same for the spill chunks (`SpillWriter(chunk_bytes=)`) and the "
        "output chunks (`merge(chunk_bytes=)`). Medians; every output verified.",
        "",
        "| chunk_bytes | spill | merge | spill + merge | writer peak anon | merge peak anon | output files | verified |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cb, runs in c["rows"].items():
        if not all(r.get("ok") for r in runs):
            err = next((r.get("error") for r in runs if not r.get("ok")), "wrong result")
            lines.append(f"| {mib(int(cb))} | FAILED: {str(err)[:200]} | | | | | | no |")
            continue
        s, m = med([r["spill_s"] for r in runs]), med([r["merge_s"] for r in runs])
        P = runs[0]["bytes"]
        lines.append(
            f"| {mib(int(cb))} | {rate(P, s)} ({s:.2f} s) | {rate(P, m)} ({m:.2f} s) | {rate(P, s + m)} | "
            f"{mib(med([r['spill_anon'] for r in runs]))} | {mib(med([r['merge_anon'] for r in runs]))} | "
            f"{runs[0]['out_files']} | yes |"
        )
    lines.append("")
    return lines


def render_codecs(c: dict) -> list[str]:
    P = c["payload"]
    lines = [
        "## Output codec",
        "",
        f"{fmt_size(P)} spilled once per data kind, then merged with each codec (fsync included; medians). "
        "*random*: normal noise in fp16 (close to incompressible). *smooth*: prediction-like maps (a coarse "
        "random field upsampled, squashed to [0, 1], quantised to 1/256). Ratio = payload bytes / bytes of the "
        "whole output store. Every output read back through spillmerge.open and verified.",
        "",
    ]
    if not c["available"]:
        lines += ["`codec=` is not a keyword of `spillmerge.merge` in this build: the rows below say so, and the "
                  "default merge is measured for reference.", ""]  # fmt: skip
    lines += ["| data | codec | merge throughput | merge time | output size | compression ratio | merge peak anon | verified |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind, d in c["data"].items():
        if not d["spill"].get("ok"):
            lines.append(f"| {kind} | spill FAILED: {str(d['spill'].get('error'))[:200]} | | | | | | |")
            continue
        if not c["available"]:
            for codec in bench_parts.CODECS:
                lines.append(f"| {kind} | {codec} | codec option not available in this build | | | | | |")
        for codec, runs in d["rows"].items():
            if not all(r.get("ok") for r in runs):
                err = next((r.get("error") for r in runs if not r.get("ok")), "wrong result")
                lines.append(f"| {kind} | {codec} | FAILED: {str(err)[-300:]!r} | | | | | no |")
                continue
            m, size = med([r["merge_s"] for r in runs]), med([r["out_bytes"] for r in runs])
            P = runs[0]["bytes"]
            name = "default (no codec option)" if codec == "default" else codec
            lines.append(f"| {kind} | {name} | {rate(P, m)} | {m:.2f} s | {mib(size)} | {P / size:.2f} | "
                         f"{mib(med([r['merge_anon'] for r in runs]))} | yes |")  # fmt: skip
    lines.append("")
    return lines


def render_procs(p: dict) -> list[str]:
    P = p["payload"]
    lines = [
        "## Merge time vs number of merge processes",
        "",
        f"{fmt_size(P)} spilled by {p['world']} independent writers (ranks of a SLURM-array-like job). "
        "n = 1: `spillmerge merge ROOT --out OUT`; n > 1: n processes `spillmerge merge ROOT --out OUT --part i/n` "
        "started together, then `spillmerge merge ROOT --out OUT --finalize`. Times include starting each "
        "process"
        + (f" ({p['cli_start_s']:.2f} s for `spillmerge --version`)" if "cli_start_s" in p else "")
        + "; medians; each process count's output verified once.",
        "",
    ]
    if not p["spill"].get("ok"):
        return [*lines, f"Spill FAILED: {p['spill'].get('error')}", ""]
    if not p["available"]:
        lines += ["`--part` / `--finalize` are not options of `spillmerge merge` in this build: only n = 1 is "
                  "measured.", ""]  # fmt: skip
    P = p["spill"]["bytes"]
    lines += ["| processes | wall | parts (all at once) | finalize | throughput | speed-up vs 1 | verified |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    one = None
    for n, runs in p["rows"].items():
        if not all(r.get("ok") for r in runs):
            err = next((r.get("error") for r in runs if not r.get("ok")), "")
            lines.append(f"| {n} | FAILED: {str(err)[-300:]!r} | | | | | no |")
            continue
        w = med([r["wall_s"] for r in runs])
        one = one or (w if n == "1" else None)
        lines.append(f"| {n} | {w:.2f} s | {med([r['parts_s'] for r in runs]):.2f} s | "
                     f"{'-' if n == '1' else format(med([r['finalize_s'] for r in runs]), '.2f') + ' s'} | {rate(P, w)} | "
                     f"{(one / w if one else float('nan')):.2f}x | yes |")  # fmt: skip
    if not p["available"]:
        for n in MERGE_PROCS[1:]:
            lines.append(f"| {n} | `--part` not available in this build | | | | | |")
    lines.append("")
    return lines


def render_flat(f: dict) -> list[str]:
    lines = [
        "## Flatness: rank 0's merge memory against the payload",
        "",
        f"spillmerge only, W={f['world']} gloo ranks; frames are made as they are written (so P can exceed "
        "what the ranks could hold). Rank 0's peak extra memory measured over its `merge()` call alone.",
        "",
        "| payload | merge anon peak (max) | merge file-mapped peak | spill | merge | wall | verified |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, runs in sorted(f["rows"].items(), key=lambda kv: int(kv[0])):
        if not all(r.get("ok") for r in runs):
            lines.append(f"| {fmt_size(int(p))} | FAILED: {str(runs[0].get('error'))[:200]} | | | | | no |")
            continue
        lines.append(
            f"| {fmt_size(int(p))} | {mib(max(r['merge_anon'] for r in runs))} | "
            f"{mib(med([r['merge_file'] for r in runs]))} | {med([r['spill_s'] for r in runs]):.2f} s | "
            f"{med([r['merge_s'] for r in runs]):.2f} s | {med([r['wall_s'] for r in runs]):.2f} s | yes |"
        )
    lines.append("")
    return lines


def render(res: dict) -> str:
    info = res["info"]
    lines = ["# spillmerge benchmark suite", ""]
    lines += [f"- **{k}**: {v}" for k, v in info.items() if k != "runtime"]
    if "runtime" in res:
        lines.append("- **runtime**: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in res["runtime"].items()))
    lines += ["", "This VM's disk and memory speed drift between minutes: quote the ratios within a run, not the "
              "seconds. Methods are interleaved repeat by repeat so drift hits them alike, in an order rotated by one each repeat.", ""]  # fmt: skip
    lines += render_targets(res)
    renderers = {"gather": render_gather, "flat": render_flat, "overlap": render_overlap, "chunks": render_chunks,
                 "codecs": render_codecs, "procs": render_procs}  # fmt: skip
    for part, fn in renderers.items():
        if part in res:
            lines += fn(res[part])
    if "gather" in res:
        lines += ["![time and peak memory per method](chart.png)", ""]
    lines += [
        "## How memory is measured",
        "",
        "A thread in each process samples `/proc/self/status` every 5 ms; *anon* is RssAnon + RssShmem "
        "(memory the process holds), *file-mapped* is RssFile (file pages mapped into the process, e.g. "
        "spill chunks the merge mmaps: clean page cache the kernel can reclaim). Peak extra = highest sample "
        "during the timed section minus the value just before it; the frames the ranks already hold are "
        "in the baseline. Page cache that is not mapped (ordinary writes) is not counted for any method.",
        "",
    ]
    return "\n".join(lines)


def chart(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = res["gather"]
    st = gather_stats(g)
    methods = [m for m in bench_gather.ALL if st.get(m, {}).get("ok")]
    if not methods:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    y = np.arange(len(methods))
    walls = [st[m]["wall"] for m in methods]
    lo = [st[m]["wall"] - min(st[m]["walls"]) for m in methods]
    hi = [max(st[m]["walls"]) - st[m]["wall"] for m in methods]
    colors = ["tab:green" if m == "spillmerge" else "tab:gray" if m in ("raw_spill", "disk_limit") else "tab:red"
              for m in methods]  # fmt: skip
    ax1.barh(y, walls, xerr=[lo, hi], color=colors, capsize=3)
    ax1.set_yticks(y, methods)
    ax1.invert_yaxis()
    ax1.set_xlabel("wall time on rank 0, s (median; whiskers: min-max)")
    ax1.set_title(f"Gather {fmt_size(g['payload'])} to rank 0, W={g['world']}")
    for i, w in enumerate(walls):
        ax1.text(w, i, f" {w:.2f} s", va="center", fontsize=8)
    h = 0.27
    a0 = [st[m]["anon0"] / MiB for m in methods]
    f0 = [st[m]["file0"] / MiB for m in methods]
    ao = [st[m]["anon_others"] / MiB for m in methods]
    ax2.barh(y - h, a0, h, label="rank 0 anon", color="tab:blue")
    ax2.barh(y, ao, h, label="other ranks anon (max)", color="tab:orange")
    ax2.barh(y + h, f0, h, label="rank 0 file-mapped (reclaimable)", color="tab:blue", alpha=0.3)
    ax2.axvline(TARGETS["merge_anon"] / MiB, color="k", ls="--", lw=0.8, label="256 MiB (target for rank 0's merge)")
    ax2.set_yticks(y, methods)
    ax2.invert_yaxis()
    ax2.set_xlabel("peak extra memory, MiB (median)")
    ax2.set_title("Peak extra memory per method")
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="gloo ranks (default 4)")
    ap.add_argument("--payload", type=parse_size, default=GiB, help="gathered payload P (default 1GiB)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of every measurement; medians (default 3)")
    ap.add_argument("--out", help="results folder (default benchmarks/results/<UTC time>)")
    ap.add_argument("--parts", default=",".join(ALL_PARTS), help=f"comma list of {','.join(ALL_PARTS + EXTRA_PARTS)}")
    ap.add_argument("--flat", action="store_true", help="also run the rank-0 memory flatness check at --flat-payload")
    ap.add_argument("--flat-payload", type=parse_size, default=4 * GiB, help="payload of the flatness check (4GiB)")
    ap.add_argument("--flat-repeats", type=int, default=1)
    ap.add_argument("--table-payload", type=parse_size, default=None,
                    help="payload of the chunk-size and codec tables (default min(P, 512MiB))")  # fmt: skip
    ap.add_argument("--frame-shape", default="3x256x256")
    ap.add_argument("--step-ms", type=float, default=25.0, help="overlap: compute per step (default 25 ms)")
    ap.add_argument("--overlap-frames", default="2,4,8",
                    help="overlap: frames written per step, one loop per value; the target uses the highest "
                    "(default 2,4,8: 30, 60, 120 MiB/s at 25 ms steps)")  # fmt: skip
    ap.add_argument("--overlap-steps", type=int, default=160, help="overlap: steps per loop, at most (default 160)")
    ap.add_argument("--workdir", help="where spills and outputs go (default: a temp dir, removed at the end)")
    ap.add_argument("--estimate", action="store_true", help="print the runtime estimate and exit")
    a = ap.parse_args(argv)
    a.shape = [int(x) for x in a.frame_shape.split("x")]
    a.overlap_frames = [int(x) for x in a.overlap_frames.split(",")]
    a.table_payload = a.table_payload or min(a.payload, 512 * MiB)
    parts = [p for p in a.parts.split(",") if p]
    if a.flat and "flat" not in parts:
        parts.append("flat")
    for p in parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r}; choose from {', '.join(PARTS)}")
    est = estimate(parts, a)
    log(f"suite: parts {', '.join(parts)}; W={a.world}, P={fmt_size(a.payload)}, {a.repeats} repeats; "
        f"estimated runtime {est / 60:.1f} min on a quiet 2-core VM (more when the machine is busy)")  # fmt: skip
    if a.estimate:
        return
    out = (
        Path(a.out)
        if a.out
        else Path(__file__).resolve().parent / "results" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    )
    out.mkdir(parents=True, exist_ok=True)
    work = a.workdir or tempfile.mkdtemp(prefix="spillmerge-suite-")
    Path(work).mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    res: dict = json.loads(res_path.read_text()) if res_path.exists() else {}
    info = machine_info(argv, work)
    if "info" in res:  # parts added to (or rerun in) an earlier run's folder: keep its header, note this one
        res["info"][f"parts {', '.join(parts)} (re)run"] = f"{info['date']}: {info['command']} (load {info['load']})"
    else:
        res["info"] = info
    res.setdefault("runtime", {})
    t_all = time.perf_counter()
    try:
        for p in parts:
            log(f"suite: {p} ...")
            t0 = time.perf_counter()
            res[p] = PARTS[p](a, work)
            res["runtime"][p] = time.perf_counter() - t0
            res_path.write_text(json.dumps(res, indent=1, default=str))
            (out / "results.md").write_text(render(res))
            log(f"suite: {p} done in {res['runtime'][p] / 60:.1f} min")
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if "gather" in res:
        chart(res, out / "chart.png")
    (out / "results.md").write_text(render(res))
    log(f"suite: finished in {(time.perf_counter() - t_all) / 60:.1f} min (estimated {est / 60:.1f}); results in {out}")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
