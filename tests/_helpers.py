"""Data helpers shared by the tests: bit-exact views of tensors and random tensors of any dtype."""

from __future__ import annotations

import numpy as np
import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor as a flat uint8 tensor, so comparisons are bit-exact (NaN
    payloads, -0.0, bfloat16 and float8 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor as ``bytes`` (for ``==`` and dict keys)."""
    return bytes(bits(t).numpy().tobytes())


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are uniformly random (every bit pattern possible)."""
    raw = torch.randint(
        0, 256, (int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=g
    )
    t = raw.view(dtype).reshape(shape)
    return t.clone() if dtype != torch.bool else (raw[: t.numel()] % 2).bool().reshape(shape)
