"""Writes 6,000 LLM outputs with odd ones between them (an empty token list, None, bools, an int
beyond int64, another key order, float and mixed lists, an int logprob, a lone surrogate) and a
second frame of a file, merges, checks every value read back (type, content, key order) and
prints an MD5 of every output file, to compare two trees' outputs:

    cd /tmp && PYTHONPATH=<tree> python .../same_output.py digests.txt
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))

import bench_objects as B  # noqa: E402

import spillmerge  # noqa: E402


def main() -> None:
    objs = [B.workload_obj("llm", r, 4) for r in range(2)]
    items = [(k, v) for o in objs for k, v in o.items()][:6000]
    base = {"text": "a", "token_ids": [1, 2], "logprob": 1.0, "finish_reason": "stop"}
    extra = [
        ("e-empty", {**base, "token_ids": []}),
        ("e-none", {**base, "logprob": None}),
        ("e-bool", {**base, "token_ids": [True]}),
        ("e-big", {**base, "token_ids": [1 << 70]}),
        ("e-order", {"token_ids": [1], "text": "a", "logprob": 1.0, "finish_reason": "stop"}),
        ("e-float", {**base, "token_ids": [1.5, 2.0]}),
        ("e-mixed", {**base, "token_ids": [1, 2.0]}),
        ("e-intlogprob", {**base, "logprob": 3}),
        ("e-sur", {**base, "text": "a\udcff"}),
    ]
    for i, (name, v) in enumerate(extra):
        items.insert(100 + 37 * i, (name, v))
        items.insert(101 + 37 * i, (name + "-x", dict(v)))
    work = tempfile.mkdtemp()
    refused = []
    with spillmerge.SpillWriter(f"{work}/spill", 0, 1, fsync=False, allow_pickle=True) as w:
        for k, v in items:
            try:
                w.write(k, 0, v)
            except spillmerge.SpillMergeError as exc:
                refused.append((k, type(exc).__name__))
        w.write(items[1][0], 1, items[1][1])
    spillmerge.merge(f"{work}/spill", f"{work}/out.zarr", progress=False, fsync=False)
    store = spillmerge.open(f"{work}/out.zarr", allow_pickle=True)
    got = {f: v for f, fr, v in store.iter_values() if fr == 0}
    want = dict(items)
    for k, _ in refused:
        want.pop(k)
    bad = [
        k
        for k in want
        if got[k] != want[k]
        or list(got[k]) != list(want[k])
        or any(type(a) is not type(b) for a, b in zip(got[k].values(), want[k].values(), strict=True))
    ]
    print("refused", refused, "differ", bad[:5], "values", len(got))
    with open(sys.argv[1], "w") as out:
        for root, dirs, names in sorted(os.walk(f"{work}/out.zarr")):
            dirs.sort()
            for fn in sorted(names):
                p = os.path.join(root, fn)
                with open(p, "rb") as f:
                    out.write(f"{os.path.relpath(p, work)} {hashlib.md5(f.read()).hexdigest()}\n")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
