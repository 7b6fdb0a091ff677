"""Reading a merged output: ``spillmerge.open(out)``."""

from __future__ import annotations

import asyncio
import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from . import _format as F
from ._errors import CorruptSpillError, IncompleteOutputError, SpillMergeError, UnknownFileError
from ._storage import Storage

# Metadata documents zarr may look for and legitimately not find; every other key is a chunk.
_METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})

_Problem = tuple[str, str]
"""(path relative to the output, what is wrong): one broken invariant of an output."""


class NoFillStore(WrapperStore[Store]):
    """A zarr store that raises :class:`CorruptSpillError` where the wrapped store has no chunk,
    and that reads a local output as untrusted storage.

    zarr reads an absent chunk as ``fill_value`` (zeros), so a deleted or lost chunk of an output
    would read back as plausible data. zarr asks the store for every chunk it reads anyway, so
    refusing the absence here costs no request at all, for any number of files, and also catches
    a chunk that vanishes after ``open`` (a listing at open would cost one listing per array on
    object stores and would not). A merge writes every chunk of every array (``write_empty_chunks``
    for the index), so an absent chunk is always damage.

    Given the output's ``storage`` on a local disk, every object is read through
    :meth:`Storage.get` instead of zarr's ``LocalStore``: regular files only (a FIFO, device, folder
    or symbolic link is refused by name, never opened or followed), and never more bytes than the
    format allows the object — a ``zarr.json`` its document limit, a chunk what its array's chunk
    shape and data type can encode to (docs/FORMAT.md, *Size limits*). The check rides on the
    read zarr makes anyway: one lstat per object, plus one small read of each array's metadata.
    """

    def __init__(self, store: Store, describe: Callable[[str], str], storage: Storage | None = None) -> None:
        super().__init__(store)
        self._describe = describe
        self._storage = storage if storage is not None and storage.local else None
        self._chunk_limits: dict[str, int] = {}

    def _with_store(self, store: Store) -> NoFillStore:
        return type(self)(store, self._describe, self._storage)

    def _missing(self, key: str) -> CorruptSpillError:
        path = self._describe(key)
        array, _, coords = key.rpartition("/c/")
        what = f"chunk {coords.replace('/', ', ')} of {array}" if array else "chunk"
        return CorruptSpillError(
            f"{path}: {what} is missing (zarr would read it as zeros); the output is damaged: merge it again",
            path=path,
        )

    def _is_chunk(self, key: str) -> bool:
        return key.rsplit("/", 1)[-1] not in _METADATA_NAMES

    def _limit(self, key: str) -> int:
        """The most bytes the object ``key`` may have (docs/FORMAT.md, *Size limits*)."""
        if not self._is_chunk(key):
            return F.ROOT_DOC_MAX_BYTES if "/" not in key else F.ARRAY_DOC_MAX_BYTES
        array = key.rpartition("/c/")[0] if "/c/" in key else key.rpartition("/")[0]
        limit = self._chunk_limits.get(array)
        if limit is None:
            assert self._storage is not None
            doc = f"{array}/zarr.json" if array else "zarr.json"
            try:
                raw = self._storage.get(doc, max_bytes=F.ARRAY_DOC_MAX_BYTES)
            except FileNotFoundError:
                raise self._missing(key) from None
            limit = F.chunk_max_bytes(F.loads(raw, path=self._describe(doc)), path=self._describe(doc))
            self._chunk_limits[array] = limit
        return limit

    def _read_local(self, key: str, byte_range: ByteRequest | None) -> bytes | None:
        assert self._storage is not None
        try:
            data = self._storage.get(key, max_bytes=self._limit(key))
        except FileNotFoundError:
            return None
        if byte_range is None:
            return data
        if isinstance(byte_range, RangeByteRequest):
            return data[byte_range.start : byte_range.end]
        if isinstance(byte_range, OffsetByteRequest):
            return data[byte_range.offset :]
        if isinstance(byte_range, SuffixByteRequest):
            return data[-byte_range.suffix :] if byte_range.suffix else b""
        raise TypeError(f"unexpected byte range {byte_range!r}")

    async def _get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None) -> Buffer | None:
        if self._storage is None:
            return await self._store.get(key, prototype, byte_range)
        data = await asyncio.to_thread(self._read_local, key, byte_range)
        return None if data is None else prototype.buffer.from_bytes(data)

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        buf = await self._get(key, prototype, byte_range)
        if buf is None and self._is_chunk(key):
            raise self._missing(key)
        return buf

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        if self._storage is None:
            out = await self._store.get_partial_values(prototype, key_ranges)
        else:
            out = [await self._get(key, prototype, byte_range) for key, byte_range in key_ranges]
        for (key, _), buf in zip(key_ranges, out, strict=True):
            if buf is None and self._is_chunk(key):
                raise self._missing(key)
        return out


