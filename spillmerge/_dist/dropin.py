"""Drop-ins for ``torch.distributed.gather_object`` / ``all_gather_object``: torch's signatures
and semantics, the objects travelling through storage instead of pickled tensors.

Each call (every rank, like the torch collectives; each step's gloo all-gather, of a fixed-size
slot a rank, also ends by the call's ``timeout``, so a rank that never calls is a timeout error,
never a hang):
  (every rank)  one gloo all-gather agrees on the call's folder (rank 0's fresh id), compares
                hostnames (on several hosts the folder must be on storage every rank sees:
                ``root=`` or env ``SPILLMERGE_ROOT``, else every rank raises ConfigError) and
                whether every rank's object is records Arrow keeps exactly (``_dist.records``)
  (several hosts, or roots naming several folders) dst puts a file in the call's folder; unless
                every rank sees it (at its one look on one host, within ``SHARED_WAIT`` across
                hosts), every rank raises ConfigError (the folder is not shared)
  records on every rank: each writes file ``R.records``, its columns' buffers; an all-gather of how
                that went (a rank that failed is named on every rank, and dst removes the call's
                folder) and of each file's size and CRC-32C; the readers check each file against
                them and convert it back. No spill, no merge.
  otherwise:    each rank spills its object and its header (``_write``) and commits; an
                all-gather of how that went, as above; dst merges (``SpillWriter.merge``, the
                shards read where they lie on one host), an all-gather of how that went; the
                readers read every rank's object back into the caller's list (``_read``)
  (all_gather_object) an all-reduce of whether reading back failed; if so an all-gather names the rank
  (dst)         removes the call's folder once every reader is done: nothing stays on storage
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import socket
import uuid
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._errors import ConfigError, CoordinationError, CorruptSpillError, RankFailedError, SpillMergeError
from .._format import crc
from .._read.store import MergedStore
from .._read.store import open as open_store
from .._storage import Storage
from .._util.gcpause import gc_paused
from .._util.poll import poll
from .._write.writer import SpillWriter
from . import records
from .gather import CHUNK_BYTES, CallWriter
from .rank import on_gloo
from .shape import FIXES, STR, Shape, at
from .sharing import node_local_root, root_identity

ROOT_ENV = "SPILLMERGE_ROOT"
"""The environment variable naming where the drop-ins' data travels (``root=`` wins over it)."""

DEFAULT_TIMEOUT = 1800.0
READ_CACHE_BYTES = 2 * CHUNK_BYTES
"""Decoded chunks kept while the readers read the call's output once, in order: a chunk is
read again only while its rows last, so a larger cache would hold only what was read."""


class DropInArgumentError(SpillMergeError, ValueError):
    """An argument torch's object collectives refuse with ``ValueError`` (an output list on the
    wrong rank or of the wrong length, both ``dst`` and ``group_dst``, an unsupported group)."""


def _name(rank: int) -> str:
    return f"{rank:08d}"  # zero-padded: files sort in rank order


def _ranks(group: Any, dst: int | None, group_dst: int | None) -> tuple[int, int, int]:
    """(this rank, world size, destination) in the default group; ``group`` must be it."""
    if not dist.is_initialized():
        raise DropInArgumentError("the default process group is not initialized (call init_process_group first)")
    if (
        group is not None
        and group is not dist.group.WORLD
        and dist.get_process_group_ranks(group) != list(range(dist.get_world_size()))
    ):
        raise DropInArgumentError(
            "group= other than the default process group (all ranks) is not supported yet; pass group=None"
        )
    if dst is not None and group_dst is not None:
        raise DropInArgumentError("Can't specify both group_rank and global_rank (dst= and group_dst=)")
    target = group_dst if group_dst is not None else (0 if dst is None else dst)
    world = dist.get_world_size()
    if not isinstance(target, int) or not 0 <= target < world:
        raise DropInArgumentError(f"destination rank {target!r} is not in [0, world_size={world})")
    return dist.get_rank(), world, target


