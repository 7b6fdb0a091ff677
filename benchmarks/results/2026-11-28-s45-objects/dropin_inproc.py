"""One process: the drop-in's write + merge + read-back of 4 ranks' objects (CPU s), for the
spillmerge on PYTHONPATH (this tree or an older one: before/after in one run, alternated).

    PYTHONPATH=. python benchmarks/results/2026-11-28-s45-objects/dropin_inproc.py coco 3
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(HERE / "benchmarks"))
sys.path.insert(0, str(HERE / "tests"))

import torch  # noqa: E402
from bench_objects import workload_obj  # noqa: E402

import spillmerge  # noqa: E402
from spillmerge._dist import dropin as D  # noqa: E402

WORLD = 4


def main() -> None:
    torch.set_num_threads(1)
    workload, repeats = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    objs = [workload_obj(workload, r, WORLD) for r in range(WORLD)]
    per_element = hasattr(D, "_write")  # the tree stores an object one file per element
    for _ in range(repeats):
        work = tempfile.mkdtemp()
        t = [time.process_time()]
        with spillmerge.SpillWriter(
            f"{work}/spill", 0, 1, fsync=False, chunk_bytes=D.CHUNK_BYTES, staging_bytes=2 * D.CHUNK_BYTES
        ) as w:
            for r in range(WORLD):
                shape = D._Shape(objs[r], False)
                if per_element:
                    D._write(w, r, shape)
                else:  # the whole object as frame 0, the numpy paths as frame 1
                    w.write(D._name(r), 0, shape.obj)
                    if shape.dumps() is not None:
                        w.write(D._name(r), 1, shape.dumps())
        t.append(time.process_time())
        spillmerge.merge(f"{work}/spill", f"{work}/out.zarr", progress=False, fsync=False)
        t.append(time.process_time())
        out: list = [None] * WORLD
        D._read(spillmerge.open(f"{work}/out.zarr"), WORLD, out)
        t.append(time.process_time())
        assert workload == "megatron" or out == objs
        shutil.rmtree(work)
        print(
            f"{'per element' if per_element else 'one frame'} {workload}: write {t[1] - t[0]:.2f} "
            f"merge {t[2] - t[1]:.2f} read {t[3] - t[2]:.2f} total {t[3] - t[0]:.2f} CPU s",
            flush=True,
        )


if __name__ == "__main__":
    main()
