"""One writer's layout catalog: every distinct layout (leaf path, dtype, shape, key positions) of
the frames it staged, in id order. The flush thread journals it with the chunks and the commit
stores it (docs/FORMAT.md). A layout joins only when a frame using it is staged: a refused frame
or batch leaves none behind. A leaf's kind, dtype and shape may differ between the frames of a
file (the merge stores each variant in a column of its own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._format import spill as FS

_FRAME_CACHE = 4096
"""Distinct frame layouts remembered by ``LayoutCatalog.layouts_of`` before it starts over."""


class _Layouts(list[FS.Layout]):
    """A frame's layouts, carrying the key ``LayoutCatalog.layouts_of`` made them for."""

    key: tuple[Any, ...] | None = None


class LayoutCatalog:
    """The catalog (``layouts``, append-only, in id order) and the lookups that find a frame's ids."""

    def __init__(self) -> None:
        self.layouts: list[FS.Layout] = []
        self._ids: dict[FS.Layout, int] = {}
        self._frame_layouts: dict[tuple[Any, ...], _Layouts] = {}
        self._frame_ids: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self._shape_ids: dict[tuple[Any, ...], dict[tuple[int, ...], int]] = {}

    def ids(self, layouts: list[FS.Layout]) -> tuple[int, ...]:
        """A frame's catalog ids, -1 where a layout is not in the catalog yet (:meth:`accept`
        adds it once the frame is staged)."""
        key = getattr(layouts, "key", None)
        cached = self._frame_ids.get(key) if key is not None else None
        if cached is None:
            get = self._ids.get
            cached = tuple([get(lay, -1) for lay in layouts])
            if key is not None and -1 not in cached:  # ids in the catalog never change
                self._frame_ids[key] = cached
        return cached

    def layouts_of(self, leaves: list[Any]) -> list[FS.Layout]:
        """The layouts of a frame's leaves, made once per distinct (paths, dtypes, shapes): a
        repeated frame shape skips building and hashing its ``Layout`` records (``ids`` finds
        them by the same key)."""
        key = tuple([(leaf.path, leaf.dtype, leaf.shape, leaf.pos) for leaf in leaves])
        layouts = self._frame_layouts.get(key)
        if layouts is None:
            if len(self._frame_layouts) >= _FRAME_CACHE:  # ragged frames: bounded memory
                self._frame_layouts.clear()
                self._frame_ids.clear()
            layouts = self._frame_layouts[key] = _Layouts(FS.Layout(*k) for k in key)
            layouts.key = key
        return layouts

    def accept(self, layouts: list[FS.Layout], ids: tuple[int, ...]) -> tuple[int, ...]:
        """The catalog ids of a frame being staged (``ids`` from :meth:`ids`): its layouts not
        in the catalog yet join it."""
        return tuple([self.add(lay) for lay in layouts]) if -1 in ids else ids

    def add(self, lay: FS.Layout) -> int:
        """The catalog id of ``lay``, a layout of a frame being staged; added on first use."""
        lid = self._ids.get(lay)
        if lid is None:
            lid = self._ids[lay] = len(self.layouts)
            self.layouts.append(lay)
        return lid

    def shape_ids(self, lay: FS.Layout, shapes: Sequence[tuple[int, ...]]) -> list[int]:
        """The catalog ids of ``lay`` with each of ``shapes`` (a batch's frames of one leaf,
        being staged), added on first use: a shape seen before costs a dict lookup, not a
        ``Layout`` made and hashed (ragged leaves of a batch: a shape per length)."""
        known = self._shape_ids.setdefault((lay.leaf, lay.dtype, lay.pos), {})
        out = []
        for shape in shapes:
            lid = known.get(shape)
            if lid is None:
                lid = known[shape] = self.add(FS.Layout(lay.leaf, lay.dtype, shape, lay.pos))
            out.append(lid)
        return out
