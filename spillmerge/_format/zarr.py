"""Zarr v3 array documents from plain values (docs/FORMAT.md): an array's ``zarr.json`` (fixed-size
chunks, ``crc32c``) and a small array written as one chunk; used by segments and outputs alike."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import codecs as _codecs
from . import common as F
from . import crc as _crc


def array_meta(
    shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str, *, crc: bool, codec: str = "none"
) -> dict[str, Any]:
    """A Zarr v3 array ``zarr.json`` (docs/FORMAT.md): bytes, ``codec``'s compressor, crc32c."""
    dt = np.dtype(dtype)
    endian = {"configuration": {"endian": "little"}} if dt.itemsize > 1 else {}
    chain = ({"name": "bytes", **endian}, _codecs.compressor_doc(codec, dt.itemsize), {"name": "crc32c"} if crc else None)
    codecs = [c for c in chain if c is not None]  # bytes, the compressor if any, crc32c if asked
    fill: Any = {"b": False, "c": [0.0, 0.0], "f": 0.0}.get(dt.kind, 0)
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": {},
    }


def array_objects(rel: str, raw: bytes, shape: tuple[int, ...], dtype: str) -> dict[str, bytes]:
    """A small array as one chunk with a crc32c checksum (zarr's crc32c codec layout): its
    objects by path."""
    chunks = tuple(max(d, 1) for d in shape)
    out = {f"{rel}/zarr.json": F.dumps(array_meta(shape, chunks, dtype, crc=True))}
    if all(d > 0 for d in shape):
        out[f"{rel}/c/" + "/".join("0" * len(shape))] = raw + _crc.value(raw).to_bytes(4, "little")
    return out
