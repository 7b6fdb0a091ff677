"""CUDA paths (run where a GPU exists; skipped elsewhere by the ``gpu`` marker in conftest.py)."""

from __future__ import annotations

import numpy as np
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


def _to_cuda(value):
    """``value`` with every tensor moved to the GPU, containers kept (a TensorDict moves whole)."""
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if type(value).__name__ == "TensorDict":
        return value.to("cuda")
    if isinstance(value, dict):
        return {k: _to_cuda(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cuda(v) for v in value)
    return value


@pytest.mark.parametrize("kind", ["dense", "wide", "tensor", "detections", "tensordict", "tuples"])
def test_a_cuda_batch_is_stored_byte_for_byte_as_row_by_row_writes_of_host_copies(tmp_path, kind):
    from test_write_batch import _batches, _merge, _write_rows

    if kind == "tuples":  # an item's tuple and str stay what they were, next to CUDA leaves
        g = torch.Generator().manual_seed(3)
        batches = []
        for b, size in enumerate((4, 2)):
            rows = [{"pair": (torch.rand(j + 1, generator=g), f"p{j}"), "ids": [j, b]} for j in range(size)]
            batches.append(([f"t{b}_{j}" for j in range(size)], rows, None, rows))
    else:
        batches = _batches(kind)
    cuda = [(names, _to_cuda(batch), frames) for names, batch, frames, _ in batches]

    def by_row(w: spillmerge.SpillWriter) -> None:
        _write_rows(w, batches)

    def by_batch(w: spillmerge.SpillWriter) -> None:
        for names, batch, frames in cuda:
            w.write_batch(names, batch, frame_idx=frames)
            with torch.no_grad():
                for t in _tensors(batch):  # the producer reuses its buffers at once
                    t.zero_()

    rows, batched = _merge(tmp_path, "rows", by_row), _merge(tmp_path, "batch", by_batch)
    assert rows.keys() == batched.keys()
    for path in rows:
        assert rows[path] == batched[path], path


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif hasattr(value, "values"):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def test_cuda_batches_of_odd_tensors_and_over_16_mib_read_back_as_written(tmp_path):
    """Non-contiguous, autograd and bfloat16 leaves go through the batch copy; a batch over
    16 MiB goes item by item; both read back bit for bit."""
    dev = torch.device("cuda")
    n = 8
    odd = torch.randn(5, n, device=dev).t()  # non-contiguous
    grad = torch.randn(n, 3, device=dev, requires_grad=True)
    bf = torch.randn(n, 7, device=dev).bfloat16()
    big = torch.randn(n, 3 << 20, device=dev).half()  # 48 MiB: over the batch copy's bound
    want = {"odd": odd.cpu(), "grad": grad.detach().cpu(), "bf": bf.cpu(), "big": big.cpu()}
    names = [f"b{i}" for i in range(n)]
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        w.write_batch(names, {"odd": odd, "grad": grad, "bf": bf})
        w.write_batch([f"big{i}" for i in range(n)], big)
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    for i, name in enumerate(names):
        got = res.value(name, 0)
        for k in ("odd", "grad"):
            assert np.array_equal(got[k], want[k][i].numpy()), (name, k)
        assert np.array_equal(got["bf"].view(np.uint16), want["bf"][i].view(torch.int16).numpy().view(np.uint16))
        assert np.array_equal(res.value(f"big{i}", 0), want["big"][i].numpy())


def test_small_and_large_cuda_leaves_of_one_chunk_wait_for_both_streams(tmp_path):
    """Leaves under 1 MiB are copied on the caller's stream, larger ones on the writer's own: a
    chunk holding both is read only after both copies, and the caller's next in-place writes
    (on its stream) never reach the stored bytes."""
    dev = torch.device("cuda")
    side = torch.cuda.Stream(device=dev)
    small = [torch.randn(100, device=dev) for _ in range(12)]
    big = [torch.randn(700_000, device=dev).half() for _ in range(12)]  # 1.4 MB each
    want = [(s.cpu(), b.cpu()) for s, b in zip(small, big, strict=True)]
    with spillmerge.SpillWriter(str(tmp_path / "s"), chunk_bytes=4 << 20) as w:
        for i, (s, b) in enumerate(zip(small, big, strict=True)):
            w.write("mixed.mp4", i, {"small": s, "big": b})
            s.mul_(-1)
            b.add_(1)
        side.wait_stream(torch.cuda.current_stream())  # the caller orders its streams, as for any op
        with torch.cuda.stream(side):  # a leaf written while another stream is current
            w.write("side.mp4", 0, small[0])
            small[0].zero_()
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    for i, (s, b) in enumerate(want):
        got = res.value("mixed.mp4", i)
        assert np.array_equal(got["small"], s.numpy()) and np.array_equal(got["big"], b.numpy()), i
    assert np.array_equal(res.value("side.mp4", 0), -want[0][0].numpy())
