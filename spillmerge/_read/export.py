"""A merged output as Arrow: record batches streamed in row order (``to_arrow``: one batch of all)
or a Parquet file, all with the columns ``filename``, ``frame_idx``, ``rank`` and one per leaf
column (``columns=`` selects those); memory is one batch plus the chunk cache."""

from __future__ import annotations

import itertools
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

import numpy as np

from .._errors import (
    ArrowUnionInParquetError,
    ConfigError,
    ParquetTypeError,
    SpillMergeError,
    SpillStorageError,
    SpillValueError,
    UnknownColumnError,
)
from .._format import common as F
from .._format import lists as L
from .._format import output as FO
from .._storage import Storage, overlaps
from . import arrow as T
from .arrow import require_pyarrow, untensor
from .column import OpenColumn

Column = OpenColumn | T.Node | T.Hidden
"""What makes an exported column: one stored column (flat) or a node of the
value tree (``_read.arrow``: unions, lists, records), either null in the rows ``Hidden`` names."""

Files = Any
"""``_read.store.OutputFiles`` (which calls this module: named here, not imported, so no import circle)."""

BATCH_BYTES = 64 << 20
"""The payload a batch aims at when ``batch_size`` is not given."""

MAX_BATCH_ROWS = 1 << 16
"""The most rows of a batch when ``batch_size`` is not given (small rows)."""


def select(files: Files, columns: Sequence[str] | str | None) -> dict[str, Column]:
    """The columns named in ``columns`` (all when None), in the order given: the names of the
    default export, and each stored column's flat name (one variant of a union, one item of a
    list)."""
    names: dict[str, OpenColumn] = {}  # flat name -> stored column, in output order
    # a leaf whose keys join to another's path ({"a/b": 1} beside {"a": {"b": 2}}) sorts after it
    # and is named by its path as JSON: the plain name is the nested path's
    for col in sorted(files.columns.values(), key=lambda c: (c.info.path, _joined(c.info.leaf), c.info.dtype)):
        name = col.info.path or "value"
        if len(files.by_leaf.get(col.info.leaf, [])) > 1:  # one column per dtype: "logits:float16"
            # per variant where they differ in more than the dtype: "result:float32.2d", "result:str"
            name = f"{name}:{col.info.variant or col.info.dtype}"
        names[T.unique_name(names, name, col.info.leaf)] = col
    flat = {id(c): name for name, c in names.items()}
    root = T.tree(list(files.columns.values()), files.key_orders.overall())
    default = T.top_columns(root, lambda c: flat[id(c)], files.list_offsets)  # (none named: these)
    if columns is None:
        return default
    known: dict[str, Column] = {**names, **default}
    if isinstance(columns, str):
        columns = [columns]
    out: dict[str, Column] = {}
    for name in columns:
        if name in ("filename", "frame_idx", "rank"):
            continue  # always there
        if name not in known:
            raise UnknownColumnError(
                f"{files.storage.describe()} has no column {name!r}; its leaf columns: "
                f"{', '.join(map(repr, known)) or 'none'} (filename, frame_idx and rank are always exported)",
                column=name,
                known=list(known),
            )
        out[name] = known[name]
    return out


def _joined(leaf: tuple[str, ...]) -> bool:
    """Whether ``leaf`` has a key that holds ``/`` or is empty (its path reads as another's)."""
    return any(not k or "/" in k for k in leaf)


def batch(files: Files, cols: dict[str, Column], a: int, b: int) -> Any:
    """Rows ``a .. b-1`` as one ``pyarrow.RecordBatch``."""
    pa = require_pyarrow("MergedStore.iter_batches()")
    files.checks.rows(a, b)  # the index over these rows, checked (frame_offsets among it)
    offsets = files.frame_offsets
    f0 = offsets.searchsorted(a, side="right") - 1
    f1 = offsets.searchsorted(b, side="left")
    rows = np.arange(a, b, dtype=np.int64)
    file_of_row = np.searchsorted(offsets.span(f0, f1 + 1), rows, side="right") - 1
    arrays: dict[str, Any] = {
        "filename": pa.array(files.filenames[f0:f1], type=pa.string()).take(pa.array(file_of_row)),
        "frame_idx": pa.array(files.frame_idx[a:b], type=pa.int64()),
        "rank": pa.array(files.prov["frame_rank"][a:b].astype(np.int32), type=pa.int32()),
    }
    fields = [pa.field(k, v.type) for k, v in arrays.items()]
    stored = T.Batch(a, b, files.list_offsets)
    for name, col in cols.items():
        hidden = None
        if isinstance(col, T.Hidden):
            hidden = col.rows[a:b]
            col = col.column
        if isinstance(col, OpenColumn):
            arr, meta, domain, at = stored.arrow(col), None, F.list_domain(col.info.leaf), np.arange(b - a)
        else:  # a node over the rows it shows only: a pruned one cannot read the others
            shown = np.ones(b - a, bool) if hidden is None else ~hidden
            (arr, meta), domain = T.node_array(col, stored, a + np.flatnonzero(shown)), ()
            at = np.cumsum(shown) - 1
        if domain:  # a list's items by their flat name: each row's items as a list
            arr = pa.LargeListArray.from_arrays(pa.array(L.item_offsets(files.list_offsets, domain, a, b)), arr)
        if hidden is not None and hidden.any():
            arr = arr.take(pa.array(at, mask=hidden))
        fields.append(pa.field(name, arr.type, metadata=meta))
        arrays[name] = arr
    return pa.RecordBatch.from_arrays(list(arrays.values()), schema=pa.schema(fields))


