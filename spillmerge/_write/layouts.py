"""The per-file leaf rule of one writer, and its layout catalog.

A leaf's kind, dtype and ndim may change between the frames of a file, and a
path hold a value in some frames and a dict, list or tuple in others (the merge stores each
variant in a column of its own, docs/FORMAT.md *Value model*): the schema records what each
path held first, and the catalog the layouts of accepted frames.

Protocol (the writer, once per frame, before anything of the frame is staged):
  :meth:`FileSchemas.check` → the writer's duplicate policy →
  :meth:`FileSchemas.accept` (the file's new schema; the frame's new layouts join the catalog)
"""

from __future__ import annotations

from typing import Any

from .._format import spill as FS

_Sig = tuple[str, str | None, int | None]
"""What a leaf must keep within a file: (kind, numeric dtype or None when not yet known, ndim)."""


_FRAME_CACHE = 4096
"""Distinct frame layouts remembered by ``FileSchemas.layouts_of`` before it starts over."""


class _Layouts(list[FS.Layout]):
    """A frame's layouts, carrying the key ``FileSchemas.layouts_of`` made them for."""

    key: tuple[Any, ...] | None = None


class FileSchemas:
    """What each file's leaves have been so far on rank ``rank``, and the catalog of layouts of
    accepted frames (``layouts``, in catalog-id order; the writer journals and commits it).

    A file's schema is an id into ``_schemas``, interned because millions of one-frame files
    share a handful of schemas; a frame's move from one schema to the next is cached in
    ``_transitions`` by the frame's leaf signatures, which ignore shapes, so ragged frames hit
    the cache too."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.layouts: list[FS.Layout] = []
        """The catalog: layouts of accepted frames, in id order (append-only)."""
        self._layout_ids: dict[FS.Layout, int] = {}
        self._file_schema: list[int] = []  # file_id -> schema id
        self._schemas: list[dict[tuple[str, ...], _Sig]] = [{}]
        self._schema_ids: dict[frozenset[tuple[tuple[str, ...], _Sig]], int] = {frozenset(): 0}
        self._transitions: dict[tuple[int, tuple[int, ...]], int] = {}
        # layout -> (catalog id, or -1 until a frame using it is accepted; signature id)
        self._known: dict[FS.Layout, tuple[int, int]] = {}
        self._sigs: list[tuple[tuple[str, ...], _Sig]] = []
        self._sig_ids: dict[tuple[tuple[str, ...], _Sig], int] = {}
        self._frame_layouts: dict[tuple[Any, ...], _Layouts] = {}
        self._frame_infos: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._by_length: dict[tuple[Any, ...], dict[int, int]] = {}

    def check(self, file_id: int, layouts: list[FS.Layout], schema: int | None = None) -> tuple[int, tuple[int, ...]]:
        """The schema of file ``file_id`` (a new file: the next id) after this frame, and the
        frame's layout ids (-1 where a layout is not in the catalog yet); changes nothing the
        catalog shows (``accept`` does, once the frame passed the duplicate policy). ``schema``:
        the file's schema before this frame when it is not the accepted one (a batch checks its
        items before accepting any)."""
        if schema is None:
            schema = self._file_schema[file_id] if file_id < len(self._file_schema) else 0
        frame_key = getattr(layouts, "key", None)
        cached = self._frame_infos.get(frame_key) if frame_key is not None else None
        if cached is None:
            known = self._known  # one lookup per leaf: write() runs once per frame
            infos = [known.get(lay) or self._new_layout(lay) for lay in layouts]  # new: a new leaf or ragged shape
            cached = (tuple([info[1] for info in infos]), tuple([info[0] for info in infos]))
            if frame_key is not None and -1 not in cached[1]:  # ids in the catalog never change
                self._frame_infos[frame_key] = cached
        sigs, ids = cached
        new_schema = self._transitions.get((schema, sigs))
        if new_schema is None:
            new_schema = self._next_schema(schema, sigs)
        return new_schema, ids

    def layouts_of(self, leaves: list[Any]) -> list[FS.Layout]:
        """The layouts of a frame's leaves, made once per distinct (paths, dtypes, shapes): a
        repeated frame shape skips building and hashing its ``Layout`` records (``check`` finds
        its catalog ids and signatures by the same key)."""
        key = tuple([(leaf.path, leaf.dtype, leaf.shape, leaf.pos) for leaf in leaves])
        layouts = self._frame_layouts.get(key)
        if layouts is None:
            if len(self._frame_layouts) >= _FRAME_CACHE:  # ragged frames: bounded memory
                self._frame_layouts.clear()
                self._frame_infos.clear()
            layouts = self._frame_layouts[key] = _Layouts(FS.Layout(*k) for k in key)
            layouts.key = key
        return layouts

    def accept(
        self, file_id: int, schema: int, layouts: list[FS.Layout], layout_ids: tuple[int, ...]
    ) -> tuple[int, ...]:
        """The frame checked as ``(schema, layout_ids)`` is written: file ``file_id`` (a new
        file: the next id) now has ``schema``, and the frame's new layouts join the catalog.
        Returns the frame's catalog ids."""
        if file_id == len(self._file_schema):
            self._file_schema.append(schema)
        else:
            self._file_schema[file_id] = schema
        if -1 in layout_ids:  # the frame is accepted: its new layouts join the catalog
            layout_ids = tuple([self._layout_id(lay) for lay in layouts])
        return layout_ids

    def accept_files(
        self, schemas: dict[int, int], layouts: list[FS.Layout], layout_ids: tuple[int, ...]
    ) -> tuple[int, ...]:
        """:meth:`accept` for a batch of frames of the same ``layouts``: file ``fid`` now has
        ``schemas[fid]`` (new files: the next ids, in order). Returns the frames' catalog ids."""
        for fid in sorted(schemas):
            if fid == len(self._file_schema):
                self._file_schema.append(schemas[fid])
            else:
                self._file_schema[fid] = schemas[fid]
        if -1 in layout_ids:
            layout_ids = tuple([self._layout_id(lay) for lay in layouts])
        return layout_ids

    def accept_new_files(
        self, n: int, schema: int, layouts: list[FS.Layout], layout_ids: tuple[int, ...]
    ) -> tuple[int, ...]:
        """:meth:`accept_files` for ``n`` new files (the next ids) that all have ``schema`` now."""
        self._file_schema.extend([schema] * n)
        if -1 in layout_ids:
            layout_ids = tuple([self._layout_id(lay) for lay in layouts])
        return layout_ids

    def schema_of(self, file_id: int) -> int:
        """The accepted schema of file ``file_id`` (0, the empty schema, for a new file)."""
        return self._file_schema[file_id] if file_id < len(self._file_schema) else 0

    def add_layout(self, lay: FS.Layout) -> int:
        """The catalog id of ``lay``, a layout of a frame being accepted whose signatures are
        those of a move already made (``_write.templates.PyTemplate``: a ragged length)."""
        if lay not in self._known:
            self._new_layout(lay)
        return self._layout_id(lay)

    def length_ids(self, lay: FS.Layout, lengths: list[int]) -> list[int]:
        """The catalog ids of ``lay`` with its first dimension at each of ``lengths`` (-1: a 0-d
        leaf), layouts of frames being accepted by a move already made (``add_layout``)."""
        known = self._by_length.setdefault((lay.leaf, lay.dtype, lay.shape[1:], lay.pos), {})
        ids = []
        for m in lengths:
            lid = known.get(m)
            if lid is None:
                shape = () if m < 0 else (m, *lay.shape[1:])
                lid = known[m] = self.add_layout(FS.Layout(lay.leaf, lay.dtype, shape, lay.pos))
            ids.append(lid)
        return ids

    def _layout_id(self, lay: FS.Layout) -> int:
        """The catalog id of a layout, added to the catalog on first use (only for frames that
        passed the layout rule: a refused frame leaves no layout a merge would trip on)."""
        lid = self._layout_ids.get(lay)
        if lid is None:
            lid = len(self.layouts)
            self.layouts.append(lay)
            self._layout_ids[lay] = lid
            self._known[lay] = (lid, self._known[lay][1])
        return lid

    def _new_layout(self, lay: FS.Layout) -> tuple[int, int]:
        """Know ``lay`` (no layout id yet) with its signature: what must stay the same for its leaf
        within one file (kind, numeric dtype, ndim), not its shape. A ``none`` row and a numeric
        row of zero elements say nothing about the dtype (``[]`` is float64 whatever the other
        rows hold)."""
        kind = lay.kind
        if kind == "none":
            sig: _Sig = ("none", None, None)
        elif kind == "num":
            sig = ("num", None if 0 in lay.shape else lay.dtype, len(lay.shape))
        else:
            sig = (kind, None, None)
        full = (lay.leaf, sig)
        sid = self._sig_ids.get(full)
        if sid is None:
            sid = self._sig_ids[full] = len(self._sigs)
            self._sigs.append(full)
        info = self._known[lay] = (-1, sid)
        return info

    def _next_schema(self, schema: int, sigs: tuple[int, ...]) -> int:
        """The file's schema after this frame (the module docstring)."""
        state = dict(self._schemas[schema])
        for sid in sigs:
            path, sig = self._sigs[sid]
            cur = state.get(path)
            if cur is None:
                state[path] = sig
            elif cur[0] == "none" or (cur[1] is None and sig[1] is not None):
                state[path] = sig  # the first variant that says something (variants may differ)
        key = frozenset(state.items())
        new = self._schema_ids.get(key)
        if new is None:
            new = self._schema_ids[key] = len(self._schemas)
            self._schemas.append(state)
        self._transitions[(schema, sigs)] = new
        return new
