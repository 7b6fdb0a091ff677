"""The zarr store an output is read through (:class:`NoFillStore`: an absent chunk is damage, not
fill values, every object read within the format's size limits), :func:`open_consolidated`, and
:func:`chunk_reader`: a chunk of an uncompressed array (codecs ``bytes`` + ``crc32c``) read straight
from storage, without zarr's event-loop round trip (its size and CRC-32C checked)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import ByteRequest, Store
from zarr.core.array import AsyncArray
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.core.group import AsyncGroup, GroupMetadata
from zarr.storage import StorePath, WrapperStore

from .._errors import CorruptSpillError
from .._format import common as F
from .._format import crc as _crc
from .._format import output as FO
from .._format.invariants import array_limits, read_array
from .._storage import Storage


def damaged(path: str, what: str) -> CorruptSpillError:
    """The error for damage ``what`` found in the object at ``path``."""
    return CorruptSpillError(f"{path}: {what}; the output is damaged: merge it again", path=path)


def missing_chunk(describe: Callable[[str], str], key: str) -> CorruptSpillError:
    """The error for chunk object ``key`` (``<array>/c/<coords>``) that is not there: damage,
    where zarr would read fill values."""
    array, _, coords = key.rpartition("/c/")
    what = f"chunk {coords.replace('/', ', ')} of {array}" if array else "chunk"
    return damaged(describe(key), f"{what} is missing (zarr would read it as zeros)")


def _plain(arr: Any, limits: FO.ChunkLimits) -> bool:
    """``arr`` is stored as raw little-endian chunks + CRC-32C (``limits``: its codecs are ``bytes``
    and ``crc32c``), chunked along its first dimension."""
    m = arr.metadata
    enc = getattr(m, "chunk_key_encoding", None)
    return (
        limits.compressor is None
        and limits.crc
        and str(getattr(m.codecs[0], "endian", None) or "little").endswith("little")
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
    path, describe = arr.path, storage.describe
    limits = array_limits(arr, describe(f"{path}/zarr.json"))
    if not _plain(arr, limits):
        return lambda c: read_array(arr, slice(c * k, min((c + 1) * k, n)))
    inner = tuple(int(d) for d in arr.chunks[1:])
    dtype = arr.dtype.newbyteorder("<")
    count = k * int(np.prod(inner, dtype=np.int64))
    size = count * dtype.itemsize + 4
    suffix = "/0" * len(inner)
    limit = limits.object_bytes

    def read(c: int) -> np.ndarray:
        rel = f"{path}/c/{c}{suffix}"
        try:
            data = storage.get(rel, max_bytes=limit)  # what NoFillStore allows: the format's size limit
        except FileNotFoundError:
            raise missing_chunk(describe, rel) from None
        # (over a numpy view: slicing the bytes would copy the whole chunk once more)
        body = np.frombuffer(data, dtype=np.uint8, count=len(data) - 4) if len(data) >= 4 else b""
        if len(data) != size or _crc.value(body) != int.from_bytes(data[-4:], "little"):
            what = f"{len(data)} bytes, its chunk shape needs {size}" if len(data) != size else "CRC-32C mismatch"
            coords = ", ".join([str(c)] + ["0"] * len(inner))
            raise damaged(describe(rel), f"chunk {coords} of {path}: its size and checksum do not match ({what})")
        out = np.frombuffer(data, dtype=dtype, count=count).reshape((k, *inner))
        return out[: min(k, n - c * k)]

    return read


# Metadata documents zarr may look for and legitimately not find; every other key is a chunk.
_METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})


class NoFillStore(WrapperStore[Store]):
    """A zarr store that raises :class:`CorruptSpillError` where the wrapped store has no chunk
    (zarr would read zeros; a merge writes every chunk, so an absent one is damage), and that checks
    every chunk against its array's ``_format.output.chunk_limits`` before zarr decodes it (a zstd
    or blosc bomb is refused unread). On a local ``storage`` (``store``: its zarr store) every
    object is read through :meth:`Storage.get`: regular files only, within the format's size limits."""

    def __init__(self, store: Store, storage: Storage) -> None:
        super().__init__(store)
        self._describe = storage.describe
        self._storage = storage
        self.local = storage.local
        """Objects are read from a local disk (``_format.invariants.read_rows`` reads chunk by chunk)."""
        self._chunk_limits: dict[str, FO.ChunkLimits] = {}

    def _with_store(self, store: Store) -> NoFillStore:
        return type(self)(store, self._storage)

    async def _limits(self, key: str, prototype: BufferPrototype) -> FO.ChunkLimits:
        """The bounds of chunk ``key`` (docs/FORMAT.md, *Size limits*), from its array's metadata
        (never read past :data:`F.ARRAY_DOC_MAX_BYTES`) checked against the format once per
        array: on every backend, before zarr decodes it."""
        array = key.rpartition("/c/")[0] if "/c/" in key else key.rpartition("/")[0]
        limits = self._chunk_limits.get(array)
        if limits is None:
            doc = f"{array}/zarr.json" if array else "zarr.json"
            buf = await self.get(doc, prototype)  # (a local disk reads no more than the limit)
            if buf is None:
                raise missing_chunk(self._describe, key)
            raw, path = buf.to_bytes(), self._describe(doc)
            if len(raw) > F.ARRAY_DOC_MAX_BYTES:
                raise CorruptSpillError(
                    f"{path} is {len(raw)} bytes, more than the {F.ARRAY_DOC_MAX_BYTES} its format allows", path=path
                )
            limits = FO.chunk_limits(F.loads(raw, path=path), path=path)
            self._chunk_limits[array] = limits
        return limits

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        chunk = key.rsplit("/", 1)[-1] not in _METADATA_NAMES
        limits = await self._limits(key, prototype) if chunk else None  # (refuses a sharded array)
        if byte_range is not None:  # zarr reads byte ranges of sharded arrays only
            raise ValueError(f"{self._describe(key)}: a byte range {byte_range!r}; an output is never sharded")
        if not self.local:
            buf = await self._store.get(key, prototype)
        else:
            doc_limit = F.ROOT_DOC_MAX_BYTES if "/" not in key else F.ARRAY_DOC_MAX_BYTES
            limit = limits.object_bytes if limits else doc_limit
            raw = await asyncio.to_thread(self._storage.get_or_none, key, max_bytes=limit)
            buf = None if raw is None else prototype.buffer.from_bytes(raw)
        if buf is None and chunk:
            raise missing_chunk(self._describe, key)
        if buf is not None and limits is not None:
            FO.check_chunk(limits, buf.as_numpy_array().data, path=self._describe(key))
        return buf

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]


