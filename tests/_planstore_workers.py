"""A part (or the finalize) of a merge in parts for tests/merge/test_planstore.py, in a process
forked from tests/_procs.py's forkserver: several start at the same moment as separate processes."""

from __future__ import annotations

import traceback


def merge_part(root: str, out: str, i: int, n: int, budget: int, result: str) -> None:
    """Part ``i`` of ``n`` (the finalize where ``i < 0``); writes the report's notes joined by
    ``|`` to ``result``, or the traceback and exits 1."""
    import spillmerge

    kw: dict[str, object] = {"chunk_bytes": 8192, "codec": "zstd", "timeout": 240.0}
    if budget:
        kw["plan_budget"] = budget
    try:
        if i < 0:
            rep = spillmerge.merge(root, out, finalize=True, **kw)  # type: ignore[arg-type]
        else:
            rep = spillmerge.merge(root, out, part=(i, n), **kw)  # type: ignore[arg-type]
    except BaseException:
        with open(result, "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None
    with open(result, "w") as f:
        f.write("|".join(rep.notes))
