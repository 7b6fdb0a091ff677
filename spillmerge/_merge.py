"""merge(): barrier → validate → plan → bulk-create output → copy stripes → consolidate → marker."""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import fsspec
import google_crc32c
import numpy as np
import zarr
from zarr.core.group import GroupMetadata
from zarr.core.metadata import ArrayV3Metadata

from . import _format as F
from ._errors import CorruptSpillError, OutputExistsError, SpillStorageError, SpillValueError
from ._plan import FilePlan, Plan, build
from ._spillroot import load_all, load_flushed, wait_for_commits
from ._storage import Storage
from ._writer import _array_meta

DEFAULT_MEMORY_BUDGET = 256 << 20


@dataclass(frozen=True, slots=True)
class MergeReport:
    """What a merge did."""

    out: str
    """Output path or URL."""
    n_files: int
    """Filenames (arrays or groups under ``files/``) written."""
    n_frames: int
    """Frames written."""
    nbytes: int
    """Payload bytes written (without checksums)."""
    ranks: list[int]
    """Ranks whose committed segments were merged."""
    segments: int
    """Committed segments merged."""
    seconds: float
    """Wall time of the whole call."""
    wait_seconds: float
    """Time spent waiting for commit records (the barrier)."""
    merge_seconds: float
    """Time spent validating, planning and writing."""
    duplicates: int
    """Duplicate (filename, frame) copies dropped (identical content, or by the duplicate policy)."""
    missing_ranks: list[int] = field(default_factory=list)
    """Ranks without a commit record (only with ``allow_partial=True``)."""
    abandoned_segments: list[str] = field(default_factory=list)
    """Uncommitted segments superseded by a later commit of the same rank (not merged)."""
    salvaged_frames: dict[int, int] = field(default_factory=dict)
    """Rank → frames merged from its uncommitted segment's journal (``allow_partial``)."""
    frame_gaps: dict[str, list[int]] = field(default_factory=dict)
    """Filename → frame indices missing between 0 and its highest merged frame (``allow_partial``)."""
    notes: list[str] = field(default_factory=list)
    """Problems that stopped salvaging a journal (torn or corrupt entries)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: wait, load (indexes), plan, metadata, copy, index, sync, finish."""

    @property
    def filenames(self) -> int:  # the contract's name for the count
        return self.n_files

    @property
    def frames(self) -> int:
        return self.n_frames

    def __str__(self) -> str:
        gib = self.nbytes / (1 << 30)
        s = (
            f"merged {self.n_files} files, {self.n_frames} frames, {gib:.3f} GiB from "
            f"{len(self.ranks)} ranks ({self.segments} segments) into {self.out} in {self.seconds:.2f} s "
            f"(wait {self.wait_seconds:.2f} s, merge {self.merge_seconds:.2f} s)"
        )
        if self.duplicates:
            s += f"; {self.duplicates} duplicate frame copies dropped"
        if self.missing_ranks:
            s += f"; PARTIAL: ranks {self.missing_ranks} missing"
            if self.salvaged_frames:
                s += f" (salvaged from their flushed chunks: {self.salvaged_frames} frames by rank)"
            if self.frame_gaps:
                n = sum(len(v) for v in self.frame_gaps.values())
                s += f"; {n} frame(s) missing in {len(self.frame_gaps)} file(s)"
        return s


def _contains(a: Storage, b: Storage) -> bool:
    """True when one storage path lies inside (or equals) the other on the same filesystem."""
    if type(a.fs) is not type(b.fs):
        return False
    pa, pb = a.root.rstrip("/") + "/", b.root.rstrip("/") + "/"
    return pa.startswith(pb) or pb.startswith(pa)


def _prepare_output(dst: Storage, overwrite: bool) -> None:
    if not dst.exists(""):
        return
    names = dst.listdir("")
    if not names:
        return
    marker = dst.get_or_none(F.COMPLETE_NAME, max_bytes=1 << 20)
    raw = dst.get_or_none("zarr.json", max_bytes=64 << 20)
    ours = False
    if raw is not None:
        try:
            obj = F.loads(raw, path=dst.describe("zarr.json"))
            ours = obj.get("attributes", {}).get("spillmerge", {}).get("kind") == "merged"
        except (CorruptSpillError, AttributeError):
            ours = False
    if not ours:
        raise OutputExistsError(
            f"{dst.describe()} exists and is not a spillmerge output; choose another --out "
            "(spillmerge never deletes a folder it did not write)",
            path=dst.describe(),
        )
    if marker is not None and not overwrite:
        raise OutputExistsError(
            f"{dst.describe()} already holds a complete merge; pass overwrite=True (--overwrite) to replace it",
            path=dst.describe(),
        )
    # An interrupted merge (no completion marker) or an explicit overwrite: start from scratch.
    dst.rm_tree("")


