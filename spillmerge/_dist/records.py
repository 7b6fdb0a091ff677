"""A drop-in's object of records as one Arrow IPC stream: each key's values become one typed
column (numpy's ``fromiter`` in C, no Python step per leaf), read back by pyarrow's ``to_pylist``
in C++, at pickle's speed.

Taken only where that round trip is exact: a list, tuple or str-keyed dict of dicts of one key
order (struct fields keep it), each key's values, at every depth, of one type (None allowed
anywhere) among int, float, str, bytes, bool, a list of such values or such dicts. Anything else
(an int and a float under one key, keys that differ, an int past 64 bits, an unpaired surrogate)
goes the general way, one file per element.

The columns are built from their buffers (``Array.from_buffers``), not by ``pa.array``: that one
imports pandas when it is installed (pyarrow's pandas shim), 0.5-0.7 s of a process's first call.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np

from .._errors import CorruptSpillError
from .._format import crc

_NONE = type(None)
_MAX_DEPTH = 8
_FILL = {int: 0, float: 0.0, bool: False, str: "", bytes: b""}
"""What stands in a column's buffer for a None (its validity bit says null)."""
_SCALARS = frozenset(_FILL)


def _offsets(lengths: np.ndarray) -> tuple[Any, bool]:
    """Arrow offsets of items of ``lengths``, and whether they need 64 bits."""
    ends = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=ends[1:])
    large = bool(ends[-1] > np.iinfo(np.int32).max)
    return ends if large else ends.astype(np.int32), large


class _NotExact(Exception):
    """Raised inside ``_column``: the values would not come back as they are."""


def _column(column: list[Any], depth: int = 0) -> Any:
    """``column`` (one key's values) as one Arrow array; ``_NotExact`` unless the module
    docstring's conditions hold. pyarrow is imported once something is to convert (not for an
    object of tensors: declined at its first key)."""
    n = len(column)
    kinds = set(map(type, column))
    nulls = _NONE in kinds
    kinds.discard(_NONE)
    if len(kinds) > 1 or depth > _MAX_DEPTH:
        raise _NotExact
    kind = kinds.pop() if kinds else None
    if kind is not None and kind is not list and kind is not dict and kind not in _SCALARS:
        raise _NotExact
    valid = None
    if nulls and kind is not None:
        valid = np.fromiter(map(operator.is_not, column, itertools.repeat(None)), dtype=bool, count=n)
        fill = {} if kind is dict else [] if kind is list else _FILL[kind]
        column = [fill if v is None else v for v in column]
    children = []
    if kind is dict:  # one key order of str keys in every dict (a None's stand-in {} aside)
        present = [v for v, ok in zip(column, valid, strict=True) if ok] if valid is not None else column
        keys = tuple(present[0])
        if not all(type(k) is str for k in keys) or not all(map(keys.__eq__, map(tuple, present))):
            raise _NotExact
        children = [_column(list(map(operator.methodcaller("get", k), column)), depth + 1) for k in keys]
    elif kind is list:
        children = [_items(column, depth + 1)]
    import pyarrow as pa

    if kind is None:
        return pa.nulls(n)
    validity = None if valid is None else pa.py_buffer(np.packbits(valid, bitorder="little"))
    if kind is int or kind is float:
        data = np.fromiter(column, dtype=np.int64 if kind is int else np.float64, count=n)
        return pa.Array.from_buffers(pa.int64() if kind is int else pa.float64(), n, [validity, pa.py_buffer(data)])
    if kind is bool:
        bits = np.packbits(np.fromiter(column, dtype=bool, count=n), bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), n, [validity, pa.py_buffer(bits)])
    if kind is str or kind is bytes:
        encoded = [s.encode() for s in column] if kind is str else column
        offsets, large = _offsets(np.fromiter(map(len, encoded), dtype=np.int64, count=n))
        typ = (pa.large_string() if large else pa.string()) if kind is str else (
            pa.large_binary() if large else pa.binary())  # fmt: skip
        return pa.Array.from_buffers(typ, n, [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))])
    if kind is list:
        offsets, large = _offsets(np.fromiter(map(len, column), dtype=np.int64, count=n))
        typ = pa.large_list(children[0].type) if large else pa.list_(children[0].type)
        return pa.Array.from_buffers(typ, n, [validity, pa.py_buffer(offsets)], children=children)
    typ = pa.struct([pa.field(k, c.type) for k, c in zip(keys, children, strict=True)])
    return pa.Array.from_buffers(typ, n, [validity], children=children)


