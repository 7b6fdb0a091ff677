"""A batched output split into the per-item values ``SpillWriter.write`` would be given (what
``write_batch`` accepts: its docstring); the keys and the split checked for the whole batch
before the writer stages any byte.

Protocol (the writer, once per batch): :func:`batch_keys` → :func:`split_batch` (or
:func:`dense_columns` for the vectorised path) → validate every item → stage every item.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import SpillValueError
from .._format.common import FILENAME_MAX_BYTES
from .leaves import check_filename, check_frame_idx


def mapping_items(mapping: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``(filename, frame_idx, value)`` of every frame of ``{filename: (frame_idx, value)}`` or
    ``{filename: {frame_idx: value}}`` (what ``SpillWriter.update`` and ``gather`` take), in order."""
    if not isinstance(mapping, Mapping):
        raise SpillValueError(f"update() takes a mapping, got {type(mapping).__name__}")
    for filename, item in mapping.items():
        if isinstance(item, tuple) and len(item) == 2:
            yield filename, item[0], item[1]
        elif isinstance(item, Mapping):
            for frame_idx, value in item.items():
                yield filename, frame_idx, value
        else:
            raise SpillValueError(
                f"update(): the value for {filename!r:.200} must be a (frame_idx, value) tuple or a "
                f"{{frame_idx: value}} dict, got {type(item).__name__}",
                filename=filename if isinstance(filename, str) else None,
            )


def _name(path: tuple[str, ...]) -> str:
    return "/".join(path) if path else "<batch>"


def batch_keys(filenames: Any, frame_idx: Any) -> tuple[list[str], list[int]]:
    """The checked filenames and frame indices of a batch (``frame_idx=None``: frame 0 each)."""
    if isinstance(filenames, (str, bytes)) or not isinstance(filenames, (Sequence, np.ndarray)):
        raise SpillValueError(
            f"write_batch: filenames must be a sequence of str (one per item), got {type(filenames).__name__}"
        )
    names = list(filenames)
    ok = set(map(type, names)) <= {str}  # exactly str, in C
    try:  # every name valid Unicode and short enough, checked in one pass; the loop below names a bad one
        if ok:
            # no name is longer than all of them together (the common case: one comparison)
            ok = (
                len("\0".join(names).encode("utf-8")) <= FILENAME_MAX_BYTES
                or max(map(len, names), default=0) <= FILENAME_MAX_BYTES // 4
            )  # 4 UTF-8 bytes a character at most
    except UnicodeEncodeError:
        ok = False
    for i, name in enumerate(names) if not ok else ():
        try:
            check_filename(name)
        except SpillValueError as exc:
            raise at_position(exc, i, len(names), None) from None
    n = len(names)
    if frame_idx is None:
        return names, [0] * n
    if isinstance(frame_idx, (torch.Tensor, np.ndarray)):
        tensor = isinstance(frame_idx, torch.Tensor)
        dtype: Any = frame_idx.dtype
        ints = not (dtype.is_floating_point or dtype == torch.bool) if tensor else dtype.kind in "iu"
        if frame_idx.ndim != 1 or not ints:
            raise SpillValueError(
                f"write_batch: frame_idx must be a 1-d integer {'tensor' if tensor else 'array'} (one per item), "
                f"got shape {tuple(frame_idx.shape)} and dtype {dtype}"
            )
        raw: list[Any] = frame_idx.tolist()
    elif isinstance(frame_idx, Sequence) and not isinstance(frame_idx, (str, bytes)):
        raw = list(frame_idx)
    else:
        raise SpillValueError(
            f"write_batch: frame_idx must be None, a sequence or a 1-d tensor of ints (one per item), "
            f"got {type(frame_idx).__name__}"
        )
    if len(raw) != n:
        raise SpillValueError(
            f"write_batch: {n} filenames but {len(raw)} frame indices"
            + (
                f"; item {n} has no filename"
                if len(raw) > n
                else f"; item {len(raw)} ({names[len(raw)]!r:.200}) has no frame index"
            ),
            filename=names[len(raw)] if len(raw) < n else None,
        )
    # The common case in C: every index an exact int in range (bool is not an exact int).
    if set(map(type, raw)) <= {int} and (not raw or (min(raw) >= 0 and max(raw) < (1 << 63))):
        return names, raw
    frames = []
    for i, (name, f) in enumerate(zip(names, raw, strict=True)):
        try:
            frames.append(check_frame_idx(f, name))
        except SpillValueError as exc:
            raise at_position(exc, i, n, name) from None
    return names, frames


