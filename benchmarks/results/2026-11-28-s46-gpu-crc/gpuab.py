"""A/B: google_crc32c (holds the GIL) vs crc32c (releases it) under spillmerge's CUDA write path,
and the parallel-write floor of /dev/shm. Usage: gpuab.py floor | gpuab.py run {google|icrar} leaf_mib chunk_mib threads"""
import os, sys, time, shutil, threading, statistics
GiB = 1 << 30
if sys.argv[1] == "floor":
    import numpy as np
    src = np.ones(64 << 20, np.uint8)
    for size_mib in (16, 64):
        for th in (1, 2, 4, 8):
            d = "/dev/shm/floor"; shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
            n = GiB // (size_mib << 20); buf = memoryview(src)[: size_mib << 20]
            def work(k):
                for i in range(k, n, th):
                    fd = os.open(f"{d}/{i}", os.O_WRONLY | os.O_CREAT, 0o644)
                    os.write(fd, buf); os.fsync(fd); os.close(fd)
            t0 = time.perf_counter(); ts = [threading.Thread(target=work, args=(k,)) for k in range(th)]
            [t.start() for t in ts]; [t.join() for t in ts]
            print(f"floor: {size_mib} MiB objects, {th} threads write+fsync: {GiB/1e9/(time.perf_counter()-t0):.2f} GB/s", flush=True)
            shutil.rmtree(d)
    sys.exit()
which, leaf_mib, chunk_mib, threads = sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if which == "icrar":
    import crc32c, google_crc32c
    google_crc32c.value = lambda b: crc32c.crc32c(b)
    google_crc32c.extend = lambda c, b: crc32c.crc32c(b, c)
import torch, spillmerge, google_crc32c
assert google_crc32c.extend(google_crc32c.value(b"hel"), b"lo") == google_crc32c.value(b"hello")
dev = torch.device("cuda"); root = "/dev/shm/sm-ab"
n_leaf = int(leaf_mib * (1 << 20)) // 2
pool = [torch.randn(n_leaf, device=dev).half() for _ in range(4)]
n = GiB // (n_leaf * 2)
res = []
for r in range(4):
    shutil.rmtree(root, ignore_errors=True); torch.cuda.synchronize()
    t0 = time.perf_counter()
    with spillmerge.SpillWriter(root, chunk_bytes=chunk_mib << 20, flush_threads=threads) as w:
        for i in range(n):
            w.write("x.mp4", i, pool[i % 4])
        torch.cuda.synchronize(); t1 = time.perf_counter()
    t2 = time.perf_counter()
    if r: res.append((n * n_leaf * 2 / 1e9 / (t1 - t0), n * n_leaf * 2 / 1e9 / (t2 - t0)))
shutil.rmtree(root, ignore_errors=True)
print(f"{which:6} leaf {leaf_mib} MiB chunk {chunk_mib} threads {threads}: write {statistics.median(r[0] for r in res):.2f} GB/s (max {max(r[0] for r in res):.2f}), +close {statistics.median(r[1] for r in res):.2f} GB/s", flush=True)
