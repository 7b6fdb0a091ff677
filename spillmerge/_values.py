"""Turn user values into leaves (dtype, shape, bytes) without pickle; validate keys.

A value is a tensor, a numpy array, a Python scalar, ``str``, ``bytes``, a list or tuple of numbers
or of ``str``, ``None``, or a nested mapping (dict, TensorDict) or dataclass (tensorclass) of
those; mappings and dataclasses become leaf paths of their keys/fields, and a list of dicts with
the same keys becomes the dict of its columns. Anything else is pickled only when the writer opted
in (``allow_pickle``). The bytes each kind puts in ``data`` are docs/FORMAT.md section 1, *catalog*.
"""

from __future__ import annotations

import dataclasses
import numbers
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._errors import SpillValueError
from ._format import DTYPES, FILENAME_MAX_BYTES, MAX_NDIM, STRING_MAX_BYTES, shape_problem

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


_EMPTY = np.zeros(0, dtype=np.uint8)
_UINT32_MAX = (1 << 32) - 1


# torch dtype -> format name, for the dtypes this torch has (write() is per frame: one dict lookup).
_TORCH_NAMES: dict[torch.dtype, str] = {dt: n for n in DTYPES if isinstance(dt := getattr(torch, n, None), torch.dtype)}


def _torch_dtype_name(dt: torch.dtype) -> str | None:
    return _TORCH_NAMES.get(dt)


def check_filename(filename: object) -> str:
    if not isinstance(filename, str):
        raise SpillValueError(f"filename must be a str, got {type(filename).__name__} {filename!r:.80}", filename=None)
    try:
        n = len(filename.encode("utf-8"))
    except UnicodeEncodeError:
        raise SpillValueError(
            f"filename {filename!r:.200} is not valid Unicode (lone surrogate); it cannot be stored",
            filename=filename,
        ) from None
    if n > FILENAME_MAX_BYTES:
        # The reader refuses an output whose filename index holds more (docs/FORMAT.md 2.3): a
        # merge of it would succeed and leave an output nobody can open.
        raise SpillValueError(
            f"filename {filename!r:.200}... is {n} bytes of UTF-8, more than the {FILENAME_MAX_BYTES} a filename "
            "may have (docs/FORMAT.md, Size limits)",
            filename=filename,
        )
    return filename


def check_leaf_limits(leaf: Leaf, filename: str) -> None:
    """The format's bounds on one leaf, which every reader enforces (docs/FORMAT.md 2.3): a
    ``str`` / ``strlist`` of at most ``STRING_MAX_BYTES``, a shape within ``shape_problem``'s
    bounds (``[2**27, 0]`` is refused: an empty value with 2**27 entries before its zero).
    Cheap: only empty and string leaves need a look."""
    if leaf.dtype in ("str", "strlist") and leaf.nbytes > STRING_MAX_BYTES:
        raise SpillValueError(
            f"leaf {_leaf_name(leaf.path)!r} of {filename!r:.200}: a string of {leaf.nbytes} bytes, more than the "
            f"{STRING_MAX_BYTES} the format allows (store it as bytes)",
            filename=filename,
            leaf=_leaf_name(leaf.path),
        )
    if leaf.nbytes == 0 and DTYPES[leaf.dtype].numeric:
        bad = shape_problem(leaf.shape)
        if bad is not None:
            raise SpillValueError(
                f"leaf {_leaf_name(leaf.path)!r} of {filename!r:.200}: {bad}",
                filename=filename,
                leaf=_leaf_name(leaf.path),
            )


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


def _from_numpy(arr: np.ndarray, path: tuple[str, ...], filename: str, allow_pickle: bool = False) -> Leaf:
    name = arr.dtype.name
    if arr.dtype.kind not in "biufc" or name not in DTYPES:
        if allow_pickle:
            return _pickled(arr, path, filename)
        hint = "; for text pass a list of str (arr.tolist())" if arr.dtype.kind in "USO" else ""
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: numpy dtype {arr.dtype} cannot be stored "
            f"without pickle (use bool, int, uint, float or complex{hint}; or open the writer with "
            "allow_pickle=True)",
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


