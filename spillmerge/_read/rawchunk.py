"""One chunk of an uncompressed output array (codecs ``bytes`` + ``crc32c``) read straight from
storage, without zarr's event-loop round trip: the object must exist, have exactly its chunk's size
and match its CRC-32C. Any other array is read through zarr."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import CorruptSpillError
from .._format import crc as _crc
from .._format.invariants import array_limits, read_array
from .._storage import Storage


def missing_chunk(describe: Callable[[str], str], key: str) -> CorruptSpillError:
    """The error for chunk object ``key`` (``<array>/c/<coords>``) that is not there: damage,
    where zarr would read fill values."""
    path = describe(key)
    array, _, coords = key.rpartition("/c/")
    what = f"chunk {coords.replace('/', ', ')} of {array}" if array else "chunk"
    return CorruptSpillError(
        f"{path}: {what} is missing (zarr would read it as zeros); the output is damaged: merge it again", path=path
    )


def _plain(arr: Any) -> bool:
    """``arr`` is stored as raw little-endian chunks + CRC-32C, chunked along its first dimension."""
    m = arr.metadata
    codecs: tuple[Any, ...] = tuple(getattr(m, "codecs", ()))
    enc = getattr(m, "chunk_key_encoding", None)
    return (
        len(codecs) == 2
        and type(codecs[0]).__name__ == "BytesCodec"
        and str(getattr(codecs[0], "endian", None) or "little").endswith("little")
        and type(codecs[1]).__name__ == "Crc32cCodec"
        and type(enc).__name__ == "DefaultChunkKeyEncoding"
        and getattr(enc, "separator", None) == "/"
        and arr.dtype.kind in "biuf"
        and tuple(arr.chunks[1:]) == tuple(max(d, 1) for d in arr.shape[1:])
    )


def chunk_reader(arr: Any, storage: Storage) -> Callable[[int], np.ndarray]:
    """``read(c)``: chunk ``c`` of ``arr`` along its first dimension (the edge chunk trimmed to the
    array), a read-only array; straight from ``storage`` when the array is plain (module
    docstring), else through zarr."""
    k, n = max(int(arr.chunks[0]), 1), int(arr.shape[0])
    if 0 in tuple(arr.shape):  # no element: zarr stores no chunk, and a read needs none
        rest = tuple(int(d) for d in arr.shape[1:])
        return lambda c: np.empty((max(0, min(k, n - c * k)), *rest), dtype=arr.dtype)
    if not _plain(arr):
        return lambda c: read_array(arr, slice(c * k, min((c + 1) * k, n)))
    inner = tuple(int(d) for d in arr.chunks[1:])
    dtype = arr.dtype.newbyteorder("<")
    count = k * int(np.prod(inner, dtype=np.int64))
    size = count * dtype.itemsize + 4
    suffix = "/0" * len(inner)
    path = arr.path
    describe = storage.describe
    limit = array_limits(arr, describe(f"{path}/zarr.json")).object_bytes

    def read(c: int) -> np.ndarray:
        rel = f"{path}/c/{c}{suffix}"
        try:
            data = storage.get(rel, max_bytes=limit)  # what NoFillStore allows: the format's size limit
        except FileNotFoundError:
            raise missing_chunk(describe, rel) from None
        # (over a numpy view: slicing the bytes would copy the whole chunk once more)
        body = np.frombuffer(data, dtype=np.uint8, count=len(data) - 4) if len(data) >= 4 else b""
        if len(data) != size or _crc.value(body) != int.from_bytes(data[-4:], "little"):
            where = describe(rel)
            what = f"{len(data)} bytes, its chunk shape needs {size}" if len(data) != size else "CRC-32C mismatch"
            coords = ", ".join([str(c)] + ["0"] * len(inner))
            raise CorruptSpillError(
                f"{where}: chunk {coords} of {path}: its size and checksum do not match ({what}); the output is "
                "damaged: merge it again",
                path=where,
            )
        out = np.frombuffer(data, dtype=dtype, count=count).reshape((k, *inner))
        return out[: min(k, n - c * k)]

    return read