def _rows(batch_size: Any) -> int:
    """``batch_size`` as a number of rows; 0 (refused) where it is no number."""
    try:
        return int(batch_size)
    except (TypeError, ValueError):
        return 0


def iter_batches(files: Files, cols: dict[str, Column], batch_size: int | None) -> Iterator[Any]:
    """Every row, ``batch_size`` rows per batch (the last may be shorter), in (filename, frame) order."""
    if batch_size is not None and (isinstance(batch_size, bool) or _rows(batch_size) < 1):
        raise ConfigError(f"batch_size must be a positive number of rows, got {batch_size!r}", key="batch_size")
    if batch_size is None:  # about BATCH_BYTES of payload, at most MAX_BATCH_ROWS
        total = 48 * files.n_rows  # filename, frame_idx, rank and offsets
        made = [c.column if isinstance(c, T.Hidden) else c for c in cols.values()]
        for col in [x for c in made for x in ([c] if isinstance(c, OpenColumn) else c.stored())]:
            v = col.values
            item = 16 if v.dtype.kind == "T" else v.dtype.itemsize  # strings: a guess, their size is not stored
            total += int(np.prod(v.shape, dtype=np.int64)) * item
        per_row = max(total / max(files.n_rows, 1), 1)
        batch_size = int(max(1, min(MAX_BATCH_ROWS, BATCH_BYTES // per_row)))
    step = int(batch_size)
    for a in range(0, files.n_rows, step):
        yield batch(files, cols, a, min(a + step, files.n_rows))


def to_parquet(
    files: Files,
    cols: dict[str, Column],
    path: str | os.PathLike[str],
    batch_size: int | None,
    storage_options: dict[str, Any] | None,
    **parquet: Any,
) -> int:
    """Write every row to the Parquet file ``path`` (a path or fsspec URL) batch by batch: one row
    group per batch, memory one batch. A local file is written under a temporary name and renamed
    when whole, an object's upload completes only when whole: a reader never sees half a file.
    Returns the rows written."""
    require_pyarrow("MergedStore.to_parquet()")
    import pyarrow.parquet as pq

    target, source = os.fspath(path), files.storage
    dest = Storage(target, storage_options)
    spill = _spill_root(source, storage_options)
    merged_from = f"the output {source.describe()} was merged from"
    for root, kind, what in ((source, "output", "it reads"), (spill, "spill root", merged_from)):
        if root is not None and overlaps(root, dest):
            where = f"the {kind} {root.describe()} {what}"
            raise SpillValueError(f"to_parquet({target!r}) would write into {where}; choose a path outside it")
    if dest.local:
        target = target.removeprefix("file://")
    rows = 0
    # (the error names the file the caller gave)
    with dest.storage_errors("write"), whole_file(target) if dest.local else nullcontext() as tmp:
        sink: Any = open(tmp, "wb") if tmp else dest.open_write("")  # noqa: SIM115 - closed below
        with sink:  # (the writer closes first, then the file, also on an error)
            batches = map(_parquet_form, iter_batches(files, cols, batch_size))
            first = next(batches, None)  # None: no rows, still a valid file with the columns
            schema = _parquet_form(batch(files, cols, 0, 0)).schema if first is None else first.schema
            _refuse_types(schema, target)
            with pq.ParquetWriter(sink, schema, **parquet) as writer:
                for rb in itertools.chain([] if first is None else [first], batches):
                    writer.write_batch(rb)
                    rows += rb.num_rows
    return rows


@contextmanager
def whole_file(target: str, shown: str | None = None) -> Iterator[str]:
    """A temporary name beside the local file ``target`` (``shown`` in messages) to write: renamed
    to ``target`` when the block ends, removed on an error, so a half-written file is never taken
    for the finished one. A ``target`` that exists and is no regular file is refused: the
    rename would replace a folder or a link, and never writes into a pipe or through a link."""
    if os.path.lexists(target) and not stat.S_ISREG(os.lstat(target).st_mode):
        raise SpillStorageError(
            f"cannot write {shown or target}: it exists and is no regular file (a folder, link, device or pipe), "
            "which the finished file would replace; choose a file's path",
            path=target,
        )
    tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise


def _spill_root(source: Storage, storage_options: dict[str, Any] | None) -> Storage | None:
    """The spill root the completion marker names, when it names it absolutely (a relative path
    was relative to the merging process's working folder: not knowable here)."""
    try:
        raw = source.get_or_none(FO.COMPLETE_NAME, max_bytes=F.RECORD_MAX_BYTES)
        root = F.loads(raw, path=source.describe(FO.COMPLETE_NAME)).get("spill_root") if raw else None
        if isinstance(root, str) and (os.path.isabs(root) or "://" in root):
            return Storage(root, storage_options)
    except (SpillMergeError, AttributeError):  # the reader checked the marker; what it names is advisory
        pass
    return None


def _refuse_types(schema: Any, target: str) -> None:
    """Parquet has no union type and no struct without fields: name the columns that hold one,
    and the ways out."""
    types = require_pyarrow().types
    bad = [f.name for f in schema if T.has_type(f.type, types.is_union)]
    if bad:
        raise ArrowUnionInParquetError(
            f"to_parquet({target!r}): column(s) {', '.join(map(repr, bad))} hold values of several kinds (an Arrow "
            "dense_union), and Parquet has no union type; pass columns= naming the others, or one variant's flat "
            "column (MergedStore.to_arrow(columns=...) names them, e.g. 'result:float32'), or use to_arrow() / "
            "iter_batches(), which keep the union",
            columns=bad,
        )
    empty = [f.name for f in schema if T.has_type(f.type, lambda t: types.is_struct(t) and not t.num_fields)]
    if empty:
        raise ParquetTypeError(
            f"to_parquet({target!r}): column(s) {', '.join(map(repr, empty))} hold only empty dicts (an Arrow "
            "struct without fields), which Parquet cannot store; pass columns= naming the others, or use "
            "to_arrow() / iter_batches()",
            columns=empty,
        )


def _parquet_form(rb: Any) -> Any:
    """``rb`` with its tensor columns (``arrow.fixed_shape_tensor``) as nested ``fixed_size_list``:
    polars and DuckDB read the extension type's flat storage without its shape, the nested lists
    with it."""
    pa = require_pyarrow("MergedStore.to_parquet()")
    if not any(T.has_type(f.type, _is_tensor) for f in rb.schema):
        return rb
    arrays = [_untensored(c) for c in rb.columns]
    fields = [pa.field(f.name, a.type, metadata=f.metadata) for f, a in zip(rb.schema, arrays, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))


def _is_tensor(t: Any) -> bool:
    return isinstance(t, require_pyarrow().FixedShapeTensorType)


def _untensored(arr: Any) -> Any:
    """``arr`` with its tensors as nested ``fixed_size_list``, those in lists and structs too."""
    pa = require_pyarrow("MergedStore.to_parquet()")
    t = arr.type
    if _is_tensor(t) or not T.has_type(t, _is_tensor):
        return untensor(arr)
    nulls = arr.is_null() if arr.null_count else None
    if pa.types.is_struct(t):
        kids = [_untensored(arr.field(i)) for i in range(t.num_fields)]
        fields = [pa.field(t.field(i).name, k.type, metadata=t.field(i).metadata) for i, k in enumerate(kids)]
        return pa.StructArray.from_arrays(kids, fields=fields, mask=nulls)
    if pa.types.is_large_list(t) or pa.types.is_list(t):
        values = _untensored(arr.values)
        field = pa.field(t.value_field.name, values.type, metadata=t.value_field.metadata)
        kind = pa.large_list if pa.types.is_large_list(t) else pa.list_
        return type(arr).from_arrays(arr.offsets, values, type=kind(field), mask=nulls)
    if pa.types.is_fixed_size_list(t):
        flat = arr.values.slice(arr.offset * t.list_size, len(arr) * t.list_size)
        return pa.FixedSizeListArray.from_arrays(_untensored(flat), t.list_size, mask=nulls)
    return arr  # a union: to_parquet refuses it by name
