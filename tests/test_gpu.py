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
