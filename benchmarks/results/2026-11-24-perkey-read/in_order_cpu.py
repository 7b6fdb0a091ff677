import sys, time, shutil, cProfile, pstats, os
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch; torch.set_num_threads(1)
import numpy as np
import bench_read as BR
import spillmerge
work = Path("/tmp/h-perkey/rd"); 
out = str(work / "out.zarr")
if not os.path.exists(out):
    work.mkdir(parents=True, exist_ok=True); out = BR.build(work, int(sys.argv[1]))
res = spillmerge.open(out); files = list(res.filenames)
flat = {leaf: (res.column(leaf).values, res.column(leaf).offsets) for leaf in ("boxes", "scores", "labels")}
cls = res.column("cls").to_list(); emb = np.asarray(res.column("emb"))
index = {f: i for i, f in enumerate(files)}
(bv, bo), (sv, so), (lv, lo) = flat["boxes"], flat["scores"], flat["labels"]
def numpy_loop():
    for f in files:
        i = index[f]
        bv[bo[i] : bo[i + 1]], sv[so[i] : so[i + 1]], lv[lo[i] : lo[i + 1]], cls[i], emb[i]
def sm(store):
    for f in files:
        v = store[f]
        for leaf in BR.LEAVES:
            v[leaf][0]
for r in range(3):
    t = time.thread_time(); numpy_loop(); a = time.thread_time() - t
    s = spillmerge.open(out); t = time.thread_time(); sm(s); b = time.thread_time() - t
    print(f"numpy {a/len(files)*1e6:.2f} us/file, spillmerge {b/len(files)*1e6:.2f} us/file ratio {b/a:.1f}")
if len(sys.argv) > 2:
    s = spillmerge.open(out); pr = cProfile.Profile(); pr.enable(); sm(s); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
