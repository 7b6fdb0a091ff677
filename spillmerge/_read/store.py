"""Reading a merged output of this spillmerge's format version (docs/FORMAT.md section 2):
``spillmerge.open(out)``; any other version is refused at open (``_format.common.version_error``)."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from .._errors import (
    CorruptSpillError,
    IncompleteOutputError,
    SpillMergeError,
    SpillStorageError,
    UnknownColumnError,
    UnknownFileError,
)
from .._format import common as F
from .._format import invariants as V
from .._format import lists as L
from .._format import output as FO
from .._format.keyorder import KeyOrders
from .._storage import Storage
from .._util.gcpause import gc_paused
from . import export as _export
from . import index as LZ
from . import values as _values
from .arrow import require_pyarrow, unique_name
from .cache import DEFAULT_CACHE_BYTES, CacheStats, ChunkCache
from .filenames import Names, close_matches
from .outputstore import NoFillStore, open_consolidated
from .views import VIEWS, LeafDict, LeafView, OpenColumn

__all__ = ["LeafView", "MergedStore", "open"]


def _view_paths(cols: list[OpenColumn]) -> list[tuple[tuple[str, ...], OpenColumn]]:
    """Where each column of a file shows in ``store[filename]``'s nested dict: at its leaf path;
    a leaf with several variant columns as ``<key>.<variant>`` for each; the
    headers and items of lists that share a path with a value in other frames are left out (a
    dict cannot hold both: ``store.value()`` reads them)."""
    count = Counter(c.info.leaf for c in cols)
    out: list[tuple[tuple[str, ...], OpenColumn]] = []
    for c in cols:
        leaf = c.info.leaf or ("",)
        if count[c.info.leaf] > 1:
            leaf = (*leaf[:-1], f"{leaf[-1]}.{c.info.variant or c.info.dtype}")
        out.append((leaf, c))
    values = {p for p, _ in out}
    return [(p, c) for p, c in out if not any(p[:d] in values for d in range(1, len(p)))]


def _dtype_choice(c: OpenColumn) -> str:
    """What ``column(..., dtype=)`` takes to choose column ``c`` among its leaf's, as messages
    show it: a Python value's type (``int``, ``list[int]`` ...), else its variant tag
    (``float32.2d``) or dtype."""
    shown = F.dtype_text(c.info.dtype, c.info.ndim)
    return shown if shown != c.info.dtype else c.info.variant or c.info.dtype


class OutputFiles:
    """The files of an output, for :class:`MergedStore`. Open reads metadata and bounded parts only
    (docs/FORMAT.md, *Invariants*): the header, the columns' headers and the arrays' lengths are
    checked there; the index arrays are read a chunk at a time and checked block by block before
    anything is served from them (``_read.index``), so open costs the same at any size; column
    values are read when asked for. A filename is found by bisecting the sorted names' blocks."""

    def __init__(
        self,
        group: Any,
        header: dict[str, Any],
        raise_: LZ.Raise,
        allow_pickle: bool,
        cache: ChunkCache,
        storage: Storage,
    ) -> None:
        self.storage, describe = storage, storage.describe
        self.filenames = Names(group, cache, raise_, storage)
        infos, problems = V.read_columns(group)
        index = {"frame_idx": V.index_node(group, "frame_idx", describe)}
        index |= {name: V.index_node(group, name, describe) for name in V.PROVENANCE if name in group["index"]}
        lengths = {name: int(node.shape[0]) for name, node in index.items()}
        n_rows = lengths["frame_idx"]
        # list offsets (their contents stay in memory, as list columns' offsets do)
        lists, list_problems = L.read_lists(group)
        raise_(problems + list_problems)
        # each list path's offsets (ending in ``ITEM``), checked here
        self.list_offsets, sizes, list_problems = L.domains(lists, n_rows)
        raise_(list_problems)
        heads = [(c, None, None) for c in infos.values() if c.dtype in ("pylist", "pytuple") and c.kind == "fixed"]
        raise_(L.header_problems(lists, self.list_offsets, heads))
        self.layouts: list[list[str]] = header.get("file_layouts")  # type: ignore[assignment]
        n_layouts = len(self.layouts) if isinstance(self.layouts, list) else 0

        lazy = partial(LZ.LazyArray, cache=cache, storage=storage)
        fo_node = V.index_node(group, "frame_offsets", describe)

        def offsets_check(first: int, arr: np.ndarray) -> None:
            last = first + len(arr) == fo_node.shape[0]
            raise_(V.offsets_block_problems("index/frame_offsets", arr, first, last, n_rows, "index/frame_idx"))

        # int64 (n_files + 1,): file i's rows are frame_offsets[i] .. frame_offsets[i + 1] - 1
        self.frame_offsets = lazy(fo_node, check=offsets_check)

        def layout_check(first: int, arr: np.ndarray) -> None:
            raise_(V.layout_problems(arr, n_layouts, self.filenames, first))

        # int64 (n_files,): file i's entry of the header's file_layouts (checked as chunks are read)
        self.file_layout = lazy(V.index_node(group, "file_layout", describe), check=layout_check)
        meta = V.meta_problems(
            self.filenames, len(self.frame_offsets), len(self.file_layout), lengths, header, infos, (lists, sizes)
        )
        raise_(meta)
        self.frame_idx = lazy(index["frame_idx"])
        self.prov: dict[str, LZ.LazyArray] = {name: lazy(index[name]) for name in V.PROVENANCE}  # (all: meta checked)
        self.n_rows = n_rows
        self.columns: dict[str, OpenColumn] = {}
        nested: dict[str, OpenColumn] = {}  # columns whose rows are a list's items
        for name, info in infos.items():
            domain = F.list_domain(info.leaf)
            col = self.columns[name] = OpenColumn(info, sizes[domain], allow_pickle, cache, storage, VIEWS[info.kind])
            # (valid and none are there as the header says: read_columns checked it)
            for kind in ("offsets", "shapes", "valid", "none"):
                node = info.arrays.get(kind)
                if node is None or (kind == "shapes" and col.offsets is None):
                    continue
                dtype = bool if kind in ("valid", "none") else np.int64
                # whole for a list's items (checked at open, as their lists are), else lazy
                setattr(col, kind, np.asarray(V.read_array(node), dtype=dtype) if domain else lazy(node, dtype=dtype))
            if domain:
                nested[name] = col
        self.by_leaf: dict[tuple[str, ...], list[OpenColumn]] = {}
        for c in sorted(self.columns.values(), key=lambda c: c.info.dtype):
            self.by_leaf.setdefault(c.info.leaf, []).append(c)
        self.variants = [sorted(c.info.name for c in cs) for _, cs in sorted(self.by_leaf.items()) if len(cs) > 1]
        """The names of each leaf's columns, for the leaves with several (one per variant)."""
        root = {name: col for name, col in self.columns.items() if name not in nested}
        self.checks = LZ.IndexChecks(self, root, raise_)
        for arr in (self.frame_idx, *self.prov.values()):
            arr.hook = self.checks.rows
        for col in root.values():
            for arr in (col.offsets, col.shapes, col.valid, col.none):
                if arr is not None:
                    arr.hook = self.checks.edges if arr is col.offsets else self.checks.rows
        # The first chunk of files and block of rows now (an output of one block is checked whole
        # at open, as the names' first block is); the others as they are read (``index.IndexChecks``).
        self.frame_offsets.span(0, 1)
        self.file_layout.span(0, 1)
        self.checks.rows(0, 0)
        if nested:  # a list item has a value only where its row's file lists the column: whole
            layout_of_row = np.repeat(self.file_layout.whole(), np.diff(self.frame_offsets.whole()))
            for name, col in nested.items():
                in_layout = self.checks.in_layout(name, layout_of_row)
                rows = L.expand(self.list_offsets, F.list_domain(col.info.leaf), in_layout)
                raise_(LZ.column_row_problems(col.info, col.offsets, col.shapes, col.valid, rows, 0, True, col.none))
            valid = {name: col.valid for name, col in nested.items()}
            none = {name: col.none for name, col in nested.items()}
            raise_(LZ.variant_problems([g for g in self.variants if g[0] in nested], nested, valid, 0, none))
        # Per file layout, its columns and where each shows in a file's value: (dicts above it, key,
        # view class, column, list domain); None for plain tensor values (one view).
        self._layout_cols = [[self.columns[name] for name in names] for names in self.layouts]
        self._layout_paths = [
            None
            if len(cols) == 1 and cols[0].info.leaf == ()
            else [(p[:-1], p[-1], c.view_cls, c, F.list_domain(c.info.leaf)) for p, c in _view_paths(cols)]
            for cols in self._layout_cols
        ]
        self._row_plans: dict[int, _values.RowPlan] = {}  # per file layout, made at its first value() read
        try:
            self.key_orders = KeyOrders(header.get("key_orders"), len(self.filenames), "zarr.json")
        except CorruptSpillError as exc:
            raise_([("zarr.json", str(exc))])
        self.leaf_names: dict[str, tuple[str, ...]] = {}
        """Each leaf's column name, as ``to_arrow`` names it: its path (``""`` for plain values), or,
        where another leaf's path reads the same (a key holding ``/`` beside nested dicts, an empty
        key), the path as JSON."""
        for leaf in sorted(self.by_leaf, key=lambda p: ("/".join(p), any(not k or "/" in k for k in p))):
            self.leaf_names[unique_name(self.leaf_names, "/".join(leaf), leaf)] = leaf

    def leaf(self, name: str) -> tuple[str, ...]:
        """The leaf of column ``name`` as :attr:`leaf_names` names it, else its keys split at ``/``."""
        return self.leaf_names.get(name, tuple(name.split("/")) if name else ())

    def value(self, i: int, filename: str) -> Any:
        """File ``i``'s nested dict of leaf views (``filename``: its name)."""
        a, b = self.checks.file_rows(i)
        layout = self.file_layout.item(i)
        paths = self._layout_paths[layout]
        if paths is None:  # plain tensor values
            col = self._layout_cols[layout][0]
            return col.view_cls(col, a, b, filename)
        out = LeafDict.top(filename)
        for up, key, cls, col, domain in paths:
            if not (up or domain):
                out[key] = cls(col, a, b, filename)
                continue
            node = out
            for k in up:
                node = node.child(k)
            # a list's items: the items of the file's rows, flattened
            node[key] = cls(col, *L.rows_of(self.list_offsets, domain, a, b), filename)
        return out

    def row_value(self, i: int, filename: str, frame_idx: int, as_torch: bool) -> Any:
        """The value of frame ``frame_idx`` of file ``i`` (``filename``: its name) as it was written
        (``_read.values``)."""
        a, b = self.checks.file_rows(i)
        r = a  # (a file of one frame: nothing to search)
        if b != a + 1 or int(self.frame_idx[a]) != frame_idx:
            frames = self.frame_idx[a:b]
            try:
                j = int(np.searchsorted(frames, frame_idx))
            except TypeError:  # no frame index (None, a list ...): not found, as "2" is
                j = len(frames)
            if j >= len(frames) or frames[j] != frame_idx:
                shown = ", ".join(map(str, frames[:10].tolist())) + (" ..." if len(frames) > 10 else "")
                asked = frame_idx if isinstance(frame_idx, (int, np.integer)) else repr(frame_idx)
                raise UnknownFileError(
                    f"{filename!r} of {self.storage.describe()} has no frame {asked} (its frames: {shown})",
                    filename=filename,
                )
            r = a + j
        plan = self.row_plan(self.file_layout.item(i))
        block = _values.Block(r, r + 1, self.list_offsets, as_torch) if plan.lists else None
        order = self.key_orders.of_file(i)
        return gc_paused(_values.row_value, plan, r, filename, as_torch, block, order)

    def row_plan(self, layout: int) -> _values.RowPlan:
        """How a value of file layout ``layout`` is built from its columns (made at its first read)."""
        plan = self._row_plans.get(layout)
        if plan is None:
            plan = self._row_plans[layout] = _values.RowPlan(self._layout_cols[layout], self.list_offsets)
        return plan


