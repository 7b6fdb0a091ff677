"""A map-style torch ``Dataset`` over a merged output (``spillmerge.OutputDataset``): ``ds[i]`` is
row ``i`` as ``{"filename", "frame_idx", <column>: value}``; torch is needed only when a row is read,
and each process opens the output on its first row (a ``DataLoader`` worker gets the path)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import require_torch
from .._format import common as F
from .._format import lists as L
from .store import MergedStore
from .views import tensor


class OutputDataset:
    """Rows of the merged output at ``path`` as dicts (see the module docstring).

    ``columns``: the leaf columns to read (names as :meth:`MergedStore.columns` lists them, e.g.
    ``"logits"`` or ``"meta/score"``; a path that reads as another's as JSON, ``'["a/b"]'``);
    None: every column. A leaf whose dtype or kind differs between files gives each row the
    value of the variant that holds it. ``storage_options`` and ``allow_pickle``: as for
    :func:`spillmerge.open`. Reading rows in order decodes each chunk once (the store's chunk
    cache); a shuffled sampler decodes a chunk per row at worst."""

    def __init__(
        self,
        path: str,
        columns: list[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
    ):
        self.path, self.storage_options, self.allow_pickle = path, storage_options, allow_pickle
        store = MergedStore(path, storage_options, allow_pickle)
        self.columns = store.columns if columns is None else list(columns)
        for name in self.columns:
            _variants(store, name)  # raises UnknownColumnError, naming the columns there are
        self._n = len(store.index_arrays()[2])
        self._store: Any = store
        self._views: list[tuple[list[Any], tuple[str, ...]]] | None = None

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if isinstance(i, np.integer):
            i = int(i)
        if type(i) is not int:
            raise TypeError(f"OutputDataset rows are selected by an int, not {type(i).__name__}")
        if not -self._n <= i < self._n:
            raise IndexError(f"row {i} out of range for {self._n} rows of {self.path}")
        i %= self._n
        if self._store is None:
            self._store = MergedStore(self.path, self.storage_options, self.allow_pickle)
        if self._views is None:
            require_torch("spillmerge.OutputDataset")  # its rows hold tensors
            self._views = [
                (_variants(self._store, name), F.list_domain(self._store.files.leaf(name))) for name in self.columns
            ]
            self._index = self._store.index_arrays()[:3]
        names, offsets, frames = self._index
        f = int(np.searchsorted(offsets, i, side="right")) - 1
        row: dict[str, Any] = {"filename": names[f], "frame_idx": int(frames[i])}
        for name, (views, domain) in zip(self.columns, self._views, strict=True):
            if domain:  # the items of lists (the views' rows are every row's items): this row's, as a list
                a, b = L.rows_of(self._store.files.list_offsets, domain, i, i + 1)
                row[name] = [_item(views, k) for k in range(a, b)]
            else:
                row[name] = _item(views, i)
        return row

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker opens the output itself (handles and the chunk cache are per process).
        return {k: v for k, v in self.__dict__.items() if k != "_index"} | {"_store": None, "_views": None}

    def __repr__(self) -> str:
        return f"OutputDataset({self.path!r}, rows={self._n}, columns={self.columns})"


def _variants(store: MergedStore, name: str) -> list[Any]:
    """The views of leaf ``name``'s columns: one, or one per dtype or kind the files disagreed on."""
    cols = store.files.by_leaf.get(store.files.leaf(name), [])
    if not cols:
        store.column(name)  # raises UnknownColumnError, naming the columns there are
    return [col.view(0, col.n_rows) for col in cols]


def _item(views: list[Any], k: int) -> Any:
    """Row ``k`` of a leaf's columns: the value of the one holding it (a numeric one as a
    tensor), None where none has a value."""
    for view in views:
        x = view[k]
        if x is not None:
            return tensor(x, view.dtype_name) if view.kind in ("fixed", "ragged") else x
    return None