def merge(
    root: str,
    out: str,
    *,
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
    world_size: int | None = None,
    run_id: str | None = None,
    timeout: float = 0.0,
    allow_partial: bool = False,
    on_duplicate: str = "error",
    overwrite: bool = False,
    chunk_bytes: int = F.DEFAULT_CHUNK_BYTES,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    threads: int | None = None,
    fsync: bool = True,
    progress: bool | None = None,
) -> MergeReport:
    """Merge every committed segment under ``root`` into one Zarr v3 store at ``out``.

    Waits up to ``timeout`` seconds for missing commit records (0: check once), failing at once
    when a rank recorded a failure. ``allow_partial`` merges what is committed and reports the
    missing ranks. Memory stays under about ``memory_budget`` bytes whatever the payload (plus one
    frame when a single frame is larger). Returns a :class:`MergeReport`.
    """
    t0 = time.perf_counter()
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise SpillValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    src = Storage(root, storage_options)
    if out_storage_options is None:  # the same credentials serve both ends when they share a protocol
        same = fsspec.core.split_protocol(str(root))[0] == fsspec.core.split_protocol(str(out))[0]
        out_storage_options = storage_options if same else None
    dst = Storage(out, out_storage_options)
    if threads is None:  # object stores need many requests in flight; local disks do not
        threads = 4 if src.local and dst.local else 16
    if not isinstance(threads, int) or threads < 1:
        raise SpillValueError(f"threads must be a positive int, got {threads!r}")
    if not src.exists(""):
        raise SpillStorageError(f"spill root {src.describe()} does not exist", path=src.describe())
    if _contains(src, dst):
        raise SpillValueError(f"output {dst.describe()} and spill root {src.describe()} overlap; choose another --out")
    state = wait_for_commits(src, world_size=world_size, run_id=run_id, timeout=timeout, allow_partial=allow_partial)
    t_wait = time.perf_counter() - t0
    phases: dict[str, float] = {"wait": t_wait}
    # Write order for the duplicate policy: segment start time, rank breaking ties.
    segments = sorted(state.committed, key=lambda s: (F.segment_sort_key(s.name)[1], s.rank, s.name))
    t = time.perf_counter()
    loaded = load_all(src, segments)
    salvaged: dict[int, int] = {}
    notes: list[str] = []
    if allow_partial:
        # Uncommitted segments of missing or failed ranks: merge what their journal proves durable.
        for rank, seg in sorted(state.partial.items()):
            part, problems = load_flushed(src, seg)
            notes.extend(problems)
            if len(part.index):
                loaded.append(part)
                salvaged[rank] = len({(int(r[0]), int(r[1])) for r in part.index[:, :2]})
    phases["load"] = time.perf_counter() - t
    t = time.perf_counter()
    plan = build(loaded, on_duplicate)
    phases["plan"] = time.perf_counter() - t
    _prepare_output(dst, overwrite)
    try:
        _write_output(src, dst, plan, state.world_size, chunk_bytes, memory_budget, threads, fsync, progress, phases)
    except BaseException:
        # The output is unusable without its completion marker anyway; removing it keeps the
        # next merge (or a reader) from seeing half a store.
        try:
            dst.rm_tree("")
        except Exception:  # noqa: BLE001
            pass
        raise
    finally:
        src.close()
    t_end = time.perf_counter()
    return MergeReport(
        out=dst.describe(),
        n_files=len(plan.files),
        n_frames=plan.n_frames,
        nbytes=plan.total_bytes,
        ranks=sorted({s.rank for s in segments}),
        segments=len(segments),
        seconds=t_end - t0,
        wait_seconds=t_wait,
        merge_seconds=t_end - t0 - t_wait,
        duplicates=plan.duplicates,
        missing_ranks=sorted([*state.missing, *state.failed]),
        abandoned_segments=[src.describe(s.rel) for s in state.abandoned],
        salvaged_frames=salvaged,
        frame_gaps=_gaps(plan) if allow_partial else {},
        notes=notes,
        phases=phases,
    )


def _gaps(plan: Plan, limit: int = 10000) -> dict[str, list[int]]:
    """Per filename, the frame indices absent between 0 and the highest frame merged."""
    out: dict[str, list[int]] = {}
    for fp in plan.files:
        top = int(fp.frames[-1])
        if len(fp.frames) != top + 1:
            missing = np.setdiff1d(np.arange(min(top + 1, 1 << 24)), fp.frames)[:limit]
            out[fp.filename] = missing.tolist()
    return out


