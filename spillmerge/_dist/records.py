"""A drop-in's object of records as Arrow columns: each key's values become one column's buffers
(numpy's ``fromiter`` in C, no Python step per leaf; a key's lists of numbers, as token ids, from
marshal's bytes of them, which tell each item's exact type); the reader makes Arrow arrays of them and
converts those back with pyarrow's ``to_pylist`` in C++, at pickle's speed. The sender does not
need pyarrow at all (its import is 25 ms and 5 MiB a process).

Taken only where that round trip is exact: a list, tuple or str-keyed dict of dicts of one key
order (struct fields keep it), each key's values, at every depth, of one type (None allowed
anywhere) among int, float, str, bytes, bool, a list of such values or such dicts. Anything else
(an int and a float under one key, keys that differ, an int past 64 bits, an unpaired surrogate)
goes the general way, one file per element.

The bytes (docs/FORMAT.md, section 4): the JSON header's length (8 bytes, little
endian), the header (the container, each column's Arrow type, length and buffers as offsets
into what follows), padded to 8 bytes, then the buffers, each starting 8-byte aligned. The
reader slices every buffer from the bytes (pyarrow refuses a slice past the end), builds only
the types listed here and validates the arrays in full (``validate(full=True)``) before
converting them.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import CorruptSpillError
from .._util.marshalled import exact_numbers

_NONE = type(None)
_MAX_DEPTH = 8
_FILL = {int: 0, float: 0.0, bool: False, str: "", bytes: b""}
"""What stands in a column's buffer for a None (its validity bit says null)."""
_SCALARS = frozenset(_FILL)
_HEADER_MAX = 1 << 24


class _NotExact(Exception):
    """Raised inside ``_column``: the values would not come back as they are."""


class Encoded:
    """An object's records as the header and buffers of its bytes."""

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0

    def buffer(self, data: Any) -> list[int]:
        """``data``'s place after the header, as ``[offset, size]``; 8-byte aligned."""
        pad = -self.size % 8
        if pad:
            self.parts.append(bytes(pad))
            self.size += pad
        view = memoryview(data).cast("B")
        self.parts.append(view)
        self.size += len(view)
        return [self.size - len(view), len(view)]

    def offsets(self, lengths: np.ndarray) -> tuple[list[int], bool]:
        """Arrow offsets of items of ``lengths`` as a buffer, and whether they need 64 bits."""
        ends = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        large = bool(ends[-1] > np.iinfo(np.int32).max)
        return self.buffer(ends if large else ends.astype(np.int32)), large

    def pieces(self, container: str, columns: dict[str, Any]) -> list[Any]:
        """The bytes, as pieces to write back to back; ``_NotExact`` for a header larger than a
        reader takes (a dict of very many keys)."""
        head = json.dumps({"container": container, "columns": columns}).encode()
        head += b" " * (-len(head) % 8)  # JSON's whitespace: the buffers start 8-byte aligned
        if len(head) > _HEADER_MAX:
            raise _NotExact
        return [len(head).to_bytes(8, "little"), head, *self.parts]


def _column(out: Encoded, column: Sequence[Any], depth: int = 0) -> dict[str, Any]:
    """``column`` (one key's values) as one Arrow array's node (type, length, buffers, children)
    in ``out``; ``_NotExact`` unless the module docstring's conditions hold."""
    n = len(column)
    kinds = set(map(type, column))
    nulls = _NONE in kinds
    kinds.discard(_NONE)
    if len(kinds) > 1 or depth > _MAX_DEPTH:
        raise _NotExact
    kind = kinds.pop() if kinds else None
    if kind is not None and kind is not list and kind is not dict and kind not in _SCALARS:
        raise _NotExact
    if kind is None:
        return {"t": "null", "n": n, "b": [None]}
    validity, present = None, column
    if nulls:
        valid = np.fromiter(map(operator.is_not, column, itertools.repeat(None)), dtype=bool, count=n)
        validity = out.buffer(np.packbits(valid, bitorder="little"))
        present = [v for v in column if v is not None]
    keys = tuple(present[0]) if kind is dict else ()
    if nulls:
        fill = dict.fromkeys(keys) if kind is dict else [] if kind is list else _FILL[kind]
        column = [fill if v is None else v for v in column]
    if kind is dict:  # one key order of str keys in every dict
        if not all(type(k) is str for k in keys) or not all(map(keys.__eq__, map(tuple, present))):
            raise _NotExact
        # a column a key, each one C-level pass over the dicts
        children = [_column(out, list(map(operator.itemgetter(k), column)), depth + 1) for k in keys]
        return {"t": "struct", "n": n, "b": [validity], "c": children, "f": list(keys)}
    if kind is list:
        offsets, large = out.offsets(np.fromiter(map(len, column), dtype=np.int64, count=n))
        child = _items(out, column, depth + 1)
        return {"t": "large_list" if large else "list", "n": n, "b": [validity, offsets], "c": [child]}
    if kind is int or kind is float:
        return _numbers(out, kind, column, n, validity)
    if kind is bool:
        bits = np.packbits(np.fromiter(column, dtype=bool, count=n), bitorder="little")
        return {"t": "bool", "n": n, "b": [validity, out.buffer(bits)]}
    encoded = [s.encode() for s in column] if kind is str else column
    offsets, large = out.offsets(np.fromiter(map(len, encoded), dtype=np.int64, count=n))
    name = ("large_" if large else "") + ("string" if kind is str else "binary")
    return {"t": name, "n": n, "b": [validity, offsets, out.buffer(b"".join(encoded))]}


