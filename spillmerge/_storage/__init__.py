"""The few storage primitives spillmerge needs: one interface, one class per backend.

``Storage(url, storage_options)`` returns the class of the URL's backend, as ``pathlib.Path``
returns a ``PosixPath``: :class:`LocalStorage` for local paths and ``file://`` URLs,
:class:`FsspecStorage` for every other fsspec protocol (zarr keeps ``LocalStore`` and
``FsspecStore`` the same way). Callers type against :class:`Storage` alone.

- ``_base``: the interface and what every backend shares (contained paths, the one error
  translation, size and kind checks of untrusted objects, listings, S3 defaults);
- ``_local``: a local disk (POSIX calls, never through a link, temporary name then rename);
- ``_fsspec``: any other fsspec filesystem (object stores: one PUT per object).
"""

from .base import Sink, Storage
from .fsspec_store import FsspecStorage
from .local import LocalStorage

# Importing a backend registers it with Storage (Storage.__init_subclass__).

__all__ = ["FsspecStorage", "LocalStorage", "Sink", "Storage"]