# numpy dtype -> format name, for the dtypes numpy holds itself (native byte order only: a
# big-endian array misses and takes the slow path, which swaps it).
_NUMPY_NAMES: dict[np.dtype[Any], str] = (
    {np.dtype(n): n for n, d in DTYPES.items() if d.native and d.numeric} if np.little_endian else {}
)


def _dense_leaf(value: object, path: tuple[str, ...]) -> Leaf | None:
    """The leaf of a plain contiguous host tensor or array of a native dtype, with one dtype
    lookup; None for anything else (``flatten`` handles it, and names what it refuses).
    ``Tensor.numpy()`` itself refuses what needs care (autograd, conj/neg bits, devices, dtypes
    numpy lacks, sparse or quantized layouts), so the checks of ``_from_tensor`` are not
    repeated here."""
    if type(value) is torch.Tensor:
        try:
            arr = value.numpy()
        except (RuntimeError, TypeError):
            return None
    elif type(value) is np.ndarray:
        arr = value
    else:
        return None
    name = _NUMPY_NAMES.get(arr.dtype)
    if name is None or not arr.flags.c_contiguous or arr.ndim > MAX_NDIM:
        return None
    if arr.size == 0 and shape_problem(arr.shape) is not None:
        return None  # flatten refuses it, naming the filename
    return Leaf(path, name, arr.shape, arr.nbytes, arr.reshape(-1).view(np.uint8))


def flatten_dense(value: object) -> list[Leaf] | None:
    """``flatten`` of the common ``write()`` value, a tensor or a flat dict of str -> tensor (or
    array), contiguous on the host: the same leaves, without the general walk. None when the
    value is anything else."""
    if type(value) is dict:
        try:
            keys = sorted(value)
        except TypeError:
            return None
        out = []
        for k in keys:
            if type(k) is not str:
                return None
            leaf = _dense_leaf(value[k], (k,))
            if leaf is None:
                return None
            out.append(leaf)
        return out or None
    leaf = _dense_leaf(value, ())
    return None if leaf is None else [leaf]


def flatten(value: object, filename: str, frame_idx: int, allow_pickle: bool = False) -> list[Leaf]:
    """Split a value into leaves in a deterministic (sorted-key) order.

    ``allow_pickle``: store objects of no other kind as ``pickle`` leaves instead of refusing
    them (the writer's opt-in; a reader must opt in too)."""
    out: list[Leaf] = []
    _walk(value, (), filename, out, 0, allow_pickle)
    if not out:
        raise SpillValueError(
            f"value for {filename!r:.200} frame {frame_idx} has no leaves (empty dict)",
            filename=filename,
            frame_idx=frame_idx,
        )
    for leaf in out:
        check_leaf_limits(leaf, filename)
        if len(leaf.shape) > MAX_NDIM:
            raise SpillValueError(
                f"leaf {_leaf_name(leaf.path)!r} of {filename!r:.200} has {len(leaf.shape)} dims (max {MAX_NDIM})",
                filename=filename,
                leaf=_leaf_name(leaf.path),
            )
    return out


def _walk(
    value: object, path: tuple[str, ...], filename: str, out: list[Leaf], depth: int, allow_pickle: bool = False
) -> None:
    if depth > _MAX_DEPTH:
        raise SpillValueError(f"value for {filename!r:.200} is nested deeper than {_MAX_DEPTH}", filename=filename)
    # Tensors first: write() runs once per frame and a tensor is the common value.
    if isinstance(value, torch.Tensor):
        out.append(_from_tensor(value, path, filename))
    elif isinstance(value, np.ndarray):
        out.append(_from_numpy(value, path, filename, allow_pickle))
    elif isinstance(value, str):  # before np.generic: np.str_ is a str
        out.append(Leaf(path, "str", *_utf8(value, path, filename)))
    elif isinstance(value, (bytes, bytearray, memoryview)):  # np.bytes_ is a bytes
        data = _bytes_view(value)
        out.append(Leaf(path, "bytes", (data.size,), data.size, data))
    elif value is None:
        out.append(Leaf(path, "none", (), 0, _EMPTY))
    elif isinstance(value, np.generic):
        out.append(_from_numpy(np.asarray(value), path, filename, allow_pickle))
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
            _walk(value[k], (*path, k), filename, out, depth + 1, allow_pickle)
    elif isinstance(value, (list, tuple)):
        _from_list(value, path, filename, out, depth, allow_pickle)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A dataclass of tensors (tensordict's @tensorclass included) is stored like the dict of
        # its fields; TensorDict itself is a Mapping and takes the branch above, so tensordict is
        # never imported here.
        for f in sorted(dataclasses.fields(value), key=lambda f: f.name):
            _walk(getattr(value, f.name), (*path, f.name), filename, out, depth + 1, allow_pickle)
    elif allow_pickle:
        out.append(_pickled(value, path, filename))
    else:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: cannot store a {type(value).__name__} "
            "without pickle (use a tensor, numpy array, Python scalar, str, bytes, list of numbers or str, "
            "None, or a dict, TensorDict or dataclass of those; or open the writer with allow_pickle=True)",
            filename=filename,
            leaf=_leaf_name(path),
        )


