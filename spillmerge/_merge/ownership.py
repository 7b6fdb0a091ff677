"""The output folder: whose it is, who may write it, what overwrite may delete (only the objects
a merge writes itself, ``OURS``, never a lease, never through a symbolic link, under the lease)."""

from __future__ import annotations

from .._errors import OutputExistsError, UnsafePathError
from .._format import output as FO
from .._format.output import header, what_is
from .._storage import Storage
from . import lease as _lease
from . import parts as _parts

OURS = ("zarr.json", "columns", "index", "lists", _parts.PARTS_DIR, FO.COMPLETE_NAME)
"""Top-level names a merge writes, the only ones it ever deletes (plus its temporary names)."""
_TEMP = tuple(f"{name}.{kind}-" for name in ("zarr.json", FO.COMPLETE_NAME) for kind in ("tmp", "part"))
"""Their temporary names: durable (``put_atomic``) or not (``fsync=False``)."""


def _is_ours_name(name: str) -> bool:
    return name in OURS or name.startswith(_TEMP)


def check_claimable(output: Storage) -> None:
    """Refuse, before creating anything, an output folder that holds something spillmerge did
    not write (``OutputExistsError``), or a file (below which nothing can be read)."""
    if output.exists("") and (what_is(output) == "file" or output.listdir("") and not is_ours(output)):
        raise not_ours(output)


def remove_ours(output: Storage, lease: _lease.Lease) -> None:
    """Delete what a merge wrote into ``output``, nothing else: not the lease folder, not a file the
    user put there, never through a symbolic link (a linked ``columns/`` loses the link only)."""
    lease.check()
    for name in output.listdir(""):
        if _is_ours_name(name):
            output.rm_tree(name)


def complete_error(output: Storage, to: str) -> OutputExistsError:
    """The output holds a complete merge and no ``overwrite`` was given."""
    return OutputExistsError(
        f"{output.describe()} already holds a complete merge; pass overwrite=True (--overwrite) to {to}",
        path=output.describe(),
    )


def not_ours(output: Storage) -> OutputExistsError:
    what = {"file": "a file", "spill": "a spill root"}.get(what_is(output), "a folder")
    return OutputExistsError(
        f"{output.describe()} exists and is {what}, not a spillmerge output; choose another out= (--out) "
        "(spillmerge never deletes a folder it did not write)",
        path=output.describe(),
    )


# The first bytes of the root document a merge writes first (``_merge.documents.json_doc`` of a group with
# the ``spillmerge`` header): a file holding a prefix of them is that write, torn by a crash.
_ROOT_PREFIX = b'{\n  "attributes": {\n    "spillmerge": {\n      "format_version": '


def is_ours(output: Storage) -> bool:
    names = output.listdir("")
    if _lease.LEASE_DIR in names or _parts.PARTS_DIR in names or header(output) is not None:
        return True
    raw = output.get_or_none("zarr.json", max_bytes=1 << 20)
    if raw is None:
        return False
    # A merge killed while writing its first document (releases before the lease folder
    # existed): nothing but that torn document and our temporary names is there.
    torn = _ROOT_PREFIX.startswith(raw) or raw.startswith(_ROOT_PREFIX)
    return torn and all(_is_ours_name(n) for n in names)


def refuse_links(output: Storage, overwrite: bool) -> None:
    """Writing or deleting through a linked ``columns/``, ``index/``, ``lists/`` or
    ``spillmerge-parts/`` would act on another folder: refuse it, or with ``overwrite`` remove the
    link (never its target)."""
    for name in ("columns", "index", "lists", _parts.PARTS_DIR):
        if output.is_link(name):
            if not overwrite:
                raise UnsafePathError(
                    f"{output.describe(name)} is a symbolic link; spillmerge does not write or delete through links "
                    "(it would act outside the output): remove the link, or pass overwrite=True (--overwrite) to "
                    "have the link (not its target) removed",
                    path=output.describe(name),
                )
            output.rm_tree(name)