def _numbers(out: Encoded, kind: type, values: Any, n: int, validity: list[int] | None) -> dict[str, Any]:
    """``n`` ints or floats from the iterable ``values`` as one column's node."""
    data = np.fromiter(values, dtype=np.int64 if kind is int else np.float64, count=n)
    return {"t": "int64" if kind is int else "float64", "n": n, "b": [validity, out.buffer(data)]}


_NUMBERS = {int: ("<i4", "int32"), float: ("<f8", "float64")}
"""A buffer's dtype and Arrow type for lists of exactly one kind of number (an int of 32 bits:
half the bytes of int64 to write, check and read)."""


def _items(out: Encoded, lists: Sequence[list[Any]], depth: int) -> dict[str, Any]:
    """The items of ``lists`` as one column's node. Numbers of one kind without None go straight
    from the lists into their buffer (no list of every item: 8 bytes an item more of peak)."""
    items = itertools.chain.from_iterable
    n, kind = sum(map(len, lists)), type(next(items(lists), None))
    if (kind is int or kind is float) and depth <= _MAX_DEPTH:
        fmt, arrow = _NUMBERS[kind]
        packed = exact_numbers(items(lists), n, kind, fmt)  # marshal's one C pass tells each item's type
        if packed is not None:
            return {"t": arrow, "n": n, "b": [None, out.buffer(packed)]}
        # every item's type counted in C, faster than collected into a set: exactly int (no bool) or float
        if operator.countOf(map(type, items(lists)), kind) == n:
            return _numbers(out, kind, items(lists), n, None)
    return _column(out, list(items(lists)), depth)


def encode(obj: Any) -> list[Any] | None:
    """``obj``'s bytes as pieces to write back to back, when it is records this round trip keeps
    exactly (the module docstring), else None."""
    kind = type(obj)
    if kind is dict:
        if not all(type(k) is str for k in obj):  # an empty dict: no values, below
            return None
        values = list(obj.values())
    elif kind is list or kind is tuple:
        values = list(obj)
    else:
        return None
    if not values or set(map(type, values)) != {dict} or not values[0]:
        return None
    out = Encoded()
    try:
        columns = {"v": _column(out, values)}
        if kind is dict:
            columns["k"] = _column(out, list(obj))
        return out.pieces(kind.__name__, columns)
    except (_NotExact, OverflowError, UnicodeError):
        return None  # mixed kinds, an int past 64 bits, a str that is no UTF-8: the general way


def copy(obj: Any) -> Any:
    """A deep copy of records ``encode`` took, equal to what ``decode`` returns: new dicts and
    lists, the str, bytes and numbers in them shared (immutable, as ``copy.deepcopy`` shares them)."""
    if type(obj) is dict:
        return dict(zip(obj, _dicts(list(obj.values())), strict=True))
    return tuple(_dicts(obj)) if type(obj) is tuple else _dicts(obj)


_NESTED = frozenset({list, dict})