def _utf8(text: str, path: tuple[str, ...], filename: str) -> tuple[tuple[int], int, np.ndarray]:
    """Shape, size and bytes of a ``str`` leaf. Lone surrogates (from ``surrogateescape``
    decoding, or a broken JSON source) are not Unicode text: no reader could decode them."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: the str is not valid Unicode (lone surrogate "
            f"at character {exc.start}); it cannot be stored as UTF-8 text (pass bytes instead)",
            filename=filename,
            leaf=_leaf_name(path),
        ) from None
    data = np.frombuffer(raw, dtype=np.uint8)
    return (data.size,), data.size, data


def _bytes_view(value: bytes | bytearray | memoryview) -> np.ndarray:
    """A flat uint8 view of a bytes-like value, copied only when it is not contiguous (write()
    copies it into staging before returning, so a view of the caller's buffer is safe)."""
    if isinstance(value, memoryview):
        value = value.cast("B") if value.c_contiguous and value.ndim else value.tobytes()
    return np.frombuffer(value, dtype=np.uint8)


def _pickled(value: object, path: tuple[str, ...], filename: str) -> Leaf:
    try:
        raw = pickle.dumps(value, protocol=5)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the value's problem
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: cannot pickle a {type(value).__name__}: "
            f"{type(exc).__name__}: {exc}",
            filename=filename,
            leaf=_leaf_name(path),
        ) from exc
    data = np.frombuffer(raw, dtype=np.uint8)
    return Leaf(path, "pickle", (data.size,), data.size, data)


# Classes of list elements for the numeric rule (docs/FORMAT.md section 2, *Columns*): all bool
# -> bool, all integral (bool included) -> int64, all real -> float64.
_BOOL, _INT, _REAL = 0, 1, 2
_NUM_DTYPES = {_BOOL: np.bool_, _INT: np.int64, _REAL: np.float64}


def _num_class(t: type) -> int | None:
    if t is bool or issubclass(t, np.bool_):
        return _BOOL
    if issubclass(t, numbers.Integral):  # numpy integers are registered as Integral
        return _INT
    if issubclass(t, numbers.Real) and not issubclass(t, numbers.Integral):
        return _REAL
    return None


def _list_error(path: tuple[str, ...], filename: str, what: str) -> SpillValueError:
    return SpillValueError(
        f"leaf {_leaf_name(path)!r} of {filename!r:.200}: {what} (a list or tuple must hold only numbers, "
        "only str, only equally long lists of numbers, or only dicts with the same keys)",
        filename=filename,
        leaf=_leaf_name(path),
    )


def _from_list(
    value: list[Any] | tuple[Any, ...],
    path: tuple[str, ...],
    filename: str,
    out: list[Leaf],
    depth: int,
    allow_pickle: bool,
) -> None:
    """A list or tuple: of ``str`` → a ``strlist`` leaf; of dicts with the same keys → the dict of
    their columns; of numbers (or of equally long lists of numbers) → a numeric array."""
    if value and isinstance(value[0], str):
        out.append(_strlist(value, path, filename))
    elif value and isinstance(value[0], Mapping):
        keys = set(value[0].keys())
        for i, d in enumerate(value):
            if not isinstance(d, Mapping) or set(d.keys()) != keys:
                got = sorted(map(str, d.keys())) if isinstance(d, Mapping) else type(d).__name__
                raise _list_error(
                    path, filename, f"item {i} is {got!r:.200}, not a dict with keys {sorted(map(str, keys))!r:.200}"
                )
        # COCO-style detection lists: one column per key, each stored as the list it makes.
        columns = {k: [d[k] for d in value] for k in keys}
        _walk(columns, path, filename, out, depth + 1, allow_pickle)
    else:
        arr = _numeric(value, path, filename, depth)
        out.append(_from_numpy(arr, path, filename))


