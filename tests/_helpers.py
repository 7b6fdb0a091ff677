"""Data helpers shared by the tests: bit-exact views of tensors and random tensors of any dtype."""

from __future__ import annotations

import functools
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spillmerge._format import spill as FS
from spillmerge._merge import plan as _plan
from spillmerge._spill.barrier import wait_for_commits
from spillmerge._spill.lazy import load_all
from spillmerge._spill.root import LoadedSegment, same_bytes
from spillmerge._storage import Storage


def is_safe_node_name(name: str) -> bool:
    """A node name ``_format.common.node_names`` may give: a plain name, or a slug and its hash."""
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}|[A-Za-z0-9._-]{0,60}~[0-9a-f]{16}", name))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor as a flat uint8 tensor, so comparisons are bit-exact (NaN
    payloads, -0.0, bfloat16 and float8 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor as ``bytes`` (for ``==`` and dict keys)."""
    return bytes(bits(t).numpy().tobytes())


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are uniformly random (every bit pattern possible)."""
    raw = torch.randint(
        0, 256, (int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=g
    )
    t = raw.view(dtype).reshape(shape)
    return t.clone() if dtype != torch.bool else (raw[: t.numel()] % 2).bool().reshape(shape)


def value_diffs(got: Any, want: Any, where: str = "", strict: bool = False) -> list[str]:
    """Where ``got`` differs from ``want`` in type or content (empty: equal). A tensor that
    spillmerge returns as a numpy array (``value()``'s default) must match it in dtype and shape.
    ``strict``: what torch's object collectives return: a tensor as a tensor (bit-exact), dict keys
    in the same order."""
    if isinstance(want, torch.Tensor) and strict:
        if type(got) is not type(want) or any(
            getattr(got, a) != getattr(want, a) for a in ("dtype", "shape", "layout", "requires_grad")
        ):
            return [f"{where}: {type(got).__name__} {got!r:.80} != {type(want).__name__} {want!r:.80}"]
        got, want = (t.detach().to_dense().reshape(-1).view(torch.uint8) for t in (got, want))  # NaN payloads too
    if isinstance(want, torch.Tensor):  # bfloat16 and the like: compared as their bits
        ref = want.numpy() if want.dtype != torch.bfloat16 else want.view(torch.uint16).numpy()
        arr = np.asarray(got).view(np.uint16) if want.dtype == torch.bfloat16 and isinstance(got, np.ndarray) else got
        if isinstance(arr, torch.Tensor) and strict:
            arr = arr.numpy()
        if (
            not isinstance(arr, np.ndarray)
            or arr.dtype != ref.dtype
            or arr.shape != ref.shape
            or not np.array_equal(arr, ref)
        ):
            return [f"{where}: {type(got).__name__} {got!r:.80} != tensor {want!r:.80}"]
        return []
    if isinstance(want, np.ndarray):
        if (
            not isinstance(got, np.ndarray)
            or got.dtype != want.dtype
            or got.shape != want.shape
            or not np.array_equal(got, want)
        ):
            return [f"{where}: {type(got).__name__} {got!r:.80} != array {want!r:.80}"]
        return []
    if type(got) is not type(want):
        return [f"{where}: {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, dict):
        if (list(got) != list(want)) if strict else (sorted(got) != sorted(want)):
            return [f"{where}: keys {list(got)} != {list(want)}"]
        return [d for k in want for d in value_diffs(got[k], want[k], f"{where}/{k}", strict)]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        pairs = enumerate(zip(got, want, strict=True))
        return [d for i, (a, b) in pairs for d in value_diffs(a, b, f"{where}[{i}]", strict)]
    return [] if got == want else [f"{where}: {got!r:.80} != {want!r:.80}"]


def zarr_strings(values: Any, offsets: Any) -> list[str]:
    """Strings stored as UTF-8 bytes + int64 offsets (format 3: Arrow's large_string layout), read
    with plain zarr and numpy as any Zarr v3 user would."""
    raw, off = np.asarray(values[:]).tobytes(), np.asarray(offsets[:]).tolist()
    return [raw[a:b].decode("utf-8") for a, b in zip(off[:-1], off[1:], strict=True)]


def zarr_filenames(group: Any) -> list[str]:
    """``index/filenames`` of a format-3 output opened with plain zarr."""
    return zarr_strings(group["index/filenames"], group["index/filename_offsets"])


def write_filenames(path: str | Path, names: list[str]) -> None:
    """Replace an output's filenames by ``names`` (any order, any count: damage for the tests),
    stored as a merge stores them, keeping the consolidated root in step."""
    import zarr

    from spillmerge._merge.documents import NAME_BLOCK
    from spillmerge._merge.nametable import table_of

    g = zarr.open_group(str(path), mode="r+", use_consolidated=False)
    for name, arr in table_of(names).index_arrays(NAME_BLOCK).items():
        old = g["index"][name]
        new = g["index"].create_array(
            name, shape=arr.shape, dtype=old.dtype, chunks=old.chunks, overwrite=True,
            dimension_names=old.metadata.dimension_names, config={"write_empty_chunks": True},
            attributes=dict(old.attrs),
        )  # fmt: skip
        if len(arr):
            new[:] = arr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))


