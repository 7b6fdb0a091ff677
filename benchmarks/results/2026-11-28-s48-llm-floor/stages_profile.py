"""``bench_objects.py --floor``'s spillmerge part split into its steps (write, merge,
``iter_values``), CPU seconds each, against pickle; with a step's name, that step of the last
run is profiled (cProfile, by tottime and cumulative).

    cd /tmp && PYTHONPATH=<tree> python .../stages_profile.py llm time 3
    cd /tmp && THREADS=1 PYTHONPATH=<tree> python .../stages_profile.py llm merge

Run it from a folder outside the trees (a tree in the current directory shadows PYTHONPATH's).
"""

from __future__ import annotations

import cProfile
import io
import os
import pickle
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))  # bench_objects: the payloads
sys.path.insert(0, str(HERE.parent / "tests"))

import bench_objects as B  # noqa: E402
import torch  # noqa: E402

import spillmerge  # noqa: E402

MERGE_KW: dict[str, Any] = {"threads": int(os.environ["THREADS"])} if os.environ.get("THREADS") else {}


def run(wl: str, objs: list[Any], files: list[dict[str, Any]], prof_stage: str | None = None) -> None:
    work = tempfile.mkdtemp()
    t: dict[str, float] = {}
    prof = cProfile.Profile()

    def go(name: str, fn: Any) -> Any:
        t0 = time.process_time()
        if prof_stage == name:
            prof.enable()
        out = fn()
        if prof_stage == name:
            prof.disable()
        t[name] = time.process_time() - t0
        return out

    def write() -> None:
        with spillmerge.SpillWriter(f"{work}/spill", 0, 1, fsync=False) as w:
            for r, fs in enumerate(files):
                for name, (frame, v) in fs.items():
                    w.write(f"{r}-{name}" if wl == "megatron" else name, frame, v)

    def merge() -> None:
        spillmerge.merge(f"{work}/spill", f"{work}/out.zarr", progress=False, fsync=False, **MERGE_KW)

    def read() -> int:
        return sum(1 for _ in spillmerge.open(f"{work}/out.zarr").iter_values(as_torch=True))

    go("write", write)
    go("merge", merge)
    go("read", read)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.process_time()
    [pickle.loads(pickle.dumps(o, protocol=5)) for o in objs]
    t["pickle"] = time.process_time() - t0
    total = t["write"] + t["merge"] + t["read"]
    print(" ".join(f"{k}={v:.3f}" for k, v in t.items()), f"total={total:.3f} ratio={total / t['pickle']:.2f}")
    if prof_stage:
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(35)
            print(s.getvalue())


def main() -> None:
    torch.set_num_threads(1)
    wl, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "time"
    objs = [B.workload_obj(wl, r, 4) for r in range(4)]
    files = [B.as_files(wl, o) for o in objs]
    if mode == "time":
        for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 2):
            run(wl, objs, files)
    else:
        run(wl, objs, files)  # first-use imports outside the profile
        run(wl, objs, files, mode)


if __name__ == "__main__":
    main()
