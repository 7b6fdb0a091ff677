"""Every ``zarr.json`` document spillmerge writes, built from plain values (docs/FORMAT.md).

Segment arrays (``array_meta``, ``array_objects``: the writer's ``data``, ``index``, ``catalog``)
and the merged output's nodes (``shared_docs``: root, ``files``, ``index`` and its arrays;
``file_docs``: each file's arrays and groups; ``consolidated_root``). Documents are normalised by
zarr's own metadata classes, so the consolidated root matches what zarr would write, and nothing
is read back.
"""

from __future__ import annotations

import json
from typing import Any

import google_crc32c
import numpy as np
from zarr.core.group import GroupMetadata
from zarr.core.metadata import ArrayV3Metadata

from . import _codecs
from . import _format as F
from ._plan import FilePlan, Plan


def frames_per_chunk(fp: FilePlan, chunk_bytes: int) -> int:
    """Frames per output chunk: at most ``chunk_bytes`` worth, balanced over the chunks the file
    needs, so the last chunk is nearly full. Zarr stores every chunk at full size (an uncompressed
    edge chunk is zero-padded): with plain ``chunk_bytes // frame_bytes`` a 100-frame file of
    384 KiB frames in 16 MiB chunks would store 126 rows; balanced, it stores 102."""
    n = len(fp.frames)
    cap = int(max(1, min(n, chunk_bytes // max(fp.frame_nbytes, 1))))
    n_chunks = -(-n // cap)
    return -(-n // n_chunks)


def shared_docs(plan: Plan, world_size: int) -> dict[str, dict[str, Any]]:
    """``zarr.json`` documents of the nodes every file shares: root (with the output header),
    ``files``, ``index`` and the index arrays — the finalizer's in a parallel merge."""
    header = F.OutputHeader(
        n_files=len(plan.files),
        n_frames=plan.n_frames,
        nbytes=plan.total_bytes,
        ranks=sorted({s.seg.rank for s in plan.segments}),
        world_size=world_size,
        segments=len(plan.segments),
        created=F.utcnow(),
    ).to_obj()
    nodes: dict[str, Any] = {
        "": GroupMetadata(attributes={"spillmerge": header}),
        "files": GroupMetadata(),
        "index": GroupMetadata(),
    }
    n = len(plan.files)
    total_frames = plan.n_frames
    str_meta: dict[str, Any] = {
        "zarr_format": 3, "node_type": "array", "shape": [n], "data_type": "string",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(n, 1)]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": "", "codecs": [{"name": "vlen-utf8"}, {"name": "crc32c"}], "attributes": {},
    }  # fmt: skip
    row_chunks = (max(1, min(total_frames, 1 << 21)),)
    index_meta = {
        "filenames": {**str_meta, "dimension_names": ["file"]},
        "keys": {**str_meta, "dimension_names": ["file"]},
        "frame_offsets": {**array_meta((n + 1,), (n + 1,), "int64", crc=True), "dimension_names": ["file_edge"]},
        "frame_idx": {**array_meta((total_frames,), row_chunks, "int64", crc=True), "dimension_names": ["row"]},
        # Provenance per output row, for coverage reports (`spillmerge inspect --plot`): the rank whose
        # segment the row came from, and how many segments held that frame (>1: a duplicate was dropped).
        "frame_rank": {**array_meta((total_frames,), row_chunks, "int32", crc=True), "dimension_names": ["row"]},
        "frame_copies": {**array_meta((total_frames,), row_chunks, "int32", crc=True), "dimension_names": ["row"]},
    }
    for name, meta in index_meta.items():
        nodes[f"index/{name}"] = ArrayV3Metadata.from_dict(meta)
    return {path: node.to_dict() for path, node in nodes.items()}


def file_docs(files: list[FilePlan], chunk_bytes: int, codec: str) -> dict[str, dict[str, Any]]:
    """``zarr.json`` documents of the nodes of ``files`` (arrays, and groups of dict values),
    normalised by zarr's own metadata classes so the consolidated root matches zarr's."""
    nodes: dict[str, Any] = {}
    for fp in files:
        k = frames_per_chunk(fp, chunk_bytes)
        if fp.is_dict:
            nodes[f"files/{fp.key}"] = GroupMetadata(
                attributes={"spillmerge": {"filename": fp.filename, "file_index": fp.index}}
            )
        for leaf in fp.leaves:
            lay = leaf.layout
            dt = F.DTYPES[lay.dtype]
            attrs = {
                "spillmerge": {
                    "filename": fp.filename,
                    "file_index": fp.index,
                    "leaf": list(lay.leaf),
                    "dtype": lay.dtype,
                }
            }
            meta = array_meta(
                (len(fp.frames), *lay.shape),
                (k, *(max(d, 1) for d in lay.shape)),
                dt.storage,
                crc=True,
                attributes=attrs,
            )
            meta = _codecs.with_codec(meta, codec, np.dtype(dt.storage).itemsize)
            # dimension_names (xarray needs them): unique per array within its group, "frame"
            # shared by the leaves of one dict value (same length); docs/FORMAT.md.
            rel = leaf.node.removeprefix(f"files/{fp.key}").strip("/").replace("/", ".")
            name = rel if fp.is_dict else fp.key
            meta["dimension_names"] = ["frame" if fp.is_dict else f"{name}.frame"] + [
                f"{name}.dim_{d}" for d in range(1, len(lay.shape) + 1)
            ]
            nodes[leaf.node] = ArrayV3Metadata.from_dict(meta)
            parent = leaf.node.rsplit("/", 1)[0]
            while parent != "files" and parent not in nodes:  # groups of nested dict levels
                nodes[parent] = GroupMetadata()
                parent = parent.rsplit("/", 1)[0]
    # Every node's zarr.json is built here and written in one concurrent batch; the consolidated
    # metadata is assembled from the same documents, so nothing is read back (zarr's own
    # create_hierarchy / consolidate_metadata cost one or more requests per node: 16 s + 6 s for
    # 1,000 files on a local S3 server).
    return {path: node.to_dict() for path, node in nodes.items()}


def json_doc(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=False, ensure_ascii=False, allow_nan=False).encode("utf-8")


def consolidated_root(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The root ``zarr.json`` with every other document of ``docs`` (path -> document, ``""`` the
    root) inlined as consolidated metadata, the way zarr-python writes it."""
    root = dict(docs[""])
    root["consolidated_metadata"] = {
        "kind": "inline",
        "must_understand": False,
        "metadata": {path: _consolidated_entry(doc) for path, doc in sorted(docs.items()) if path},
    }
    return root


def _consolidated_entry(doc: dict[str, Any]) -> dict[str, Any]:
    # zarr-python writes child groups into the inline consolidated metadata with an empty
    # consolidated block of their own; mirror it so reading never falls back to listing.
    if doc.get("node_type") == "group":
        return {**doc, "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": {}}}
    return doc


def array_meta(
    shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str, *, crc: bool, attributes: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A Zarr v3 array ``zarr.json`` document (docs/FORMAT.md)."""
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if np.dtype(dtype).itemsize == 1:
        codecs = [{"name": "bytes"}]
    if crc:
        codecs.append({"name": "crc32c"})
    kind = np.dtype(dtype).kind
    fill: Any = False if kind == "b" else [0.0, 0.0] if kind == "c" else 0.0 if kind == "f" else 0
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": attributes or {},
    }


def array_objects(rel: str, raw: bytes, shape: tuple[int, ...], dtype: str) -> dict[str, bytes]:
    """A small array as one chunk with a crc32c checksum (zarr's crc32c codec layout): its
    objects by path."""
    chunks = tuple(max(d, 1) for d in shape)
    out = {f"{rel}/zarr.json": F.dumps(array_meta(shape, chunks, dtype, crc=True))}
    if all(d > 0 for d in shape):
        crc = np.uint32(google_crc32c.value(raw)).astype("<u4").tobytes()
        out[f"{rel}/c/" + "/".join("0" * len(shape))] = raw + crc
    return out