def _strlist(value: list[Any] | tuple[Any, ...], path: tuple[str, ...], filename: str) -> Leaf:
    """``n`` uint32 LE byte lengths, then the UTF-8 bytes of each string (docs/FORMAT.md)."""
    enc = []
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise _list_error(path, filename, f"item 0 is a str but item {i} is a {type(s).__name__}")
        try:
            enc.append(s.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise SpillValueError(
                f"leaf {_leaf_name(path)!r} of {filename!r:.200}: string {i} is not valid Unicode (lone "
                f"surrogate at character {exc.start}); it cannot be stored as UTF-8 text",
                filename=filename,
                leaf=_leaf_name(path),
            ) from None
    n = len(enc)
    lens = np.fromiter(map(len, enc), dtype=np.int64, count=n)
    if n and int(lens.max()) > _UINT32_MAX:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: a string of a list is 4 GiB or longer (store it "
            "as a str leaf of its own)",
            filename=filename,
            leaf=_leaf_name(path),
        )
    body = b"".join(enc)
    data = np.empty(4 * n + len(body), dtype=np.uint8)
    data[: 4 * n] = lens.astype("<u4").view(np.uint8)
    data[4 * n :] = np.frombuffer(body, dtype=np.uint8)
    return Leaf(path, "strlist", (n, data.size), data.size, data)


def _numeric(value: list[Any] | tuple[Any, ...], path: tuple[str, ...], filename: str, depth: int) -> np.ndarray:
    """A list of numbers (or of equally long such lists) as a bool, int64 or float64 array.

    The element types decide the dtype, not numpy's inference: ``np.asarray([1, 2**63])`` is a
    float64 array that silently rounds, and ``np.asarray(["1", 2])`` a string array."""
    if depth > _MAX_DEPTH:
        raise SpillValueError(f"value for {filename!r:.200} is nested deeper than {_MAX_DEPTH}", filename=filename)
    if not value:
        return np.zeros(0, dtype=np.float64)
    if isinstance(value[0], (list, tuple)):
        rows = []
        for i, item in enumerate(value):
            if not isinstance(item, (list, tuple)):
                raise _list_error(path, filename, f"item 0 is a list but item {i} is a {type(item).__name__}")
            rows.append(_numeric(item, path, filename, depth + 1))
        shapes = {r.shape for r in rows}
        if len(shapes) > 1:
            raise _list_error(
                path, filename, f"its lists are not rectangular (inner shapes {sorted(shapes)[:4]!r:.200})"
            )
        # The rule over every element: rows of zero elements (all rows then) stay float64.
        kinds = {r.dtype for r in rows if r.size}
        dt: type = np.float64
        if kinds and np.dtype(np.float64) not in kinds:
            dt = np.int64 if np.dtype(np.int64) in kinds else np.bool_
        return np.stack([r.astype(dt, copy=False) for r in rows])
    classes = {t: _num_class(t) for t in set(map(type, value))}
    bad = sorted(t.__name__ for t, c in classes.items() if c is None)
    if bad:
        hint = "; stack tensors or arrays with torch.stack / np.stack" if {"Tensor", "ndarray"} & set(bad) else ""
        held = ", ".join(sorted(t.__name__ for t in classes))
        raise _list_error(path, filename, f"it holds {held}{hint}")
    cls = max(c for c in classes.values() if c is not None)
    try:
        return np.array(value, dtype=_NUM_DTYPES[cls])
    except OverflowError:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: an integer of the list does not fit int64",
            filename=filename,
            leaf=_leaf_name(path),
        ) from None
