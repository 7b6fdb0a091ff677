"""The output's index arrays' chunk objects, written without zarr in zarr's encoding (``bytes`` +
``crc32c``): a whole merge writes them all, each part of a merge in parts its share (one run of
each array's chunks), the finalize none (docs/SCALE.md)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._format import crc as _crc
from .._storage import Storage
from . import documents as Z
from .plan import Plan
from .plancolumns import NONE


@dataclass(frozen=True, slots=True)
class IndexChunk:
    """One chunk of one index array: elements ``[lo, hi)`` along its first dimension."""

    path: str
    """The array's path in the output (``index/frame_idx``, ``columns/<name>/offsets``, ...)."""
    chunk: int
    lo: int
    hi: int
    shape: tuple[int, ...]
    """The chunk shape (the array's ``chunk_shape``)."""
    dtype: str
    source: Any
    """The array the elements come from (only ``[lo, hi)`` is read); of a ``valid`` or ``none``
    array, its column's ``src`` (the elements: ``src >= 0``, ``src == NONE``)."""

    @property
    def key(self) -> str:
        return f"{self.path}/c/{self.chunk}" + "/0" * (len(self.shape) - 1)

    def elements(self) -> np.ndarray:
        block = np.asarray(self.source[self.lo : self.hi])
        if self.path.endswith("/valid"):
            return block >= 0
        return block == NONE if self.path.endswith("/none") else block

    def encode(self) -> list[np.ndarray]:
        """The chunk object: the elements at the full chunk shape, then their CRC-32C."""
        out = np.zeros(self.shape, dtype=np.dtype(self.dtype).newbyteorder("<"))  # (a byte has no order)
        out[: self.hi - self.lo] = self.elements()
        raw = out.reshape(-1).view(np.uint8)
        return [raw, np.frombuffer(np.uint32(_crc.value(raw)).astype("<u4").tobytes(), np.uint8)]


def index_chunks(plan: Plan, docs: dict[str, dict[str, Any]]) -> list[IndexChunk]:
    """Every chunk of every index array of the output whose documents are ``docs``
    (``_merge.documents.output_docs``: the arrays under ``index/``, ``lists/`` and ``columns/``
    but ``values``), in the order the shares are dealt."""
    index = {
        **plan.filenames.index_arrays(Z.NAME_BLOCK),  # no str per name
        "file_layout": plan.file_layout, "frame_offsets": plan.file_offsets, "frame_idx": plan.frame_idx,
        "frame_rank": plan.rank, "frame_copies": plan.copies,
    }  # fmt: skip
    sources: dict[str, Any] = {f"index/{k}": v for k, v in index.items()}
    sources |= {f"lists/{lst.name}/offsets": lst.offsets for lst in plan.lists}
    columns = {f"columns/{col.name}": col for col in plan.columns}
    out = []
    for path, doc in docs.items():
        base, _, name = path.rpartition("/")
        if doc["node_type"] != "array" or name == "values":
            continue  # a group, or a column's values (the copy's)
        source = sources.get(path)
        if source is None:  # a column's offsets, shapes, or ``valid`` / ``none`` from its ``src``
            source = getattr(columns[base], "src" if name in ("valid", "none") else name)
        n = int(doc["shape"][0])  # (none: the array has no chunk; its other dimensions are never 0)
        chunks = tuple(int(d) for d in doc["chunk_grid"]["configuration"]["chunk_shape"])
        for j, lo in enumerate(range(0, n, chunks[0])):
            out.append(IndexChunk(path, j, lo, min(lo + chunks[0], n), chunks, doc["data_type"], source))
    return out


def share(chunks: Sequence[IndexChunk], part: int, parts: int) -> list[IndexChunk]:
    """Part ``part``'s chunks of ``parts``: of each array, one of ``parts`` runs of its chunks
    (the ``j``-th array's ``q``-th run to part ``(q + j) mod parts``, so the arrays of one chunk
    are spread over the parts), so a part reads one range of each of a stored plan's arrays."""
    by_path: dict[str, list[IndexChunk]] = {}
    for c in chunks:
        by_path.setdefault(c.path, []).append(c)
    out = []
    for j, run in enumerate(by_path.values()):
        m, q = len(run), (part - j) % parts
        out += run[m * q // parts : m * (q + 1) // parts]
    return out


def write(output: Storage, chunks: Sequence[IndexChunk], *, threads: int) -> None:
    """Write ``chunks`` (whole objects: a rerun rewrites them), ``threads`` at a time."""
    for folder in sorted({c.key.rsplit("/", 1)[0] for c in chunks}):
        output.makedirs(folder)

    def put(c: IndexChunk) -> None:
        output.put(c.key, c.encode())  # type: ignore[arg-type]

    if threads <= 1 or len(chunks) <= 1:
        for c in chunks:
            put(c)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spillmerge-index") as pool:
        list(pool.map(put, chunks))  # raises the first error, in chunk order
