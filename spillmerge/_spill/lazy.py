"""A spill root's committed segments read when a merge first uses them (:class:`LazySegment`,
duck-typed as ``_spill.root.LoadedSegment``) and let go between its passes unless they fit in
the merge's budget for keeping them (:data:`KEEP_BYTES`); a large one (:data:`STREAM_BYTES`) is
read by the plan a block at a time instead (``_spill.stream``), never whole."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import cast

import numpy as np

from .._errors import CorruptSpillError
from .._format import spill as FS
from .._storage import Storage
from .root import LoadedSegment, Segment, corrupt, load_segment
from .stream import Stream, Whole

KEEP_BYTES = 64 << 20
"""Catalogs and indexes one merge may keep loaded between its passes, in all (estimated from the
commit records): a small merge reads each segment once; a large one lets them go after each pass
and reads them again, one at a time."""

STREAM_BYTES = 8 << 20
"""Index bytes beyond which the plan's sort reads a segment a block at a time
(:meth:`LazySegment.open_stream`) rather than whole: what it holds of one segment then stays
bounded (``_spill.stream``)."""


class LazySegment:
    """A committed segment read as :class:`LoadedSegment` is (:func:`load_segment`, with its
    checks) when its catalog or index is first used: a merge plans from the segments one at a
    time, never holding every segment's filenames and index at once (docs/SCALE.md)."""

    def __init__(self, storage: Storage, seg: Segment, kept: list[int]) -> None:
        assert seg.commit is not None
        self.seg, self.chunk_bytes, self.n_rows = seg, seg.commit.chunk_bytes, seg.commit.n_rows
        self._storage = storage
        self._whole: LoadedSegment | None = None
        self._small: tuple[list[FS.Layout], np.ndarray | None] | None = None
        self._kept = kept
        """What is left of :data:`KEEP_BYTES` for the segments of one :func:`load_all` (one int, shared)."""
        self._held = False
        """Kept loaded within the merge's budget: never let go."""
        self.stream: Stream | None = None
        """The block-at-a-time reader :meth:`open_stream` gave, if any."""

    def open_stream(self, folder: str, si: int) -> Stream | None:
        """Read this segment a block at a time from now on (its filenames to files of
        ``folder``), when its index is larger than :data:`STREAM_BYTES` and it has not been read
        whole; None when it is read whole (small, or not readable so: then it is read here, and
        a damaged segment raises its error)."""
        if self.stream is not None:
            return self.stream
        if self._whole is not None or self.n_rows * FS.INDEX_COLUMNS * 8 <= STREAM_BYTES:
            return None
        try:
            st = Stream(self._storage, self.seg, os.path.join(folder, f"names-{si:06d}"))
        except Whole:
            self._load()
            return None
        self.stream = st
        self._small = (st.layouts, st.checks)
        return st

    def rows(self, step: int) -> Iterator[np.ndarray]:
        """The index, at most ``step`` rows at a time, read a block at a time (and checked again)
        from the stream :meth:`open_stream` gave."""
        assert self.stream is not None
        try:
            yield from self.stream.rows(step)
        except Whole:
            self._load()  # raises the segment's error
            raise self.corrupt("index changed while it was read", FS.INDEX_NAME) from None

    def corrupt(self, msg: str, rel: str = "") -> CorruptSpillError:
        """The error naming this segment's object ``rel`` (a check the plan's sort makes)."""
        return corrupt(self._storage, self.seg, msg, rel)

    def _load(self) -> LoadedSegment:
        whole = self._whole
        if whole is None:
            whole = self._whole = load_segment(self._storage, self.seg)
            self._small = (whole.layouts, whole.checks)
        return whole

    @property
    def filenames(self) -> list[str]:
        return self._load().filenames

    @property
    def index(self) -> np.ndarray:
        return self._load().index

    @property
    def layouts(self) -> list[FS.Layout]:
        return self._small[0] if self._small is not None else self._load().layouts

    @property
    def checks(self) -> np.ndarray | None:
        return self._small[1] if self._small is not None else self._load().checks

    def release(self) -> None:
        """Let the filenames and index go (the layouts and checks stay), unless they fit in
        what is left of the merge's budget: then they stay for the next pass."""
        if self._held or self._whole is None:
            return
        commit = self.seg.commit
        assert commit is not None
        cost = self.n_rows * FS.INDEX_COLUMNS * 8 + commit.n_files * 128  # the index, the names
        if cost <= self._kept[0]:
            self._kept[0] -= cost
            self._held = True
            return
        self._whole = None


def load_all(storage: Storage, segments: list[Segment]) -> list[LoadedSegment]:
    """Every segment, each read when first used (:class:`LazySegment`: duck-typed as a
    :class:`LoadedSegment`, which is what the planner takes)."""
    kept = [KEEP_BYTES]
    return [cast(LoadedSegment, LazySegment(storage, seg, kept)) for seg in segments]
