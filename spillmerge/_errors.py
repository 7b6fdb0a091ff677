"""Errors raised on purpose by spillmerge. All derive from :class:`SpillMergeError`."""

from __future__ import annotations


class SpillMergeError(Exception):
    """Base class of every error spillmerge raises on purpose."""


class SpillValueError(SpillMergeError, ValueError):
    """A value, filename or frame index given to the writer cannot be stored.

    ``filename``, ``frame_idx`` and ``leaf`` name the offending item when known.
    """

    def __init__(
        self,
        message: str,
        *,
        filename: str | None = None,
        frame_idx: int | None = None,
        leaf: str | None = None,
    ) -> None:
        super().__init__(message)
        self.filename = filename
        self.frame_idx = frame_idx
        self.leaf = leaf


class DuplicateFrameError(SpillValueError):
    """The same ``(filename, frame_idx)`` was written more than once with different content.

    ``ranks`` lists the ranks that wrote it.
    """

    def __init__(self, message: str, *, filename: str, frame_idx: int, ranks: list[int]) -> None:
        super().__init__(message, filename=filename, frame_idx=frame_idx)
        self.ranks = ranks


class LayoutMismatchError(SpillValueError):
    """A leaf changed dtype or shape between frames of one filename (``ranks`` name the writers)."""

    def __init__(self, message: str, *, filename: str, leaf: str, ranks: list[int] | None = None) -> None:
        super().__init__(message, filename=filename, leaf=leaf)
        self.ranks = ranks or []


class WriterClosedError(SpillMergeError, RuntimeError):
    """``write`` was called on a writer that is closed (or was never entered)."""


class SpillStorageError(SpillMergeError, OSError):
    """Reading or writing storage failed; ``path`` names the object."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class CorruptSpillError(SpillMergeError, ValueError):
    """Something read from a spill root or an output is malformed or fails its checksum.

    ``path`` names the object, ``rank`` the rank it belongs to when known, ``reason`` what is
    wrong without the path (``verify`` lists it next to the path) when the raiser gives it.
    """

    def __init__(
        self, message: str, *, path: str | None = None, rank: int | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.path = path
        self.rank = rank
        self.reason = reason


class TruncatedObjectError(CorruptSpillError, SpillStorageError):
    """An object is shorter than its metadata promise (a torn write or a truncated copy): both
    corrupt data and a storage problem, so either ``except`` catches it; ``path`` names it."""


class IncompleteSpillError(SpillMergeError):
    """Some ranks have no commit record. ``missing`` lists them; ``incomplete`` maps rank → path
    of an uncommitted segment when one exists."""

    def __init__(self, message: str, *, missing: list[int], incomplete: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.missing = missing
        self.incomplete = incomplete or {}


class CommitTimeout(IncompleteSpillError, TimeoutError):
    """Waiting for commit records timed out after ``waited_s`` seconds."""

    def __init__(
        self,
        message: str,
        *,
        missing: list[int],
        waited_s: float,
        incomplete: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message, missing=missing, incomplete=incomplete)
        self.waited_s = waited_s


class RankFailedError(SpillMergeError, RuntimeError):
    """One or more ranks recorded a failure. ``failures`` maps rank → "Type: message"."""

    def __init__(self, message: str, *, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class MergeFailedError(RankFailedError):
    """The merging rank's merge failed; raised on every rank that waits for the output
    (``SpillWriter.merge(wait=True)``, ``all_gather``). ``rank`` is the merging rank and
    ``failures`` maps it to "Type: message"."""

    def __init__(self, message: str, *, rank: int, failures: dict[int, str]) -> None:
        super().__init__(message, failures=failures)
        self.rank = rank


class MergeTimeout(SpillMergeError, TimeoutError):
    """A rank waited ``waited_s`` seconds for the merged output at ``path`` without seeing it
    complete or fail."""

    def __init__(self, message: str, *, path: str, waited_s: float) -> None:
        super().__init__(message)
        self.path = path
        self.waited_s = waited_s


class FormatVersionError(CorruptSpillError):
    """A tree (an output or a spill root) was written with a format version this spillmerge does
    not read: ``found`` is the tree's version, ``supported`` the one version this spillmerge
    reads (each spillmerge reads exactly one output and one spill format)."""

    def __init__(self, message: str, *, path: str, found: object, supported: int) -> None:
        super().__init__(message, path=path)
        self.found = found
        self.supported = supported


class OutputExistsError(SpillMergeError, FileExistsError):
    """The merge output already exists; pass ``overwrite=True`` (``--overwrite``) to replace it."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class OutputBusyError(SpillMergeError, BlockingIOError):
    """Another merge (or part, or finalize) holds the output's lease: one merge per output.

    ``path`` is the output, ``holders`` describes each holder (role, host, pid, since, expiry).
    """

    def __init__(self, message: str, *, path: str, holders: list[str]) -> None:
        super().__init__(message)
        self.path = path
        self.holders = holders


