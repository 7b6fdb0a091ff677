"""Storage primitives: ``Storage(url, storage_options)`` returns the backend's class, as
``pathlib.Path`` returns a ``PosixPath``: :class:`LocalStorage` for local paths and ``file://``,
:class:`FsspecStorage` for every other fsspec protocol. Callers type against :class:`Storage`."""

from .base import Sink, Storage, output_options, overlaps
from .fsspec_store import FsspecStorage
from .local import LocalStorage

__all__ = ["FsspecStorage", "LocalStorage", "Sink", "Storage", "output_options", "overlaps"]
