"""Repeated value structures the writer recognises instead of re-deriving them (issue 22).

A job writes millions of values of one structure (``{"logits": fp16[1000], "emb": fp16[512]}``
per image). What ``_write.flatten.flatten`` checks and yields, the layout rule's move from a new file's
empty schema and the frame's catalog ids depend only on that structure, so the writer derives
them once and keeps them here:

- :class:`FrameTemplate` (``write``): the flat dict of host tensors / arrays of the last new
  file written; a value of the same keys, dtypes and shapes, C-contiguous on the host, is staged
  from it without ``flatten``, ``Leaf`` records, the layout rule or a row list per frame.
- :class:`DenseTemplate` (``write_batch``): a dense batch's leaves by signature (paths, array
  types, dtypes, item shapes), item 0 flattened and checked once for every later batch like it.

Protocol (writer): after a frame / batch of new files went the general way, build the template
from what it derived (``FrameTemplate.of`` / ``DenseTemplate``); for the next value ``match``
it (``FrameTemplate``) or look it up by signature (``DenseTemplate``); anything that does not
match takes the general way, which names what it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._format import spill as FS


@dataclass(frozen=True, slots=True)
class FrameTemplate:
    """The structure of a flat dict of host arrays that ``write()`` staged into a new file."""

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
    schema: int
    """A new file's schema after one such frame (``FileSchemas``; a pure function of the frame's
    leaf signatures)."""
    layout_ids: tuple[int, ...]
    """The frame's catalog layout ids (fixed once in the catalog)."""
    starts: np.ndarray
    """int64 offset of each leaf from the frame's first byte."""

    @staticmethod
    def of(leaves: list[Any], schema: int, layout_ids: tuple[int, ...]) -> FrameTemplate | None:
        """The template of a frame whose ``leaves`` came from ``_write.flatten.flatten_dense`` of a dict
        (paths of one key, host uint8 views), accepted as ``(schema, layout_ids)`` into a new
        file; None when a leaf is empty (the general way stages it)."""
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
            schema=schema,
            layout_ids=tuple(layout_ids),
            starts=np.cumsum((0, *sizes[:-1]), dtype=np.int64),
        )

    def match(self, value: dict[Any, Any]) -> list[np.ndarray] | None:
        """Each leaf's bytes (flat uint8 views, in key order) when ``value`` has this structure:
        the same keys, each a plain host tensor or array of the same dtype and shape,
        C-contiguous; None otherwise. ``Tensor.numpy()`` refuses what needs care (autograd,
        conj / neg bits, other devices and layouts), exactly as ``flatten_dense`` relies on."""
        if len(value) != len(self.keys) or tuple(value) != self.order:
            return None
        out = []
        for k, dtype, shape in zip(self.keys, self.dtypes, self.shapes, strict=True):
            v = value.get(k)
            t = type(v)
            if t is torch.Tensor:
                try:
                    a = v.numpy()  # type: ignore[union-attr]
                except (RuntimeError, TypeError):
                    return None
            elif t is np.ndarray:
                a = v
            else:
                return None
            if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
                return None
            out.append(a.view(np.uint8) if a.ndim == 1 else a.reshape(-1).view(np.uint8))
        return out


@dataclass(slots=True)
class DenseTemplate:
    """What every item of a dense batch of one signature stages (``SpillWriter._dense_template``)."""

    paths: tuple[tuple[str, ...], ...]
    """The batch's leaf paths (as given) in the order ``flatten`` puts the item's leaves."""
    layouts: list[FS.Layout]
    """The item's layouts, in that order."""
    fresh_move: tuple[int, tuple[int, ...]] | None = None
    """(schema, catalog layout ids) of a new file after one such frame, once a batch of new
    files was accepted (ids in the catalog never change; the move is a pure function)."""
