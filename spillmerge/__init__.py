"""spillmerge: gather distributed PyTorch predictions through storage instead of gather_object:
each rank spills to its own Zarr segment (``SpillWriter``), one process merges them all (``merge``)
and ``open`` reads the result. ``import spillmerge`` does not import torch (PEP 562 lazy names)."""

from typing import TYPE_CHECKING, Any

from . import _errors
from ._errors import *  # noqa: F403 - every error class is public
from ._format.codecs import CODECS
from ._format.common import FORMAT_VERSION
from ._inspect.status import JobStatus, MergeStatus, RankStatus, status
from ._inspect.summary import VerifyReport, verify
from ._merge.job import merge
from ._merge.report import MergeReport
from ._read.dataset import OutputDataset
from ._read.store import MergedStore, open  # noqa: A004 - the public name is fixed
from ._read.views import LeafView
from ._spill.root import committed_keys

if TYPE_CHECKING:
    from ._dist.dropin import all_gather_object, gather_object
    from ._dist.gather import all_gather, gather
    from ._write.writer import SpillWriter

# Public names whose modules import torch: name -> its module. Loaded on first access.
_NEEDS_TORCH = {
    "SpillWriter": "_write.writer",
    "gather": "_dist.gather",
    "all_gather": "_dist.gather",
    "gather_object": "_dist.dropin",
    "all_gather_object": "_dist.dropin",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _NEEDS_TORCH:
        if name.startswith("_") and not name.startswith("__"):  # spillmerge._dist.gather as before: imported on use
            try:
                return importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError:
                pass
        raise AttributeError(f"module 'spillmerge' has no attribute {name!r}")
    _errors.require_torch(f"spillmerge.{name}")  # MissingDependencyError with the install hint, not ImportError
    value = getattr(importlib.import_module(f"{__name__}.{_NEEDS_TORCH[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NEEDS_TORCH))


__version__ = "0.1.0"

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "JobStatus",
    "LeafView",
    "MergeReport",
    "MergeStatus",
    "MergedStore",
    "OutputDataset",
    "RankStatus",
    "SpillWriter",
    "VerifyReport",
    "__version__",
    "all_gather",
    "all_gather_object",
    "committed_keys",
    "gather",
    "gather_object",
    "merge",
    "open",
    "status",
    "verify",
]
__all__ += _errors.__all__