def _frames_per_chunk(fp: FilePlan, chunk_bytes: int) -> int:
    return int(max(1, min(len(fp.frames), chunk_bytes // max(fp.frame_nbytes, 1))))


def _write_output(
    src: Storage,
    dst: Storage,
    plan: Plan,
    world_size: int,
    chunk_bytes: int,
    budget: int,
    threads: int,
    fsync: bool,
    progress: bool | None,
    phases: dict[str, float],
) -> None:
    t = time.perf_counter()
    header = {
        "format_version": F.FORMAT_VERSION,
        "kind": "merged",
        "n_files": len(plan.files),
        "n_frames": plan.n_frames,
        "nbytes": plan.total_bytes,
        "ranks": sorted({s.seg.rank for s in plan.segments}),
        "world_size": world_size,
        "segments": len(plan.segments),
        "created": F.utcnow(),
    }
    nodes: dict[str, Any] = {
        "": GroupMetadata(attributes={"spillmerge": header}),
        "files": GroupMetadata(),
        "index": GroupMetadata(),
    }
    for fp in plan.files:
        k = _frames_per_chunk(fp, chunk_bytes)
        if fp.is_dict:
            nodes[f"files/{fp.key}"] = GroupMetadata(
                attributes={"spillmerge": {"filename": fp.filename, "file_index": fp.index}}
            )
        for leaf in fp.leaves:
            lay = leaf.layout
            dt = F.DTYPES[lay.dtype]
            attrs = {
                "spillmerge": {
                    "filename": fp.filename,
                    "file_index": fp.index,
                    "leaf": list(lay.leaf),
                    "dtype": lay.dtype,
                }
            }
            meta = _array_meta(
                (len(fp.frames), *lay.shape),
                (k, *(max(d, 1) for d in lay.shape)),
                dt.storage,
                crc=True,
                attributes=attrs,
            )
            # dimension_names (xarray needs them): unique per array within its group, "frame"
            # shared by the leaves of one dict value (same length); docs/FORMAT.md.
            rel = leaf.node.removeprefix(f"files/{fp.key}").strip("/").replace("/", ".")
            name = rel if fp.is_dict else fp.key
            meta["dimension_names"] = ["frame" if fp.is_dict else f"{name}.frame"] + [
                f"{name}.dim_{d}" for d in range(1, len(lay.shape) + 1)
            ]
            nodes[leaf.node] = ArrayV3Metadata.from_dict(meta)
            parent = leaf.node.rsplit("/", 1)[0]
            while parent not in nodes:  # groups of nested dict levels
                nodes[parent] = GroupMetadata()
                parent = parent.rsplit("/", 1)[0]
    n = len(plan.files)
    total_frames = plan.n_frames
    str_meta: dict[str, Any] = {
        "zarr_format": 3, "node_type": "array", "shape": [n], "data_type": "string",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(n, 1)]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": "", "codecs": [{"name": "vlen-utf8"}, {"name": "crc32c"}], "attributes": {},
    }  # fmt: skip
    row_chunks = (max(1, min(total_frames, 1 << 21)),)
    index_meta = {
        "filenames": {**str_meta, "dimension_names": ["file"]},
        "keys": {**str_meta, "dimension_names": ["file"]},
        "frame_offsets": {**_array_meta((n + 1,), (n + 1,), "int64", crc=True), "dimension_names": ["file_edge"]},
        "frame_idx": {**_array_meta((total_frames,), row_chunks, "int64", crc=True), "dimension_names": ["row"]},
        # Provenance per output row, for coverage reports (`spillmerge inspect --plot`): the rank whose
        # segment the row came from, and how many segments held that frame (>1: a duplicate was dropped).
        "frame_rank": {**_array_meta((total_frames,), row_chunks, "int32", crc=True), "dimension_names": ["row"]},
        "frame_copies": {**_array_meta((total_frames,), row_chunks, "int32", crc=True), "dimension_names": ["row"]},
    }
    for name, meta in index_meta.items():
        nodes[f"index/{name}"] = ArrayV3Metadata.from_dict(meta)
    # Every node's zarr.json is built here and written in one concurrent batch; the consolidated
    # metadata is assembled from the same documents, so nothing is read back (zarr's own
    # create_hierarchy / consolidate_metadata cost one or more requests per node: 16 s + 6 s for
    # 1,000 files on a local S3 server).
    docs = {path: node.to_dict() for path, node in nodes.items()}
    # The root document goes first, alone: it marks the folder as a spillmerge output, so an
    # interrupted merge can be recognised and rebuilt.
    dst.makedirs("")
    dst.put("zarr.json", _json_doc(docs[""]))
    dst.put_many({f"{path}/zarr.json": _json_doc(doc) for path, doc in docs.items() if path})

    phases["metadata"] = time.perf_counter() - t
    t = time.perf_counter()
    _copy(src, dst, plan, chunk_bytes, budget, threads, progress)
    phases["copy"] = time.perf_counter() - t
    t = time.perf_counter()

    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(f.frames) for f in plan.files])
    store = dst.zarr_store()
    # write_empty_chunks: an index chunk that happens to be all zeros must still exist on disk
    # (verify treats a missing chunk as damage).
    with zarr.config.set({"array.write_empty_chunks": True}):
        index = zarr.open_group(store, mode="r+", use_consolidated=False)["index"]
        if n:
            index["filenames"][:] = np.array([f.filename for f in plan.files], dtype=object)  # type: ignore[index]
            index["keys"][:] = np.array([f.key for f in plan.files], dtype=object)  # type: ignore[index]
        index["frame_offsets"][:] = offsets  # type: ignore[index]
        if total_frames:
            index["frame_idx"][:] = np.concatenate([f.frames for f in plan.files])  # type: ignore[index]
            seg_rank = np.array([s.seg.rank for s in plan.segments], dtype=np.int32)
            rows = np.concatenate([f.leaves[0].rows for f in plan.files])
            index["frame_rank"][:] = seg_rank[plan.seg[rows]]  # type: ignore[index]
            index["frame_copies"][:] = plan.copies[rows].astype(np.int32)  # type: ignore[index]
    root = dict(docs[""])
    root["consolidated_metadata"] = {
        "kind": "inline",
        "must_understand": False,
        "metadata": {path: _consolidated_entry(doc) for path, doc in sorted(docs.items()) if path},
    }
    phases["index"] = time.perf_counter() - t
    t = time.perf_counter()
    if fsync:  # every chunk and document is durable before the root and the marker vouch for them
        dst.fsync_tree("")
    phases["sync"] = time.perf_counter() - t
    t = time.perf_counter()
    dst.put_atomic("zarr.json", _json_doc(root))
    marker = {
        "format_version": F.FORMAT_VERSION,
        "kind": "merge-complete",
        "n_files": n,
        "n_frames": total_frames,
        "nbytes": plan.total_bytes,
        "finished": F.utcnow(),
    }
    dst.put_atomic(F.COMPLETE_NAME, F.dumps(marker))
    phases["finish"] = time.perf_counter() - t


