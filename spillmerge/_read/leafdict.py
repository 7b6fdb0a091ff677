"""The nested dict a file's value reads as (``store[filename]``), by leaf path: a plain ``dict``
whose missing keys raise :class:`UnknownLeafError` naming the file, the leaf and the leaves it
has, as ``column()`` does for columns (a ``KeyError`` still, so ``in`` and ``.get`` work)."""

from __future__ import annotations

from typing import Any

from .._errors import UnknownLeafError


class LeafDict(dict[str, Any]):
    """One level of a file's value: ``prefix`` is the leaf path down to it (``()`` at the top)."""

    # Slots: no per-instance __dict__ to allocate, one LeafDict per file read in order.
    __slots__ = ("filename", "prefix")
    filename: str
    prefix: tuple[str, ...]

    @classmethod
    def top(cls, filename: str, prefix: tuple[str, ...] = ()) -> LeafDict:
        """The level ``prefix`` (``()``: the top) of ``filename``'s value (a ``str``: a numpy str's
        repr would show in messages), made without a Python ``__init__``: one per file read, so it
        counts when files are read in order."""
        out = cls.__new__(cls)
        out.filename = filename
        out.prefix = prefix
        return out

    def child(self, key: str) -> LeafDict:
        """The level below ``key``, created when absent."""
        node = self.get(key)
        if node is None:
            node = self[key] = LeafDict.top(self.filename, (*self.prefix, key))
        return node  # type: ignore[no-any-return]

    def __missing__(self, key: object) -> Any:
        leaf = "/".join((*self.prefix, str(key)))
        known = ["/".join((*self.prefix, k)) for k in sorted(self)]
        where = f"; leaves under {'/'.join(self.prefix)!r}" if self.prefix else "; its leaves"
        raise UnknownLeafError(
            f"{self.filename!r} has no leaf {leaf!r}{where}: {', '.join(map(repr, known)) or 'none'}",
            filename=self.filename,
            leaf=leaf,
            known=known,
        )