class LeafArray:
    """One output array: ``(n_frames, *frame_shape)``, rows in frame order, read lazily.

    Indexing and ``np.asarray`` give numpy arrays of the stored dtype (raw bits for dtypes numpy
    lacks, e.g. uint16 for bfloat16); :meth:`to_torch` gives a tensor of the real dtype.
    """

    def __init__(self, array: Any, dtype_name: str, filename: str) -> None:
        self.zarr = array
        """The underlying ``zarr.Array``."""
        self.dtype_name = dtype_name
        """Real dtype name, e.g. ``"bfloat16"``."""
        self.filename = filename
        """Original filename."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.zarr.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        """numpy dtype of what indexing returns (the storage dtype)."""
        return np.dtype(F.DTYPES[self.dtype_name].storage)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)  # type: ignore[no-any-return]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, sel: Any) -> np.ndarray:
        try:
            return np.asarray(self.zarr[sel])
        except SpillMergeError:
            raise
        except Exception as exc:  # noqa: BLE001 - zarr reports a damaged chunk as ValueError, codec errors ...
            raise CorruptSpillError(
                f"{self.zarr.store_path}: a chunk is corrupt ({type(exc).__name__}: {exc})",
                path=str(self.zarr.store_path),
            ) from exc

    def numpy(self) -> np.ndarray:
        return self[...]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        # The array zarr decodes into is returned as is: no copy beyond reading it (a dtype other
        # than the storage dtype converts, which numpy's copy=False forbids).
        arr = self.numpy()
        if dtype is None or np.dtype(dtype) == arr.dtype:
            return arr
        if copy is False:
            raise ValueError(f"{self!r}: converting {arr.dtype} to {np.dtype(dtype)} needs a copy")
        return arr.astype(dtype)

    def to_torch(self, sel: Any = ...) -> torch.Tensor:
        """A CPU tensor of the real dtype (bfloat16, float8 ... bit-exact) that wraps the array
        zarr decoded into (``torch.from_numpy`` plus a dtype view): no copy beyond reading it."""
        arr = np.ascontiguousarray(self[sel])
        t = torch.from_numpy(arr)
        return t if F.DTYPES[self.dtype_name].native else t.view(self.torch_dtype)

    def __repr__(self) -> str:
        return f"LeafArray({self.filename!r}, shape={self.shape}, dtype={self.dtype_name})"


class MergedStore(Mapping[str, Any]):
    """A merged output. ``store[filename]`` is a :class:`LeafArray` for tensor values or a (nested)
    dict of them for dict values; ``store.frames(filename)`` gives the frame indices.

    The index is checked before anything is returned from it (docs/FORMAT.md, "Invariants of the
    index"): at open, what the small per-file index arrays and the array metadata say (offsets
    from 0, non-decreasing, ending at the number of rows; as many keys as filenames; provenance
    as long as ``frame_idx``); ``frame_idx`` itself when it is first read (non-negative, strictly
    ascending within each file); a file's arrays at the first access to that file (known dtype
    matching the storage dtype, as many rows as its offsets span). The per-file checks are lazy
    because they need the file's array metadata: checking every file at open would cost
    O(files x leaves) even to read one file of a store of thousands. Chunks are never read to
    check; an absent chunk raises when it is read (:class:`NoFillStore`). Every failure is a
    :class:`CorruptSpillError` naming the object and what is wrong.
    """

    def __init__(self, out: str, storage_options: dict[str, Any] | None = None) -> None:
        import zarr

        self.storage = Storage(out, storage_options)
        marker = self.storage.get_or_none(F.COMPLETE_NAME, max_bytes=F.RECORD_MAX_BYTES)
        if marker is None:
            if not self.storage.exists("zarr.json"):
                raise SpillMergeError(f"{self.storage.describe()} is not a spillmerge output (no zarr.json)")
            raise IncompleteOutputError(
                f"{self.storage.describe()} is incomplete (no {F.COMPLETE_NAME}): the merge that wrote it "
                "did not finish; run the merge again",
                path=self.storage.describe(),
            )
        F.loads(marker, path=self.storage.describe(F.COMPLETE_NAME))
        try:
            store = NoFillStore(self.storage.zarr_store(read_only=True), self.storage.describe, self.storage)
            self.group = zarr.open_group(store, mode="r", use_consolidated=True)
        except Exception as exc:  # noqa: BLE001 - zarr raises many kinds
            raise CorruptSpillError(
                f"{self.storage.describe()}: cannot open as zarr: {exc}", path=self.storage.describe()
            ) from exc
        header = self.group.attrs.get("spillmerge")
        if not isinstance(header, dict) or header.get("kind") != "merged":
            raise CorruptSpillError(f"{self.storage.describe()}: not a spillmerge output", path=self.storage.describe())
        if header.get("format_version") != F.FORMAT_VERSION:
            from ._errors import FormatVersionError

            raise FormatVersionError(
                f"{self.storage.describe()}: format_version {header.get('format_version')!r} is not "
                f"supported (this spillmerge reads {F.FORMAT_VERSION})",
                path=self.storage.describe(),
            )
        self.header: dict[str, Any] = header
        self._filenames = [str(x) for x in read_index(self.group, "filenames", self.storage.describe)]
        self._keys = [str(x) for x in read_index(self.group, "keys", self.storage.describe)]
        self._offsets = np.asarray(read_index(self.group, "frame_offsets", self.storage.describe), dtype=np.int64)
        self._raise(
            index_problems(
                self._filenames, self._keys, self._offsets, index_lengths(self.group, self.storage.describe), header
            )
        )
        self._frame_idx: np.ndarray | None = None
        self._prov: dict[str, np.ndarray | None] = {}
        self._pos = {f: i for i, f in enumerate(self._filenames)}
        self._checked: set[int] = set()

    def _raise(self, problems: list[_Problem]) -> None:
        """Raise the first problem (with a count of the others) as a :class:`CorruptSpillError`."""
        if not problems:
            return
        rel, what = problems[0]
        path = self.storage.describe(rel)
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CorruptSpillError(
            f"{path}: {what}{more}; the output is damaged: `spillmerge verify {self.storage.describe()}` lists "
            "every problem, merging again rebuilds it",
            path=path,
        )

    @property
    def filenames(self) -> list[str]:
        """Original filenames, sorted."""
        return list(self._filenames)

    def __len__(self) -> int:
        return len(self._filenames)

    def __iter__(self) -> Iterator[str]:
        return iter(self._filenames)

    def __contains__(self, filename: object) -> bool:
        return filename in self._pos

    def _index(self, filename: str) -> int:
        try:
            i = self._pos[filename]
        except (KeyError, TypeError):
            near = difflib.get_close_matches(filename, self._filenames, n=3) if isinstance(filename, str) else []
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise UnknownFileError(
                f"{filename!r} is not a filename of {self.storage.describe()} ({len(self._filenames)} files){hint}",
                filename=filename,
            ) from None
        if i not in self._checked:
            # The file's arrays must hold exactly its rows before any of its rows is handed out.
            self._raise(self._file_problems(i))
            self._checked.add(i)
        return i

    def _file_problems(self, i: int) -> list[_Problem]:
        rows = int(self._offsets[i + 1] - self._offsets[i])
        return file_problems(self.group, self._keys[i], self._filenames[i], rows)

    def frames(self, filename: str) -> np.ndarray:
        """Ascending int64 frame indices of ``filename``, one per row."""
        i = self._index(filename)
        if self._frame_idx is None:
            frame_idx = np.asarray(read_index(self.group, "frame_idx", self.storage.describe), dtype=np.int64)
            self._raise(frame_problems(frame_idx, self._offsets, self._filenames))
            self._frame_idx = frame_idx
        return self._frame_idx[self._offsets[i] : self._offsets[i + 1]].copy()

    def _provenance(self, filename: str, name: str) -> np.ndarray | None:
        i = self._index(filename)
        if name not in self._prov:
            idx: Any = self.group["index"]
            # Absent from outputs written before provenance was recorded (docs/FORMAT.md).
            arr = None
            if name in idx:
                arr = np.asarray(read_index(self.group, name, self.storage.describe), dtype=np.int64)
                self._raise(provenance_problems(name, arr))
            self._prov[name] = arr
        arr = self._prov[name]
        return None if arr is None else arr[self._offsets[i] : self._offsets[i + 1]].copy()

    def frame_ranks(self, filename: str) -> np.ndarray | None:
        """The rank each row of ``filename`` came from (int64, one per row), or ``None`` when the
        output predates provenance (``index/frame_rank``)."""
        return self._provenance(filename, "frame_rank")

    def frame_copies(self, filename: str) -> np.ndarray | None:
        """How many spill segments held each row's frame (1, or more when duplicates were
        dropped), or ``None`` when the output predates provenance (``index/frame_copies``)."""
        return self._provenance(filename, "frame_copies")

    def __getitem__(self, filename: str) -> Any:
        i = self._index(filename)
        files: Any = self.group["files"]
        node = files[self._keys[i]]
        return self._wrap(node, filename)

    def _wrap(self, node: Any, filename: str) -> Any:
        import zarr

        if isinstance(node, zarr.Array):
            meta: Any = node.attrs["spillmerge"]
            return LeafArray(node, meta["dtype"], filename)
        # Dict value: every array below the file's group knows its original leaf path.
        out: dict[str, Any] = {}
        for _, child in sorted(node.members(max_depth=None), key=lambda kv: kv[0]):
            if isinstance(child, zarr.Array):
                meta = child.attrs["spillmerge"]  # type: ignore[assignment]
                _set_nested(out, list(meta["leaf"]), LeafArray(child, meta["dtype"], filename))
        return out

    def __repr__(self) -> str:
        return f"MergedStore({self.storage.describe()!r}, files={len(self)}, frames={self.header.get('n_frames')})"


def _set_nested(out: dict[str, Any], path: list[str], value: Any) -> None:
    for k in path[:-1]:
        out = out.setdefault(k, {})
    out[path[-1]] = value


def open(out: str, storage_options: dict[str, Any] | None = None) -> MergedStore:  # noqa: A001
    """Open a merged output for reading."""
    return MergedStore(out, storage_options)


# --------------------------------------------------------------------------------------------
# Invariants of the index (docs/FORMAT.md), shared by the reader (which raises the first broken
# one) and `spillmerge verify` (which lists them all). Each returns (path, what is wrong) pairs.

_PROVENANCE = ("frame_rank", "frame_copies")


def _index_node(group: Any, name: str, describe: Callable[[str], str]) -> Any:
    import zarr

    rel = f"index/{name}"
    try:
        node = group[rel]
    except KeyError:
        raise CorruptSpillError(f"{describe(rel)}: missing from the output's index", path=describe(rel)) from None
    if not isinstance(node, zarr.Array) or node.ndim != 1:
        raise CorruptSpillError(f"{describe(rel)}: expected a 1-d array", path=describe(rel))
    return node


def read_index(group: Any, name: str, describe: Callable[[str], str]) -> np.ndarray:
    """The whole index array ``index/NAME``; a missing or unreadable one raises
    :class:`CorruptSpillError` naming it."""
    rel = f"index/{name}"
    node = _index_node(group, name, describe)
    try:
        return np.asarray(node[:])
    except SpillMergeError:
        raise
    except Exception as exc:  # noqa: BLE001 - zarr reports codec and checksum errors as many types
        raise CorruptSpillError(f"{describe(rel)}: cannot read it ({exc})", path=describe(rel)) from exc


def index_lengths(group: Any, describe: Callable[[str], str]) -> dict[str, int]:
    """Rows of ``frame_idx`` and of the provenance arrays present, from their metadata alone."""
    out = {"frame_idx": _index_node(group, "frame_idx", describe).shape[0]}
    idx: Any = group["index"]
    for name in _PROVENANCE:
        if name in idx:
            out[name] = _index_node(group, name, describe).shape[0]
    return out


def index_problems(
    filenames: list[str], keys: list[str], offsets: np.ndarray, lengths: dict[str, int], header: dict[str, Any]
) -> list[_Problem]:
    """What the per-file index arrays and the arrays' lengths break: O(files), no data read."""
    out: list[_Problem] = []
    n, rows = len(filenames), lengths["frame_idx"]
    if len(keys) != n:
        out.append(("index/keys", f"{len(keys)} keys for {n} filenames in index/filenames"))
    for rel, names in (("index/filenames", filenames), ("index/keys", keys)):
        dup = _first_duplicate(names)
        if dup is not None:
            out.append((rel, f"{dup!r:.200} is listed more than once"))
    bad = [k for k in keys if not F.is_safe_node_name(k)]
    if bad:
        out.append(("index/keys", f"{bad[0]!r} is not a node name a merge writes (docs/FORMAT.md, Node names)"))
    if len(offsets) != n + 1:
        out.append(("index/frame_offsets", f"{len(offsets)} entries for {n} files (must be {n + 1})"))
    elif offsets[0] != 0:
        out.append(("index/frame_offsets", f"starts at {int(offsets[0])}, not 0"))
    elif np.any(np.diff(offsets) < 0):
        i = int(np.flatnonzero(np.diff(offsets) < 0)[0])
        out.append(
            ("index/frame_offsets", f"decreases from {int(offsets[i])} to {int(offsets[i + 1])} at entry {i + 1}")
        )
    elif offsets[-1] != rows:
        out.append(("index/frame_offsets", f"ends at {int(offsets[-1])}, but index/frame_idx has {rows} rows"))
    for name in _PROVENANCE:
        if name in lengths and lengths[name] != rows:
            out.append((f"index/{name}", f"{lengths[name]} rows, but index/frame_idx has {rows}"))
    for field, want in (("n_files", n), ("n_frames", rows)):
        if header.get(field) != want:
            out.append(("zarr.json", f"the header's {field} is {header.get(field)!r}, but the index holds {want}"))
    return out