SLOT = 1024
"""Bytes a rank's message takes in the call's fixed-size all-gathers: what the ranks tell each
other (host, ids, sizes, CRCs; whether a step failed) fits, so one collective does what
``all_gather_object`` does in two (sizes, then bytes)."""
_LONG = 0xFF  # a slot's first byte when its message did not fit (JSON text is ASCII)


def _exchange(rank: int, mine: Any, timeout: float, what: str) -> list[Any]:
    """Every rank's ``mine`` (JSON: tuples come back as lists), in rank order: one gloo
    all-gather of ``SLOT`` bytes a rank, bounded by ``timeout``; when some rank's message is
    longer (a long error or root), a second round sends every message whole."""
    data = json.dumps(mine).encode()
    slot = np.zeros(SLOT, dtype=np.uint8)
    if len(data) <= SLOT:
        slot[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    else:
        slot[0] = _LONG
    got = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(dist.get_world_size())]
    on_gloo(rank, timeout, what, dist.all_gather, got, torch.from_numpy(slot))
    raw = [g.numpy().tobytes() for g in got]
    if any(r[0] == _LONG for r in raw):
        whole: list[Any] = [None] * len(raw)
        on_gloo(rank, timeout, what, dist.all_gather_object, whole, data)
        raw = whole
    return [json.loads(r.rstrip(b"\0")) for r in raw]


def _alike(rank: int, values: list[Any], name: str, error: type[SpillMergeError], **fields: Any) -> None:
    """Raise ``error`` naming the ranks whose ``name`` is not the most common one (every rank
    raises alike: ``values`` came from one all-gather)."""
    common = collections.Counter(values).most_common(1)[0][0]
    odd = [r for r, v in enumerate(values) if v != common]
    if odd:
        who = "; ".join(f"rank {r}: {name}={values[r]!r}" for r in odd[:8]) + (" ..." if len(odd) > 8 else "")
        raise error(f"rank {rank}: every rank must pass the same {name}, but {who} (the others {common!r})", **fields)


def _agree(
    rank: int, dst: int, root: str | os.PathLike[str] | None, timeout: float, records: bool
) -> tuple[str, bool, bool, bool]:
    """The call's folder, rank 0's fresh id under the root; whether every rank runs on this host
    (the default root is node-local); whether every rank's object is ``records``; whether the
    ranks must check on storage that they see one folder (several hosts, or ranks on one host
    whose root names different folders: ``_dist.sharing``): from one all-gather, which also
    checks that every rank passed the same ``dst`` and root."""
    where = os.fspath(root) if root is not None else os.environ.get(ROOT_ENV) or None
    mine = (socket.gethostname(), uuid.uuid4().hex, records, dst, where, root_identity(where or node_local_root()))
    got = _exchange(rank, mine, timeout, "entered the call")
    _alike(rank, [g[3] for g in got], "dst", DropInArgumentError)
    _alike(rank, [g[4] for g in got], "root", ConfigError, key=ROOT_ENV)
    hosts = sorted({g[0] for g in got})
    if where is None and len(hosts) > 1:
        raise ConfigError(
            f"the ranks run on {len(hosts)} hosts ({', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''}) and "
            f"the default root ({node_local_root()}) is node-local: set {ROOT_ENV} (or pass root=) to a folder "
            "every rank sees",
            key=ROOT_ENV,
        )
    check = len(hosts) > 1 or len({tuple(g[5]) for g in got}) > 1
    return f"{(where or node_local_root()).rstrip('/')}/spillmerge-{got[0][1]}", len(hosts) == 1, all(g[2] for g in got), check


SHARED_WAIT = 5.0  # seconds a rank on another host looks for the file dst put in the call's folder
_PROBE = "shared"


