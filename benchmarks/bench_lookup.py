"""Opening a large output and finding one filename's rows (issue 24): `spillmerge.open` and
`res[f]` at 10^6 and 10^7 keys, against the same lookup in a Python dict of every filename (the
baseline a user would build, measured in the same run).

The outputs are built cheaply, not spilled and merged (a 10^7-key merge does not fit this 2-core
VM's time): the plan of a one-frame-per-key output of `{label int64, caption str}` is made in
numpy, and the merge's own writers lay it out (`_merge.documents.output_docs`, the merge's index writer
`_merge.index.write`, the consolidated root and the completion marker), with the column
values written through zarr. So the index and its chunking are exactly a merge's.

Each measurement runs in a fresh process: open time, peak RSS of the process after open (and its
growth over the imports), then 200 lookups of random filenames (`res[f]["label"][0]` and
`res[f]["caption"][0]`), cold blocks (cache on, but random files rarely share a block).

With ``--before DIR`` (a checkout of an earlier spillmerge, e.g. the main branch), each output is
also measured with that reader, alternated before / after ``--repeats`` times, same outputs.

Usage: python benchmarks/bench_lookup.py [--keys 1000000,10000000] [--workdir /tmp/x] [--out DIR]
       [--before /work/main --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def build(out: Path, n: int) -> None:
    import zarr

    from spillmerge._format import common as F
    from spillmerge._format import output as FO
    from spillmerge._merge import documents as Z
    from spillmerge._merge import index as _index
    from spillmerge._merge.plan import Plan, PlannedColumn
    from spillmerge._storage import Storage

    names = [f"images/shard-{i // 10000:05d}/img_{i:09d}.jpg" for i in range(n)]
    captions = [f"caption {i}" for i in range(n)]
    cap_len = np.fromiter((len(c) for c in captions), dtype=np.int64, count=n)
    ones = np.ones(n, dtype=np.int64)
    rows = np.arange(n, dtype=np.int64)
    cap_off = np.concatenate([[0], np.cumsum(cap_len)])
    label = PlannedColumn(("label",), "fixed", "int64", 0, None, False, name="label", src=rows, n_present=n, shape=())
    caption = PlannedColumn(
        ("caption",), "str", "str", 0, None, False, name="caption", src=n + rows, n_present=n, offsets=cap_off
    )
    plan = Plan(
        filenames=names, file_offsets=np.arange(n + 1, dtype=np.int64), frame_idx=np.zeros(n, np.int64),
        rank=np.zeros(n, np.int32), copies=np.ones(n, np.int32), file_layout=np.zeros(n, np.int32),
        file_layouts=[["caption", "label"]], columns=[caption, label], segments=[],
        seg=np.zeros(2 * n, np.int64), offset=np.zeros(2 * n, np.int64),
        nbytes=np.concatenate([8 * ones, cap_len]), crc=np.zeros(2 * n, np.int64), duplicates=0,
        total_bytes=int(8 * n + cap_len.sum()),
    )  # fmt: skip
    storage = Storage(str(out))
    storage.makedirs("")
    docs = Z.output_docs(plan, 1, F.DEFAULT_CHUNK_BYTES, "none")
    storage.put_atomic("zarr.json", Z.json_doc(docs[""]))  # the merge marks the folder first
    storage.put_many({f"{p}/zarr.json": Z.json_doc(d) for p, d in docs.items() if p})
    _index.write(storage, _index.index_chunks(plan, docs), threads=2)
    g = zarr.open_group(str(out), mode="r+", use_consolidated=False)
    g["columns/label/values"][:] = rows
    g["columns/caption/values"][:] = np.frombuffer("".join(captions).encode(), dtype=np.uint8)
    storage.put_atomic("zarr.json", Z.json_doc(Z.consolidated_root(docs)))
    marker = FO.CompletionMarker(n_files=n, n_frames=n, nbytes=plan.total_bytes, finished=F.utcnow(),
                                 written_by={}, spill_root="bench_lookup", plan="", run_id=None)  # fmt: skip
    storage.put_atomic(FO.COMPLETE_NAME, marker.to_json())


def _peak_kib() -> int:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure(out: str, n: int) -> dict[str, float]:
    """In this (fresh) process: open, RSS, lookups; and the dict baseline."""
    rss0 = _peak_kib()
    import spillmerge

    rss1 = _peak_kib()
    t = time.perf_counter()
    res = spillmerge.open(out)
    t_open = time.perf_counter() - t
    rss2 = _peak_kib()
    rng = np.random.default_rng(1)
    picks = [f"images/shard-{i // 10000:05d}/img_{i:09d}.jpg" for i in rng.integers(0, n, 200).tolist()]
    lookup, row = [], []
    for f in picks:
        t = time.perf_counter()
        v = res[f]
        lookup.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert v["label"][0] == int(f[-13:-4]) and v["caption"][0] == f"caption {int(f[-13:-4])}"
        row.append(time.perf_counter() - t)
    rss3 = _peak_kib()
    # baseline: the dict of every filename a user would build to find rows (its build time too)
    t = time.perf_counter()
    names = list(res.filenames)
    pos = {f: i for i, f in enumerate(names)}
    t_dict = time.perf_counter() - t
    base = []
    for f in picks:
        t = time.perf_counter()
        pos[f]
        base.append(time.perf_counter() - t)
    ms = 1e3
    return {
        "open_s": t_open, "rss_import_mib": rss1 / 1024, "rss_open_mib": rss2 / 1024,
        "rss_open_growth_mib": (rss2 - rss1) / 1024, "rss_after_lookups_mib": rss3 / 1024, "rss_start_mib": rss0 / 1024,
        "lookup_ms_median": statistics.median(lookup) * ms, "lookup_ms_p90": sorted(lookup)[179] * ms,
        "row_read_ms_median": statistics.median(row) * ms,
        "dict_build_s": t_dict, "dict_lookup_us_median": statistics.median(base) * 1e6,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", default="1000000,10000000")
    ap.add_argument("--workdir", default="/tmp/bench_lookup")
    ap.add_argument("--out", default=None)
    ap.add_argument("--before", default=None, help="a checkout of an earlier spillmerge to alternate with")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure[0], int(a.measure[1]))))
        return
    work = Path(a.workdir)
    readers = [("before", a.before), ("after", None)] if a.before else [("after", None)]
    results: dict[str, dict[str, Any]] = {}
    for n in [int(k) for k in a.keys.split(",")]:
        out = work / f"out-{n}.zarr"
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        build(out, n)
        built = time.perf_counter() - t
        obj = sum(1 for p in out.rglob("*") if p.is_file())
        for rep in range(a.repeats):
            for label, path in readers:
                env = dict(os.environ)
                if path:
                    env["PYTHONPATH"] = path
                r = subprocess.run(
                    [sys.executable, __file__, "--measure", str(out), str(n)], capture_output=True, text=True, env=env
                )
                if r.returncode:
                    sys.exit(r.stderr)
                key = f"{n} {label} {rep}"
                results[key] = {**json.loads(r.stdout.strip().splitlines()[-1]), "build_s": built, "objects": obj,
                                "n": n, "reader": label, "load": os.getloadavg()[0]}  # fmt: skip
                print(key, json.dumps(results[key]), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    lines = [
        "| keys | reader | open (s) | peak RSS after open (MiB) | of which open (MiB) | lookup res[f] median / p90 (ms) "
        "| row read (2 leaves) median (ms) | dict of all names: build (s) / lookup (us) | objects | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        lines.append(
            f"| {r['n']:,} | {r['reader']} | {r['open_s']:.3f} | {r['rss_open_mib']:.0f} | {r['rss_open_growth_mib']:.0f} "
            f"| {r['lookup_ms_median']:.3f} / {r['lookup_ms_p90']:.3f} | {r['row_read_ms_median']:.3f} "
            f"| {r['dict_build_s']:.2f} / {r['dict_lookup_us_median']:.2f} | {r['objects']} | {r['load']:.1f} |"
        )
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench_lookup.md").write_text(text + "\n")
        (Path(a.out) / "bench_lookup.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