def _first_duplicate(names: list[str]) -> str | None:
    seen: set[str] = set()
    for x in names:
        if x in seen:
            return x
        seen.add(x)
    return None


def frame_problems(frame_idx: np.ndarray, offsets: np.ndarray, filenames: list[str]) -> list[_Problem]:
    """Frame indices non-negative and strictly ascending within each file (``offsets`` already
    checked): vectorised, O(rows)."""
    rel = "index/frame_idx"

    def where(r: int) -> str:
        i = int(np.searchsorted(offsets, r, side="right")) - 1
        return f"row {r} (file {i}, {filenames[i]!r:.200})"

    out: list[_Problem] = []
    neg = np.flatnonzero(frame_idx < 0)
    if len(neg):
        r = int(neg[0])
        out.append((rel, f"{where(r)} holds frame index {int(frame_idx[r])} < 0 ({len(neg)} negative in all)"))
    step_ok = np.diff(frame_idx) > 0
    starts = offsets[1:-1]
    starts = starts[(starts > 0) & (starts < len(frame_idx))]
    step_ok[starts - 1] = True  # the first row of a file may be below the last of the previous one
    bad = np.flatnonzero(~step_ok)
    if len(bad):
        r = int(bad[0]) + 1
        out.append(
            (
                rel,
                f"frame indices are not strictly ascending within a file: {where(r)} holds {int(frame_idx[r])} "
                f"after {int(frame_idx[r - 1])} ({len(bad)} such rows)",
            )
        )
    return out


