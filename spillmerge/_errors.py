"""Errors raised on purpose by spillmerge. All derive from :class:`SpillMergeError`; each names
its data (the annotated attributes below), given as keywords after the message."""

from __future__ import annotations

import importlib
from typing import Any, Self


class SpillMergeError(Exception):
    """Base of every error raised on purpose: ``Error(message, **fields)`` sets each field as an
    attribute; the message alone is its text, unquoted (``KeyError`` subclasses included)."""

    def __init__(self, *args: object, **fields: Any) -> None:
        super().__init__(*args)
        for name, value in fields.items():
            setattr(self, name, value)

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()

    def prefixed(self, where: str) -> Self:
        """This error with ``where`` in front of its message (same class, same fields)."""
        self.args = (f"{where}: {self.args[0] if self.args else self}", *self.args[1:])
        return self


class SpillValueError(SpillMergeError, ValueError):
    """A value, filename or frame index given to the writer cannot be stored; ``filename``,
    ``frame_idx`` and ``leaf`` name the offending item when known, ``batch_index`` its place in
    a ``write_batch`` batch."""

    filename: str | None = None
    frame_idx: int | None = None
    leaf: str | None = None
    batch_index: int | None = None


class DuplicateFrameError(SpillValueError):
    """The same ``(filename, frame_idx)`` was written twice with different content by ``ranks``."""

    ranks: list[int]


class LayoutMismatchError(SpillValueError):
    """Two leaf paths would share an output column (``ranks`` name the writers)."""

    ranks: list[int]

    def __init__(self, message: str, *, ranks: list[int] | None = None, **fields: Any) -> None:
        super().__init__(message, ranks=ranks or [], **fields)


class WriterClosedError(SpillMergeError, RuntimeError):
    """``write`` was called on a writer that is closed (or was never entered)."""


class SpillStorageError(SpillMergeError, OSError):
    """Reading or writing storage failed; ``path`` names the object."""

    path: str | None = None


class CorruptSpillError(SpillMergeError, ValueError):
    """Something read is malformed or fails its checksum: ``path`` names the object, ``rank``
    its rank when known, ``reason`` what is wrong without the path (``verify`` lists it)."""

    path: str | None = None
    rank: int | None = None
    reason: str | None = None


class TruncatedObjectError(CorruptSpillError, SpillStorageError):
    """An object is shorter than its metadata promise: corrupt data and a storage problem both."""


class IncompleteSpillError(SpillMergeError):
    """Some ranks have no commit record. ``missing`` lists them; ``incomplete`` maps rank → path
    of an uncommitted segment when one exists."""

    missing: list[int]
    incomplete: dict[int, str]

    def __init__(self, message: str, *, incomplete: dict[int, str] | None = None, **fields: Any) -> None:
        super().__init__(message, incomplete=incomplete or {}, **fields)


class CommitTimeout(IncompleteSpillError, TimeoutError):
    """Waiting for commit records timed out after ``waited_s`` seconds."""

    waited_s: float


class RankFailedError(SpillMergeError, RuntimeError):
    """One or more ranks recorded a failure. ``failures`` maps rank → "Type: message"."""

    failures: dict[int, str]


class MergeFailedError(RankFailedError):
    """The merging rank's merge failed, raised on every rank waiting for the output; ``rank``
    is the merging rank and ``failures`` maps it to "Type: message"."""

    rank: int


class MergeTimeout(SpillMergeError, TimeoutError):
    """A rank waited ``waited_s`` seconds for the merged output at ``path`` to complete or fail."""

    path: str
    waited_s: float


class FormatVersionError(CorruptSpillError):
    """A tree was written with format version ``found``; this spillmerge reads only ``supported``."""

    found: object
    supported: int


class OutputExistsError(SpillMergeError, FileExistsError):
    """The merge output already exists; pass ``overwrite=True`` (``--overwrite``) to replace it."""

    path: str


class OutputBusyError(SpillMergeError, BlockingIOError):
    """Another merge (or part, or finalize) holds the lease of output ``path``; ``holders``
    describes each holder (role, host, pid, since, expiry)."""

    path: str
    holders: list[str]


class LeaseLostError(SpillMergeError, RuntimeError):
    """This merge's lease on output ``path`` was taken over or removed; the merge stopped."""

    path: str


class IncompleteOutputError(SpillMergeError):
    """A merged output has no completion marker: the merge that wrote it did not finish."""

    path: str


