"""Byte-for-byte comparison of merge outputs between two checkouts (the planner's proof).

    python benchmarks/compare_planner.py --base /work/wt/base            # every value kind + 10^5 keys
    python benchmarks/compare_planner.py --base /work/wt/base --n 2000   # quicker

Spill roots are written once (with this checkout's writer): a root of every value kind
(tests/write/test_value_model.py's VALUES), and a generated root of ``--n`` keys from W=4 ranks with duplicates (identical copies on another rank, and copies of different
content), a leaf that is float16 in some files and str in others, None, zero-element arrays,
ragged arrays, lists of dicts and lists of str, written with ``write`` and ``write_batch``. Each
root is merged, in a fresh process, by both checkouts (``PYTHONPATH``) under each duplicate
policy; an error must be the same class and message in both; outputs must hold the same files
with the same bytes, except two records that carry a time: the root ``zarr.json`` (compared
without ``created``) and ``spillmerge-complete.json`` (compared without ``finished`` and
``written_by``; its ``plan`` fingerprint must agree); with ``--parts``, the part records too
(without ``finished``, ``host``, ``pid`` and the share's ``nbytes``). Exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
STAMPED = ("zarr.json", "spillmerge-complete.json")
"""Records that carry a time and a writer (process, host): compared without those fields; the
completion record's plan fingerprint is compared."""

MERGE = """
import json, sys, spillmerge
root, out, policy, parts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
try:
    if parts == 1:
        spillmerge.merge(root, out, on_duplicate=policy, overwrite=True, progress=False)
    else:  # the parts one after another (the first stores the plan, the others read it), then the finalize
        for i in range(parts):
            spillmerge.merge(root, out, on_duplicate=policy, part=(i, parts), progress=False)
        spillmerge.merge(root, out, on_duplicate=policy, finalize=True, progress=False)
    print(json.dumps({"ok": True, "module": spillmerge.__file__}))
except Exception as exc:
    print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc), "module": spillmerge.__file__}))
"""


def write_values_root(root: str) -> None:
    sys.path[:0] = [str(HERE / "tests"), str(HERE / "tests" / "write")]  # the tests' folders
    from test_value_model import VALUES

    import spillmerge

    with spillmerge.SpillWriter(root) as w:
        for k, v in VALUES.items():
            w.write(k, 0, v)


