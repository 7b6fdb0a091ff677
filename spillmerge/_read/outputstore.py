"""The zarr store an output is read through (:class:`NoFillStore`: an absent chunk is damage, not
fill values, every object read within the format's size limits) and :func:`open_consolidated`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import zarr
from zarr.abc.store import ByteRequest, Store
from zarr.core.array import AsyncArray
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.core.group import AsyncGroup, GroupMetadata
from zarr.storage import StorePath, WrapperStore

from .._errors import CorruptSpillError
from .._format import common as F
from .._format import output as FO
from .._storage import Storage
from .rawchunk import missing_chunk

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
        self._chunk_limits: dict[str, FO.ChunkLimits] = {}

    @property
    def local(self) -> bool:
        """Objects are read from a local disk (``_format.invariants.read_rows`` reads chunk by chunk)."""
        return self._storage.local

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
        if not self._storage.local:
            buf = await self._store.get(key, prototype)
        else:
            doc_limit = F.ROOT_DOC_MAX_BYTES if "/" not in key else F.ARRAY_DOC_MAX_BYTES
            try:
                raw = await asyncio.to_thread(
                    self._storage.get, key, max_bytes=limits.object_bytes if limits else doc_limit
                )
            except FileNotFoundError:
                raw = None
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
