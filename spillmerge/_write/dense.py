"""``write_batch`` of dense batches (tensors / arrays with a batch dimension, or flat dicts of
them): item 0 flattened and checked for all, then staged a block at a time (``Staging.add_frames``),
exactly as item by item writes would stage them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import SpillValueError
from .._format import spill as FS
from .._format.common import user_key
from .batch import as_rows, at_position, nest
from .columns import first_leaves, flat_columns
from .flatten import flatten
from .layouts import LayoutCatalog
from .staging import Staging
from .templates import DenseTemplate


class DenseSteps:
    """``SpillWriter``'s vectorised ``write_batch`` steps; they use the writer's state declared here."""

    allow_pickle: bool
    _filenames: list[str]
    _file_ids: dict[str, int]
    _catalog: LayoutCatalog
    _staging: Staging
    _n_rows: int
    _keys: dict[tuple[int, int], tuple[int, int]]
    _fresh_keys: list[tuple[int, list[int], int, int]]
    _n_fresh_keys: int
    _dense_templates: dict[tuple[Any, ...], DenseTemplate]

    if TYPE_CHECKING:

        def _key_map(self) -> dict[tuple[int, int], tuple[int, int]]: ...

        def _put(
            self, filename: str, frame: int, leaves: list[Any], layouts: list[FS.Layout] | None = None
        ) -> tuple[int, ...] | None: ...

    def _put_dense(self, names: list[str], frames: list[int], columns: dict[tuple[str, ...], Any]) -> bool:
        """The vectorised ``write_batch`` of a batch of host tensors / arrays: every item has the
        same layouts, so item 0 is flattened and checked for all, and the bytes and journal rows
        of the frames are made a block at a time (``Staging.add_frames``), the same as
        item-by-item writes make them. False (nothing done) when a key of the batch was written
        before or repeats in it: the item-by-item path applies the duplicate policy."""
        n = len(names)
        base = len(self._filenames)
        # The common batch: n files never written before, each once. Their ids are the next n and
        # no key can repeat.
        fresh = self._file_ids.keys().isdisjoint(names) and len(set(names)) == n
        file_ids: Any
        new_names: dict[str, int] = {}
        if fresh:
            file_ids = range(base, base + n)
        else:
            file_ids = []
            next_id = base
            for name in names:
                fid = self._file_ids.get(name)
                if fid is None:
                    fid = new_names.get(name)
                    if fid is None:
                        fid = new_names[name] = next_id
                        next_id += 1
                file_ids.append(fid)
            keys = list(zip(file_ids, frames, strict=True))
            known = self._key_map()
            if len(set(keys)) != n or (known and any(k in known for k in keys)):
                return False
        template = self._dense_template(names, frames, columns)
        if template is None:
            return False
        rows = [as_rows(columns[path], n) for path in template.paths]
        if template.ids is None:  # ids in the catalog never change: once per template
            template.ids = self._catalog.accept(template.layouts, self._catalog.ids(template.layouts))
        layout_ids = template.ids
        if fresh:
            self._filenames.extend(names)
            self._file_ids.update(zip(names, range(base, base + n), strict=True))
            self._stage_frames(names, frames, None, layout_ids, rows, _frame_array(frames))
            return True
        self._filenames.extend(new_names)
        self._file_ids.update(new_names)
        self._stage_frames(names, frames, np.asarray(file_ids, dtype=np.int64), layout_ids, rows, _frame_array(frames))
        return True

    def _put_records(self, names: list[str], frames: list[int], zero: bool, items: list[Any]) -> bool:
        """``write_batch`` of dicts into new files a column at a time (``_write.columns.flat_columns``):
        the first item taken is flattened and checked for all (the others' leaves differ from its
        leaves only in their first dimension), and each length's layout joins the catalog once.
        Items holding an empty list are checked before anything is staged and staged after, item
        by item. False (nothing done) when a filename was written before or repeats, or the items
        are not such dicts."""
        n, base = len(names), len(self._filenames)
        if n < 2 or not self._file_ids.keys().isdisjoint(names) or len(set(names)) != n:
            return False
        cols = flat_columns(items)
        if cols is None:
            return False
        kept = cols.kept
        leaves = first_leaves(cols, items, names, frames, self.allow_pickle)
        if leaves is None:
            return False  # the item-by-item way says what is wrong, naming the item
        layouts = self._catalog.layouts_of(leaves)
        others = []
        for i in sorted(set(range(n)) - set(kept)):  # checked before any byte of the batch is staged
            try:
                item_leaves = flatten(items[i], names[i], frames[i], self.allow_pickle)
            except SpillValueError as exc:
                raise at_position(exc, i, n, names[i]) from None
            others.append((names[i], frames[i], item_leaves, self._catalog.layouts_of(item_leaves)))
        self._catalog.accept(layouts, self._catalog.ids(layouts))
        layout_ids = np.empty_like(cols.lengths)
        for j, lay in enumerate(layouts):
            if lay.dtype == "strlist":  # shape (strings, bytes)
                pairs = np.stack([cols.lengths[:, j], cols.sizes[:, j]], axis=1)
                found, where = np.unique(pairs, axis=0, return_inverse=True)
                ids = [self._catalog.add(FS.Layout(lay.leaf, lay.dtype, (m, nb), lay.pos)) for m, nb in found.tolist()]
            else:
                found, where = np.unique(cols.lengths[:, j], return_inverse=True)
                ids = self._catalog.length_ids(lay, found.tolist())
            layout_ids[:, j] = np.asarray(ids, dtype=np.int64)[where.reshape(-1)]
        if len(kept) < n:
            names, frames = [names[i] for i in kept], [frames[i] for i in kept]
        self._filenames.extend(names)
        self._file_ids.update(zip(names, range(base, base + len(names)), strict=True))
        row0 = self._n_rows
        self._n_rows += len(names) * len(leaves)
        self._fresh_keys.append((base, frames, row0, len(leaves)))
        self._n_fresh_keys += len(names)
        frame_arr = None if zero else _frame_array(frames)
        self._staging.add_frames(row0, base, frame_arr, layout_ids, cols.sizes, cols.data)
        for name, frame, item_leaves, item_layouts in others:
            self._put(name, frame, item_leaves, item_layouts)
        return True

    def _stage_frames(
        self, names: list[str], frames: list[int], file_ids: np.ndarray | None, layout_ids: tuple[int, ...],
        rows: list[np.ndarray], frame_arr: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """The staged bytes and keys of a checked dense batch whose files are accepted:
        ``file_ids`` None for a batch of new files (the last ``len(names)`` ids), ``rows`` each
        leaf's ``(n, item bytes)`` uint8 rows in the layouts' order; ``frame_arr`` None when
        every frame index is 0."""
        n, n_leaves, row0 = len(names), len(layout_ids), self._n_rows
        need = self._n_rows = row0 + n * n_leaves
        if file_ids is None:
            base = len(self._filenames) - n
            self._fresh_keys.append((base, frames, row0, n_leaves))
            self._n_fresh_keys += n
            self._staging.add_frames(row0, base, frame_arr, *_rows_of(n, layout_ids, rows))
        else:
            spans = zip(range(row0, need, n_leaves), [n_leaves] * n, strict=True)
            self._keys.update(zip(zip(file_ids.tolist(), frames, strict=True), spans, strict=True))
            self._staging.add_frames(row0, file_ids, frame_arr, *_rows_of(n, layout_ids, rows))

    def _dense_template(
        self, names: list[str], frames: list[int], columns: dict[tuple[str, ...], Any]
    ) -> DenseTemplate | None:
        """The leaves every item of a dense batch has (item 0 flattened and checked for all),
        made once per distinct (leaf paths, array kinds, dtypes, item shapes): what ``flatten``
        checks and yields depends on nothing else, so a batch like the previous one skips it.
        None when the batch holds leaves the vectorised path does not stage."""
        sig = tuple([(path, type(col), col.dtype, tuple(col.shape[1:])) for path, col in columns.items()])
        template = self._dense_templates.get(sig)
        if template is not None:
            return template
        n = len(names)
        item0 = nest({path: col[0] for path, col in columns.items()})
        try:
            leaves = flatten(item0, names[0], frames[0], self.allow_pickle)
        except SpillValueError as exc:
            raise at_position(exc, 0, n, names[0]) from None
        if len(leaves) != len(columns) or any(leaf.dtype in ("pickle", "str", "bytes") for leaf in leaves):
            return None
        by_leaf = {tuple([user_key(k) for k in path]): path for path in columns}  # keys as flatten escapes them
        paths = [by_leaf.get(leaf.path) for leaf in leaves]
        if None in paths:
            return None
        template = DenseTemplate(
            tuple(paths),  # type: ignore[arg-type]
            [FS.Layout(leaf.path, leaf.dtype, leaf.shape, leaf.pos) for leaf in leaves],
        )
        if len(self._dense_templates) < 256:  # bounded: batches of ever new shapes take the slow way
            self._dense_templates[sig] = template
        return template


def _frame_array(frames: list[int]) -> np.ndarray | None:
    """A batch's frame indices as int64, None when all are 0 (``Staging.add_frames``)."""
    return np.array(frames, dtype=np.int64) if any(frames) else None


def _rows_of(n: int, layout_ids: tuple[int, ...], rows: list[np.ndarray]) -> tuple[Any, Any, list[np.ndarray]]:
    """A dense batch's ``(layout ids, sizes, columns)`` as ``Staging.add_frames`` takes them:
    every frame's leaf ``j`` has ``layout_ids[j]`` and ``rows[j]``'s width."""
    ids = np.empty((n, len(rows)), dtype=np.int64)
    sizes = np.empty((n, len(rows)), dtype=np.int64)
    ids[:] = layout_ids
    sizes[:] = [r.shape[1] for r in rows]
    return ids, sizes, [np.ascontiguousarray(r).reshape(-1) for r in rows]