def provenance_problems(name: str, values: np.ndarray) -> list[_Problem]:
    """``frame_rank`` non-negative, ``frame_copies`` at least 1."""
    least = 1 if name == "frame_copies" else 0
    bad = np.flatnonzero(values < least)
    if not len(bad):
        return []
    return [(f"index/{name}", f"row {int(bad[0])} holds {int(values[bad[0]])} < {least} ({len(bad)} such rows)")]


def file_problems(group: Any, key: str, filename: str, rows: int) -> list[_Problem]:
    """The node of one file: present, and every array of it with the spillmerge attributes, a
    known dtype stored as the dtype table says, and ``rows`` rows (its offsets' span). Metadata
    only (consolidated): no chunk is read."""
    import zarr

    rel = f"files/{key}"
    try:
        node = group[rel]
    except KeyError:
        return [(rel, f"the node of {filename!r:.200} (index/keys) is missing")]
    if isinstance(node, zarr.Array):
        return _leaf_problems(node, rel, filename, rows, in_dict=False)
    out: list[_Problem] = []
    arrays = [(f"{rel}/{p}", a) for p, a in sorted(node.members(max_depth=None)) if isinstance(a, zarr.Array)]
    if not arrays:
        out.append((rel, f"the group of {filename!r:.200} holds no arrays"))
    for path, arr in arrays:
        out.extend(_leaf_problems(arr, path, filename, rows, in_dict=True))
    return out


