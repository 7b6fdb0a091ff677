"""Turn user values into leaves (dtype, shape, bytes) without pickle; validate keys.

A value is a tensor, a numpy array, a Python scalar, or a nested mapping (dict, TensorDict) or
dataclass (tensorclass) of those; mappings and dataclasses become leaf paths of their keys/fields.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._errors import SpillValueError
from ._format import DTYPES, MAX_NDIM

_MAX_DEPTH = 32


@dataclass(frozen=True, slots=True)
class Leaf:
    """One array-like leaf of a frame value, ready to be copied into a staging buffer."""

    path: tuple[str, ...]
    """Dict keys from the value's root to this leaf."""
    dtype: str
    """Dtype name from the format's dtype table."""
    shape: tuple[int, ...]
    """Shape of the leaf."""
    nbytes: int
    """Number of bytes of the leaf."""
    data: Any
    """A flat uint8 view: ``np.ndarray`` on the host or a contiguous ``torch.Tensor`` on any device."""


# torch dtype -> format name, for the dtypes this torch has (write() is per frame: one dict lookup).
_TORCH_NAMES: dict[torch.dtype, str] = {dt: n for n in DTYPES if isinstance(dt := getattr(torch, n, None), torch.dtype)}


def _torch_dtype_name(dt: torch.dtype) -> str | None:
    return _TORCH_NAMES.get(dt)


def check_filename(filename: object) -> str:
    if not isinstance(filename, str):
        raise SpillValueError(f"filename must be a str, got {type(filename).__name__} {filename!r:.80}", filename=None)
    try:
        filename.encode("utf-8")
    except UnicodeEncodeError:
        raise SpillValueError(
            f"filename {filename!r:.200} is not valid Unicode (lone surrogate); it cannot be stored",
            filename=filename,
        ) from None
    return filename


def check_frame_idx(frame_idx: object, filename: str | None = None) -> int:
    """Accept non-negative Python/numpy ints and 0-d integer tensors; refuse anything else."""
    value: object = frame_idx
    if isinstance(frame_idx, torch.Tensor):
        if (
            frame_idx.ndim != 0
            or frame_idx.dtype.is_floating_point
            or frame_idx.dtype
            in (
                torch.bool,
                torch.complex64,
                torch.complex128,
            )
        ):
            raise SpillValueError(
                f"frame_idx must be a non-negative integer; got a tensor of shape "
                f"{tuple(frame_idx.shape)} and dtype {frame_idx.dtype} (filename {filename!r:.200})",
                filename=filename,
            )
        value = int(frame_idx.item())
    elif isinstance(frame_idx, (bool, np.bool_)) or not isinstance(frame_idx, numbers.Integral):
        raise SpillValueError(
            f"frame_idx must be a non-negative integer, got {type(frame_idx).__name__} "
            f"{frame_idx!r:.80} (filename {filename!r:.200})",
            filename=filename,
        )
    out = int(value)  # type: ignore[call-overload]
    if not 0 <= out < (1 << 63):
        raise SpillValueError(
            f"frame_idx must be in [0, 2**63), got {out} (filename {filename!r:.200})", filename=filename
        )
    return out


def _leaf_name(path: tuple[str, ...]) -> str:
    return "/".join(path) if path else "<value>"


def _from_numpy(arr: np.ndarray, path: tuple[str, ...], filename: str) -> Leaf:
    name = arr.dtype.name
    if arr.dtype.kind not in "biufc" or name not in DTYPES:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: numpy dtype {arr.dtype} cannot be stored "
            "without pickle (use bool, int, uint, float or complex)",
            filename=filename,
            leaf=_leaf_name(path),
        )
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and np.little_endian is False):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    shape = tuple(int(d) for d in arr.shape)  # before ascontiguousarray, which makes 0-d arrays 1-d
    flat = np.ascontiguousarray(arr).reshape(-1)
    return Leaf(path, name, shape, flat.nbytes, flat.view(np.uint8))


