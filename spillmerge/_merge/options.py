"""Every option of :func:`spillmerge.merge`, declared once in :class:`MergeOptions` with its default,
meaning, ``[merge]`` TOML key and ``spillmerge merge`` flag."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .._format.common import DEFAULT_CHUNK_BYTES

DEFAULT_MEMORY_BUDGET = 256 << 20
"""Bytes of output chunks a merge keeps in flight by default."""

DEFAULT_PLAN_BUDGET = 512 << 20
"""The planner's memory limit by default. With ``DEFAULT_MEMORY_BUDGET`` a merge process stays
within about 1 GiB (docs/SCALE.md)."""


def parse_size(text: str) -> int:
    """``16MiB``, ``256M``, ``1g``, ``4096`` → bytes (the CLI's sizes)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16MiB, 256M, 1048576)") from None


def parse_part(text: str) -> tuple[int, int]:
    """``I/N`` → ``(i, n)`` (the CLI's ``--part``)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a part: {text!r} (I/N, e.g. 0/4 for the first of 4)") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"part {text!r} is not in 0/N .. (N-1)/N")
    return i, n


@dataclass(frozen=True, slots=True)
class Flag:
    """How an option is given to ``spillmerge merge``."""

    name: str
    """The flag, e.g. ``--timeout``."""
    help: str
    """Its help text."""
    argparse: Mapping[str, Any] = field(default_factory=dict)
    """Further ``add_argument`` keywords (``type``, ``choices``, ``metavar``, ``action``). A dict
    option's flag is repeatable ``KEY=VALUE`` and updates the config file's table."""
    exclusive: str | None = None
    """Flags sharing this name are mutually exclusive."""


def _option(
    default: Any, config: type | None = None, flag: str | None = None, text: str = "", *,
    exclusive: str | None = None, **argparse_kw: Any,
) -> Any:  # fmt: skip
    """A field of :class:`MergeOptions`: ``config`` is its TOML type in ``[merge]`` (None: not a
    config key), ``flag`` its command-line flag (None: library only) with help ``text`` and
    further ``add_argument`` keywords."""
    spec = None if flag is None else Flag(flag, text, argparse_kw, exclusive)
    return field(default=default, metadata={"config": config, "flag": spec})


@dataclass(frozen=True, slots=True)
class MergeOptions:
    """Every option of one merge call, as :func:`spillmerge.merge` takes them (see its docstring).
    Those with a flag come in the order ``spillmerge merge --help`` lists them."""

    timeout: float = _option(
        0.0, float, "--timeout",
        "seconds to wait for missing commit records, and in a part for the stored plan (default 0: check "
        "once; a part still waits for the plan while the part building it is alive)",
        type=float,
    )  # fmt: skip
    """Seconds to wait for missing commit records (0: check once), in a part for the plan the part
    holding the ``planner`` lease stores (then it plans itself; with 0 it waits while that holder is
    alive), and for missing parts at finalize."""
    allow_partial: bool = _option(
        False, bool, "--allow-partial",
        "merge what is committed plus what dead ranks provably flushed; report missing ranks and frames",
        action="store_true",
    )  # fmt: skip
    expected: Mapping[str, int] | str | None = _option(
        None, str, "--expected",
        "manifest (columns filename,n_frames): list every frame missing against it; exit 1 if any",
        metavar="CSV",
    )  # fmt: skip
    """Filename → expected frame count, or the path of a ``filename,n_frames`` CSV manifest."""
    on_duplicate: str = _option(
        "error", str, "--on-duplicate", "what to do with a key written twice with different content (default error)",
        choices=["error", "first", "last"],
    )  # fmt: skip
    overwrite: bool = _option(False, bool, "--overwrite", "replace an existing complete output", action="store_true")
    """Replace an existing complete output (or part records of another plan)."""
    codec: str = _option(
        "none", str, "--codec", "compress the output arrays (default none; --finalize takes it from the parts)",
        choices=["none", "blosc-lz4", "zstd"],
    )  # fmt: skip
    part: tuple[int, int] | None = _option(
        None, None, "--part",
        "write only part I of N (its share of the files) and its part record; run all N, then --finalize",
        type=parse_part, metavar="I/N", exclusive="how",
    )  # fmt: skip
    finalize: bool = _option(
        False, None, "--finalize",
        "after every --part ran: check all parts are present and of the same plan, write the index, "
        "consolidated metadata and completion marker (--timeout waits for missing parts)",
        action="store_true", exclusive="how",
    )  # fmt: skip
    world_size: int | None = _option(
        None, int, "--world-size", "expected number of ranks (default: from the commit records)", type=int
    )
    chunk_bytes: int = _option(
        DEFAULT_CHUNK_BYTES, int, "--chunk-bytes", "target output chunk size (default 16MiB)", type=parse_size
    )
    memory_budget: int = _option(
        DEFAULT_MEMORY_BUDGET, int, "--memory-budget", "bytes of frames in flight (default 256MiB)", type=parse_size
    )
    plan_budget: int = _option(
        DEFAULT_PLAN_BUDGET, int, "--plan-budget",
        "memory limit of the planner; beyond it the planner spills to --plan-dir (default 512MiB)",
        type=parse_size,
    )  # fmt: skip
    """Memory limit of the planner; beyond it the planner spills to ``plan_dir``. Never changes the plan."""
    plan_dir: str | None = _option(
        None, str, "--plan-dir", "the planner's temporary folder, emptied after the merge (default: system temp)",
        metavar="DIR",
    )  # fmt: skip
    threads: int | None = _option(
        None, int, "--threads", "copy threads (default 4 on local disks, 16 with an object store)", type=int
    )
    storage_options: dict[str, Any] | None = _option(
        None, dict, "--storage-option",
        "fsspec option for ROOT (repeatable; also used for OUT when both share a protocol); VALUE is read "
        """as JSON where it is JSON (a number, true, {...}), else as a string (quote one: secret='"123"')""",
        action="append", metavar="KEY=VALUE",
    )  # fmt: skip
    out_storage_options: dict[str, Any] | None = _option(
        None, dict, "--out-storage-option", "fsspec option for OUT (repeatable; VALUE as for --storage-option)",
        action="append", metavar="KEY=VALUE",
    )  # fmt: skip
    remove_spill: bool = _option(
        False, bool, "--remove-spill",
        "delete the spill root once the output is complete and nothing is missing (kept otherwise)",
        action="store_true",
    )  # fmt: skip
    progress: bool | None = _option(
        None, None, "--no-progress", "no progress bar, no notices while waiting for ranks",
        action="store_const", const=False,
    )  # fmt: skip
    """Progress bar (None: on a terminal); unless False, also a line on stderr every 30 s while the
    merge waits for ranks to commit, naming them."""
    run_id: str | None = _option(None)
    """Run id the barrier waits for (None: each rank's newest segments)."""
    fsync: bool = _option(True)
    """Flush to the device before records and markers vouch for the data."""
    session: int | None = _option(None)
    """The writer session this merge serves (``SpillWriter.merge`` passes it), for the marker."""


def config_keys() -> dict[str, type]:
    """Option → its TOML type, for the options a ``[merge]`` table may set."""
    return {f.name: f.metadata["config"] for f in fields(MergeOptions) if f.metadata["config"] is not None}


def flags() -> dict[str, Flag]:
    """Option → its ``spillmerge merge`` flag, in declaration order."""
    return {f.name: f.metadata["flag"] for f in fields(MergeOptions) if f.metadata["flag"] is not None}
