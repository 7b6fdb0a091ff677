"""The checks of a segment that need all of it, made on the plan's sorted rows: a segment read a
block at a time (``_spill.stream``) is never held whole, but the sort puts its equal keys side
by side. The errors are those ``_spill.root.load_segment`` gives a segment read whole."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._format import spill as FS
from .plancolumns import ROW_BLOCK

DISTINCT = "catalog filenames must be distinct strings"


def twice(c: dict[str, np.ndarray], segments: Sequence[Any], name_of: Callable[[int], str]) -> None:
    """Sorted rows ``c`` (file, frame, segment, leaf path, and ``lf``: the row's file number in
    its segment's catalog): two rows of one segment with the same key and leaf are a frame the
    index lists twice, or, when their catalog numbers differ, a name the catalog lists twice."""
    f, fr, sg, lp = c["file"], c["frame"], c["seg"], c["lp"]
    same = (f[1:] == f[:-1]) & (fr[1:] == fr[:-1]) & (sg[1:] == sg[:-1]) & (lp[1:] == lp[:-1])
    if not same.any():
        return
    i = int(np.argmax(same))
    s = segments[int(sg[i])]  # a segment read a block at a time: one read whole was checked at load
    if c["lf"][i] != c["lf"][i + 1]:
        raise s.corrupt(DISTINCT, FS.CATALOG_NAME)
    raise s.corrupt(f"index lists frame {int(fr[i])} of {name_of(int(f[i]))!r:.200} twice", FS.INDEX_NAME)


def distinct_names(segments: Sequence[Any], file_ids: Sequence[np.ndarray], stamp: np.ndarray) -> None:
    """Each segment read a block at a time (``s.stream``) lists each filename once: its names
    that hold rows have distinct file numbers (``file_ids``; ``stamp``: int32, one per file,
    filled with -1), and a name that holds none (-1: rare) is found once among its names."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for si, s in enumerate(segments):
        st = getattr(s, "stream", None)
        if st is None:
            continue
        fid = file_ids[si]
        seen = 0
        unused = [np.zeros(0, np.int64)]
        for a in range(0, len(fid), ROW_BLOCK):
            f = np.asarray(fid[a : a + ROW_BLOCK])
            unused.append(a + np.flatnonzero(f < 0))
            f = f[f >= 0]
            if len(f) and np.any(stamp[f] == si):
                raise s.corrupt(DISTINCT, FS.CATALOG_NAME)
            stamp[f] = si
            seen += len(f)
        if seen and int(np.count_nonzero(np.asarray(stamp) == si)) != seen:
            raise s.corrupt(DISTINCT, FS.CATALOG_NAME)
        ids = np.concatenate(unused)
        if not len(ids):
            continue
        all_names = st.names()
        wanted = pa.array(sorted({all_names[int(i)].as_py() for i in ids}), type=pa.large_binary())
        if len(wanted) < len(ids):
            raise s.corrupt(DISTINCT, FS.CATALOG_NAME)
        found = 0
        for a in range(0, len(all_names), ROW_BLOCK):
            found += int(pc.sum(pc.is_in(all_names.slice(a, ROW_BLOCK), value_set=wanted)).as_py() or 0)
        if found != len(ids):
            raise s.corrupt(DISTINCT, FS.CATALOG_NAME)
