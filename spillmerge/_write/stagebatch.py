"""A batch's frames staged a block at a time (``write_batch``): each leaf's rows of the frames
that fit in the current chunk copied back to back, one block checksum per ``CHECK_BYTES``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._format import crc as _crc
from . import direct as D
from .flush import Chunk

if TYPE_CHECKING:
    from .._storage import Storage

CHECK_BYTES = 1 << 20
"""Largest block checksum (docs/FORMAT.md, ``checks``) ``add_frames`` makes, unless one row is larger."""


class BatchSteps:
    """``Staging``'s block-at-a-time steps; they use the staging state declared here."""

    chunk_bytes: int
    offset: int
    frames: int
    direct: bool | None
    _storage: Storage
    _path: str

    if TYPE_CHECKING:

        def _decide(self, nbytes: int, host: bool) -> None: ...

        def _current_chunk(self) -> Chunk: ...

        def _close_run(self, chunk: Chunk) -> None: ...

        def _block(self, chunk: Chunk, start: int, stop: int, rows: np.ndarray, value: int | None = None) -> None: ...

        def hand_off(self) -> None: ...

        def add(
            self, row: int, file_id: int, frame: int, layout_id: int, data: Any, nbytes: int,
            held: list[Any] | None = None, last: bool = True,
        ) -> None: ...  # fmt: skip

    def add_frames(
        self, row: int, file_ids: np.ndarray | int, frames: np.ndarray | None, layout_ids: np.ndarray,
        sizes: np.ndarray, columns: list[np.ndarray],
    ) -> None:  # fmt: skip
        """Stage whole frames at once: frame ``i`` has index rows ``row + i * L + j`` for its
        ``L`` leaves; leaf ``j`` is ``sizes[i, j]`` bytes (every frame has some) of catalog layout
        ``layout_ids[i, j]``, the next bytes of ``columns[j]`` (leaf ``j``'s rows back to back).
        ``file_ids``: int64 per frame, or an int (frame ``i`` is file ``file_ids + i``);
        ``frames``: int64 per frame, or None (frame 0 each). The
        frames that fit whole in the current chunk are staged a leaf at a time, one copy per leaf
        (its rows one byte range) and a block checksum per CHECK_BYTES of its rows; a frame
        straddling two chunks goes through ``add`` (a CRC per row, as ``write`` does)."""
        n, n_leaves = sizes.shape
        ends = np.cumsum(sizes, axis=0)
        starts = ends - sizes
        frame_ends = np.cumsum(sizes.sum(axis=1))
        gaps = (sizes == 0).any(axis=0).tolist()  # per leaf: a row of no bytes, in no block
        if self.direct is None:
            self._decide(int(frame_ends[0]), True)
        self.frames += n
        grid = np.arange(n * n_leaves, dtype=np.int64).reshape(n, n_leaves) + row
        fids = np.arange(file_ids, file_ids + n, dtype=np.int64) if isinstance(file_ids, int) else file_ids
        i = 0
        while i < n:
            chunk = self._current_chunk()
            done = int(frame_ends[i - 1]) if i else 0
            k = int(np.searchsorted(frame_ends, done + self.chunk_bytes - chunk.fill, side="right")) - i
            fr = 0 if frames is None else int(frames[i])
            if k == 0:  # this frame straddles the chunk boundary: leaf by leaf, as write() does
                nbs = sizes[i].tolist()
                pieces = [col[a : a + nb] for col, a, nb in zip(columns, starts[i].tolist(), nbs, strict=True)]
                self._add_by_leaf(int(grid[i, 0]), int(fids[i]), fr, layout_ids[i].tolist(), pieces, nbs)
                i += 1
                continue
            self._open_block(chunk)
            part = slice(i, i + k)
            cube = np.empty((k, n_leaves, 6), dtype=np.int64)
            cube[:, :, 0] = grid[part]
            cube[:, :, 1] = fids[part, None]
            cube[:, :, 2] = 0 if frames is None else frames[part, None]
            cube[:, :, 3] = layout_ids[part]
            cube[:, :, 5] = sizes[part]
            fill, base = chunk.fill, self.offset - chunk.fill
            for j in range(n_leaves):
                a, b = int(starts[i, j]), int(ends[i + k - 1, j])
                lo, hi = starts[part, j] - a, ends[part, j] - a  # the rows' bytes in this block of the leaf
                cube[:, j, 4] = base + fill + lo
                if a == b:
                    continue
                src = columns[j][a:b]
                if chunk.direct:
                    D.write_parts(self._storage, chunk.fd, [src], fill, self._path)
                else:
                    chunk.host_np[fill : fill + b - a] = src
                r = 0
                while r < k:  # block checksums of at most CHECK_BYTES (or one larger row)
                    s = max(r + 1, int(np.searchsorted(hi, lo[r] + CHECK_BYTES, side="right")))
                    rows = cube[r:s, j, 0][sizes[i + r : i + s, j] > 0] if gaps[j] else cube[r:s, j, 0]
                    if len(rows):
                        value = _crc.value(src[lo[r] : hi[s - 1]]) if chunk.direct else None
                        self._block(chunk, fill + int(lo[r]), fill + int(hi[s - 1]), rows, value)
                    r = s
                fill += b - a
            chunk.complete_block(cube.reshape(k * n_leaves, 6))
            self.offset += fill - chunk.fill
            chunk.fill = fill
            i += k
            if chunk.fill == self.chunk_bytes:
                self.hand_off()

    def _add_by_leaf(
        self, row: int, file_id: int, frame: int, layout_ids: Any, pieces: list[Any], sizes: list[int]
    ) -> None:
        """One frame through ``add``, a leaf at a time (rows ``row`` ...)."""
        held: list[Any] = []
        last = len(pieces) - 1
        for j, (piece, nb) in enumerate(zip(pieces, sizes, strict=True)):
            self.add(row + j, file_id, frame, int(layout_ids[j]), piece, nb, held, j == last)

    def _open_block(self, chunk: Chunk) -> None:
        """Make ``chunk`` ready for a block of whole frames copied in by ``add_frames``."""
        if chunk.host_np is None and not chunk.direct:
            chunk.host_np = chunk.host.numpy()
        if chunk.run:
            self._close_run(chunk)
