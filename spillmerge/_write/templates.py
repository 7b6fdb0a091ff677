"""Repeated value structures the writer recognises instead of re-deriving them.

A job writes millions of values of one structure (``{"logits": fp16[1000], "emb": fp16[512]}``
per image). What ``_write.flatten.flatten`` checks and yields and the frame's catalog ids
depend only on that structure, so the writer derives them once and keeps them here: a new
file's flat dict of host tensors / arrays (:class:`FrameTemplate`, ``write``) or of Python
values (:class:`PyTemplate`, ``write``: an LLM output ``{text, token_ids, logprob,
finish_reason}``), a dense batch's signature (:class:`DenseTemplate`, ``write_batch``).

Protocol (writer): after a frame / batch of new files went the general way, build the template
from what it derived (``FrameTemplate.of`` / ``DenseTemplate``); for the next value ``match``
it (``FrameTemplate``) or look it up by signature (``DenseTemplate``); anything that does not
match takes the general way, which names what it refuses.
"""

from __future__ import annotations

import array
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._format import spill as FS
from .._format.common import MARK, STRING_MAX_BYTES
from .._util.marshalled import SHORT, exact_numbers
from .leaves import PY_NUMBERS, PY_PACK, host_array

if TYPE_CHECKING:
    from .layouts import LayoutCatalog


@dataclass(frozen=True, slots=True)
class FrameTemplate:
    """The structure of a flat dict of host arrays that ``write()`` staged into a new file: a
    value that matches it is staged without ``flatten``, ``Leaf`` records or catalog lookups."""

    keys: tuple[str, ...]
    """The dict's keys, sorted (the order of its leaves and index rows)."""
    order: tuple[str, ...]
    """The dict's keys in the order it held them (its layouts carry that order)."""
    dtypes: tuple[np.dtype[Any], ...]
    """Each leaf's numpy dtype (native byte order: the format's little-endian bytes)."""
    shapes: tuple[tuple[int, ...], ...]
    """Each leaf's shape."""
    sizes: tuple[int, ...]
    """Each leaf's bytes (all > 0)."""
    total: int
    """The frame's bytes."""
    layout_ids: tuple[int, ...]
    """The frame's catalog layout ids (fixed once in the catalog)."""

    @staticmethod
    def of(leaves: list[Any], layout_ids: tuple[int, ...]) -> FrameTemplate | None:
        """The template of a frame whose ``leaves`` came from ``_write.flatten.flatten_dense``
        of a dict (paths of one key, host uint8 views), staged into a new file with
        ``layout_ids``; None when a leaf is empty (the general way stages it)."""
        if not leaves or any(len(leaf.path) != 1 or not leaf.nbytes for leaf in leaves) or -1 in layout_ids:
            return None
        sizes = tuple(int(leaf.nbytes) for leaf in leaves)
        keys = tuple(leaf.path[0] for leaf in leaves)
        pos = [leaf.pos[0] if leaf.pos is not None else i for i, leaf in enumerate(leaves)]
        return FrameTemplate(
            keys=keys,
            order=tuple(k for _, k in sorted(zip(pos, keys, strict=True))),
            dtypes=tuple(np.dtype(leaf.dtype) for leaf in leaves),
            shapes=tuple(tuple(leaf.shape) for leaf in leaves),
            sizes=sizes,
            total=sum(sizes),
            layout_ids=tuple(layout_ids),
        )

    def match(
        self, value: dict[Any, Any], catalog: LayoutCatalog
    ) -> tuple[list[np.ndarray], tuple[int, ...], int, tuple[int, ...]] | None:
        """``(data, sizes, total, layout_ids)`` as ``PyTemplate.match``'s (``catalog`` holds every
        layout already), ``data`` each leaf's bytes (flat uint8 views, in key order), when
        ``value`` has this structure: the same keys, each a plain host tensor or array of the same
        dtype and shape, C-contiguous; None otherwise. ``Tensor.numpy()`` refuses what needs care
        (autograd, conj / neg bits, other devices and layouts), exactly as ``flatten_dense`` relies on."""
        if len(value) != len(self.keys) or tuple(value) != self.order:
            return None
        out = []
        for k, dtype, shape in zip(self.keys, self.dtypes, self.shapes, strict=True):
            a = host_array(value.get(k))
            if a is None or a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
                return None
            out.append(a.view(np.uint8) if a.ndim == 1 else a.reshape(-1).view(np.uint8))
        return out, self.sizes, self.total, self.layout_ids


@dataclass(slots=True)
class DenseTemplate:
    """What every item of a dense batch of one signature stages (``SpillWriter._dense_template``)."""

    paths: tuple[tuple[str, ...], ...]
    """The batch's leaf paths (as given) in the order ``flatten`` puts the item's leaves."""
    layouts: list[FS.Layout]
    """The item's layouts, in that order."""


_PY_TYPES = {name: t for t, name in PY_NUMBERS.items()}
_PY_ARRAY = {"pyint": "q", "pyfloat": "d", "pybool": "b"}
"""``array.array`` (and numpy) type codes of the same bytes as the dtypes' storage on a
little-endian host: a short list converts in a third of ``np.array``'s time."""
_STR, _NONE, _SCALAR, _LIST = 0, 1, 2, 3


