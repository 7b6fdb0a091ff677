"""Records sent as one Arrow stream (``_dist.records``): whatever it takes comes back exactly
(type, content, dict key order, None where it was), what it cannot keep exactly it declines (the
drop-in then sends it the general way), and bytes that are not its stream are refused."""

from __future__ import annotations

import math

import crc32c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spillmerge import CorruptSpillError
from spillmerge._dist.dropin import _get_records, _put_records
from spillmerge._dist.records import copy, decode, encode

KEYS = st.sampled_from(["score", "bbox", "a", "", "é"])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(), st.binary()
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=3)),
    max_leaves=12,
)


def _bytes(pieces) -> bytes:
    return b"".join(pieces)


def _back(pieces, rank: int = 0):
    """What a reader makes of ``encode``'s pieces written back to back."""
    return decode(_bytes(pieces), rank=rank)


def _same(got, want) -> bool:
    """Equal in type, content and dict key order, -0.0 told from 0.0."""
    if type(got) is not type(want):
        return False
    if isinstance(want, dict):
        return list(got) == list(want) and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, float):
        return got == want and math.copysign(1.0, got) == math.copysign(1.0, want)
    return got == want


def _fresh(got, want) -> bool:
    """No dict or list of ``got`` is one of ``want``'s (a deep copy)."""
    if isinstance(want, (dict, list, tuple)):
        if got is want and not isinstance(want, tuple):
            return False
        pairs = (got.values(), want.values()) if isinstance(want, dict) else (got, want)
        return all(_fresh(g, w) for g, w in zip(*pairs, strict=True))
    return True


def _copied(obj) -> bool:
    """What ``copy`` makes of records ``encode`` took is ``decode``'s result, sharing no list or dict."""
    got = copy(obj)
    return _same(got, obj) and _fresh(got, obj)


@given(
    st.lists(st.dictionaries(KEYS, VALUES, min_size=1, max_size=4), min_size=1, max_size=6),
    st.sampled_from([list, tuple, dict]),
)
def test_what_it_takes_comes_back_exactly(rows, container):
    obj = {f"k{i}": r for i, r in enumerate(rows)} if container is dict else container(rows)
    encoded = encode(obj)
    if encoded is not None:
        assert _same(_back(encoded), obj) and _copied(obj)


KINDS = [
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(),
    st.binary(),
    st.lists(st.one_of(st.none(), st.integers(-5, 5))),
    st.lists(st.text(max_size=3)),
    st.builds(lambda y, x: {"y": y, "x": x}, st.lists(st.booleans()), st.one_of(st.none(), st.floats(allow_nan=False))),
]


@st.composite
def uniform_records(draw):
    """Rows of one key order, each key's values of one kind or None (what models' outputs are)."""
    keys = draw(st.lists(KEYS, unique=True, min_size=1, max_size=4))
    kinds = {k: draw(st.sampled_from(KINDS)) for k in keys}
    return [{k: draw(st.one_of(st.none(), kinds[k])) for k in keys} for _ in range(draw(st.integers(1, 6)))]


@given(uniform_records(), st.sampled_from([list, tuple, dict]))
def test_records_of_one_kind_a_key_are_taken_and_come_back_exactly(rows, container):
    obj = {f"k{i}": r for i, r in enumerate(rows)} if container is dict else container(rows)
    encoded = encode(obj)
    assert encoded is not None
    assert _same(_back(encoded), obj) and _copied(obj)


@pytest.mark.parametrize(
    "obj",
    [
        [{"v": 1}, {"v": 2.5}],  # the int would come back a float
        [{"v": True}, {"v": 1}],
        [{"a": 1}, {"b": 1}],  # keys that differ: one would gain the other's as None
        [{"b": 1, "a": 2}, {"a": 2, "b": 1}],  # key orders that differ
        [{"v": 2**63}],
        [{"v": "\ud800"}],
        [{"v": (1, 2)}],
        [{"v": [1, 2.0]}],
        [{"v": {1: 2}}],
        [{"v": [{"x": 1}, {"y": 1}]}],
        [{"v": {"x": 1}}, {"v": {}}],
        {1: {"v": 1}},
        [{"v": 1}, None],
        [],
        [{}],
        "text",
    ],
)
def test_what_would_not_come_back_exactly_is_declined(obj):
    assert encode(obj) is None


def test_records_whose_header_a_reader_would_refuse_are_declined(monkeypatch):
    from spillmerge._dist import records

    wide = [{f"key{i}": i for i in range(40)}]  # one struct field a key: the header grows with the keys
    assert _same(_back(encode(wide)), wide)
    monkeypatch.setattr(records, "_HEADER_MAX", 512)  # the readers' limit, as for a dict of ~300k keys
    head = b'{"container": "list", "columns": {}}'.ljust(600)
    with pytest.raises(CorruptSpillError, match="a header of 600 bytes"):
        decode(len(head).to_bytes(8, "little") + head, 0)
    assert encode(wide) is None  # the general way, not bytes the readers would refuse


def test_the_workloads_people_gather_are_taken():
    llm = {
        f"prompt-{p}": {"text": "é" * p, "token_ids": list(range(p)), "logprob": -p / 3, "finish": "stop"}
        for p in range(5)
    }
    coco = [{"image_id": i, "instances": [{"bbox": [1.0, 2.0, 3.0, 4.0], "score": 0.5}] * i} for i in range(3)]
    for obj in (llm, coco, tuple(coco)):
        encoded = encode(obj)
        assert encoded is not None and _same(_back(encoded), obj) and _copied(obj)


