"""Frame-index arithmetic shared by the merge's report and the inspection tools: runs of
consecutive frames, the frames absent below a span (in O(frames), whatever the span), and the
manifest of expected frame counts (``expected=`` / ``--expected``). Below both: the merge never
imports the inspection tools."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator, Mapping

import numpy as np

from .._errors import ConfigError, SpillValueError

MAX_FRAME = (1 << 63) - 1
"""Highest frame index (int64); a manifest count is at most ``MAX_FRAME + 1``."""


def runs(frames: np.ndarray, labels: np.ndarray | None = None) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of consecutive frames with the same label: (first, last, label)."""
    if not len(frames):
        return
    lab = labels if labels is not None else np.zeros(len(frames), dtype=np.int64)
    brk = np.flatnonzero((np.diff(frames) != 1) | (np.diff(lab) != 0)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [len(frames)])) - 1
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        yield int(frames[a]), int(frames[b]), int(lab[a])


def n_below(frames: np.ndarray, span: int) -> int:
    """How many of ``frames`` (ascending int64) are below ``span`` (which may be 2**63)."""
    return len(frames) if span > MAX_FRAME else int(np.searchsorted(frames, span))


def gap_runs(frames: np.ndarray, span: int) -> np.ndarray:
    """Inclusive ``[first, last]`` runs of ``0 .. span-1`` absent from ``frames`` (ascending,
    unique), as an int64 array of shape (k, 2); k is at most ``len(frames) + 1``."""
    have = frames[: n_below(frames, span)].astype(np.int64, copy=False)
    if not len(have):
        return np.array([[0, span - 1]] if span else np.zeros((0, 2)), dtype=np.int64)
    inner = np.stack((have[:-1] + 1, have[1:] - 1), axis=1)  # no overflow: have[i] < have[i+1]
    head = [[0, int(have[0]) - 1]] if have[0] > 0 else []
    # In Python ints: the last frame may be 2**63 - 1, where have + 1 would wrap.
    tail = [[int(have[-1]) + 1, span - 1]] if int(have[-1]) + 1 <= span - 1 else []
    runs = np.concatenate((np.array(head, np.int64).reshape(-1, 2), inner, np.array(tail, np.int64).reshape(-1, 2)))
    return runs[runs[:, 0] <= runs[:, 1]]


def read_manifest(path: str) -> dict[str, int]:
    """``filename,n_frames`` CSV (header required; other columns ignored) → filename → count."""
    try:
        # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is no part of the first column's name
        f = open(path, newline="", encoding="utf-8-sig")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ConfigError(f"manifest {path}: cannot read it ({exc.strerror or exc})", key="expected") from None
    out: dict[str, int] = {}
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None or not {"filename", "n_frames"} <= {h.strip() for h in header}:
                raise ConfigError(
                    f"manifest {path} line 1: expected a header with columns filename,n_frames, got {header!r}",
                    key="expected",
                )
            cols = [h.strip() for h in header]
            fi, ni = cols.index("filename"), cols.index("n_frames")
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) <= max(fi, ni):
                    raise ConfigError(
                        f"manifest {path} line {line}: expected filename,n_frames, got {row!r}", key="expected"
                    )
                name, raw = row[fi], row[ni].strip()
                try:
                    n = int(raw)
                except ValueError:
                    n = -1
                if not 0 <= n <= MAX_FRAME + 1:  # frame indices are int64: 0 .. 2**63 - 1
                    raise ConfigError(
                        f"manifest {path} line {line}: n_frames {raw!r} of {name!r} is not an integer in [0, 2**63]",
                        key="expected",
                    )
                if name in out:
                    raise ConfigError(f"manifest {path} line {line}: {name!r} is listed twice", key="expected")
                out[name] = n
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"manifest {path} line {reader.line_num}: not valid CSV ({exc})", key="expected"
            ) from None
    return out


def first_missing(have: np.ndarray, span: int, limit: int) -> list[int]:
    """The first ``limit`` integers of ``0 .. span-1`` not in ``have`` (ascending, unique), from
    the gaps' runs: ``span`` integers are never materialised, however large it is."""
    out: list[int] = []
    for a, b in gap_runs(have, span).tolist():
        if len(out) >= limit:
            break
        out.extend(range(a, min(b + 1, a + limit - len(out))))
    return out


def check_expected(expected: Mapping[str, int] | str | None) -> dict[str, int] | None:
    """``expected=``: a CSV manifest's path, or a mapping filename → non-negative frame count."""
    if expected is None:
        return None
    if isinstance(expected, (str, os.PathLike)):
        return read_manifest(os.fspath(expected))
    if not isinstance(expected, Mapping):
        raise SpillValueError(
            f"expected must be a mapping filename -> frame count or a CSV path, got {type(expected).__name__}"
        )
    for name, count in expected.items():
        if not isinstance(name, str) or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise SpillValueError(f"expected[{name!r}] must map a filename to a non-negative int, got {count!r}")
    return dict(expected)
