"""Rank bodies for tests/distributed/test_dropin.py: ``spillmerge.gather_object`` / ``all_gather_object``
against ``torch.distributed.gather_object`` / ``all_gather_object`` on the same inputs, in the
same 3-rank gloo group; every scenario runs in the same processes."""

from __future__ import annotations

import collections
import dataclasses
import enum
import glob
import os
import time
from typing import Any

import fsspec
import numpy as np
import torch
from _helpers import value_diffs
from _mp_scenarios import run_scenarios
from _object_list import create_collectives_object_test_list

WORLD = 3
TIMEOUT = 60.0


def payload(rank: int, seed: int = 0) -> Any:
    """What people gather: COCO-like per-instance dicts (keys not in sorted order), tensors,
    numpy arrays, Python scalars, tuples, nested dicts."""
    g = torch.Generator().manual_seed(rank * 100 + seed)
    return {
        "rank": rank,
        "seed": seed,
        "instances": [
            {"image_id": rank * 10 + i, "category_id": i % 3, "bbox": [1.5 * i, 2.0, 3.0, 4.25], "score": 0.5 + i / 10}
            for i in range(4)
        ],
        "logits": torch.randn(3, 5, generator=g),
        "mask": torch.rand(4, generator=g) > 0.5,
        "half": torch.randn(2, generator=g).to(torch.bfloat16),
        "half0": torch.tensor(rank + 0.5, dtype=torch.bfloat16),  # a 0-d tensor of a dtype numpy lacks
        "np_scalar": np.float32(rank + 0.25),
        "emb": np.arange(6, dtype=np.float32).reshape(2, 3) + rank,
        "pair": (7, 0.93),
        "meta": {"zeta": "z", "alpha": [1, 2, 3], "mid": None, "ids": np.array([rank, 2], dtype=np.int64)},
        "text": f"rank {rank} says hi",
    }


def _compare(rank: int, world: int, objs: list[Any], allow_pickle: bool, dst: int = 1) -> list[str]:
    import torch.distributed as dist

    import spillmerge

    obj = objs[rank]
    diffs: list[str] = []
    got: list[Any] = [None] * world
    want: list[Any] = [None] * world
    spillmerge.all_gather_object(got, obj, allow_pickle=allow_pickle, timeout=TIMEOUT)
    dist.all_gather_object(want, obj)
    diffs += value_diffs(got, want, "all_gather_object", strict=True)
    g_got = [None] * world if rank == dst else None
    g_want = [None] * world if rank == dst else None
    spillmerge.gather_object(obj, g_got, dst=dst, allow_pickle=allow_pickle, timeout=TIMEOUT)
    dist.gather_object(obj, g_want, dst=dst)
    diffs += value_diffs(g_got, g_want, "gather_object", strict=True)
    return diffs


def same_as_torch(rank: int, world: int, base: str) -> dict[str, Any]:
    objs = [payload(r) for r in range(world)]
    objs[2] = [objs[2]["instances"], torch.arange(5), np.float64(1.0).item(), "x", None]  # kinds differ per rank
    # more than one 4 MiB chunk of the call's writer: its flush thread starts while it writes
    objs[1]["big"] = np.arange(1_200_000, dtype=np.float32)
    return {"diffs": _compare(rank, world, objs, allow_pickle=False)}


def containers_of_dicts(rank: int, world: int, base: str) -> dict[str, Any]:
    """Lists, tuples and dicts of dicts (stored one file per element): an element lacks keys
    another has and comes back without them, key order and element order kept, numpy and
    tensors inside elements, elements that are no dict, and empty containers."""
    g = torch.Generator().manual_seed(rank)
    objs = [
        [
            {"image_id": 3, "instances": [{"score": 0.5, "bbox": [1.0, 2.0, 3.0, 4.0]}]},
            {"zeta": None, "alpha": np.arange(3, dtype=np.int16), "t": torch.randn(2, generator=g)},
            {},
            None,
            "text",
            {"image_id": 4, "instances": []},
            ({"in": "tuple"}, np.float32(2.5)),
        ],
        {f"prompt-{p}": {"text": "é" * p, "token_ids": list(range(p)), "logprob": -p / 3} for p in (10, 2, 33, 1)},
        ({"a": 1}, {"b": [1, 2]}, {"a": {"nested": {"z": 1, "y": 2}}}),
    ]
    diffs = _compare(rank, world, objs[:world], allow_pickle=False)
    diffs += _compare(rank, world, [[], {}, ()][:world], allow_pickle=False, dst=0)
    diffs += _compare(rank, world, [{"one": {}}, [{}], ({"k": None},)][:world], allow_pickle=False, dst=2)
    return {"diffs": diffs}