def _check_shared(
    rank: int, dst: int, call: str, storage_options: dict[str, Any] | None, timeout: float, one_host: bool
) -> None:  # fmt: skip
    """Every rank raises ConfigError unless every rank sees the file dst puts in the call's folder
    (several hosts, or one host whose ranks' root may name different folders): a folder each
    host or rank has to itself would keep the others' data, and the merge would wait its whole
    timeout for their commit records. On one host (one kernel's view of its folders) and for
    ``memory://`` (each process's own) a look after dst's put is the answer: every rank looks
    once, after an all-gather that follows the put. Across hosts, shared storage may show a new
    file late (a client's cached folder): a rank looks for up to ``SHARED_WAIT`` seconds."""
    error, seen = None, False
    at_once = one_host or call.startswith("memory://")
    with contextlib.ExitStack() as stack:
        try:
            storage = stack.enter_context(contextlib.closing(Storage(call, storage_options)))
            if rank == dst:
                storage.makedirs("")
                storage.put(_PROBE, [b""])
        except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised here
            error = exc
        if at_once:  # every rank is past dst's put before any looks
            _settle(rank, dst, call, storage_options, error, timeout, "making the call's folder")
        if error is None:
            try:
                wait = 0.0 if at_once else min(timeout, SHARED_WAIT)
                seen = any(storage.exists(_PROBE) for _ in poll(wait, first=0.01, cap=0.5))
            except Exception as exc:  # noqa: BLE001 - told to every rank just below, then raised here
                error = exc
    got = _settle(rank, dst, call, storage_options, error, timeout, "looking for the call's folder", seen)
    if blind := [r for r, s in enumerate(got) if not s]:
        if rank == dst:
            with contextlib.suppress(Exception):  # the error below is what the caller sees
                _remove(call, storage_options)
        raise ConfigError(
            f"rank {rank}: rank(s) {blind} do not see the folder {call} rank {dst} made for this call: {ROOT_ENV} "
            "(or root=) must name storage every rank sees (on several hosts: shared storage; a relative path is "
            "each rank's working directory's, memory:// each process's own)",
            key=ROOT_ENV,
        )


def _settle(
    rank: int, dst: int, call: str, storage_options: dict[str, Any] | None, error: BaseException | None,
    timeout: float, what: str, info: Any = None,
) -> list[Any]:  # fmt: skip
    """After a step of the call, every rank learns whether any rank's step failed, and every
    rank's ``info``, which it returns. On a failure dst removes the call's folder (every rank is
    past the step: nobody writes there any more) and every rank raises: its own error, else a
    :class:`RankFailedError` naming the ranks."""
    mine = None if error is None else f"{type(error).__name__}: {str(error)[:2000]}"
    try:
        got = _exchange(rank, (mine, info), timeout, f"finished {what}")
    except CoordinationError:  # the call is over for every rank: none may be left to remove it
        with contextlib.suppress(Exception):
            _remove(call, storage_options)
        raise
    failures = {r: m for r, (m, _) in enumerate(got) if m is not None}
    if not failures:
        return [i for _, i in got]
    if rank == dst:
        with contextlib.suppress(Exception):  # the call's own error is what the caller sees
            _remove(call, storage_options)
    if error is not None:
        raise error
    names = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
    raise RankFailedError(f"rank {rank}: rank(s) {sorted(failures)} failed {what} ({names})", failures=failures)


def _check_list(rank: int, dst: int, world: int, object_list: Any, every_rank: bool) -> None:
    """torch's checks of the output list (``_validate_output_list_for_rank``), and its length."""
    wanted = every_rank or rank == dst
    if not wanted:
        if object_list:
            raise DropInArgumentError(
                "Argument ``object_gather_list`` must NOT be specified on non-destination ranks "
                f"(destination is rank {dst})"
            )
        return
    name = "object_list" if every_rank else "object_gather_list"
    if not every_rank and not object_list:
        raise DropInArgumentError(f"Argument ``{name}`` must be specified on destination rank")
    if not isinstance(object_list, list) or len(object_list) != world:
        got = len(object_list) if isinstance(object_list, list) else type(object_list).__name__
        raise DropInArgumentError(f"``{name}`` must be a list of world_size={world} items, got {got}")