def make_hostile(victim: Path, outside: Path, attack: str, grow: int) -> None:
    """Replace the object ``victim`` by what a hostile writer of its folder could leave: a FIFO
    (``fifo``), a link to ``outside`` holding the same bytes (``link out of the root``), a link to
    ``/dev/zero`` (``dev zero``), or the object grown by ``grow`` sparse bytes (``oversized``)."""
    kept = victim.read_bytes()
    outside.write_bytes(kept)  # the same bytes: only where they live is wrong
    victim.unlink()
    if attack == "fifo":
        os.mkfifo(victim)
    elif attack == "link out of the root":
        victim.symlink_to(outside)
    elif attack == "dev zero":
        victim.symlink_to("/dev/zero")
    elif attack == "oversized":
        victim.write_bytes(kept)
        os.truncate(victim, len(kept) + grow)
    else:
        raise ValueError(attack)


def assert_group_commits(events: list[tuple[str, str]]) -> None:
    """``events`` (("write" | "fsync" | "entry", path), in order) of a local writer: each journal
    entry comes after an fsync of every chunk it names (after that chunk's last write) and of
    their folder, and some group commit fsynced a chunk before the entry naming it was due."""
    entries = [(k, p) for k, (what, p) in enumerate(events) if what == "entry"]
    ahead = False
    for at, entry in entries:
        seg, n = entry.rsplit("/journal/", 1)
        folder = f"{seg}/data/c"
        for c in range(int(n) + 1):
            chunk = f"{folder}/{c}"
            writes = [k for k, e in enumerate(events[:at]) if e == ("write", chunk)]
            assert writes, (entry, chunk, events)
            after = events[writes[-1] + 1 : at]
            assert ("fsync", chunk) in after, (entry, chunk, events)
            assert ("fsync", folder) in after, (entry, chunk, events)
        ahead |= ("fsync", f"{folder}/{int(n) + 1}") in events[:at]
    assert ahead, events


def committed_segments(root: str | Path) -> tuple[Storage, list[LoadedSegment]]:
    """The spill root ``root`` and its committed segments, loaded, in a merge's write order."""
    storage = Storage(str(root))
    state = wait_for_commits(storage, world_size=None, run_id=None, timeout=0.0, progress=False)
    segments = sorted(state.committed, key=lambda s: (FS.segment_sort_key(s.name)[1], s.rank, s.name))
    return storage, load_all(storage, segments)


def plan_of(root: str | Path, on_duplicate: str = "error", **kw: Any) -> _plan.Plan:
    """The merge plan of the spill root ``root``, built as a merge builds it."""
    storage, segments = committed_segments(root)
    return _plan.build(segments, on_duplicate, same_bytes=functools.partial(same_bytes, storage), **kw)
