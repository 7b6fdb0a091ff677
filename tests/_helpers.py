"""Data helpers shared by the tests: bit-exact views of tensors and random tensors of any dtype."""

from __future__ import annotations

from typing import Any

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


def value_diffs(got: Any, want: Any, where: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` in type or content (empty: equal). A tensor that
    spillmerge returns as a numpy array (``value()``'s default) must match it in dtype and shape."""
    if isinstance(want, torch.Tensor):  # bfloat16 and the like: compared as their bits
        ref = want.numpy() if want.dtype != torch.bfloat16 else want.view(torch.uint16).numpy()
        arr = np.asarray(got).view(np.uint16) if want.dtype == torch.bfloat16 and isinstance(got, np.ndarray) else got
        if not isinstance(arr, np.ndarray) or arr.dtype != ref.dtype or arr.shape != ref.shape or not np.array_equal(arr, ref):
            return [f"{where}: {type(got).__name__} {got!r:.80} != tensor {want!r:.80}"]
        return []
    if isinstance(want, np.ndarray):
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or not np.array_equal(got, want):
            return [f"{where}: {type(got).__name__} {got!r:.80} != array {want!r:.80}"]
        return []
    if type(got) is not type(want):
        return [f"{where}: {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, dict):
        if list(sorted(got)) != list(sorted(want)):
            return [f"{where}: keys {sorted(got)} != {sorted(want)}"]
        return [d for k in want for d in value_diffs(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        return [d for i, (a, b) in enumerate(zip(got, want, strict=True)) for d in value_diffs(a, b, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r:.80} != {want!r:.80}"]