def _remove(call: str, storage_options: dict[str, Any] | None) -> None:
    with contextlib.closing(Storage(call, storage_options)) as storage:
        storage.rm_tree()


def _header_name(rank: int) -> str:
    return f"{_name(rank)}.h"  # after the rank's element files ('.' sorts after '-')


def _split(obj: Any) -> bool:
    """Whether ``obj`` is stored one file per element: a dict of str keys that holds a dict (else
    a column per key), a list or tuple that holds a dict. A list of scalars or of lists is one
    leaf already, its items stored as one array. (Records Arrow keeps exactly went as such.)"""
    kind = type(obj)
    if kind is dict:
        return STR.issuperset(map(type, obj)) and any(type(v) is dict for v in obj.values())
    return (kind is list or kind is tuple) and any(type(v) is dict for v in obj)


def _write(w: SpillWriter, rank: int, obj: Any, pieces: list[Any] | None, allow_pickle: bool) -> None:
    """The rank's object: records (``pieces``, from ``records.encode``, where another rank's
    object is not) as file ``R``, those bytes; lists, tuples and str-keyed dicts that hold dicts
    one file per element (``R-i``, i the position, zero-padded); any other object as file ``R``.
    File ``R.h``, a JSON header (the kind, a dict's keys in order, the paths of numpy arrays and
    pickled objects), unless the object is file ``R`` with nothing to restore."""
    name = _name(rank)
    if pieces is not None:  # records, where another rank's object is not: one file of their bytes
        w.write(name, 0, np.frombuffer(b"".join(pieces), dtype=np.uint8))
        w.write(_header_name(rank), 0, json.dumps({"kind": "records", "shape": None}))
        return
    shape = Shape(obj, allow_pickle)
    obj = shape.obj
    header: dict[str, Any] = {"shape": shape.paths()}
    if _split(obj):
        kind = type(obj)
        header["kind"], header["n"] = kind.__name__, len(obj)
        if kind is dict:
            header["keys"] = list(obj)
        for i, v in enumerate(obj.values() if kind is dict else obj):
            w.write(f"{name}-{i:010d}", 0, v)
    else:
        header["kind"] = "object"
        w.write(name, 0, obj)
        if header["shape"] is None:
            return  # no header file: the object is file R's only value (a small call's one file)
    w.write(_header_name(rank), 0, json.dumps(header))


def _read(store: MergedStore, world: int, object_list: list[Any]) -> None:
    """Every rank's object, from one pass over the output's rows in filename order (a rank's
    files sort together, its elements in order): tensors as torch tensors on the CPU, the paths
    its header names turned back (numpy arrays, pickled objects)."""
    items: list[list[Any]] = [[] for _ in range(world)]
    headers: list[Any] = [None] * world
    for name, _, value in store.iter_values(as_torch=True):
        r = int(name[:8])
        if name.endswith(".h"):
            headers[r] = json.loads(value)
        else:
            items[r].append(value)
    for r in range(world):
        object_list[r] = _rebuild(r, headers[r] or {"kind": "object", "shape": None}, items[r])


def _rebuild(r: int, header: dict[str, Any], got: list[Any]) -> Any:
    """Rank ``r``'s object from its header and its files' values."""
    kind = header["kind"]
    if kind in ("object", "records") and len(got) != 1:
        raise CorruptSpillError(f"rank {r}'s {kind} came back as {len(got)} files")
    if kind == "records":
        value = records.decode(got[0], r)
    elif kind == "object":
        value = got[0]
    else:
        if len(got) != header["n"]:
            raise CorruptSpillError(f"rank {r}'s {kind} of {header['n']} items came back with {len(got)}")
        value = dict(zip(header["keys"], got, strict=True)) if kind == "dict" else got
        value = tuple(value) if kind == "tuple" else value
    if header["shape"] is not None:  # what ``Shape.paths`` says storage did not keep
        for key, fix in FIXES.items():  # in this order: a pickled whole may hold numpy arrays
            for path in header["shape"][key]:
                value = at(value, path, fix)
    return value


