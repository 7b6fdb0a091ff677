"""The drop-in's steps in one process, for every rank's object of a real-format payload: the shape
walk, the writes (a SpillWriter per rank), the merge, open and the read-back, against pickle's
dumps and loads of the same objects (wall seconds of each step).

    PYTHONPATH=<tree> python benchmarks/results/2026-11-28-s46-objects/stages.py coco 2 [check]

Run it from a folder outside the trees (a tree in the current directory shadows PYTHONPATH's).
"""

from __future__ import annotations

import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))  # bench_objects: the payloads
sys.path.insert(0, str(HERE.parent / "tests"))

import bench_objects as B  # noqa: E402
import torch  # noqa: E402

import spillmerge  # noqa: E402
from spillmerge._dist import dropin as D  # noqa: E402
from spillmerge._merge.job import merge  # noqa: E402
from spillmerge._read.store import open as open_store  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    workload, repeats, world = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2, 4
    objs = [B.workload_obj(workload, r, world) for r in range(world)]
    for rep in range(repeats):
        work = tempfile.mkdtemp()
        t: dict[str, float] = {}
        t0 = time.perf_counter()
        shapes = [D._Shape(o, False) for o in objs]
        t["shape"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for r in range(world):
            with spillmerge.SpillWriter(
                f"{work}/spill", r, world, run_id="x", fsync=False, chunk_bytes=D.CHUNK_BYTES,
                staging_bytes=2 * D.CHUNK_BYTES,
            ) as w:  # fmt: skip
                D._write(w, r, shapes[r])
        t["write"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        merge(f"{work}/spill", f"{work}/out.zarr", fsync=False, progress=False, world_size=world, run_id="x")
        t["merge"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        store = open_store(f"{work}/out.zarr")
        t["open"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        got: list[object] = [None] * world
        D._read(store, world, got)
        t["read"] = time.perf_counter() - t0
        total = sum(t.values())
        t0 = time.perf_counter()
        raw = [pickle.dumps(o, protocol=5) for o in objs]
        t["pickle.dumps"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = [pickle.loads(x) for x in raw]
        t["pickle.loads"] = time.perf_counter() - t0
        del raw, back
        print(" ".join(f"{k}={v:.3f}" for k, v in t.items()), f"spillmerge={total:.3f}")
        if rep == 0 and "check" in sys.argv:
            B._check_equal(got, objs)
            print("equal: type, content, key order")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