def _items(lists: list[list[Any]], depth: int) -> Any:
    """The items of ``lists`` as one Arrow array. Numbers of one kind without None go straight
    from the lists into their buffer (no list of every item: 8 bytes an item more of peak)."""
    kinds = set(map(type, itertools.chain.from_iterable(lists)))
    if len(kinds) == 1 and depth <= _MAX_DEPTH and (kind := kinds.pop()) in (int, float):
        import pyarrow as pa

        n = sum(map(len, lists))
        data = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64 if kind is int else np.float64, count=n)
        return pa.Array.from_buffers(pa.int64() if kind is int else pa.float64(), n, [None, pa.py_buffer(data)])
    return _column(list(itertools.chain.from_iterable(lists)), depth)


def encode(obj: Any) -> Any | None:
    """``obj`` as one Arrow record batch when it is records this round trip keeps exactly (the
    module docstring), else None. Its schema's metadata names the container (dict, list, tuple)."""
    kind = type(obj)
    if kind is dict:
        if not obj or not all(type(k) is str for k in obj):
            return None
        values = list(obj.values())
    elif kind is list or kind is tuple:
        values = list(obj)
    else:
        return None
    if not values or set(map(type, values)) != {dict} or not values[0]:
        return None
    try:
        arrays, names = [_column(values)], ["v"]
        if kind is dict:
            arrays.append(_column(list(obj)))
            names.append("k")
    except (_NotExact, OverflowError, UnicodeError):
        return None  # mixed kinds, an int past 64 bits, a str that is no UTF-8: the general way
    import pyarrow as pa

    return pa.RecordBatch.from_arrays(arrays, names=names).replace_schema_metadata({"container": kind.__name__})


class Checksummed:
    """A file-like object Arrow's writer writes to: the bytes go on to ``sink`` (a storage
    object being written), counted and their CRC-32C taken on the way."""

    def __init__(self, sink: Any) -> None:
        self.sink, self.nbytes, self.crc = sink, 0, 0
        self.closed = False

    def write(self, data: Any) -> int:
        self.sink.write(data)
        self.crc = crc.extend(self.crc, data)
        self.nbytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def write(batch: Any, out: Any) -> None:
    """``batch`` as an Arrow IPC stream into ``out`` (a pyarrow sink or a file-like object)."""
    import pyarrow as pa

    if not isinstance(out, pa.NativeFile):
        out = pa.PythonFile(out, mode="w")
    with pa.ipc.new_stream(out, batch.schema) as stream:
        stream.write_batch(batch)


def to_bytes(batch: Any) -> np.ndarray:
    """``batch``'s IPC stream as bytes."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    write(batch, sink)
    return np.frombuffer(sink.getvalue(), dtype=np.uint8)


_CONTAINERS = {"dict": dict, "list": list, "tuple": tuple}


def decode(data: Any, rank: int) -> Any:
    """The object ``encode`` made the stream ``data`` of (its bytes checked as Arrow data before
    use; a checksum, where the caller has one, checked by the caller)."""
    import pyarrow as pa

    if not isinstance(data, (bytes, memoryview)):  # a spilled value: a uint8 array or tensor
        data = np.ascontiguousarray(np.asarray(data), dtype=np.uint8)
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
        table.validate(full=True)
        container = _CONTAINERS[(table.schema.metadata or {}).get(b"container", b"").decode()]
        values = table.column("v").to_pylist()
        if container is dict:
            return dict(zip(table.column("k").to_pylist(), values, strict=True))
        return tuple(values) if container is tuple else values
    except (pa.ArrowException, OSError, KeyError, ValueError) as exc:  # Arrow's I/O errors are OSErrors
        raise CorruptSpillError(f"rank {rank}'s records are not the Arrow stream written: {exc}") from exc