def _json_doc(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=False, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _consolidated_entry(doc: dict[str, Any]) -> dict[str, Any]:
    # zarr-python writes child groups into the inline consolidated metadata with an empty
    # consolidated block of their own; mirror it so reading never falls back to listing.
    if doc.get("node_type") == "group":
        return {**doc, "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": {}}}
    return doc


@dataclass(slots=True)
class _Stripe:
    """The frames ``[start, stop)`` of one file: one chunk of each of its arrays."""

    file: FilePlan
    """The file."""
    chunk: int
    """Chunk number along the frame axis."""
    start: int
    """First output row."""
    stop: int
    """One past the last output row."""
    k: int
    """Frames per chunk of this file's arrays."""

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.file.frame_nbytes


def _stripes(plan: Plan, chunk_bytes: int) -> list[_Stripe]:
    out = []
    for fp in plan.files:
        k = _frames_per_chunk(fp, chunk_bytes)
        for j, a in enumerate(range(0, len(fp.frames), k)):
            out.append(_Stripe(fp, j, a, min(a + k, len(fp.frames)), k))
    return out


def _done_cb(done: Any, size: int, fut: Future[None]) -> None:
    done(fut, size)


def _copy(
    src: Storage,
    dst: Storage,
    plan: Plan,
    chunk_bytes: int,
    budget: int,
    threads: int,
    progress: bool | None,
) -> None:
    stripes = _stripes(plan, chunk_bytes)
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="merge", file=sys.stderr)
    cond = threading.Condition()
    in_flight = 0
    errors: list[BaseException] = []

    def done(fut: Future[None], size: int) -> None:
        nonlocal in_flight
        with cond:
            in_flight -= size
            exc = fut.exception()
            if exc is not None:
                errors.append(exc)
            cond.notify_all()
        if bar is not None and exc is None:
            bar.update(size)

    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spillmerge-merge") as pool:
            for stripe in stripes:
                size = stripe.nbytes
                with cond:
                    # Bounded memory: wait until this stripe fits in the budget (one stripe always may run).
                    while in_flight and in_flight + size > budget and not errors:
                        cond.wait()
                    if errors:
                        break
                    in_flight += size
                fut = pool.submit(_copy_stripe, src, dst, plan, stripe)
                fut.add_done_callback(functools.partial(_done_cb, done, size))
    finally:
        if bar is not None:
            bar.close()
    if errors:
        raise errors[0]