@dataclass(slots=True)
class PyTemplate:
    """The structure of a flat dict of Python values that ``write()`` staged into a new file the
    general way: each key a ``str``, ``None``, an ``int`` / ``float`` / ``bool`` or a non-empty
    list of one of those types. ``match`` makes the leaves ``_write.flatten.flatten`` would make
    of a value of the same structure (the same bytes, dtypes, shapes and key positions)."""

    order: tuple[str, ...]
    """The dict's keys in the order it held them."""
    keys: tuple[str, ...]
    """The keys sorted (the order of the frame's leaves)."""
    kinds: tuple[tuple[int, type, Any], ...]
    """Per leaf: what it is (``_STR`` ...), the exact Python type of the value (of its items for
    a list), and the ``struct`` of a scalar."""
    layouts: tuple[FS.Layout, ...]
    """The leaves' layouts in the first frame (paths, dtypes and key positions of every frame)."""
    ids: tuple[dict[int, int], ...]
    """Per leaf: catalog layout id by the leaf's length (one entry for a scalar or ``None``)."""

    @staticmethod
    def of(value: dict[Any, Any], leaves: list[Any], layout_ids: tuple[int, ...]) -> PyTemplate | None:
        """The template of ``value``, whose ``leaves`` (``flatten``'s) were staged into a new
        file with ``layout_ids``; None when it is not such a flat dict."""
        if len(leaves) != len(value) or not leaves or -1 in layout_ids or sys.byteorder != "little":
            return None
        kinds: list[tuple[int, type, Any]] = []
        layouts: list[FS.Layout] = []
        ids: list[dict[int, int]] = []
        for leaf, lid in zip(leaves, layout_ids, strict=True):
            key = leaf.path[0] if len(leaf.path) == 1 else None
            if type(key) is not str or key not in value or key.startswith(MARK):
                return None
            v, dtype, n = value[key], leaf.dtype, leaf.shape[0] if leaf.shape else 0
            if dtype == "str" and type(v) is str:
                kinds.append((_STR, str, None))
            elif dtype == "none" and v is None:
                kinds.append((_NONE, type(None), None))
            elif dtype in PY_PACK and not leaf.shape and type(v) is _PY_TYPES[dtype]:
                kinds.append((_SCALAR, _PY_TYPES[dtype], PY_PACK[dtype]))
            elif dtype in PY_PACK and len(leaf.shape) == 1 and n and type(v) is list and type(v[0]) is _PY_TYPES[dtype]:
                kinds.append((_LIST, _PY_TYPES[dtype], _PY_ARRAY[dtype]))
            else:
                return None
            layouts.append(FS.Layout(leaf.path, dtype, tuple(leaf.shape), leaf.pos))
            ids.append({n: lid})
        order = tuple(value)
        return PyTemplate(order, tuple(sorted(order)), tuple(kinds), tuple(layouts), tuple(ids))

    def match(
        self, value: dict[Any, Any], catalog: LayoutCatalog
    ) -> tuple[bytes, list[int], int, tuple[int, ...]] | None:
        """``(bytes, sizes, total, layout_ids)`` of a frame of ``value`` when it has this
        structure: its leaves' bytes back to back (a leaf's length seen for the first time joins
        the catalog: the frame is accepted as it is); None otherwise, and for what the general
        way must look at or refuse (an empty list, an int beyond int64, a lone surrogate, a
        string over the format's limit, a frame of no bytes)."""
        if tuple(value) != self.order:
            return None
        parts: list[Any] = []
        sizes: list[int] = []
        lids: list[int] = []
        try:
            for key, (kind, typ, how), ids, lay in zip(self.keys, self.kinds, self.ids, self.layouts, strict=True):
                v = value[key]
                if kind == _LIST:
                    raw: Any = exact_numbers(v, len(v), typ, how) if type(v) is list and len(v) >= SHORT else None
                    if raw is None:  # a short list, or one marshal does not take: each item's type checked
                        if type(v) is not list or not v or (len(v) > 1 and set(map(type, v)) != {typ}) or type(v[0]) is not typ:
                            return None
                        raw = array.array(how, v)
                    n, size = len(v), len(v) * raw.itemsize
                elif type(v) is not typ:
                    return None
                elif kind == _STR:
                    raw = v.encode("utf-8")  # type: ignore[attr-defined]
                    n = size = len(raw)
                    if n > STRING_MAX_BYTES:
                        return None
                else:  # a scalar or None
                    raw = how.pack(v) if kind == _SCALAR else b""
                    n, size = 0, len(raw)
                lid = ids.get(n)
                if lid is None:
                    lid = ids[n] = catalog.add(FS.Layout(lay.leaf, lay.dtype, (n,), lay.pos))
                parts.append(raw)
                sizes.append(size)
                lids.append(lid)
        except (OverflowError, UnicodeEncodeError, struct.error):  # an int beyond int64, a lone surrogate
            return None
        total = sum(sizes)
        return (b"".join(parts), sizes, total, tuple(lids)) if total else None