class UnsafePathError(SpillMergeError, ValueError):
    """A path would escape the root it belongs to."""

    path: str


class UnknownFileError(SpillMergeError, KeyError):
    """A merged store has no array for ``filename`` (a ``KeyError``, so ``in`` / ``.get`` idioms work)."""

    filename: object


class ConfigError(SpillMergeError, ValueError):
    """A configuration file or option is invalid; ``key`` names it when known."""

    key: str | None = None


class CoordinationError(SpillMergeError, RuntimeError):
    """CPU-side coordination between ranks (gloo) failed or timed out; ``rank`` is the caller."""

    rank: int


class PartFailedError(RankFailedError):
    """Parts of a parallel merge of ``path`` failed; ``failures`` maps part → "Type: message"."""

    path: str


class MissingPartsError(IncompleteOutputError):
    """Parts of a parallel merge have no completion record (``missing``, out of ``parts``)."""

    missing: list[int]
    parts: int


class PartsTimeout(MissingPartsError, TimeoutError):
    """Waiting for the parts of a parallel merge timed out after ``waited_s`` seconds."""

    waited_s: float


class PlanMismatchError(SpillMergeError, ValueError):
    """Parts ``parts`` of output ``path`` were (or would be) written from different merge plans
    (spill root, part count or options changed between them)."""

    path: str
    parts: list[int]


class MissingDependencyError(SpillMergeError, ImportError):
    """Optional dependency ``package`` is not installed; ``spillmerge[extra]`` installs it."""

    def __init__(self, package: str, extra: str, feature: str) -> None:
        message = f"{feature} needs {package}, which is not installed: pip install 'spillmerge[{extra}]'"
        super().__init__(message, package=package, extra=extra)

    package: str
    extra: str


def require(module: str, *, package: str, extra: str, feature: str):  # type: ignore[no-untyped-def]
    """Import an optional dependency, or raise :class:`MissingDependencyError` with the install hint."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(package, extra, feature) from None


class NotAnOutputError(SpillMergeError, ValueError):
    """A path opened as a merged output is not one; ``kind`` says what it is: ``"missing"`` (does
    not exist), ``"file"``, ``"spill"`` (a spill root: merge it first) or ``"other"`` (a folder
    spillmerge did not write). ``path`` names it."""

    path: str
    kind: str


class NotASpillRootError(SpillMergeError, ValueError):
    """``spillmerge status`` on a path that is no spill root; ``kind`` says what it is:
    ``"missing"`` (does not exist), ``"file"``, ``"output"`` (a merged output) or ``"other"`` (a
    folder without rank folders). ``path`` names it."""

    path: str
    kind: str


class UnknownLeafError(SpillMergeError, KeyError):
    """A file's value has no leaf ``leaf`` (a ``KeyError``, so ``in`` / ``.get`` idioms work);
    ``filename`` names the file and ``known`` lists the leaf paths it has."""

    filename: str
    leaf: str
    known: list[str]


def require_torch(feature: str):  # type: ignore[no-untyped-def]
    """torch, imported where it is needed (writing; reading never needs it)."""
    return require("torch", package="torch", extra="torch", feature=feature)


class UnknownColumnError(SpillMergeError, KeyError):
    """A merged store has no leaf column ``column``; ``known`` lists the ones it has."""

    column: str
    known: list[str]


class PickleNotAllowedError(SpillMergeError, ValueError):
    """Leaf ``leaf`` holds pickled objects and the store was opened without ``allow_pickle=True``."""

    leaf: str


class RaggedShapeError(SpillMergeError, ValueError):
    """Rows of a ragged leaf were asked for as one stacked array; use ``to_list()`` or ``values``."""


class StaleSpillError(SpillMergeError, ValueError):
    """A spill root holds segments of an earlier run with another world size; ``stale`` maps each
    such segment's path to its world size, ``world_size`` is this run's."""

    path: str
    world_size: int
    stale: dict[str, int]


class ParquetTypeError(SpillMergeError, ValueError):
    """``to_parquet`` was asked for ``columns`` of an Arrow type Parquet lacks (a struct without
    fields: an empty dict where no row has keys)."""

    columns: list[str]


class ArrowUnionInParquetError(ParquetTypeError):
    """``to_parquet`` was asked for ``columns`` that hold an Arrow union, which Parquet lacks."""


# Every error class is public (spillmerge's ``__all__`` adds these names).
__all__ = sorted(n for n, v in list(globals().items()) if isinstance(v, type) and issubclass(v, SpillMergeError))