_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread buffer reused across stripes. Fresh allocations of this size are mmapped and
    page-faulted anew each time; on the VMs we measured that tripled the merge's CPU time."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]


def _copy_stripe(src: Storage, dst: Storage, plan: Plan, stripe: _Stripe) -> None:
    for leaf in stripe.file.leaves:
        rows = leaf.rows[stripe.start : stripe.stop]
        item = leaf.layout.nbytes
        if item == 0:  # zero-size frames: the array has no elements, so no chunk to write
            continue
        full = stripe.k * item  # the last chunk of an array is padded to the chunk shape
        used = len(rows) * item
        key = f"{leaf.node}/c/{stripe.chunk}" + "/0" * len(leaf.layout.shape)
        if src.local:
            # Frames are written straight from the page cache (mmap), never copied into our memory.
            parts: list[Any] = []
            for j, r in enumerate(rows.tolist()):
                views = [src.view(rel, lo, hi) for rel, lo, hi in _pieces(plan, rows[j : j + 1])]
                got = 0
                for v in views:
                    got = google_crc32c.extend(got, v)
                if got != int(plan.crc[r]):
                    _raise_mismatch(src, plan, stripe, leaf, j, r)
                parts.extend(views)
        else:
            buf = _scratch(used)
            src.read_into(_pieces(plan, rows), buf.data)
            for j, r in enumerate(rows.tolist()):
                if google_crc32c.value(buf[j * item : (j + 1) * item]) != int(plan.crc[r]):
                    _raise_mismatch(src, plan, stripe, leaf, j, r)
            parts = [buf]
        if used < full:
            parts.append(_zeros(full - used))
        out_crc = 0
        for part in parts:
            out_crc = google_crc32c.extend(out_crc, part)
        dst.makedirs(key.rsplit("/", 1)[0])
        dst.put(key, [*parts, np.uint32(out_crc).astype("<u4").tobytes()])


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.uint8)


def _raise_mismatch(src: Storage, plan: Plan, stripe: _Stripe, leaf: Any, j: int, r: int) -> None:
    seg = plan.segments[int(plan.seg[r])]
    where = src.describe(f"{seg.seg.rel}/{F.DATA_NAME}")
    raise CorruptSpillError(
        f"{where}: checksum mismatch for {stripe.file.filename!r:.200} frame "
        f"{int(stripe.file.frames[stripe.start + j])} leaf {leaf.layout.leaf_name()!r} at bytes "
        f"{int(plan.offset[r])}..{int(plan.offset[r] + plan.nbytes[r])} (rank {seg.seg.rank}): "
        "the spill is corrupt; run `spillmerge verify` on the root",
        path=where,
        rank=seg.seg.rank,
    )


def _pieces(plan: Plan, rows: np.ndarray) -> list[tuple[str, int, int]]:
    """Byte ranges of ``rows`` in their data chunk objects, adjacent ranges coalesced."""
    out: list[tuple[str, int, int]] = []
    for r in rows.tolist():
        seg = plan.segments[int(plan.seg[r])]
        cb = seg.chunk_bytes
        off, end = int(plan.offset[r]), int(plan.offset[r] + plan.nbytes[r])
        while off < end:
            c = off // cb
            stop = min(end, (c + 1) * cb)
            rel = f"{seg.seg.rel}/{F.DATA_NAME}/c/{c}"
            lo, hi = off - c * cb, stop - c * cb
            if out and out[-1][0] == rel and out[-1][2] == lo:
                out[-1] = (rel, out[-1][1], hi)
            else:
                out.append((rel, lo, hi))
            off = stop
    return out


def committed_keys(root: str, storage_options: dict[str, Any] | None = None) -> dict[str, set[int]]:
    """Filename → frame indices already committed under a spill root, by any rank and session.

    A rerun after a crash can skip these keys; the merge unions all sessions."""
    from ._spillroot import committed_keys as _keys

    storage = Storage(root, storage_options)
    if not storage.exists(""):
        return {}
    return _keys(storage)
