"""CPU seconds per phase of one process's write + merge + ``iter_values`` of every rank's
objects, against pickle dumps + loads of the same objects. Run from a tree's root with
PYTHONPATH set to it: ``python phases.py coco 3 [nogc]`` (``nogc``: the collector off)."""

import gc
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.getcwd() + "/benchmarks")
import bench_objects as B  # noqa: E402

import spillmerge  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    workload, repeats = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        gc.disable()
    objs = [B.workload_obj(workload, r, 4) for r in range(4)]
    files = [B.as_files(workload, o) for o in objs]
    res: dict[str, list[float]] = {"pickle": [], "write": [], "merge": [], "read": []}
    for _ in range(repeats):
        t = time.process_time()
        back = [pickle.loads(pickle.dumps(o, protocol=5)) for o in objs]
        res["pickle"].append(time.process_time() - t)
        del back
        work = tempfile.mkdtemp()
        t0 = time.process_time()
        with spillmerge.SpillWriter(f"{work}/spill", 0, 1, fsync=False) as w:
            for fs in files:
                for name, (frame, v) in fs.items():
                    w.write(name, frame, v)
        t1 = time.process_time()
        spillmerge.merge(f"{work}/spill", f"{work}/out.zarr", progress=False, fsync=False)
        t2 = time.process_time()
        sum(1 for _ in spillmerge.open(f"{work}/out.zarr").iter_values(as_torch=True))
        t3 = time.process_time()
        res["write"].append(t1 - t0)
        res["merge"].append(t2 - t1)
        res["read"].append(t3 - t2)
        shutil.rmtree(work)
    med = {k: round(statistics.median(v), 3) for k, v in res.items()}
    ratio = (med["write"] + med["merge"] + med["read"]) / med["pickle"]
    print(os.path.basename(os.getcwd()), med, f"ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
