"""The output folder: whose it is, who may write it, what overwrite may delete.

A folder is a spillmerge output when its root ``zarr.json`` says so, or it holds a lease folder
or part records of a merge (an interrupted merge); anything else is never written into or deleted.
A merge deletes only the objects it writes itself (``OURS``), never a lease and never through a
symbolic link, and only while it holds the output's lease (``_lease``).
"""

from __future__ import annotations

from typing import Any

from . import _format as F
from . import _lease, _parts
from ._errors import CorruptSpillError, OutputExistsError, UnsafePathError
from ._storage import Storage


def overlaps(a: Storage, b: Storage) -> bool:
    """True when one storage root is, contains or lies inside the other on the same filesystem.
    Roots are resolved first (``Storage``: ``..``, ``.``, ``//``, ``file://``, relative paths and
    symbolic links), so every spelling of one folder compares equal."""
    if type(a.fs) is not type(b.fs):
        return False
    pa, pb = a.root.rstrip("/") + "/", b.root.rstrip("/") + "/"
    return pa.startswith(pb) or pb.startswith(pa)


OURS = ("zarr.json", "files", "index", _parts.PARTS_DIR, F.COMPLETE_NAME)
"""Top-level names a merge writes, the only ones it ever deletes (plus its temporary names)."""
_TEMP = tuple(f"{name}.tmp-" for name in ("zarr.json", F.COMPLETE_NAME))


def _is_ours_name(name: str) -> bool:
    return name in OURS or name.startswith(_TEMP)


def check_claimable(dst: Storage) -> None:
    """Refuse, before creating anything, an output folder that holds something spillmerge did
    not write (``OutputExistsError``)."""
    if dst.exists("") and dst.listdir("") and not is_ours(dst):
        raise not_ours(dst)


def prepare(dst: Storage, overwrite: bool, lease: _lease.Lease) -> None:
    """A whole merge's start, under its lease: an empty or interrupted output is cleared of what
    an earlier merge wrote; a complete one only with ``overwrite``."""
    if not dst.listdir(""):
        return
    if not is_ours(dst):
        raise not_ours(dst)
    if dst.exists(F.COMPLETE_NAME) and not overwrite:
        raise complete_error(dst, "replace it")
    # An interrupted merge (no completion marker) or an explicit overwrite: start from scratch.
    remove_ours(dst, lease)


def remove_ours(dst: Storage, lease: _lease.Lease) -> None:
    """Delete what a merge wrote into ``dst``, nothing else: not the lease folder, not a file the
    user put there, never through a symbolic link (a linked ``files/`` loses the link only)."""
    lease.check()
    for name in dst.listdir(""):
        if _is_ours_name(name):
            dst.rm_tree(name)


def complete_error(dst: Storage, to: str) -> OutputExistsError:
    """The output holds a complete merge and no ``overwrite`` was given."""
    return OutputExistsError(
        f"{dst.describe()} already holds a complete merge; pass overwrite=True (--overwrite) to {to}",
        path=dst.describe(),
    )


def header(storage: Storage) -> dict[str, Any] | None:
    """The output header (root ``zarr.json`` attributes ``spillmerge``) when ``storage`` holds a
    merged output's root document, else None (absent, torn or not ours). The one reader of
    "is this a merged output?" for the merge, ``inspect`` and ``open``."""
    raw = storage.get_or_none("zarr.json", max_bytes=256 << 20)
    if raw is None:
        return None
    try:
        obj = F.loads(raw, path=storage.describe("zarr.json"))
    except CorruptSpillError:
        return None
    head = obj.get("attributes", {}).get("spillmerge") if isinstance(obj, dict) else None
    if isinstance(head, dict) and head.get("kind") == "merged":
        return head
    return None


def not_ours(dst: Storage) -> OutputExistsError:
    return OutputExistsError(
        f"{dst.describe()} exists and is not a spillmerge output; choose another --out "
        "(spillmerge never deletes a folder it did not write)",
        path=dst.describe(),
    )


# The first bytes of the root document a merge writes first (``_merge._json_doc`` of a group with
# the ``spillmerge`` header): a file holding a prefix of them is that write, torn by a crash.
_ROOT_PREFIX = b'{\n  "attributes": {\n    "spillmerge": {\n      "format_version": '


def is_ours(dst: Storage) -> bool:
    names = dst.listdir("")
    if _lease.LEASE_DIR in names or _parts.PARTS_DIR in names:
        return True
    if header(dst) is not None:
        return True
    raw = dst.get_or_none("zarr.json", max_bytes=1 << 20)
    if raw is None:
        return False
    # A merge killed while writing its first document (releases before the lease folder
    # existed): nothing but that torn document and our temporary names is there.
    torn = _ROOT_PREFIX.startswith(raw) or raw.startswith(_ROOT_PREFIX)
    return torn and all(_is_ours_name(n) for n in names)


def refuse_links(dst: Storage, overwrite: bool) -> None:
    """Writing or deleting through a linked ``files/``, ``index/`` or ``spillmerge-parts/`` would
    act on another folder: refuse it, or with ``overwrite`` remove the link (never its target)."""
    for name in ("files", "index", _parts.PARTS_DIR):
        if dst.is_link(name):
            if not overwrite:
                raise UnsafePathError(
                    f"{dst.describe(name)} is a symbolic link; spillmerge does not write or delete through links "
                    "(it would act outside the output): remove the link, or pass overwrite=True (--overwrite) to "
                    "have the link (not its target) removed",
                    path=dst.describe(name),
                )
            dst.rm_tree(name)


def claim(dst: Storage, overwrite: bool, lease: _lease.Lease) -> None:
    """A part's ``prepare``, under its lease: the output must be empty or ours; never delete
    anything but the completion marker (``overwrite``), because other parts may be writing next
    to us."""
    names = dst.listdir("")
    if names and not is_ours(dst):
        raise not_ours(dst)
    lease.check()
    refuse_links(dst, overwrite)
    if dst.exists(F.COMPLETE_NAME):
        if not overwrite:
            raise complete_error(dst, "rebuild it (every part, then finalize)")
        dst.rm_tree(F.COMPLETE_NAME)  # from here on the output is incomplete until finalized