def test_lists_of_numbers_come_back_exact_whatever_mix_of_kinds_they_hold():
    """A key's lists of numbers go into one int64 or float64 buffer only when every item is
    exactly an int (or a float): a bool, a None, an int past 32 bits, a subclass or a float among
    the ints comes back as it went, or the records are declined."""
    import enum

    class Kind(enum.IntEnum):
        A = 1

    class Real(float):
        pass

    edges = [0, 1, -1, 2**31 - 1, -(2**31)]
    for lists in (
        [edges, [], [7] * 1000, [-5]],  # all 32 bits: the one-buffer way
        [[1.5, -0.0, float("inf"), 1e308], [], [2.0]],
        [[7] * 1000] * 100 + [list(range(-100_000, 100_000))],  # parts of 64k items; lists across them
        [[1, 2], [2**31]],  # past 32 bits, still 64
        [[1, 2], [-(2**31) - 1], [2**63 - 1, -(2**63)]],
        [[1, None, 3], [4]],
        [[1.0, None], [2.5]],
    ):
        obj = [{"ids": ids} for ids in lists]
        encoded = encode(obj)
        assert encoded is not None and _same(_back(encoded), obj), lists
    declined = [[[1, 2], [True]], [[1, Kind.A]], [[1.0, Real(2.0)]], [[1, 2], [2.5]], [[1.0], [2]], [[1], [2**64]]]
    declined += [[[1, ""]], [[1, b""]], [[1.0, "abcd"]]]  # of the size marshal gives an int (a float)
    declined += [[[1] * 1000] * 100 + [[True]], [[1.0] * 1000] * 100 + [[1]]]  # in a later part
    for lists in declined:
        assert encode([{"ids": ids} for ids in lists]) is None, lists


def test_bytes_that_are_not_the_records_are_refused_naming_the_rank():
    import json

    import numpy as np

    data = np.frombuffer(_bytes(encode([{"text": "x" * 100, "n": 7, "ids": [1, 2]}])), dtype=np.uint8)
    size = int.from_bytes(data[:8].tobytes(), "little")
    bad = data.copy()
    bad[8 + size + 4 : 8 + size + 8] ^= 0xFF  # the text's end offset
    header = json.loads(data[8 : 8 + size].tobytes())
    body = data[8 + size :].tobytes()

    def remade(**change) -> bytes:
        head = json.dumps({**header, **change}).encode()
        head += b" " * (-len(head) % 8)
        return len(head).to_bytes(8, "little") + head + body

    columns = header["columns"]["v"]
    past_end = {**columns, "c": [{**columns["c"][0], "b": [None, [0, len(body) + 1]]}, *columns["c"][1:]]}
    longer = {**columns, "n": columns["n"] + 1000}
    for damaged in (
        bad,  # an offset past its buffer
        data[: len(data) // 2] ^ 1,  # flipped bits in the header
        data[:10],  # short
        data[:-3],  # a buffer cut off
        remade(container="set"),  # a container no drop-in takes
        remade(columns={"v": {**columns, "t": "dictionary"}}),  # a type the records do not use
        remade(columns={"v": past_end}),  # a buffer past the end
        remade(columns={"v": longer}),  # more rows than the buffers hold
        remade(columns={"v": {**columns, "f": ["text"]}}),  # field names that do not match
    ):
        with pytest.raises(CorruptSpillError, match="rank 3"):
            decode(damaged, rank=3)


def test_records_files_come_back_and_damage_is_refused_naming_rank_and_path(tmp_path):
    """The drop-ins' records on every rank: one file a rank, checked against the size and CRC-32C
    its rank reported, before Arrow reads it."""
    call = str(tmp_path / "call")
    objs = [{f"p{i}": {"text": "é" * i, "ids": list(range(i))} for i in range(5)}, [{"a": None}, {"a": 1.5}]]
    sizes = [_put_records(call, r, encode(o), None) for r, o in enumerate(objs)]
    assert sizes[0] == (len(_bytes(encode(objs[0]))), crc32c.crc32c(_bytes(encode(objs[0]))))
    out = [None, None]
    _get_records(call, sizes, None, out, mine=-1)
    assert all(_same(g, w) for g, w in zip(out, objs, strict=True))
    path = tmp_path / "call" / "00000001.records"
    good = path.read_bytes()
    path.write_bytes(good[:-9] + bytes([good[-9] ^ 1]) + good[-8:])  # one bit flipped
    with pytest.raises(CorruptSpillError, match=r"rank 1's records at .*00000001\.records"):
        _get_records(call, sizes, None, [None, None], mine=0)
    path.write_bytes(good[:-1])
    with pytest.raises(CorruptSpillError, match="rank 1"):
        _get_records(call, sizes, None, [None, None], mine=0)
    path.unlink()
    with pytest.raises(CorruptSpillError, match="rank 1.*missing"):
        _get_records(call, sizes, None, [None, None], mine=0)


@given(st.data())
def test_damaged_records_are_refused_or_read_never_another_error(data):
    """Whatever bytes of a records file are changed, reading it either gives some value or
    raises CorruptSpillError naming the rank: never another exception, a crash or a hang."""
    obj = [{"text": "é" * i, "ids": list(range(i)), "score": None if i % 2 else i / 3, "m": {"b": b"x" * i}} for i in range(6)]
    good = bytearray(b"".join(encode(obj)))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(good)))
    try:
        decode(bytes(good[:cut] if data.draw(st.booleans()) else good), rank=5)
    except CorruptSpillError as exc:
        assert "rank 5" in str(exc)
