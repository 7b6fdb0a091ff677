"""The plan's filenames as a string table: UTF-8 bytes (``surrogatepass``) back to back and int64
offsets (Arrow's large_string layout), no Python ``str`` per name. A name is decoded when it is
asked for; the arrays may be maps of files, so a plan of 10^9 names holds none in memory."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, overload

import numpy as np


class NameTable(Sequence[str]):
    """Sorted, distinct filenames: ``len``, ``names[i]``, ``names[a:b]`` (a list), iteration,
    :meth:`search` (a position or -1), and the arrays themselves (:attr:`data`, :attr:`offsets`)."""

    def __init__(
        self, data: np.ndarray, offsets: np.ndarray, *, heads: dict[int, tuple[Any, Any]] | None = None
    ) -> None:
        self.data = data
        """uint8: the names' bytes back to back."""
        self.offsets = offsets
        """int64 (n + 1,): name i is ``data[offsets[i]:offsets[i + 1]]``, from 0."""
        self._heads = heads or {}
        """:meth:`index_arrays`' heads (bytes, offsets) by ``block``, when known (a stored plan
        carries them: reading every ``block``-th name would touch every block of ``data``)."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def raw(self, i: int) -> bytes:
        """Name ``i``'s UTF-8 bytes."""
        return bytes(self.data[int(self.offsets[i]) : int(self.offsets[i + 1])])

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        k = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= k < n:
            raise IndexError(f"filename {i} of {n}")
        return self.raw(k).decode("utf-8", "surrogatepass")

    def search(self, name: str) -> int:
        """The position of ``name``, or -1 (a binary search on the bytes: their order is the
        names' code-point order)."""
        key = name.encode("utf-8", "surrogatepass")
        lo = bisect.bisect_left(range(len(self)), key, key=self.raw)
        return lo if lo < len(self) and self.raw(lo) == key else -1

    def index_arrays(self, block: int) -> dict[str, np.ndarray]:
        """The output's ``index/filenames``, ``filename_offsets``, ``filename_heads`` and
        ``filename_head_offsets`` (the first name of every ``block``)."""
        known = self._heads.get(block)
        if known is None:
            heads = table_of([self[k] for k in range(0, len(self), block)])
            known = (heads.data, heads.offsets)
        return {"filenames": self.data, "filename_offsets": self.offsets, "filename_heads": known[0],
                "filename_head_offsets": known[1]}  # fmt: skip


def table_of(names: Sequence[str]) -> NameTable:
    """``names`` as a :class:`NameTable`."""
    enc = [f.encode("utf-8", "surrogatepass") for f in names]
    offsets = np.cumsum([0, *map(len, enc)], dtype=np.int64)
    return NameTable(np.frombuffer(b"".join(enc), dtype=np.uint8), offsets)