def _records_file(rank: int) -> str:
    return f"{_name(rank)}.records"


def _put_records(call: str, rank: int, pieces: list[Any], storage_options: dict[str, Any] | None) -> tuple[int, int]:
    """Write the rank's records (``records.encode``'s pieces) as file ``R.records`` in the call's
    folder; its size and CRC-32C."""
    with contextlib.closing(Storage(call, storage_options)) as storage:
        storage.makedirs("")
        storage.put(_records_file(rank), pieces)
    return sum(map(len, pieces)), functools.reduce(crc.extend, pieces, 0)


def _get_records(
    call: str, sizes: list[tuple[int, int]], storage_options: dict[str, Any] | None, out: list[Any], mine: int
) -> None:
    """Every rank's records but rank ``mine``'s into ``out``, each file checked against the size
    and CRC-32C its rank reported."""
    with contextlib.closing(Storage(call, storage_options)) as storage:
        for r, size in enumerate(sizes):
            if r == mine:
                continue
            nbytes, want = size
            data = storage.get_or_none(_records_file(r), max_bytes=nbytes)
            if data is None or len(data) != nbytes or crc.value(data) != want:
                where = storage.describe(_records_file(r))
                got = "missing" if data is None else f"{len(data)} bytes of CRC-32C {crc.value(data):08x}"
                raise CorruptSpillError(
                    f"rank {r}'s records at {where} are not what it wrote ({nbytes} bytes of CRC-32C {want:08x}): {got}",
                    path=where,
                )
            out[r] = records.decode(data, r)
            del data