class ConsolidatedGroup(zarr.Group):
    """A group whose lookups (``group[path]``, ``members(max_depth=0)``) are answered from
    its consolidated metadata in the calling thread, not zarr's event-loop thread; without
    consolidated metadata, or for deeper members, zarr answers."""

    def __getitem__(self, path: str) -> Any:
        node: Any = self.metadata
        if node.consolidated_metadata is None:
            return super().__getitem__(path)
        for name in path.strip("/").split("/"):
            children = node.consolidated_metadata if isinstance(node, GroupMetadata) else None
            if children is None or name not in children.metadata:
                raise KeyError(path)
            node = children.metadata[name]
        where = self.store_path / path.strip("/")
        if isinstance(node, GroupMetadata):
            return ConsolidatedGroup(AsyncGroup(metadata=node, store_path=where))
        return zarr.Array(AsyncArray(metadata=node, store_path=where))

    def members(
        self, max_depth: int | None = 0, *, use_consolidated_for_children: bool = True
    ) -> tuple[tuple[str, zarr.Array[Any] | zarr.Group], ...]:
        consolidated = self.metadata.consolidated_metadata
        if consolidated is None or max_depth != 0:
            return super().members(max_depth, use_consolidated_for_children=use_consolidated_for_children)
        return tuple((key, self[key]) for key in consolidated.metadata)


def open_consolidated(store: NoFillStore, storage: Storage) -> zarr.Group:
    """The output's root group, read only, with its consolidated metadata (required); on a local
    disk read here within :data:`F.ROOT_DOC_MAX_BYTES` and parsed by ``AsyncGroup.from_dict``."""
    if not storage.local:
        return zarr.open_group(store, mode="r", use_consolidated=True, zarr_format=3)
    doc = F.loads(storage.get("zarr.json", max_bytes=F.ROOT_DOC_MAX_BYTES), path=storage.describe("zarr.json"))
    if not isinstance(doc, dict) or doc.get("consolidated_metadata") is None:
        raise ValueError("Consolidated metadata requested with 'use_consolidated=True' but not found in ''.")
    return ConsolidatedGroup(AsyncGroup.from_dict(StorePath(store, ""), doc))
