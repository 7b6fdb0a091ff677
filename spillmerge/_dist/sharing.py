"""Where the drop-ins' data travels, and whether the ranks on one host name one folder by it.

A root spelled alike on every rank can still be a folder of each rank's own on one host: a
relative path resolves in each rank's working directory, ``memory://`` is each process's own, a
container has its own ``/dev/shm``. Each rank says what its spelling names here
(:func:`root_identity`); the drop-ins check on storage only when two ranks differ, so the usual
call pays a few ``stat`` calls and a wrong root is refused in seconds instead of a merge waiting
its whole timeout for commit records it cannot see.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any


def node_local_root() -> str:
    """``/dev/shm`` when present and writable (nothing reaches a disk), else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def root_identity(where: str) -> tuple[Any, ...]:
    """What ``where`` names in this process: for a local path, the device and inode of its nearest
    existing folder and the names below it; for ``memory://``, this process; else the URL
    itself. Equal identities of ranks on one host are one folder; unequal ones may still be one
    (a folder created between two ranks' looks), which only storage can tell."""
    if where.startswith("memory://"):
        return ("memory", os.getpid())
    if "://" in where and not where.startswith("file://"):
        return (where.rstrip("/"),)
    path = os.path.abspath(where.removeprefix("file://"))
    below: list[str] = []
    while True:
        try:
            st = os.stat(path)
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return (path, *reversed(below))
            below.append(os.path.basename(path))
            path = parent
            continue
        return (st.st_dev, st.st_ino, *reversed(below))