class LeaseLostError(SpillMergeError, RuntimeError):
    """This merge's lease on its output was taken over (it expired) or removed; it stopped before
    its next destructive step or its completion marker. ``path`` is the output."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class IncompleteOutputError(SpillMergeError):
    """A merged output has no completion marker: the merge that wrote it did not finish."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class UnsafePathError(SpillMergeError, ValueError):
    """A path would escape the root it belongs to."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class UnknownFileError(SpillMergeError, KeyError):
    """A merged store has no array for ``filename`` (a ``KeyError``, so ``in`` / ``.get`` idioms work)."""

    def __init__(self, message: str, *, filename: object) -> None:
        super().__init__(message)
        self.filename = filename

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class ConfigError(SpillMergeError, ValueError):
    """A configuration file or option is invalid; ``key`` names it when known."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class CoordinationError(SpillMergeError, RuntimeError):
    """CPU-side coordination between ranks (gloo) failed or timed out; ``rank`` is the caller."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class PartFailedError(RankFailedError):
    """Parts of a parallel merge recorded a failure. ``failures`` maps part → "Type: message";
    ``path`` is the output. In ``SpillWriter.merge(parallel=True)`` part ``i`` is rank ``i``."""

    def __init__(self, message: str, *, failures: dict[int, str], path: str) -> None:
        super().__init__(message, failures=failures)
        self.path = path


class MissingPartsError(IncompleteOutputError):
    """Parts of a parallel merge have no completion record (``missing``, out of ``parts``)."""

    def __init__(self, message: str, *, path: str, missing: list[int], parts: int) -> None:
        super().__init__(message, path=path)
        self.missing = missing
        self.parts = parts


class PartsTimeout(MissingPartsError, TimeoutError):
    """Waiting for the parts of a parallel merge timed out after ``waited_s`` seconds."""

    def __init__(self, message: str, *, path: str, missing: list[int], parts: int, waited_s: float) -> None:
        super().__init__(message, path=path, missing=missing, parts=parts)
        self.waited_s = waited_s


class PlanMismatchError(SpillMergeError, ValueError):
    """Parts of one output were (or would be) written from different merge plans: the spill root,
    the part count or the merge options changed between them. ``parts`` names the disagreeing
    parts (their record paths in the message), ``path`` is the output."""

    def __init__(self, message: str, *, path: str, parts: list[int]) -> None:
        super().__init__(message)
        self.path = path
        self.parts = parts


class MissingDependencyError(SpillMergeError, ImportError):
    """An optional dependency is not installed; ``package`` names it and ``extra`` the
    ``spillmerge[extra]`` that installs it."""

    def __init__(self, package: str, extra: str, feature: str) -> None:
        super().__init__(f"{feature} needs {package}, which is not installed: pip install 'spillmerge[{extra}]'")
        self.package = package
        self.extra = extra


def require(module: str, *, package: str, extra: str, feature: str):  # type: ignore[no-untyped-def]
    """Import an optional dependency, or raise :class:`MissingDependencyError` with the install hint."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(package, extra, feature) from None


class NotAnOutputError(SpillMergeError, ValueError):
    """A path opened as a merged output is not one; ``kind`` says what it is: ``"missing"`` (does
    not exist), ``"file"``, ``"spill"`` (a spill root: merge it first) or ``"other"`` (a folder
    spillmerge did not write). ``path`` names it."""

    def __init__(self, message: str, *, path: str, kind: str) -> None:
        super().__init__(message)
        self.path = path
        self.kind = kind


class NotASpillRootError(SpillMergeError, ValueError):
    """``spillmerge status`` on a path that is no spill root; ``kind`` says what it is:
    ``"missing"`` (does not exist), ``"file"``, ``"output"`` (a merged output) or ``"other"`` (a
    folder without rank folders). ``path`` names it."""

    def __init__(self, message: str, *, path: str, kind: str) -> None:
        super().__init__(message)
        self.path = path
        self.kind = kind


class UnknownLeafError(SpillMergeError, KeyError):
    """A file's value has no leaf ``leaf`` (a ``KeyError``, so ``in`` / ``.get`` idioms work);
    ``filename`` names the file and ``known`` lists the leaf paths it has."""

    def __init__(self, message: str, *, filename: str, leaf: str, known: list[str]) -> None:
        super().__init__(message)
        self.filename = filename
        self.leaf = leaf
        self.known = known

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def require_torch(feature: str):  # type: ignore[no-untyped-def]
    """torch, imported where it is needed: reading an output never needs it, writing does
    (``pip install 'spillmerge[torch]'``, or any torch >= 2.2)."""
    return require("torch", package="torch", extra="torch", feature=feature)


class UnknownColumnError(SpillMergeError, KeyError):
    """A merged store has no leaf column ``column``; ``known`` lists the ones it has."""

    def __init__(self, message: str, *, column: str, known: list[str]) -> None:
        super().__init__(message)
        self.column = column
        self.known = known

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PickleNotAllowedError(SpillMergeError, ValueError):
    """A leaf holds pickled objects and the store was opened without ``allow_pickle=True``
    (nothing is ever unpickled by default); ``leaf`` names it."""

    def __init__(self, message: str, *, leaf: str) -> None:
        super().__init__(message)
        self.leaf = leaf


class RaggedShapeError(SpillMergeError, ValueError):
    """Rows of a ragged leaf with different shapes were asked for as one stacked array; read them
    with ``to_list()`` or the flat ``values`` / ``offsets`` / ``shapes``."""


class StaleSpillError(SpillMergeError, ValueError):
    """A spill root holds segments of an earlier run with another world size: nothing is corrupt,
    but they cannot be merged with this run's. ``stale`` maps each such segment's path to the world
    size it was written with; ``world_size`` is this run's. Remove the root, choose another one, or
    merge the old run alone with its own ``world_size``."""

    def __init__(self, message: str, *, path: str, world_size: int, stale: dict[str, int]) -> None:
        super().__init__(message)
        self.path = path
        self.world_size = world_size
        self.stale = stale


class ArrowUnionInParquetError(SpillMergeError, ValueError):
    """``to_parquet`` was asked for a column that holds an Arrow union (a leaf of several kinds):
    Parquet has no union type. ``columns`` names them."""

    def __init__(self, message: str, *, columns: list[str]) -> None:
        super().__init__(message)
        self.columns = columns
