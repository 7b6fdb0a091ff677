import sys, time, tempfile, shutil, pickle, os, gc
sys.path.insert(0, os.getcwd() + "/benchmarks")
import torch; torch.set_num_threads(1)
import bench_objects as B, spillmerge
wl = sys.argv[1]
objs = [B.workload_obj(wl, r, 4) for r in range(4)]
files = [B.as_files(wl, o) for o in objs]
res = {"pickle": [], "write": [], "merge": [], "read": []}
for rep in range(int(sys.argv[2])):
    t = time.process_time(); back = [pickle.loads(pickle.dumps(o, protocol=5)) for o in objs]; res["pickle"].append(time.process_time() - t); del back
    work = tempfile.mkdtemp()
    t = time.process_time()
    with spillmerge.SpillWriter(f"{work}/spill", 0, 1, fsync=False) as w:
        for r, fs in enumerate(files):
            for name, (frame, v) in fs.items():
                w.write(name, frame, v)
    t1 = time.process_time()
    spillmerge.merge(f"{work}/spill", f"{work}/out.zarr", progress=False, fsync=False)
    t2 = time.process_time()
    n = sum(1 for _ in spillmerge.open(f"{work}/out.zarr").iter_values(as_torch=True))
    t3 = time.process_time()
    res["write"].append(t1 - t); res["merge"].append(t2 - t1); res["read"].append(t3 - t2)
    shutil.rmtree(work)
import statistics as S
print(os.getcwd().split("/")[-1], {k: round(S.median(v), 3) for k, v in res.items()}, "ratio", round(sum(S.median(res[k]) for k in ("write","merge","read")) / S.median(res["pickle"]), 2))
