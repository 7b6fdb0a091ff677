"""Python numbers converted by marshal: ``marshal.dumps(list, 2)`` writes the items of a list in
one C pass and its bytes tell each item's exact type, so one numpy view of them checks every type
and takes every value. Faster than a type check per item and ``np.array`` / ``np.fromiter`` /
``array.array`` from a few dozen items on (:data:`SHORT`); fewer go the other way."""

from __future__ import annotations

import itertools
import marshal
from collections.abc import Iterable
from typing import Any

import numpy as np

SHORT = 40
"""Fewer items convert faster by a type check per item and ``array.array`` / ``np.fromiter``."""
PART = 1 << 15
"""Items marshalled at a time: the bytes and the copy of a part stay small (in cache)."""

_ITEMS: dict[type, tuple[bytes, np.dtype[Any]]] = {int: (b"i", np.dtype("<i4")), float: (b"g", np.dtype("<f8"))}
"""marshal's format 2 (no back-references): a list is ``[`` and its length (4 bytes), an int of
32 bits ``i`` and its 4 bytes, a float ``g`` and its 8; a bool, None, a larger int or another
type has another code and size, a subclass of int or float is refused (ValueError)."""


def exact_numbers(values: Iterable[Any], n: int, kind: type, dtype: Any) -> np.ndarray | None:
    """The ``n`` items of ``values`` (a list, or an iterable of them) as an array of ``dtype``,
    when every item is of exactly ``kind`` (int or float) and an int fits in 32 bits; None
    otherwise, and for another ``kind``."""
    if kind not in _ITEMS:
        return None
    if type(values) is list and n <= PART:
        got = _part(values, kind)
        return None if got is None or len(got) != n else got.astype(dtype)
    out = np.empty(n, dtype=dtype)
    items = iter(values)
    for start in range(0, n, PART):
        got = _part(list(itertools.islice(items, PART)), kind)
        if got is None or len(got) != min(PART, n - start):
            return None
        out[start : start + len(got)] = got
    return out


def _part(values: list[Any], kind: type) -> np.ndarray | None:
    """``exact_numbers`` of the list ``values``, as a view of marshal's bytes."""
    code, dtype = _ITEMS[kind]
    try:
        raw = marshal.dumps(values, 2)
    except ValueError:  # a subclass of int or float somewhere
        return None
    n, size = len(values), 1 + dtype.itemsize
    # Every code checked where the layout puts it: the first item of another kind shows its own.
    if len(raw) != 5 + n * size or raw[:1] != b"[" or raw[5::size] != code * n:
        return None
    return np.ndarray((n,), dtype, raw, 6, (size,))  # each value, after its code