def write_generated_root(root: str, n: int, world: int = 4) -> None:
    """``n`` keys dealt to ``world`` ranks; duplicates, variants, None, empty, ragged, lists."""
    import numpy as np
    import torch

    import spillmerge

    rng = np.random.default_rng(0)
    emb = torch.from_numpy(rng.standard_normal((n, 16)).astype(np.float16))

    def value(i: int, salt: int = 0) -> dict:
        v: dict = {"emb": emb[i] + salt, "label": i % 7}
        if i % 5 == 0:
            v["var"] = f"text {i}"  # str in these files, float16 in the others
        elif i % 5 == 1:
            v["var"] = torch.full((2,), float(i % 100), dtype=torch.float16)
        if i % 11 == 0:
            v["opt"] = None
        elif i % 11 == 1:
            v["opt"] = torch.zeros(0, 3)
        else:
            v["opt"] = torch.arange(i % 4 * 3, dtype=torch.float32).reshape(-1, 3)  # ragged first dim
        if i % 3 == 0:
            v["boxes"] = [{"b": [float(i), 1.0], "c": i % 4} for _ in range(i % 3 + 1)]
        if i % 4 == 0:
            v["tags"] = [f"t{i % 9}", "", "x\x00y"][: i % 3 + 1]
        return v

    nl = "\n"
    names = [f"shard-{i % 13:02d}/key-{i:07d}\u00e9{nl if i % 997 == 0 else ''}.bin" for i in range(n)]
    names[1] = "odd-\x00-nul-\U0001f600"  # NUL and a code point beyond the BMP
    order = rng.permutation(n)
    for rank in range(world):
        mine = order[rank::world]
        with spillmerge.SpillWriter(root, rank=rank, world_size=world) as w:
            for i in mine.tolist():
                w.write(names[i], 0, value(i))
                if i % 9 == 0:
                    w.write(names[i], 1, value(i, 1))
            if rank > 0:  # identical copies of rank 0's keys (padding), and different ones
                theirs = order[0::world][: max(1, n // 200)]
                for i in theirs.tolist():
                    w.write(names[i], 0, value(i))
                    if i % 9 == 0:
                        w.write(names[i], 1, value(i, 1))
                if rank == 3:
                    for i in order[0::world][n // 100 : n // 100 + max(1, n // 500)].tolist():
                        w.write(names[i], 0, value(i, rank))
            # a batch of keys of their own
            batch = {"x": torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4) + rank}
            w.write_batch([f"batch-{rank}-{j:03d}" for j in range(64)], batch)


def merge(checkout: str, root: str, out: str, policy: str, parts: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=checkout)
    r = subprocess.run([sys.executable, "-c", MERGE, root, out, policy, str(parts)], env=env, capture_output=True, text=True, cwd=checkout,
                       timeout=3600)  # fmt: skip
    if r.returncode != 0 or not r.stdout.strip():
        return {"ok": False, "error": "crash", "message": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def tree(path: str) -> dict[str, Path]:
    base = Path(path)
    return {str(p.relative_to(base)): p for p in sorted(base.rglob("*")) if p.is_file()} if base.exists() else {}


def _without_stamps(name: str, raw: bytes) -> object:
    """The record without what says when and by which process it was written."""
    obj = json.loads(raw)
    if name.startswith("spillmerge-parts/part-"):
        # a part's record: when, on which host, which process, and its share's bytes (the split of
        # the output chunks between parts, not the output)
        for key in ("finished", "host", "pid", "nbytes"):
            obj.pop(key, None)
    elif name == "zarr.json":
        obj.get("attributes", {}).get("spillmerge", {}).pop("created", None)
    else:
        for key in ("finished", "written_by"):
            obj.pop(key, None)
    return obj


def compare(a: str, b: str) -> list[str]:
    ta, tb = tree(a), tree(b)
    diffs = [f"only in base: {k}" for k in sorted(set(ta) - set(tb))]
    diffs += [f"only in new: {k}" for k in sorted(set(tb) - set(ta))]
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k].read_bytes(), tb[k].read_bytes()
        if x == y:
            continue
        stamped = k in STAMPED or k.startswith("spillmerge-parts/part-")
        if stamped and _without_stamps(k, x) == _without_stamps(k, y):
            continue
        diffs.append(f"differs: {k} ({len(x)} and {len(y)} bytes)")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="/work/wt/base", help="checkout of today's planner")
    ap.add_argument("--new", default=str(HERE), help="checkout of the planner under test")
    ap.add_argument("--n", type=int, default=100_000, help="keys of the generated root")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--parts", type=int, default=1, help="merge in this many parts + finalize (1: whole)")
    ap.add_argument("--root", action="append", default=[], help="an existing spill root to compare on instead (kept)")
    ap.add_argument("--policies", default="error,first,last")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="compare-planner-")
    roots: dict[str, str] = {}
    if args.root:
        roots = {os.path.basename(r.rstrip("/")): r for r in args.root}
    else:
        roots["values"] = os.path.join(work, "values")
        write_values_root(roots["values"])
        t = time.perf_counter()
        roots[f"generated-{args.n}"] = os.path.join(work, "generated")
        write_generated_root(roots[f"generated-{args.n}"], args.n)
        print(f"spill roots written in {time.perf_counter() - t:.1f} s under {work}", flush=True)
    bad = 0
    for name, root in roots.items():
        for policy in args.policies.split(","):
            outs = {}
            res = {}
            for side, checkout in (("base", args.base), ("new", args.new)):
                outs[side] = os.path.join(work, f"out-{name}-{policy}-{side}")
                t = time.perf_counter()
                res[side] = merge(checkout, root, outs[side], policy, args.parts)
                res[side]["s"] = round(time.perf_counter() - t, 1)
            a, b = res["base"], res["new"]
            assert a.get("module", "").startswith(args.base) and b.get("module", "").startswith(args.new), (a, b)
            if a["ok"] != b["ok"] or (not a["ok"] and (a["error"], a["message"]) != (b["error"], b["message"])):
                diffs = [f"base: {a}", f"new: {b}"]
            else:
                diffs = compare(outs["base"], outs["new"]) if a["ok"] else []
            n_files = len(tree(outs["new"]))
            what = "merged" if a["ok"] else f"both raise {a['error']}"
            status = "SAME" if not diffs else "DIFFERENT"
            print(f"{status:9} {name:18} on_duplicate={policy:5} parts={args.parts} {what}, {n_files} files "
                  f"(base {a['s']} s, new {b['s']} s)", flush=True)  # fmt: skip
            for d in diffs[:20]:
                print("    ", d)
            bad += bool(diffs)
            for o in outs.values():
                shutil.rmtree(o, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print("all outputs byte-identical" if not bad else f"{bad} comparisons differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
