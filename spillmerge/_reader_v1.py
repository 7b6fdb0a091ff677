"""Reading merged outputs of format version 1 (docs/FORMAT.md section 5): one array per file and
leaf under ``files/``, read exactly as spillmerge 0.1 read them (storage dtypes, raw bits for
bfloat16 ...). ``_reader.MergedStore`` delegates here when the header says version 1."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _format as F
from ._errors import CorruptSpillError, SpillMergeError, UnknownFileError, require_torch
from ._invariants import (
    PROVENANCE,
    Problem,
    frame_problems,
    index_lengths,
    offsets_problems,
    provenance_problems,
    read_index,
)
from ._leafdict import LeafDict
from ._names import suggest

if TYPE_CHECKING:
    import torch


class LeafArray:
    """One output array of a version-1 output: ``(n_frames, *frame_shape)``, rows in frame order,
    read lazily.

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
        return getattr(require_torch("LeafArray.to_torch()"), self.dtype_name)  # type: ignore[no-any-return]

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
        torch = require_torch("LeafArray.to_torch()")
        t = torch.from_numpy(arr)
        return t if F.DTYPES[self.dtype_name].native else t.view(self.torch_dtype)

    def __repr__(self) -> str:
        return f"LeafArray({self.filename!r}, shape={self.shape}, dtype={self.dtype_name})"


class V1Files:
    """The files of a version-1 output, for ``MergedStore``.

    The index is checked before anything is returned from it: at open, what the small per-file
    index arrays and the array metadata say (offsets from 0, non-decreasing, ending at the number
    of rows; as many keys as filenames; provenance as long as ``frame_idx``); ``frame_idx``
    itself when it is first read; a file's arrays at the first access to that file (known dtype
    matching the storage dtype, as many rows as its offsets span)."""

    def __init__(
        self,
        group: Any,
        header: dict[str, Any],
        describe: Callable[[str], str],
        raise_: Callable[[list[Problem]], None],
    ) -> None:
        self.group = group
        self._describe = describe
        self._raise = raise_
        self._filenames = [str(x) for x in read_index(group, "filenames", describe)]
        self._keys = [str(x) for x in read_index(group, "keys", describe)]
        self._offsets = np.asarray(read_index(group, "frame_offsets", describe), dtype=np.int64)
        raise_(index_problems(self._filenames, self._keys, self._offsets, index_lengths(group, describe), header))
        self._frame_idx: np.ndarray | None = None
        self._prov: dict[str, np.ndarray | None] = {}
        self._pos = {f: i for i, f in enumerate(self._filenames)}
        self._checked: set[int] = set()

    @property
    def filenames(self) -> list[str]:
        return list(self._filenames)

    def __len__(self) -> int:
        return len(self._filenames)

    def __iter__(self) -> Iterator[str]:
        return iter(self._filenames)

    def __contains__(self, filename: object) -> bool:
        return filename in self._pos

    def index(self, filename: str, where: Callable[[], str]) -> int:
        try:
            i = self._pos[filename]
        except (KeyError, TypeError):
            j = bisect.bisect_left(self._filenames, filename) if isinstance(filename, str) else 0  # sorted (checked)
            near = suggest(filename, self._filenames[max(0, j - 50) : j + 50]) if isinstance(filename, str) else []
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise UnknownFileError(
                f"{filename!r} is not a filename of {where()} ({len(self._filenames)} files){hint}", filename=filename
            ) from None
        if i not in self._checked:
            # The file's arrays must hold exactly its rows before any of its rows is handed out.
            rows = int(self._offsets[i + 1] - self._offsets[i])
            self._raise(file_problems(self.group, self._keys[i], self._filenames[i], rows))
            self._checked.add(i)
        return i

    def frames(self, i: int) -> np.ndarray:
        if self._frame_idx is None:
            frame_idx = np.asarray(read_index(self.group, "frame_idx", self._describe), dtype=np.int64)
            self._raise(frame_problems(frame_idx, self._offsets, self._filenames))
            self._frame_idx = frame_idx
        return self._frame_idx[self._offsets[i] : self._offsets[i + 1]].copy()

    def provenance(self, i: int, name: str) -> np.ndarray | None:
        if name not in self._prov:
            idx: Any = self.group["index"]
            # Absent from outputs written before provenance was recorded (docs/FORMAT.md).
            arr = None
            if name in idx:
                arr = np.asarray(read_index(self.group, name, self._describe), dtype=np.int64)
                self._raise(provenance_problems(name, arr))
            self._prov[name] = arr
        arr = self._prov[name]
        return None if arr is None else arr[self._offsets[i] : self._offsets[i + 1]].copy()

    def value(self, i: int, filename: str | None = None) -> Any:  # noqa: ARG002 - V2Files.value's signature
        import zarr

        files: Any = self.group["files"]
        node = files[self._keys[i]]
        filename = self._filenames[i]
        if isinstance(node, zarr.Array):
            meta: Any = node.attrs["spillmerge"]
            return LeafArray(node, meta["dtype"], filename)
        # Dict value: every array below the file's group knows its original leaf path.
        out = LeafDict(filename)
        for _, child in sorted(node.members(max_depth=None), key=lambda kv: kv[0]):
            if isinstance(child, zarr.Array):
                meta = child.attrs["spillmerge"]  # type: ignore[assignment]
                set_nested(out, list(meta["leaf"]), LeafArray(child, meta["dtype"], filename))
        return out


def set_nested(out: LeafDict, path: list[str] | tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        out = out.child(k)
    out[path[-1]] = value


# --------------------------------------------------------------------------------------------
# Invariants of the index, version 1 (docs/FORMAT.md section 5.1)


def index_problems(
    filenames: list[str], keys: list[str], offsets: np.ndarray, lengths: dict[str, int], header: dict[str, Any]
) -> list[Problem]:
    """What the per-file index arrays and the arrays' lengths break: O(files), no data read."""
    out: list[Problem] = []
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
    out.extend(offsets_problems(offsets, n, rows, "index/frame_offsets", "files", "index/frame_idx"))
    for name in PROVENANCE:
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


def file_problems(group: Any, key: str, filename: str, rows: int) -> list[Problem]:
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
    out: list[Problem] = []
    arrays = [(f"{rel}/{p}", a) for p, a in sorted(node.members(max_depth=None)) if isinstance(a, zarr.Array)]
    if not arrays:
        out.append((rel, f"the group of {filename!r:.200} holds no arrays"))
    for path, arr in arrays:
        out.extend(_leaf_problems(arr, path, filename, rows, in_dict=True))
    return out


def _leaf_problems(arr: Any, rel: str, filename: str, rows: int, *, in_dict: bool) -> list[Problem]:
    meta = arr.attrs.get("spillmerge")
    if not isinstance(meta, dict):
        return [(rel, "no spillmerge attributes (filename, leaf, dtype)")]
    out: list[Problem] = []
    name = meta.get("dtype")
    dt = F.DTYPES.get(name) if isinstance(name, str) else None
    if dt is None or not dt.numeric:
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