def at_position(exc: SpillValueError, i: int, n: int, filename: str | None) -> SpillValueError:
    """``exc`` (raised for one item) with the item's batch position in front of its message. The
    same exception object is returned, so its class and attributes (``leaf`` ...) stay as the
    per-item check set them; ``batch_index`` is added."""
    exc.prefixed(f"write_batch item {i} of {n}" + (f" ({filename!r:.200})" if filename is not None else ""))
    exc.batch_index = i
    if exc.filename is None and filename is not None:
        exc.filename = filename
    return exc


def _length_error(path: tuple[str, ...], got: int, names: list[str]) -> SpillValueError:
    n = len(names)
    filename = names[got] if got < n else None
    detail = f"item {got} ({filename!r:.200}) has no value there" if got < n else f"its item {n} has no filename"
    return SpillValueError(
        f"write_batch: leaf {_name(path)!r} has {got} items but the batch has {n} filenames; {detail} "
        "(every leaf's first dimension is the batch)",
        filename=filename,
        leaf=_name(path),
    )


def split_batch(value: Any, names: list[str], path: tuple[str, ...] = (), depth: int = 0) -> list[Any]:
    """Item ``i`` of ``value`` (the batch, or its leaf at ``path``) for every ``i``; raises
    ``SpillValueError`` naming the leaf when a leaf is not batched or has the wrong length."""
    n = len(names)
    if depth > 32:
        raise SpillValueError(f"write_batch: the batch is nested deeper than 32 at {_name(path)!r}", leaf=_name(path))
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            raise SpillValueError(
                f"write_batch: leaf {_name(path)!r} is a 0-d {type(value).__name__}; a batch leaf's first "
                "dimension is the batch",
                leaf=_name(path),
            )
        if len(value) != n:
            raise _length_error(path, len(value), names)
        return list(value.unbind(0)) if isinstance(value, torch.Tensor) else list(value)
    if isinstance(value, Mapping):
        keys = list(value.keys())
        for k in keys:
            if not isinstance(k, str):
                raise SpillValueError(f"write_batch: dict keys must be str, got {k!r:.80} at {_name(path)!r}")
        columns = [split_batch(value[k], names, (*path, k), depth + 1) for k in keys]
        return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)] if keys else [{}] * n
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return split_batch({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, names, path, depth)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise _length_error(path, len(value), names)
        return list(value)
    raise SpillValueError(
        f"write_batch: leaf {_name(path)!r} is a {type(value).__name__}, not batched: a batch is a tensor or "
        "array whose first dimension is the batch, a list with one value per item, or a dict / TensorDict / "
        "dataclass of those",
        leaf=_name(path),
    )


CUDA_BATCH_BYTES = 16 << 20
"""The most bytes of CUDA tensors that ``write_batch`` copies to host in one go (see
:func:`cuda_to_host`); a larger batch is copied item by item, asynchronously."""


def cuda_to_host(batch: Any) -> Any:
    """``batch`` with its CUDA tensors replaced by host copies, made with one device-to-host copy
    per tensor and one wait, when its first tensor is on CUDA and all of them hold at most
    :data:`CUDA_BATCH_BYTES`; else ``batch`` itself (item by item, a batch of small rows costs one
    copy call per leaf of every item). The copy of a whole leaf costs what ``.cpu()`` costs and
    waits like it. Mappings become dicts and tuples lists, as ``split_batch`` treats them alike
    above the items; an item keeps its dicts, lists and tuples. Dataclasses, other
    containers inside an item, and tensors it cannot copy plainly (sparse, quantized, nested)
    leave the batch as it is, for the item-by-item path to store or name."""
    first = _first_tensor(batch, 0)
    if first is None or not first.is_cuda:
        return batch
    found: list[torch.Tensor] = []
    if not _cuda_leaves(batch, found, 0) or sum(t.nbytes for t in found) > CUDA_BATCH_BYTES:
        return batch
    host: dict[int, torch.Tensor] = {}
    for t in found:
        if id(t) not in host:  # one copy of a tensor that appears twice
            host[id(t)] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host[id(t)].copy_(t.detach(), non_blocking=True)  # resolves conj / neg bits into plain values
    for dev in {t.device for t in found}:  # the copies ran on each device's current stream, after the producer
        torch.cuda.current_stream(dev).synchronize()
    return _replace(batch, host)


def _first_tensor(value: Any, depth: int) -> torch.Tensor | None:
    """The first tensor of a batch: down a mapping's values in turn (a leaf of strings may come
    before the tensors) and a list's first item only (cheap for a host batch)."""
    if isinstance(value, torch.Tensor):
        return value
    if depth > 32:
        return None
    if isinstance(value, Mapping):
        for v in value.values():
            found = _first_tensor(v, depth + 1)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)) and value:
        return _first_tensor(value[0], depth + 1)
    return None