def _collective(
    obj: Any,
    object_list: Any,
    dst: int | None,
    group: Any,
    group_dst: int | None,
    *,
    every_rank: bool,
    root: str | os.PathLike[str] | None,
    allow_pickle: bool,
    timeout: float,
    storage_options: dict[str, Any] | None,
) -> None:
    rank, world, target = _ranks(group, dst, group_dst)
    reads = every_rank or rank == target  # this rank fills an output list
    try:
        pieces = gc_paused(records.encode, obj)
    except Exception:  # noqa: BLE001 - not records after all: the general way names what is wrong
        pieces = None
    # Records on every rank go as one file a rank, read back as they are: no spill, no merge.
    call, one_host, direct, check = _agree(rank, target, root, timeout, pieces is not None)
    if check:
        _check_shared(rank, target, call, storage_options, timeout, one_host)
    spill, out = f"{call}/spill", f"{call}/out.zarr"
    error: BaseException | None = None
    info = None
    try:
        _check_list(rank, target, world, object_list, every_rank)
        if direct and (every_rank or rank != target):  # dst's own file would be read by nobody
            info = _put_records(call, rank, pieces, storage_options)
        if direct and reads:  # a copy, as the other ranks' objects are, made while they still write
            object_list[rank] = gc_paused(records.copy, obj)
        if not direct:
            # fsync=False here and in the merge: the call's folder is removed when the call
            # returns, so nothing in it has to outlive a crash (a syncfs per call was most of a
            # small call).
            with CallWriter(
                spill, rank, world, storage_options, allow_pickle=allow_pickle, run_id=call[-32:], fsync=False
            ) as w:
                gc_paused(_write, w, rank, obj, pieces, allow_pickle)  # builds only acyclic lists and buffers
    except SpillMergeError as exc:  # name the rank, as the other ranks' errors do
        error = exc.prefixed(f"rank {rank}")
    except Exception as exc:  # told to every rank just below, then raised here
        error = exc
    # Every rank has committed (or failed) once this returns: dst's merge finds every commit
    # record at its first look, with no polling of storage.
    sizes = _settle(rank, target, call, storage_options, error, timeout, "writing its object", info)
    if not direct:
        try:
            # On one host every shard lies where dst reads it: no transfer to coordinate. The
            # spill stays until the call's folder goes as a whole.
            w.merge(
                out, target, wait=False, timeout=timeout, overwrite=True, storage_options=storage_options,
                remove_spill=False, progress=False, fsync=False, transport="storage" if one_host else "auto",
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - told to every rank just below, then raised here
            error = exc
        _settle(rank, target, call, storage_options, error, timeout, "the merge")
    try:
        if reads and direct:
            gc_paused(_get_records, call, sizes, storage_options, object_list, rank)  # builds only acyclic objects
        elif reads:
            store = open_store(
                out, storage_options=storage_options, allow_pickle=allow_pickle, cache_bytes=READ_CACHE_BYTES
            )
            gc_paused(_read, store, world, object_list)  # builds only acyclic lists and dicts
    except SpillMergeError as exc:
        error = exc.prefixed(f"rank {rank}")
    except Exception as exc:  # noqa: BLE001 - told to every reading rank just below, then raised here
        error = exc
    try:
        if every_rank:  # every rank has read the output before dst removes it, and knows who failed
            failed = torch.tensor([error is not None], dtype=torch.int32)
            on_gloo(rank, timeout, "finished reading back", dist.all_reduce, failed)
            if failed.item():  # one round of one int when all went well; a second names who failed
                _settle(rank, target, call, storage_options, error, timeout, "reading back")
    finally:
        if rank == target:  # every rank is done with the call's folder
            _remove(call, storage_options)
    if error is not None:  # gather_object: only dst reads, as in torch
        raise error


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
    *,
    root: str | os.PathLike[str] | None = None,
    allow_pickle: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """``torch.distributed.gather_object`` through storage: on rank ``dst`` (default 0),
    ``object_gather_list`` (``world_size`` items; ``None`` on the other ranks) is filled in rank
    order with what each rank passed: dicts (str keys, their order kept), lists, tuples, Python
    scalars, str, bytes, numpy arrays as numpy arrays and tensors as torch tensors on the CPU.
    Other objects are pickled only with ``allow_pickle=True``, and so are dicts with other keys,
    subclasses (enums, Parameter ...), dataclasses, sparse and quantized tensors (without it, a
    subclass comes back as its base type, a dataclass as a dict, a sparse tensor is refused).

    The data travels through ``root`` (else env ``SPILLMERGE_ROOT``, else ``/dev/shm`` or the temp
    dir when every rank runs on one host; on several hosts one of the two must name storage every
    rank sees, else every rank raises :class:`~spillmerge.ConfigError`); nothing is left there
    when the call returns. A rank that raises inside the call makes every rank raise a
    :class:`~spillmerge.SpillMergeError` naming it; a rank that never calls, one after
    ``timeout`` seconds. Only the default process group is supported (``group=None``)."""
    _collective(
        obj, object_gather_list, dst, group, group_dst, every_rank=False, root=root, allow_pickle=allow_pickle,
        timeout=timeout, storage_options=storage_options,
    )  # fmt: skip


def all_gather_object(
    object_list: list[Any],
    obj: Any,
    group: Any = None,
    *,
    root: str | os.PathLike[str] | None = None,
    allow_pickle: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """``torch.distributed.all_gather_object`` through storage: every rank's ``object_list``
    (``world_size`` items) is filled in rank order with what each rank passed, as
    :func:`gather_object` fills the destination's."""
    _collective(
        obj, object_list, None, group, None, every_rank=True, root=root, allow_pickle=allow_pickle,
        timeout=timeout, storage_options=storage_options,
    )  # fmt: skip


__all__ = ["ROOT_ENV", "DropInArgumentError", "all_gather_object", "gather_object"]
