"""W=4 gloo ranks in one spawn: per call, the slowest rank's wall, rank 0's CPU and the CPU of all
ranks, for torch's ``gather_object``, the drop-in and ``gather`` + ``iter_values`` (methods
rotated each repeat; the first round is a warm-up). Run from a checkout's root (the ranks import
``spillmerge`` from there):

    python cpu_ab.py llm 3 /tmp/out.json
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

METHODS = ["gather_object", "dropin", "gather"]


def main(rank: int, world: int, port: int, workload: str, reps: int, res: str, work: str) -> None:
    import torch.distributed as dist
    from bench_objects import as_files, workload_obj

    import spillmerge

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    obj = workload_obj(workload, rank, world)
    files = as_files(workload, obj)
    rows = []
    for i in range(reps + 1):
        for m in METHODS[i % 3 :] + METHODS[: i % 3]:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            if m == "gather":
                store = spillmerge.gather(files, f"{work}/out.zarr", progress=False)
                if store is not None:
                    _ = [v for _, _, v in store.iter_values(as_torch=True)]
            else:
                lib: Any = spillmerge if m == "dropin" else dist
                parts = [None] * world if rank == 0 else None
                lib.gather_object(obj, parts, dst=0)
            got: list[Any] = [None] * world
            dist.all_gather_object(got, (time.perf_counter() - t, time.process_time() - c))
            if i and rank == 0:
                rows.append({
                    "method": m, "wall": max(w for w, _ in got), "cpu0": got[0][1], "cpu_all": sum(c for _, c in got),
                })  # fmt: skip
    if rank == 0:
        with open(res, "w") as fh:
            json.dump(rows, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    workload, reps, res = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(dir="/dev/shm")
    try:
        mp.spawn(main, args=(4, port, workload, reps, res, work), nprocs=4)
    finally:
        shutil.rmtree(work, ignore_errors=True)
