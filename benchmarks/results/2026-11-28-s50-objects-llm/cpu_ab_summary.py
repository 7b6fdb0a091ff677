"""Medians and ratios of ``cpu_ab.py``'s JSON files in a folder (``WORKLOAD-TREE-K.json``)."""

from __future__ import annotations

import collections
import glob
import json
import statistics as st
import sys
from typing import Any


def med(rows: list[dict[str, Any]], key: str) -> float:
    return st.median(r[key] for r in rows)


def main(folder: str) -> None:
    agg: dict[tuple[str, str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for f in sorted(glob.glob(f"{folder}/*.json")):
        wl, label, _ = f.split("/")[-1][:-5].split("-")
        with open(f) as fh:
            for r in json.load(fh):
                agg[(wl, label, r["method"])].append(r)
    print("| workload | tree | method | wall median (s) | rank 0 CPU median (s) | all ranks' CPU median (s) | n |")
    print("|---|---|---|---|---|---|---|")
    for (wl, label, m), rs in sorted(agg.items()):
        print(
            f"| {wl} | {label} | {m} | {med(rs, 'wall'):.2f} | {med(rs, 'cpu0'):.2f} | {med(rs, 'cpu_all'):.2f} | {len(rs)} |"
        )
    print()
    for wl in sorted({k[0] for k in agg}):
        for label in ("base", "new"):
            t = {m: agg[(wl, label, m)] for m in ("gather_object", "dropin", "gather")}
            if not all(t.values()):
                continue
            w0, c0 = med(t["gather_object"], "wall"), med(t["gather_object"], "cpu_all")
            print(f"{wl} {label}: " + ", ".join(
                f"{m}/torch wall {med(t[m], 'wall') / w0:.2f}x CPU(all) {med(t[m], 'cpu_all') / c0:.2f}x"
                for m in ("dropin", "gather")
            ))  # fmt: skip
        for m in ("gather_object", "dropin", "gather"):
            b, n = agg[(wl, "base", m)], agg[(wl, "new", m)]
            if b and n:
                print(f"{wl} {m} new/base: wall {med(n, 'wall') / med(b, 'wall'):.2f}x, rank 0 CPU "
                      f"{med(n, 'cpu0') / med(b, 'cpu0'):.2f}x, all ranks' CPU {med(n, 'cpu_all') / med(b, 'cpu_all'):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