def _leaf_problems(arr: Any, rel: str, filename: str, rows: int, *, in_dict: bool) -> list[_Problem]:
    meta = arr.attrs.get("spillmerge")
    if not isinstance(meta, dict):
        return [(rel, "no spillmerge attributes (filename, leaf, dtype)")]
    out: list[_Problem] = []
    name = meta.get("dtype")
    dt = F.DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        out.append((rel, f"unknown dtype {name!r} in its attributes (known: docs/FORMAT.md section 3)"))
    elif arr.dtype != np.dtype(dt.storage):
        out.append((rel, f"dtype {name!r} is stored as {dt.storage}, but the array holds {arr.dtype}"))
    if meta.get("filename", filename) != filename:
        out.append((rel, f"belongs to {meta.get('filename')!r:.200}, but index/keys maps {filename!r:.200} to it"))
    leaf = meta.get("leaf")
    if not isinstance(leaf, list) or not all(isinstance(k, str) for k in leaf) or (in_dict and not leaf):
        out.append((rel, f"leaf {leaf!r} is not a list of dict keys"))
    if arr.ndim < 1 or arr.shape[0] != rows:
        have = arr.shape[0] if arr.ndim else "no"
        out.append((rel, f"{have} rows, but index/frame_offsets gives {filename!r:.200} {rows}"))
    return out