def _cuda_leaves(value: Any, found: list[torch.Tensor], depth: int, item: bool = False) -> bool:
    """Collect every CUDA tensor of ``value``; False where the batch holds something this copy
    leaves alone: a dataclass, a tensor of another layout, a mapping with keys other than str, or,
    inside an item (under a list), a container other than a plain dict, list or tuple, whose type
    the copy could not keep."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            if not _strided(value):
                return False
            found.append(value)
        return True
    if depth > 32:
        return False
    if isinstance(value, Mapping):
        return (
            (not item or type(value) is dict)
            and all(type(k) is str for k in value.keys())
            and all(_cuda_leaves(v, found, depth + 1, item) for v in value.values())
        )
    if isinstance(value, (list, tuple)):
        return type(value) in (list, tuple) and all(_cuda_leaves(v, found, depth + 1, True) for v in value)
    return not (dataclasses.is_dataclass(value) and not isinstance(value, type))


def _strided(t: torch.Tensor) -> bool:
    """A dense tensor: strided, neither quantized nor nested."""
    return t.layout == torch.strided and not t.is_quantized and not t.is_nested


def _replace(value: Any, host: dict[int, torch.Tensor]) -> Any:
    """``value`` with the tensors ``host`` holds swapped in: above the items a mapping becomes a
    dict (``split_batch`` reads any mapping as one); an item's dicts, lists and tuples keep their type."""
    if isinstance(value, torch.Tensor):
        return host.get(id(value), value)
    if isinstance(value, Mapping):
        return {k: _replace(v, host) for k, v in value.items()}
    if type(value) is list:
        return [_replace(v, host) for v in value]
    if type(value) is tuple:
        return tuple(_replace(v, host) for v in value)
    return value


def dense_columns(batch: Any, n: int) -> dict[tuple[str, ...], Any] | None:
    """The leaves of a batch that is only host tensors / numeric arrays with ``n`` items each
    (a dict, TensorDict or dataclass of them, or one of them), by leaf path; None for any other
    batch (lists, CUDA, a wrong length ...: the item-by-item path handles and names it)."""
    out: dict[tuple[str, ...], Any] = {}
    return out if n and _dense(batch, (), n, out, 0) else None


def _dense(value: Any, path: tuple[str, ...], n: int, out: dict[tuple[str, ...], Any], depth: int) -> bool:
    if isinstance(value, torch.Tensor):
        ok = value.device.type == "cpu" and _strided(value) and value.ndim > 0
        ok = ok and value.shape[0] == n and value.numel() > 0  # n > 0: every item holds something
    elif isinstance(value, np.ndarray):
        ok = value.dtype.kind in "biufc" and value.ndim > 0 and len(value) == n and value[0].size > 0
    elif isinstance(value, Mapping) and depth < 32:
        keys = list(value.keys())
        return bool(keys) and all(isinstance(k, str) and _dense(value[k], (*path, k), n, out, depth + 1) for k in keys)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type) and depth < 32:
        fields = dataclasses.fields(value)
        return bool(fields) and all(_dense(getattr(value, f.name), (*path, f.name), n, out, depth + 1) for f in fields)
    else:
        return False
    if ok:
        out[path] = value
    return ok


def nest(by_path: dict[tuple[str, ...], Any]) -> Any:
    """The nested dict of leaves given by path (``()``: the value itself)."""
    if () in by_path:
        return by_path[()]
    out: dict[str, Any] = {}
    for path, v in by_path.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out
