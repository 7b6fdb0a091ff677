"""spillmerge: gather distributed PyTorch predictions through storage instead of gather_object.

Every rank appends its predictions to its own chunked Zarr segment (``SpillWriter``); one process
merges all segments into one consolidated Zarr v3 store (``merge``); ``open`` reads it back.

A leaf of an output reads as a :class:`LeafView` (format version 2, what ``merge`` writes);
:class:`LeafArray` is the same for outputs of format version 1, kept for code written against 0.1.
"""

from ._codecs import CODECS
from ._errors import (
    CommitTimeout,
    ConfigError,
    CoordinationError,
    CorruptSpillError,
    DuplicateFrameError,
    FormatVersionError,
    IncompleteOutputError,
    IncompleteSpillError,
    LayoutMismatchError,
    LeaseLostError,
    MergeFailedError,
    MergeTimeout,
    MissingDependencyError,
    MissingPartsError,
    NotAnOutputError,
    OutputBusyError,
    OutputExistsError,
    PartFailedError,
    PartsTimeout,
    PickleNotAllowedError,
    PlanMismatchError,
    RaggedShapeError,
    RankFailedError,
    SpillMergeError,
    SpillStorageError,
    SpillValueError,
    StaleSpillError,
    TruncatedObjectError,
    UnknownColumnError,
    UnknownFileError,
    UnknownLeafError,
    UnsafePathError,
    WriterClosedError,
)
from ._format import FORMAT_VERSION
from ._gather import all_gather, gather
from ._inspect import VerifyReport, verify
from ._merge import merge
from ._reader import LeafArray, MergedStore, open  # noqa: A004 - the public name is fixed
from ._report import MergeReport
from ._spillroot import committed_keys
from ._views import LeafView
from ._writer import SpillWriter

__version__ = "0.1.0"

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "CommitTimeout",
    "ConfigError",
    "CoordinationError",
    "CorruptSpillError",
    "DuplicateFrameError",
    "FormatVersionError",
    "IncompleteOutputError",
    "IncompleteSpillError",
    "LayoutMismatchError",
    "LeafArray",
    "LeafView",
    "MergeReport",
    "MergedStore",
    "MissingPartsError",
    "MissingDependencyError",
    "LeaseLostError",
    "MergeFailedError",
    "MergeTimeout",
    "NotAnOutputError",
    "OutputBusyError",
    "OutputExistsError",
    "PartFailedError",
    "PartsTimeout",
    "PickleNotAllowedError",
    "RaggedShapeError",
    "PlanMismatchError",
    "RankFailedError",
    "SpillMergeError",
    "SpillStorageError",
    "SpillValueError",
    "SpillWriter",
    "StaleSpillError",
    "TruncatedObjectError",
    "UnknownColumnError",
    "UnknownFileError",
    "UnknownLeafError",
    "UnsafePathError",
    "VerifyReport",
    "WriterClosedError",
    "__version__",
    "all_gather",
    "committed_keys",
    "gather",
    "merge",
    "open",
    "verify",
]
