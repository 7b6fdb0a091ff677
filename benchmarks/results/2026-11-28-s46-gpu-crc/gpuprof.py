"""Where write() of large CUDA leaves spends its time: bandwidth for several leaf sizes, chunk
sizes and flush_threads, and a cProfile of the main thread."""
import cProfile, io, os, pstats, shutil, sys, time, threading
import torch
import spillmerge

dev = torch.device("cuda")
root = "/dev/shm/sm-prof"
GiB = 1 << 30

def run(leaf_mib, chunk_mib, threads, total=GiB, profile=False, fsync=True):
    n_leaf = int(leaf_mib * (1 << 20)) // 2
    pool = [torch.randn(n_leaf, device=dev).half() for _ in range(4)]
    n = total // (n_leaf * 2)
    shutil.rmtree(root, ignore_errors=True)
    torch.cuda.synchronize()
    pr = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    with spillmerge.SpillWriter(root, chunk_bytes=chunk_mib << 20, flush_threads=threads, fsync=fsync) as w:
        if pr: pr.enable()
        for i in range(n):
            w.write("x.mp4", i, pool[i % 4])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        if pr: pr.disable()
    t2 = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    gb = n * n_leaf * 2 / 1e9
    out = f"leaf {leaf_mib:>6} MiB chunk {chunk_mib:>3} MiB threads {threads} fsync {fsync}: write {gb/(t1-t0):6.2f} GB/s  +close {gb/(t2-t0):6.2f} GB/s"
    print(out, flush=True)
    if pr:
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30); print(s.getvalue())
    return out

# pinned floors
src = torch.empty(GiB, dtype=torch.uint8, device=dev).random_()
pinned = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
for _ in range(2):
    torch.cuda.synchronize(); t0 = time.perf_counter(); pinned.copy_(src, non_blocking=True); torch.cuda.synchronize()
print(f"pinned one copy {GiB/1e9/(time.perf_counter()-t0):.2f} GB/s")
for cm in (16, 64):
    dst = pinned.view(-1, cm << 20); s = src.view(-1, cm << 20)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for i in range(len(s)): dst[i].copy_(s[i], non_blocking=True)
    torch.cuda.synchronize(); print(f"pinned copies of {cm} MiB {GiB/1e9/(time.perf_counter()-t0):.2f} GB/s")
# memcpy + crc floors on host
import numpy as np, google_crc32c
a = pinned.numpy(); b = np.empty_like(a)
t0 = time.perf_counter(); b[:] = a; print(f"host memcpy 1 GiB {GiB/1e9/(time.perf_counter()-t0):.2f} GB/s")
t0 = time.perf_counter(); google_crc32c.value(a); print(f"crc32c 1 GiB {GiB/1e9/(time.perf_counter()-t0):.2f} GB/s")
with open("/dev/shm/floor.bin", "wb") as f:
    t0 = time.perf_counter(); f.write(memoryview(a)); os.fsync(f.fileno()); print(f"write+fsync 1 GiB to /dev/shm {GiB/1e9/(time.perf_counter()-t0):.2f} GB/s")
os.unlink("/dev/shm/floor.bin")
del b
run(0.375, 16, 2)  # warm
for leaf in (0.375, 4, 64):
    for chunk, th in ((16, 2), (64, 2), (64, 4), (64, 8)):
        run(leaf, chunk, th)
run(64, 64, 4, fsync=False)
run(0.375, 16, 2, profile=True)
run(64, 64, 4, profile=True)