def _dicts(rows: Any) -> list[Any]:
    """Dicts of one key order, or None, copied: each dict in C, then the lists and dicts under a
    key a column at a time (a key's values are of one kind, or None: ``encode`` checked)."""
    out = [None if d is None else d.copy() for d in rows]
    present = [d for d in out if d is not None]
    for k in present[0]:
        first = next((d[k] for d in present if d[k] is not None), None)
        if type(first) in _NESTED:
            for d in present:
                if d[k] is not None:
                    d[k] = _copy(d[k])
    return out


def _copy(value: Any) -> Any:
    """A list or dict in records copied."""
    if type(value) is dict:
        return _dicts([value])[0]
    for first in value:  # a list's items are of one kind, or None
        if first is not None:
            if type(first) is dict:
                return _dicts(value)
            if type(first) is list:
                return [None if v is None else _copy(v) for v in value]
            break
    return value.copy()


_CONTAINERS = {"dict": dict, "list": list, "tuple": tuple}


def _array(pa: Any, node: Any, body: Any, depth: int) -> Any:
    """The Arrow array ``node`` describes, its buffers sliced from ``body``; every offset checked."""
    if type(node) is not dict or depth > _MAX_DEPTH + 2:
        raise ValueError("a column is not described by a JSON object, or is nested too deep")
    t, n, refs = node.get("t"), node.get("n"), node.get("b")
    if type(n) is not int or n < 0 or type(refs) is not list:
        raise ValueError(f"column of type {t!r}: no length or buffers")
    buffers: list[Any] = []
    for ref in refs:
        if ref is None:
            buffers.append(None)
            continue
        if type(ref) is not list or len(ref) != 2 or not all(type(x) is int and x >= 0 for x in ref):
            raise ValueError(f"column of type {t!r}: a buffer's place {ref!r} is not [offset, size]")
        buffers.append(body.slice(ref[0], ref[1]))  # past the end: pyarrow's ArrowIndexError
    children = [_array(pa, c, body, depth + 1) for c in node.get("c", [])]
    if t == "struct":
        names = node.get("f")
        if type(names) is not list or len(names) != len(children) or not all(type(x) is str for x in names):
            raise ValueError("a struct column's field names do not match its children")
        typ = pa.struct([pa.field(k, c.type) for k, c in zip(names, children, strict=True)])
    elif t in ("list", "large_list"):
        if len(children) != 1:
            raise ValueError(f"a {t} column has {len(children)} children, not 1")
        typ = (pa.list_ if t == "list" else pa.large_list)(children[0].type)
    elif t in ("null", "int32", "int64", "float64", "bool", "string", "large_string", "binary", "large_binary") and not children:
        typ = pa.bool_() if t == "bool" else getattr(pa, t)()
    else:
        raise ValueError(f"a column of type {t!r}, which the records do not use")
    return pa.Array.from_buffers(typ, n, buffers, children=children if t in ("struct", "list", "large_list") else None)


def decode(data: Any, rank: int) -> Any:
    """The object ``encode`` made ``data`` of (its bytes checked before use; a checksum, where
    the caller has one, checked by the caller)."""
    import pyarrow as pa

    if not isinstance(data, (bytes, memoryview)):  # a spilled value: a uint8 array or tensor
        data = np.ascontiguousarray(np.asarray(data), dtype=np.uint8)
    whole = pa.py_buffer(data)
    try:
        size = int.from_bytes(bytes(whole.slice(0, 8)), "little") if len(whole) >= 8 else -1
        if not 0 < size <= min(len(whole) - 8, _HEADER_MAX) or size % 8 != 0:
            raise ValueError(f"a header of {size} bytes in {len(whole)}")
        header = json.loads(bytes(whole.slice(8, size)))
        container = _CONTAINERS[header["container"]]
        body = whole.slice(8 + size)
        columns = header["columns"]
        values = _array(pa, columns["v"], body, 0)
        values.validate(full=True)
        if container is not dict:
            return tuple(values.to_pylist()) if container is tuple else values.to_pylist()
        keys = _array(pa, columns["k"], body, 0)
        keys.validate(full=True)
        if keys.type != pa.string() or keys.null_count or len(keys) != len(values):
            raise ValueError("the dict's keys are not one str per value")
        return dict(zip(keys.to_pylist(), values.to_pylist(), strict=True))
    except (pa.ArrowException, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CorruptSpillError(f"rank {rank}'s records are not the bytes a drop-in writes: {exc}") from exc