def _from_tensor(t: torch.Tensor, path: tuple[str, ...], filename: str) -> Leaf:
    lname = _leaf_name(path)
    if t.layout != torch.strided or t.is_quantized or getattr(t, "is_nested", False):
        raise SpillValueError(
            f"leaf {lname!r} of {filename!r:.200}: only dense (strided) tensors can be stored, "
            f"got layout {t.layout}{' (quantized)' if t.is_quantized else ''}",
            filename=filename,
            leaf=lname,
        )
    device = t.device.type
    if device == "meta":
        raise SpillValueError(
            f"leaf {lname!r} of {filename!r:.200}: meta tensors have no data", filename=filename, leaf=lname
        )
    name = _torch_dtype_name(t.dtype)
    if name is None:
        raise SpillValueError(
            f"leaf {lname!r} of {filename!r:.200}: torch dtype {t.dtype} is not supported",
            filename=filename,
            leaf=lname,
        )
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if device not in ("cpu", "cuda"):
        t, device = t.to("cpu"), "cpu"
    if not t.is_contiguous():
        # On CUDA this is the one temporary device allocation we cannot avoid: a strided
        # device-to-host copy needs a contiguous source.
        t = t.contiguous()
    shape = tuple(t.shape)
    if device == "cpu" and DTYPES[name].native:  # numpy's views are cheaper than torch's per call
        flat_np = t.numpy().reshape(-1).view(np.uint8)
        return Leaf(path, name, shape, flat_np.nbytes, flat_np)
    nbytes = t.numel() * t.element_size()
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    if device == "cpu":
        return Leaf(path, name, shape, nbytes, flat.numpy())
    return Leaf(path, name, shape, nbytes, flat)


def flatten(value: object, filename: str, frame_idx: int) -> list[Leaf]:
    """Split a value into leaves in a deterministic (sorted-key) order."""
    out: list[Leaf] = []
    _walk(value, (), filename, out, 0)
    if not out:
        raise SpillValueError(
            f"value for {filename!r:.200} frame {frame_idx} has no leaves (empty dict)",
            filename=filename,
            frame_idx=frame_idx,
        )
    for leaf in out:
        if len(leaf.shape) > MAX_NDIM:
            raise SpillValueError(
                f"leaf {_leaf_name(leaf.path)!r} of {filename!r:.200} has {len(leaf.shape)} dims (max {MAX_NDIM})",
                filename=filename,
                leaf=_leaf_name(leaf.path),
            )
    return out


def _walk(value: object, path: tuple[str, ...], filename: str, out: list[Leaf], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise SpillValueError(f"value for {filename!r:.200} is nested deeper than {_MAX_DEPTH}", filename=filename)
    if isinstance(value, torch.Tensor):
        out.append(_from_tensor(value, path, filename))
    elif isinstance(value, np.ndarray):
        out.append(_from_numpy(value, path, filename))
    elif isinstance(value, np.generic):
        out.append(_from_numpy(np.asarray(value), path, filename))
    elif isinstance(value, bool):
        out.append(_from_numpy(np.asarray(value, dtype=np.bool_), path, filename))
    elif isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise SpillValueError(
                f"leaf {_leaf_name(path)!r} of {filename!r:.200}: {value} does not fit int64",
                filename=filename,
                leaf=_leaf_name(path),
            )
        out.append(_from_numpy(np.asarray(value, dtype=np.int64), path, filename))
    elif isinstance(value, float):
        out.append(_from_numpy(np.asarray(value, dtype=np.float64), path, filename))
    elif isinstance(value, complex):
        out.append(_from_numpy(np.asarray(value, dtype=np.complex128), path, filename))
    elif isinstance(value, Mapping):
        keys = list(value.keys())
        for k in keys:
            if not isinstance(k, str):
                raise SpillValueError(
                    f"dict keys must be str; {filename!r:.200} has key {k!r:.80} at {_leaf_name(path)!r}",
                    filename=filename,
                    leaf=_leaf_name(path),
                )
        for k in sorted(keys):
            _walk(value[k], (*path, k), filename, out, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A dataclass of tensors (tensordict's @tensorclass included) is stored like the dict of
        # its fields; TensorDict itself is a Mapping and takes the branch above, so tensordict is
        # never imported here.
        for f in sorted(dataclasses.fields(value), key=lambda f: f.name):
            _walk(getattr(value, f.name), (*path, f.name), filename, out, depth + 1)
    else:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: cannot store a {type(value).__name__} "
            "without pickle (use a tensor, numpy array, Python scalar, or a dict, TensorDict or dataclass of those)",
            filename=filename,
            leaf=_leaf_name(path),
        )
