"""Every ``zarr.json`` document of a merged output, built from the plan (docs/FORMAT.md) and
normalised by zarr's own metadata classes, so the consolidated root matches what zarr would write."""

from __future__ import annotations

import json
from typing import Any

from zarr.core.group import GroupMetadata
from zarr.core.metadata import ArrayV3Metadata

from .._format import common as F
from .._format import output as FO
from .._format.zarr import array_meta
from .plan import Plan, PlannedColumn

INDEX_ROWS_PER_CHUNK = 1 << 15
"""Rows per chunk of the per-file and per-row index arrays (``frame_offsets``, ``frame_idx`` ...,
``offsets``, ``valid``): a reader reads and checks them a chunk at a time (``_read.index``), so a
lookup costs one such chunk per array (256 KiB of int64), not the 16 MiB of 2**21 rows."""


def balanced(n: int, cap: int) -> int:
    """Units per chunk for ``n`` units at most ``cap`` per chunk, balanced over the chunks needed so
    the last chunk is nearly full. Zarr stores every chunk at full size (an uncompressed edge chunk
    is zero-padded): with plain ``cap`` a 100-unit array of 79 units per chunk would store 158
    units; balanced, it stores 100."""
    if n <= 0:
        return 1
    cap = int(max(1, min(n, cap)))
    m = -(-n // cap)
    return -(-n // m)


SMALL_ROW_BYTES = 64 << 10
"""Columns whose rows average fewer bytes get chunks of ``chunk_bytes // 4``."""

NAME_CHUNK_BYTES = 64 << 10
"""Bytes per chunk of ``index/filenames``: a lookup by filename reads one such chunk."""

NAME_BLOCK = 1024
"""Filenames per block: ``index/filename_heads`` holds the first filename of each block (its
attributes say how many names a block has), so a lookup bisects the heads in memory and decodes
one block."""

NAME_OFFSETS_CHUNK = 8192
"""Entries per chunk of ``index/filename_offsets`` (64 KiB: fewer objects than one per block)."""

BYTES_CHUNK_BYTES = 1 << 20
"""Target bytes of a chunk of a ``bytes`` / ``pickle`` column of small rows: one row reads its
whole chunk (and checks its CRC)."""


def values_chunk(col: PlannedColumn, chunk_bytes: int) -> int:
    """Units (first-dimension entries) per chunk of a column's ``values`` (docs/FORMAT.md section 2):
    a reader reads a whole chunk for one row, so columns of small rows (read a key at a time) get
    a quarter of ``chunk_bytes``, byte-stored ones at most :data:`BYTES_CHUNK_BYTES`; columns of
    large rows keep whole ``chunk_bytes`` chunks, which write fastest."""
    small = col.n_units * col.unit_bytes / max(col.n_present, 1) < SMALL_ROW_BYTES
    target = chunk_bytes // 4 if small else chunk_bytes
    if small and col.kind not in FO.NUMERIC_KINDS:  # stored as uint8 bytes + byte offsets
        target = min(target, BYTES_CHUNK_BYTES)
    return balanced(col.n_units, int(max(target, 1) // max(col.unit_bytes, 1)))


def output_docs(plan: Plan, world_size: int, chunk_bytes: int, codec: str) -> dict[str, dict[str, Any]]:
    """Every ``zarr.json`` document of an output (path -> document, ``""`` the root with
    the output header), normalised by zarr's own metadata classes so the consolidated root matches
    what zarr would write. Built from the plan alone: nothing is read back."""
    header = FO.OutputHeader(
        n_files=plan.n_files,
        n_frames=plan.n_frames,
        nbytes=plan.total_bytes,
        ranks=sorted({s.seg.rank for s in plan.segments}),
        world_size=world_size,
        segments=len(plan.segments),
        created=F.utcnow(),
        file_layouts=plan.file_layouts,
        key_orders=plan.key_orders,
    ).to_obj()
    nodes: dict[str, Any] = {
        "": GroupMetadata(attributes={"spillmerge": header}),
        "index": GroupMetadata(),
        "columns": GroupMetadata(),
    }
    n, rows = plan.n_files, plan.n_frames
    names = plan.filenames.index_arrays(NAME_BLOCK)
    name_bytes, head_bytes = int(names["filename_offsets"][-1]), int(names["filename_head_offsets"][-1])
    n_heads = -(-n // NAME_BLOCK)
    index_meta = {
        # Filenames as UTF-8 bytes + int64 offsets (Arrow's large_string layout): every Zarr v3
        # implementation reads uint8 and int64 (tensorstore has no string type). Small chunks and
        # the first filename of every block (heads) make a lookup one block read.
        "filenames": _rows_meta(name_bytes, "uint8", ["filename_byte"], NAME_CHUNK_BYTES),
        "filename_offsets": _rows_meta(n + 1, "int64", ["file_edge"], NAME_OFFSETS_CHUNK),
        "filename_heads": {
            **_rows_meta(head_bytes, "uint8", ["filename_head_byte"]),
            "attributes": {"spillmerge": {"names_per_head": NAME_BLOCK}},
        },
        "filename_head_offsets": _rows_meta(n_heads + 1, "int64", ["filename_head_edge"]),
        "file_layout": _rows_meta(n, "int32", ["file"]),
        "frame_offsets": _rows_meta(n + 1, "int64", ["file_edge"]),
        "frame_idx": _rows_meta(rows, "int64", ["row"]),
        # Provenance per output row, for coverage reports (`spillmerge inspect --plot`): the rank whose
        # segment the row came from, and how many segments held that frame (>1: a duplicate was dropped).
        "frame_rank": _rows_meta(rows, "int32", ["row"]),
        "frame_copies": _rows_meta(rows, "int32", ["row"]),
    }  # fmt: skip
    for name, meta in index_meta.items():
        nodes[f"index/{name}"] = _array_doc(meta)
    # A list path's offsets (its items are the rows of the columns under it), and the
    # dimension names of each domain: ``row`` for the output's rows, ``<list>.item`` for a list's items.
    dim: dict[tuple[str, ...], str] = {(): "row"}
    if plan.lists:
        nodes["lists"] = GroupMetadata()
    for lst in plan.lists:
        dim[lst.path] = f"{lst.name}.item"
        nodes[f"lists/{lst.name}"] = GroupMetadata(attributes={"spillmerge": {"list": list(lst.path)}})
        edge = f"{dim[F.list_domain(lst.path[:-1])]}_edge"  # the list whose items hold these lists
        nodes[f"lists/{lst.name}/offsets"] = _array_doc(_rows_meta(len(lst.offsets), "int64", [edge]))
    for col in plan.columns:
        k = values_chunk(col, chunk_bytes)
        base = f"columns/{col.name}"
        unit = col.unit_shape
        n_dom, row = len(col.src), dim[F.list_domain(col.leaf)]
        chunks = (k, *(max(d, 1) for d in unit))
        meta = array_meta((col.n_units, *unit), chunks, col.storage, crc=True, codec=codec)
        first = row if col.offsets is None else f"{col.name}.elem"
        meta["dimension_names"] = [first] + [f"{col.name}.dim_{d}" for d in range(1, len(unit) + 1)]
        nodes[base] = GroupMetadata(attributes={"spillmerge": col.header().to_obj()})
        nodes[f"{base}/values"] = _array_doc(meta)
        if col.offsets is not None:
            nodes[f"{base}/offsets"] = _array_doc(_rows_meta(n_dom + 1, "int64", [f"{row}_edge"]))
        if col.shapes is not None:
            shp = array_meta(
                (n_dom, col.ndim), (max(1, min(n_dom, INDEX_ROWS_PER_CHUNK)), max(col.ndim, 1)), "int64", crc=True
            )
            nodes[f"{base}/shapes"] = _array_doc({**shp, "dimension_names": [row, f"{col.name}.dims"]})
        for flag, has in (("valid", col.has_valid), ("none", col.has_none)):
            if has:
                nodes[f"{base}/{flag}"] = _array_doc(_rows_meta(n_dom, "bool", [row]))
    # Every node's zarr.json is built here and written in one concurrent batch; the consolidated
    # metadata is assembled from the same documents, so nothing is read back (zarr's own
    # create_hierarchy / consolidate_metadata cost one or more requests per node).
    return {path: node if isinstance(node, dict) else node.to_dict() for path, node in nodes.items()}


_NORMALISED: dict[str, str] = {}
"""zarr's form of an array document (JSON), by the document's JSON without its shape and chunk
shape (``_array_doc``); a few dozen kinds of array at most."""


def _array_doc(meta: dict[str, Any]) -> dict[str, Any]:
    """``ArrayV3Metadata.from_dict(meta).to_dict()``: the document as zarr writes it. zarr's
    normalisation of a document copies its shape and chunk shape as they are (ints), so it runs
    once per process for each kind of array (dtype, codecs, dimension names, attributes, number
    of dimensions) and the shapes are put into a copy."""
    grid = meta["chunk_grid"]
    shape, chunks = [int(d) for d in meta["shape"]], [int(d) for d in grid["configuration"]["chunk_shape"]]
    rest = {
        **meta,
        "shape": len(shape),
        "chunk_grid": {**grid, "configuration": {**grid["configuration"], "chunk_shape": len(chunks)}},
    }
    key = json.dumps(rest, sort_keys=True)
    text = _NORMALISED.get(key)
    if text is None:
        text = json.dumps(ArrayV3Metadata.from_dict(meta).to_dict())
        if len(_NORMALISED) < 4096:
            _NORMALISED[key] = text
    doc: dict[str, Any] = json.loads(text)
    doc["shape"] = shape
    doc["chunk_grid"]["configuration"]["chunk_shape"] = chunks
    return doc


def _rows_meta(n: int, dtype: str, dims: list[str], chunk: int | None = None) -> dict[str, Any]:
    """A 1-d array of ``n`` elements, ``chunk`` (default ``INDEX_ROWS_PER_CHUNK``, read when called) a
    chunk, its dimension named ``dims``."""
    k = max(1, min(n, chunk or INDEX_ROWS_PER_CHUNK))
    return {**array_meta((n,), (k,), dtype, crc=True), "dimension_names": dims}


def json_doc(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=False, ensure_ascii=False, allow_nan=False).encode("utf-8")


def consolidated_root(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The root ``zarr.json`` with every other document of ``docs`` (path -> document, ``""`` the
    root) inlined as consolidated metadata, the way zarr-python writes it: child groups with an
    empty consolidated block of their own, so reading never falls back to listing."""
    empty = {"kind": "inline", "must_understand": False, "metadata": {}}
    inlined = {}
    for path, doc in sorted(docs.items()):
        if path:
            inlined[path] = {**doc, "consolidated_metadata": empty} if doc.get("node_type") == "group" else doc
    return {**docs[""], "consolidated_metadata": {**empty, "metadata": inlined}}