REMOTE_LOOK_S = 1.0
"""On an object store a look at the completion marker is a request: an open store looks at most
once in this many seconds whether its output was replaced (on a local disk, a stat at every read)."""


class MergedStore(Mapping[str, Any]):
    """A merged output (of :data:`~spillmerge.FORMAT_VERSION`, the one version this spillmerge reads).

    ``store[filename]`` is the file's value: for a file whose only leaf is the plain value (leaf
    ``[]``) a leaf view of its rows (:class:`~spillmerge._read.views.LeafView`), else a nested dict, by
    leaf path, of such views. ``store.frames(filename)`` gives the frame index of each row;
    ``store.column(path)`` one leaf over every file; ``store.to_arrow()`` everything as a pyarrow
    table.

    The index is checked before anything is returned from it (docs/FORMAT.md,
    *Invariants*); every failure is a :class:`CorruptSpillError` naming the object and what is wrong.
    Chunks are never read to check; an absent chunk raises when it is read (:class:`NoFillStore`).
    A chunk read from storage while chunks read earlier are cached raises a :class:`SpillMergeError`
    when the output was replaced since it was opened (on an object store, one noticed within
    :data:`REMOTE_LOOK_S` of the store's last look).
    """

    def __init__(
        self,
        out: str,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.cache = ChunkCache(cache_bytes, self._same_output)
        self._looked = float("inf")  # an object store is not looked at again while it opens
        self.storage = Storage(out, storage_options)
        where = self.storage.describe()
        try:
            marker = self.storage.get_or_none(FO.COMPLETE_NAME, max_bytes=F.RECORD_MAX_BYTES)
        except SpillStorageError:
            if FO.what_is(self.storage) == "file":  # reading below a file fails with "Not a directory"
                raise FO.not_an_output(self.storage, "file") from None
            raise
        if marker is None:
            if not self.storage.exists("zarr.json"):
                raise FO.not_an_output(self.storage)
            what = f"is incomplete (no {FO.COMPLETE_NAME}): the merge that wrote it did not finish"
            raise IncompleteOutputError(f"{where} {what}; run the merge again", path=where)
        F.loads(marker, path=self.storage.describe(FO.COMPLETE_NAME))
        self._marker = self._marker_identity(marker)
        try:
            store = NoFillStore(self.storage.zarr_store(), self.storage)
            self.group = open_consolidated(store, self.storage)
        except Exception as exc:  # noqa: BLE001 - zarr raises many kinds
            raise CorruptSpillError(f"{where}: cannot open as zarr: {exc}", path=where) from exc
        header = self.group.attrs.get("spillmerge")
        if not isinstance(header, dict) or header.get("kind") != "merged":
            raise CorruptSpillError(f"{where}: not a spillmerge output", path=where)
        self.header: dict[str, Any] = header
        self.format_version: int = F.check_version(header, self.storage.describe(), spill=False)
        """The output's format version (:data:`~spillmerge.FORMAT_VERSION`: no other is opened)."""
        self.allow_pickle = allow_pickle
        self.files = OutputFiles(self.group, header, self._raise, allow_pickle, self.cache, self.storage)
        """The output's files and columns as the package's readers use them (inspect, datasets)."""
        self._looked = time.monotonic()

    def _marker_identity(self, marker: bytes | None = None) -> Any:
        """What tells this output's completion marker from another merge's: on a local disk its
        file's identity (a stat, no read), elsewhere its bytes (the finish time, the lease token)."""
        if not self.storage.local:
            return marker or self.storage.get_or_none(FO.COMPLETE_NAME, max_bytes=F.RECORD_MAX_BYTES)
        try:
            st = os.stat(self.storage.path(FO.COMPLETE_NAME), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def _same_output(self, damage: bool = False) -> None:
        """Raise unless the output still holds the completion marker it held at open: every merge
        writes its own, last, and an overwrite deletes the old one before it deletes or rewrites a
        chunk. ``damage``: a read just found damage, which a replacement explains: look now."""
        now = time.monotonic()
        if not damage and not self.storage.local and now - self._looked < REMOTE_LOOK_S:
            return
        marker = self._marker_identity()
        if marker != self._marker:
            where = self.storage.describe()
            what = "is being replaced (its completion marker is gone)" if marker is None else "was replaced"
            raise SpillMergeError(
                f"{where} {what} by another merge since this store opened it: rows read now could mix both "
                "outputs or find the old one's chunks gone; open it again once that merge completed",
                path=where,
            )
        self._looked = now

    def _raise(self, problems: list[V.Problem]) -> None:
        """Raise the first problem (with a count of the others) as a :class:`CorruptSpillError`, or
        that the output was replaced since it was opened, which explains it."""
        if not problems:
            return
        self._same_output(damage=True)
        rel, what = problems[0]
        path = self.storage.describe(rel)
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CorruptSpillError(
            f"{path}: {what}{more}; the output is damaged: `spillmerge verify {self.storage.describe()}` lists "
            "every problem, merging again rebuilds it",
            path=path,
        )

    @property
    def filenames(self) -> Sequence[str]:
        """Original filenames, sorted: a sequence read block by block as it is used (``len``,
        ``names[i]``, slices, iteration, ``in``; no read of every filename to open or to find one)."""
        return self.files.filenames

    def __len__(self) -> int:
        return len(self.files.filenames)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files.filenames)

    def __contains__(self, filename: object) -> bool:
        return filename in self.files.filenames

    def _index(self, filename: str) -> tuple[int, str]:
        """The file's position and its name as a ``str`` (a numpy str's repr would show in messages)."""
        # (find's in-order hint is a plain hint, not a lock: a racing thread at worst costs
        # another thread the search.)
        names = self.files.filenames
        i = names.find(filename)
        if i is None:
            near = close_matches(names, filename)  # neighbours in sort order: no scan of every name
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise UnknownFileError(
                f"{filename!r} is not a filename of {self.storage.describe()} ({len(names)} files){hint}",
                filename=filename,
            )
        return i, filename if type(filename) is str else names[i]

    def _rows(self, filename: str, of: LZ.LazyArray) -> np.ndarray:
        """The entries of the per-row array ``of`` for ``filename``'s rows."""
        a, b = self.files.checks.file_rows(self._index(filename)[0])
        return of[a:b].copy()  # type: ignore[no-any-return]

    def frames(self, filename: str) -> np.ndarray:
        """Ascending int64 frame indices of ``filename``, one per row."""
        return self._rows(filename, self.files.frame_idx)

    def frame_ranks(self, filename: str) -> np.ndarray:
        """The rank each row of ``filename`` came from (int64, one per row; ``index/frame_rank``)."""
        return self._rows(filename, self.files.prov["frame_rank"])

    def frame_copies(self, filename: str) -> np.ndarray:
        """How many spill segments held each row's frame (1, or more when duplicates were
        dropped; ``index/frame_copies``)."""
        return self._rows(filename, self.files.prov["frame_copies"])

    def __getitem__(self, filename: str) -> Any:
        return self.files.value(*self._index(filename))

    def value(self, filename: str, frame_idx: int = 0, *, as_torch: bool = False) -> Any:
        """The value of one row (``filename``, ``frame_idx``) as it was written: dicts, lists,
        tuples, Python scalars, ``str``, ``bytes`` and ``None`` as themselves, tensors and arrays
        as numpy arrays (``as_torch=True``: torch tensors, importing torch only then), pickled
        objects unpickled (only under ``open(..., allow_pickle=True)``); a dict key some frames
        of the file have and this one lacks is absent here too."""
        return self.files.row_value(*self._index(filename), frame_idx, as_torch)

    def iter_values(self, *, as_torch: bool = False) -> Iterator[tuple[str, int, Any]]:
        """Every row as ``(filename, frame_idx, value)``, in (filename, frame) order: ``value`` as
        :meth:`value` returns it (equal in type and content), read a block of rows at a time
        (each column's rows of a block decoded once, no search for a file): for work over every
        value, e.g. the list ``gather_object`` gives (``[v for _, _, v in res.iter_values()]``).
        Memory is one block of rows (4,096 rows, a column's rows read one by one where they hold
        more than 32 MiB), whatever the output's size."""
        return _values.iter_values(self.files, as_torch)

    def index_arrays(self) -> tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(filenames, frame_offsets, frame_idx, frame_rank, frame_copies), as checked at open
        (for coverage, which needs them whole)."""
        files = self.files
        files.checks.rows(0, files.n_rows)
        return (
            files.filenames, files.frame_offsets.whole(), files.frame_idx.whole(), files.prov["frame_rank"].whole(),
            files.prov["frame_copies"].whole(),
        )  # fmt: skip

    def column(self, path: str | tuple[str, ...] | list[str] | None = None, dtype: str | None = None) -> LeafView:
        """One leaf over every row of every file, in (filename, frame) order: ``"logits"``,
        ``"a/b"`` (or the keys as a tuple), or None for plain tensor values (leaf ``[]``). The
        same kind of view as ``store[filename]`` gives; :class:`UnknownColumnError` lists the
        columns when there is no such leaf. A leaf whose dtype differs between files has one
        column per dtype (rows of the other files absent): choose one with ``dtype=``."""
        if path is None:
            leaf: tuple[str, ...] = ()
        elif isinstance(path, str):
            leaf = self.files.leaf(path)
        elif isinstance(path, tuple | list) and all(isinstance(k, str) for k in path):
            leaf = tuple(path)
        else:
            raise TypeError(f"column() takes path as a str, a tuple or list of str, or None, not {path!r}")
        where, name, cols = self.storage.describe(), "/".join(leaf), self.files.by_leaf.get(leaf, [])
        shown = name or "None (the plain tensor values)"
        if dtype is not None and cols:
            dts = [_dtype_choice(c) for c in cols]
            cols = [c for c in cols if dtype in (c.info.dtype, c.info.variant, _dtype_choice(c))]
            if not cols:
                what = f"has no column of dtype {dtype!r}; its dtypes: {', '.join(map(repr, dts))}"
                raise UnknownColumnError(f"{where}: leaf {name or None!r} {what}", column=name, known=dts)
        if len(cols) > 1:
            dts = [_dtype_choice(c) for c in cols]
            what = f"has one column per dtype or kind ({', '.join(dts)}: files disagreed on it)"
            hint = f"pass dtype=, e.g. column({name or None!r}, dtype={dts[0]!r})"
            raise UnknownColumnError(f"{where}: leaf {shown!r} {what}; {hint}", column=name, known=dts)
        if not cols:
            known = sorted(n if lf else "<tensor> (None)" for n, lf in self.files.leaf_names.items())
            what = f"has no leaf column {shown!r}; its columns: {', '.join(map(repr, known)) or 'none'}"
            raise UnknownColumnError(f"{where} {what}", column=name, known=known)
        return cols[0].view(0, cols[0].n_rows)

    @property
    def columns(self) -> list[str]:
        """The leaf columns' names, sorted: each leaf's path (``""`` for plain tensor values), or where
        two paths read the same (a key holding ``/`` beside nested dicts, an empty key) the path as
        JSON (``'["a/b"]'``), as :meth:`to_arrow` names them; :meth:`column` takes each."""
        return sorted(self.files.leaf_names)

    def iter_batches(self, columns: Sequence[str] | str | None = None, batch_size: int | None = None) -> Iterator[Any]:
        """Every row as ``pyarrow.RecordBatch`` es, streamed in (filename, frame) order: the
        columns of :meth:`to_arrow`, ``columns`` selecting leaf columns by those names (``filename``,
        ``frame_idx`` and ``rank`` always come). ``batch_size`` rows per batch (default: about 64
        MiB of payload, at most 65,536 rows). Memory is one batch plus the chunk cache, whatever
        the output's size; every chunk is decoded once."""
        return _export.iter_batches(self.files, _export.select(self.files, columns), batch_size)

    def to_parquet(
        self,
        path: str | os.PathLike[str],
        columns: Sequence[str] | str | None = None,
        batch_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        **parquet_options: Any,
    ) -> int:
        """Write the rows of :meth:`iter_batches` to the Parquet file ``path`` (a path or fsspec
        URL, ``storage_options`` for it), one row group per batch, so memory stays one batch;
        polars (``pl.scan_parquet``), DuckDB and Hugging Face ``datasets.load_dataset("parquet")``
        read it lazily. ``parquet_options`` go to ``pyarrow.parquet.ParquetWriter`` (e.g.
        ``compression="zstd"``). A local file appears only when whole. Returns the rows written."""
        cols = _export.select(self.files, columns)
        return _export.to_parquet(self.files, cols, path, batch_size, storage_options, **parquet_options)

    def to_arrow(self, columns: Sequence[str] | str | None = None) -> Any:
        """Every row as a ``pyarrow.Table`` (needs ``pip install 'spillmerge[arrow]'``), all in
        memory (:meth:`iter_batches` streams it): columns ``filename`` (string), ``frame_idx``
        (int64), ``rank`` (int32), then one per leaf, named by its path (``"a/b"``; ``"value"``
        for plain tensor values), null where a row lacks it. ``columns`` selects leaf columns, or a
        stored column's flat name (``"result:float32.2d"``: one variant). docs/READING.md,
        *pyarrow*, has the Arrow type of each kind of leaf."""
        files = self.files
        cols = _export.select(files, columns)
        pa = require_pyarrow("MergedStore.to_arrow()")
        return pa.Table.from_batches([_export.batch(files, cols, 0, files.n_rows)])

    def cache_stats(self) -> CacheStats:
        """What the decoded-chunk cache holds now and its hits and misses (``open(cache_bytes=)``)."""
        return self.cache.stats()

    def __repr__(self) -> str:
        return f"MergedStore({self.storage.describe()!r}, files={len(self)}, frames={self.header.get('n_frames')})"


def open(  # noqa: A001
    out: str,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
) -> MergedStore:
    """Open a merged output (of :data:`~spillmerge.FORMAT_VERSION`) for reading. ``allow_pickle=True`` lets
    leaves stored pickled be unpickled (only for outputs you trust: unpickling runs code).
    ``cache_bytes`` bounds the decoded chunks kept for reading rows (default 64 MiB, shared by
    every view and ``column()`` of this store and by its threads; 0 keeps none): reading rows
    in order decodes each chunk once."""
    return MergedStore(out, storage_options, allow_pickle, cache_bytes)
