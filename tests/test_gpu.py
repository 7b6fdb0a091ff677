"""CUDA paths (run where a GPU exists; skipped elsewhere by the ``gpu`` marker in conftest.py)."""

from __future__ import annotations

import pytest
import torch

import spillmerge

pytestmark = pytest.mark.gpu


def test_cuda_tensors_spill_bit_exactly_without_gpu_allocations(tmp_path):
    dev = torch.device("cuda")
    frames = [torch.randn(3, 256, 256, device=dev).to(torch.bfloat16) for _ in range(70)]  # > 1 chunk
    odd = torch.randn(64, 32, device=dev).t()  # non-contiguous: the documented exception
    expected = [t.cpu() for t in frames]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.max_memory_allocated()
    with spillmerge.SpillWriter(str(tmp_path / "s"), chunk_bytes=4 << 20) as w:
        for i, t in enumerate(frames):
            w.write("cuda.mp4", i, t)
            t.add_(1)  # the producer reuses its buffer at once: the copy must already be ordered
    assert torch.cuda.max_memory_allocated() == before  # pinned host staging only
    with spillmerge.SpillWriter(str(tmp_path / "s2")) as w:
        w.write("odd.mp4", 0, odd)
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    got = spillmerge.open(str(tmp_path / "o"))["cuda.mp4"].to_torch()
    for i, want in enumerate(expected):
        assert torch.equal(got[i].view(torch.int16), want.view(torch.int16))
    spillmerge.merge(str(tmp_path / "s2"), str(tmp_path / "o2"))
    assert torch.equal(spillmerge.open(str(tmp_path / "o2"))["odd.mp4"].to_torch()[0], odd.cpu())


def _nccl_rank(rank: int, port: int, base: str, result: str) -> None:
    """Two ranks, one GPU each, each on its own disk: rank 1's shards come over NCCL."""
    import json

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        with spillmerge.SpillWriter(f"{base}/disk{rank}", chunk_bytes=4 << 20) as w:
            for i in range(64):  # 64 x 384 KiB = 24 MiB per rank
                w.write(f"r{rank}.mp4", i, torch.full((3, 256, 256), float(i), device="cuda").half())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        rep = w.merge(f"{base}/out", transport="nccl", transfer_chunk_bytes=1 << 20, progress=False)
        peak = torch.cuda.max_memory_allocated() - before
        info = {"peak": peak, "transferred": {str(k): v for k, v in rep.transferred.items()} if rep else None}
        with open(f"{result}.{rank}", "w") as fh:
            json.dump(info, fh)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL point-to-point needs two GPUs")
def test_nccl_transfer_uses_at_most_the_staging_buffer_of_gpu_memory(tmp_path):
    import json
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, str(tmp_path), str(tmp_path / "res"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    infos = [json.loads((tmp_path / f"res.{r}").read_text()) for r in range(2)]
    assert infos[0]["transferred"] and list(infos[0]["transferred"]) == ["1"]
    for info in infos:  # the staging buffer (1 MiB) plus NCCL's small header tensors
        assert info["peak"] <= (1 << 20) + (64 << 10), info
    res = spillmerge.open(str(tmp_path / "out"))
    assert res.filenames == ["r0.mp4", "r1.mp4"]
    got = res["r1.mp4"].to_torch()
    assert all(torch.equal(got[i], torch.full((3, 256, 256), float(i)).half()) for i in range(64))
