"""Reading a merged output: ``spillmerge.open(out)``."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from . import _format as F
from ._errors import CorruptSpillError, IncompleteOutputError, SpillMergeError, UnknownFileError
from ._storage import Storage


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
        return np.asarray(self.zarr[sel])

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
    dict of them for dict values; ``store.frames(filename)`` gives the frame indices."""

    def __init__(self, out: str, storage_options: dict[str, Any] | None = None) -> None:
        import zarr

        self.storage = Storage(out, storage_options)
        marker = self.storage.get_or_none(F.COMPLETE_NAME, max_bytes=1 << 20)
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
            self.group = zarr.open_group(self.storage.zarr_store(read_only=True), mode="r", use_consolidated=True)
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
        idx: Any = self.group["index"]
        self._filenames = [str(x) for x in idx["filenames"][:]]
        self._keys = [str(x) for x in idx["keys"][:]]
        self._offsets = np.asarray(idx["frame_offsets"][:], dtype=np.int64)
        self._frame_idx: np.ndarray | None = None
        self._prov: dict[str, np.ndarray | None] = {}
        self._pos = {f: i for i, f in enumerate(self._filenames)}

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
            return self._pos[filename]
        except (KeyError, TypeError):
            near = difflib.get_close_matches(filename, self._filenames, n=3) if isinstance(filename, str) else []
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise UnknownFileError(
                f"{filename!r} is not a filename of {self.storage.describe()} ({len(self._filenames)} files){hint}",
                filename=filename,
            ) from None

    def frames(self, filename: str) -> np.ndarray:
        """Ascending int64 frame indices of ``filename``, one per row."""
        i = self._index(filename)
        if self._frame_idx is None:
            frame_idx: Any = self.group["index/frame_idx"]
            self._frame_idx = np.asarray(frame_idx[:], dtype=np.int64)
        return self._frame_idx[self._offsets[i] : self._offsets[i + 1]].copy()

    def _provenance(self, filename: str, name: str) -> np.ndarray | None:
        i = self._index(filename)
        if name not in self._prov:
            idx: Any = self.group["index"]
            # Absent from outputs written before provenance was recorded (docs/FORMAT.md).
            self._prov[name] = np.asarray(idx[name][:], dtype=np.int64) if name in idx else None
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