def records(rank: int, world: int, base: str) -> dict[str, Any]:
    """Records (sent as one Arrow stream where the round trip is exact): an LLM eval's dict of
    dicts, COCO's images holding instances, None, bools, bytes and empty containers at any depth;
    next to records that must go the general way (an int and a float under one key, keys that
    differ, a numpy array or a tuple inside), each rank's of another kind."""
    exact = {
        f"prompt-{p}": {"text": "é数" * p, "token_ids": list(range(p)), "logprob": -p / 3, "finish": None if p else "stop"}
        for p in (3, 0, 7)
    }
    coco = [
        {"image_id": 9, "instances": [{"image_id": 9, "category_id": 2, "bbox": [1.5, 2.0, 3.0, 4.25], "score": 0.5}]},
        {"image_id": 10, "instances": []},
        {"image_id": 11, "instances": None},
    ]
    odd = [
        {"flag": True, "blob": b"\x00\xff", "nested": {"z": [[1], [], None], "a": {}}, "none": None},
        {"flag": False, "blob": None, "nested": None, "none": None},
    ]
    general = [
        [{"v": 1}, {"v": 2.5}],  # an int and a float under one key: the int stays an int
        [{"a": 1}, {"b": 2}],  # keys that differ
        ({"emb": np.arange(3, dtype=np.int16)},),  # a numpy array inside
        [{"t": (1, 2)}],  # a tuple inside
    ]
    diffs = _compare(rank, world, [exact, coco, odd][:world], allow_pickle=False)
    diffs += _compare(rank, world, [general[0], general[1] + general[3], general[2]][:world], allow_pickle=False)
    diffs += _compare(rank, world, [tuple(coco), general[0], exact][:world], allow_pickle=False, dst=0)
    return {"diffs": diffs}


def odd_types(rank: int, world: int, base: str) -> dict[str, Any]:
    """numpy arrays and scalars of dtypes numpy lacks (ml_dtypes bfloat16, float8), 0-d too;
    types stored as another: bytearray, numpy's str and bytes scalars; a tensor that requires grad."""
    import ml_dtypes

    objs = [
        {
            "bf16": np.array([1.5, -0.0], dtype=ml_dtypes.bfloat16),
            "f8": np.array(1.0, dtype=ml_dtypes.float8_e4m3fn),
            "w": torch.ones(2, requires_grad=True),
        },
        [ml_dtypes.bfloat16(2.5), np.array([[1.0]], dtype=ml_dtypes.float8_e5m2)[:, ::-1], bytearray(b"ab")],
        (np.zeros((0, 2), dtype=ml_dtypes.bfloat16), ml_dtypes.float8_e4m3fn(0.5), {"s": np.str_("é"), "b": np.bytes_(b"x")}),
    ]
    return {"diffs": _compare(rank, world, objs[:world], allow_pickle=False)}


Point = collections.namedtuple("Point", "x y")


class Level(enum.IntEnum):
    HIGH = 2


class Colour(enum.StrEnum):
    RED = "red"


@dataclasses.dataclass
class Box:
    label: str
    score: float


def pickled_types(rank: int, world: int, base: str) -> dict[str, Any]:
    """With ``allow_pickle``, what would not come back as its own type is pickled whole: dicts
    with int keys, an OrderedDict, a namedtuple, a dataclass (at the root and inside a list),
    enums, a Parameter, a sparse tensor."""
    objs = [
        {rank: "int key", "s": {0: np.arange(2)}},
        collections.OrderedDict(b=rank, a=[Point(rank, 2)]),
        [Box("cat", 0.5 + rank), Point(1, rank), {"k": collections.OrderedDict(z=1)}, np.datetime64("2020-01-01")],
    ]
    objs[rank] = [  # subclasses of scalars and tensors, and tensors stored only pickled
        objs[rank], Level.HIGH, Colour.RED, torch.nn.Parameter(torch.ones(2)), torch.eye(2).to_sparse(),
    ]  # fmt: skip
    return {"diffs": _compare(rank, world, objs[:world], allow_pickle=True, dst=2)}


def torch_object_list(rank: int, world: int, base: str) -> dict[str, Any]:
    items = create_collectives_object_test_list()
    return {"diffs": _compare(rank, world, [items[r % len(items)] for r in range(world)], allow_pickle=True, dst=0)}


def _leftovers(root: str) -> list[str]:
    return sorted(glob.glob(f"{root}/spillmerge-*"))


def back_to_back(rank: int, world: int, base: str) -> dict[str, Any]:
    """Two calls with no barrier between: each sees only its own objects; nothing left in the
    default root (``/dev/shm`` here) or in ``SPILLMERGE_ROOT``."""
    import torch.distributed as dist

    import spillmerge
    from spillmerge._dist.dropin import node_local_root

    before = _leftovers(node_local_root())
    dist.barrier()
    first: list[Any] = [None] * world
    second: list[Any] = [None] * world
    spillmerge.all_gather_object(first, ("first", rank), timeout=TIMEOUT)
    spillmerge.all_gather_object(second, {"second": rank}, timeout=TIMEOUT)
    third = [None] * world if rank == 0 else None
    spillmerge.gather_object(["third", rank], third, timeout=TIMEOUT)
    # records on every rank: one Arrow file a rank, no spill and no merge
    fourth: list[Any] = ["stale"] * world  # whatever the list holds is replaced, as torch does
    spillmerge.all_gather_object(fourth, [{"fourth": rank, "ids": [rank] * rank}], timeout=TIMEOUT)
    fifth = [None] * world if rank == 2 else None
    spillmerge.gather_object({"k": {"fifth": rank}}, fifth, dst=2, timeout=TIMEOUT)
    dist.barrier()
    # Other tests' calls may run beside this one (pytest workers) and share the default root:
    # their folders come and go; one of ours would stay.
    deadline = time.monotonic() + 20
    while set(after := _leftovers(node_local_root())) - set(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    env_root = f"{base}/envroot"
    os.makedirs(env_root, exist_ok=True)
    os.environ["SPILLMERGE_ROOT"] = env_root
    try:
        via_env: list[Any] = [None] * world
        spillmerge.all_gather_object(via_env, rank * 2, timeout=TIMEOUT)
    finally:
        del os.environ["SPILLMERGE_ROOT"]
    long_root = f"{base}/" + "/".join(["r" * 230] * 5)  # longer than a message's slot: sent whole
    long: list[Any] = [None] * world
    spillmerge.all_gather_object(long, [{"long": rank}], root=long_root, timeout=TIMEOUT)
    dist.barrier()
    return {
        "first": first, "second": second, "third": third, "fourth": fourth, "fifth": fifth, "via_env": via_env,
        "new_in_default_root": sorted(set(after) - set(before)), "left_in_env_root": os.listdir(env_root),
        "long": long, "left_in_long_root": os.listdir(long_root),
    }  # fmt: skip


def failures(rank: int, world: int, base: str) -> dict[str, Any]:
    """A rank that raises inside the drop-in: every rank raises a SpillMergeError naming it."""
    import spillmerge
    from spillmerge._dist import dropin as _dropin

    out: dict[str, Any] = {}
    os.environ["SPILLMERGE_ROOT"] = f"{base}/failures"  # what a failed call leaves stays in the test's folder

    def attempt(name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn()
            out[name] = None
        except spillmerge.SpillMergeError as exc:
            out[name] = {"type": type(exc).__name__, "msg": str(exc), "value_error": isinstance(exc, ValueError),
                         "waited": time.perf_counter() - t0}  # fmt: skip

    lst: list[Any] = [None] * world
    attempt(
        "unpicklable", lambda: spillmerge.all_gather_object(lst, (lambda: 1) if rank == 1 else rank, timeout=TIMEOUT)
    )
    # an error longer than a message's slot in the call's all-gathers: sent whole, still named
    long_key = {"k" * 1500: object()} if rank == 1 else rank
    attempt("long_error", lambda: spillmerge.all_gather_object(lst, long_key, timeout=TIMEOUT))
    short = [None] * (world - 1) if rank == 0 else None
    attempt("short_list", lambda: spillmerge.gather_object(rank, short, dst=0, timeout=TIMEOUT))
    records_of = [{"rank": rank}]  # every rank's object records: the failure comes in the records' way
    attempt("short_list_records", lambda: spillmerge.gather_object(records_of, short, dst=0, timeout=TIMEOUT))
    extra = [None] * world
    attempt("list_off_dst", lambda: spillmerge.gather_object(rank, extra, dst=0, timeout=TIMEOUT))
    attempt("dst_and_group_dst", lambda: spillmerge.gather_object(rank, None, dst=0, group_dst=0, timeout=TIMEOUT))
    import torch.distributed as dist

    sub = dist.new_group([0, 1], backend="gloo")  # every rank creates it, as torch requires
    attempt("subgroup", lambda: spillmerge.gather_object(rank, None, dst=0, group=sub, timeout=TIMEOUT))
    dist.barrier()  # dst removes a failed call's folder once every rank raised: look after that
    out["left_after_failures"] = os.listdir(f"{base}/failures") if os.path.isdir(f"{base}/failures") else []
    del os.environ["SPILLMERGE_ROOT"]  # the default root: node-local
    real = _dropin.socket.gethostname
    if rank == 2:  # this rank runs on "another node"
        _dropin.socket.gethostname = lambda: "another-node"  # type: ignore[attr-defined]
    try:
        attempt("two_hosts", lambda: spillmerge.all_gather_object([None] * world, rank, timeout=TIMEOUT))
        # a root each process sees alone (as a node-local folder on each host): refused, not a
        # gather that leaves the other hosts' shards behind
        kw: dict[str, Any] = {"root": "memory://unshared", "timeout": TIMEOUT}
        attempt("unshared_all", lambda: spillmerge.all_gather_object([None] * world, {"t": torch.ones(1)}, **kw))
        attempt("unshared_records", lambda: spillmerge.all_gather_object([None] * world, [{"r": rank}], **kw))
        attempt("unshared_gather", lambda: spillmerge.gather_object(rank, [None] * world if rank == 0 else None, **kw))
        shared = [None] * world  # a folder every rank sees: the call works across hosts
        attempt("shared", lambda: spillmerge.all_gather_object(shared, {"t": rank}, root=f"{base}/shared", timeout=TIMEOUT))
        out["shared_value"] = shared
    finally:
        _dropin.socket.gethostname = real  # type: ignore[attr-defined]
    memory = fsspec.filesystem("memory")
    out["left_unshared"] = memory.ls("/unshared") if memory.exists("/unshared") else []
    after: list[Any] = [None] * world  # the group still works after every failure
    spillmerge.all_gather_object(after, rank, timeout=TIMEOUT)
    out["after"] = after
    return out


LATE_TIMEOUT = 4.0


def after_a_timeout(rank: int, world: int, base: str) -> dict[str, Any]:
    """A call the last rank joins only after the others timed out, then a call of the same
    timeout on every rank: it works (the group the first call broke is not used again)."""
    import spillmerge

    def wait_for(*names: str) -> None:
        while not all(os.path.exists(f"{base}/{n}") for n in names):
            time.sleep(0.05)

    out: dict[str, Any] = {}
    warm: list[Any] = [None] * world  # the group of this timeout exists and works
    spillmerge.all_gather_object(warm, rank, timeout=LATE_TIMEOUT)
    if rank == world - 1:
        wait_for(*(f"late-timed-out-{r}" for r in range(world - 1)))
    try:
        spillmerge.all_gather_object([None] * world, rank, timeout=LATE_TIMEOUT)
        out["late"] = None
    except spillmerge.SpillMergeError as exc:
        out["late"] = {"type": type(exc).__name__, "msg": str(exc)}
    open(f"{base}/late-timed-out-{rank}", "w").close()
    wait_for(*(f"late-timed-out-{r}" for r in range(world)))
    again: list[Any] = [None] * world
    try:
        spillmerge.all_gather_object(again, rank, timeout=LATE_TIMEOUT)
        out["again"] = again
    except spillmerge.SpillMergeError as exc:
        out["again"] = {"type": type(exc).__name__, "msg": str(exc)}
    return out


SLOW_TIMEOUT = 4.0


def slow_rank(rank: int, world: int, base: str) -> dict[str, Any]:
    """The last rank still writes when the others' timeout ends: every rank raises, and the
    call's folder does not stay (nobody is left to remove it once the call is over). The last
    rank writes on until every other rank has raised (each leaves a file saying so), no longer."""
    import torch.distributed as dist

    import spillmerge
    from spillmerge._dist import dropin as _dropin

    real = _dropin._write

    def slow(*args: Any) -> None:
        real(*args)
        deadline = time.monotonic() + 10 * SLOW_TIMEOUT  # a rank that never raises fails the test
        while rank == world - 1 and time.monotonic() < deadline:
            if all(os.path.exists(f"{base}/slow-raised-{r}") for r in range(world - 1)):
                break
            time.sleep(0.05)

    _dropin._write = slow  # type: ignore[assignment]
    try:
        spillmerge.all_gather_object([None] * world, {"t": torch.ones(3)}, root=f"{base}/slow", timeout=SLOW_TIMEOUT)
        error = None
    except spillmerge.SpillMergeError as exc:
        error = type(exc).__name__
    finally:
        _dropin._write = real  # type: ignore[assignment]
        open(f"{base}/slow-raised-{rank}", "w").close()
    dist.barrier()
    return {"error": error, "left": os.listdir(f"{base}/slow")}


NEVER_TIMEOUT = 3.0


def never_called(rank: int, world: int, base: str) -> dict[str, Any]:
    """The last rank never calls: the others raise a CoordinationError naming the wait within
    the call's timeout (a timeout no earlier call used), never a hang. Last: the group is not
    used for a drop-in after it."""
    import spillmerge

    if rank == world - 1:
        return {}
    t0 = time.perf_counter()
    try:
        spillmerge.all_gather_object([None] * world, rank, timeout=NEVER_TIMEOUT)
        return {"error": None}
    except spillmerge.SpillMergeError as exc:
        return {"error": {"type": type(exc).__name__, "msg": str(exc)}, "waited": time.perf_counter() - t0}


UNSHARED = {"memory": "memory://alone", "relative": "calls"}


def unshared_on_one_host(rank: int, world: int, base: str) -> dict[str, Any]:
    """Ranks on one host whose root names a folder of each rank's own (``memory://``, a relative
    path from different working directories): every rank raises ConfigError in seconds, not
    after the merge waited its whole timeout for the others' commit records; nothing stays."""
    import spillmerge

    out: dict[str, Any] = {}
    here, mine = os.getcwd(), f"{base}/cwd{rank}"
    os.makedirs(mine, exist_ok=True)
    os.chdir(mine)
    try:
        for name, root in UNSHARED.items():
            for kind, obj in (("spill", {"t": torch.ones(2) * rank}), ("records", [{"r": rank}])):
                t0 = time.perf_counter()
                try:
                    spillmerge.all_gather_object([None] * world, obj, root=root, timeout=TIMEOUT)
                    error = None
                except spillmerge.SpillMergeError as exc:
                    error = {"type": type(exc).__name__, "msg": str(exc), "key": getattr(exc, "key", None)}
                out[f"{name}_{kind}"] = {"error": error, "waited": time.perf_counter() - t0}
    finally:
        os.chdir(here)
    import torch.distributed as dist

    dist.barrier()  # dst removes the call's folder once every rank raised
    out["left"] = sorted(glob.glob(f"{mine}/**/spillmerge-*", recursive=True))
    memory = fsspec.filesystem("memory")
    out["left_in_memory"] = memory.ls("/alone") if memory.exists("/alone") else []
    return out


SCENARIOS = {
    "same_as_torch": same_as_torch,
    "torch_object_list": torch_object_list,
    "containers_of_dicts": containers_of_dicts,
    "records": records,
    "odd_types": odd_types,
    "pickled_types": pickled_types,
    "back_to_back": back_to_back,
    "failures": failures,
    "after_a_timeout": after_a_timeout,
    "slow_rank": slow_rank,
    "unshared_on_one_host": unshared_on_one_host,
    "never_called": never_called,
}


def worker(rank: int, world: int, port: int, base: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes`` (the rank comes first)."""
    run_scenarios(rank, world, port, base, SCENARIOS, barrier_between=True)


def s3_worker(rank: int, world: int, port: int, base: str) -> None:
    """The drop-ins with their root on an object store (``base/s3.json``: the endpoint): records
    on every rank (an object a rank, no spill), then objects that go through a spill and a merge;
    each compared strictly with torch's collective on the same inputs."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from _s3 import storage_options

    import spillmerge

    opts = storage_options(json.loads(Path(base, "s3.json").read_text())["endpoint"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        records = {f"p{rank}-{i}": {"text": "é数" * i, "ids": list(range(i)), "score": None if i else 0.5} for i in range(5)}
        mixed = {"rank": rank, "t": torch.arange(3) + rank, "instances": [{"a": 1}, {"b": [2.5]}]}
        kw: dict[str, Any] = {"root": "s3://test/calls", "storage_options": opts, "timeout": TIMEOUT}
        got, want = [None] * world, [None] * world
        spillmerge.all_gather_object(got, records, **kw)
        dist.all_gather_object(want, records)
        diffs = value_diffs(got, want, "records", strict=True)
        got_m = [None] * world if rank == 0 else None
        want_m = [None] * world if rank == 0 else None
        spillmerge.gather_object(mixed, got_m, dst=0, **kw)
        dist.gather_object(mixed, want_m, dst=0)
        diffs += value_diffs(got_m, want_m, "mixed", strict=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    out = Path(base, "results", f"rank-{rank}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"diffs": diffs}))
