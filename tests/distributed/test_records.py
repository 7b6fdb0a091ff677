"""Records sent as one Arrow stream (``_dist.records``): whatever it takes comes back exactly
(type, content, dict key order, None where it was), what it cannot keep exactly it declines (the
drop-in then sends it the general way), and bytes that are not its stream are refused."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spillmerge import CorruptSpillError
from spillmerge._dist.dropin import _get_records, _put_records
from spillmerge._dist.records import decode, encode, to_bytes

KEYS = st.sampled_from(["score", "bbox", "a", "", "é"])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(), st.binary()
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=3)),
    max_leaves=12,
)


def _back(batch, rank: int = 0):
    """What a reader makes of ``batch``'s stream."""
    return decode(to_bytes(batch), rank=rank)


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


@given(st.lists(st.dictionaries(KEYS, VALUES, min_size=1, max_size=4), min_size=1, max_size=6), st.sampled_from([list, tuple, dict]))
def test_what_it_takes_comes_back_exactly(rows, container):
    obj = {f"k{i}": r for i, r in enumerate(rows)} if container is dict else container(rows)
    encoded = encode(obj)
    if encoded is not None:
        assert _same(_back(encoded), obj)


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
    assert _same(_back(encoded), obj)


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


def test_the_workloads_people_gather_are_taken():
    llm = {f"prompt-{p}": {"text": "é" * p, "token_ids": list(range(p)), "logprob": -p / 3, "finish": "stop"} for p in range(5)}
    coco = [{"image_id": i, "instances": [{"bbox": [1.0, 2.0, 3.0, 4.0], "score": 0.5}] * i} for i in range(3)]
    for obj in (llm, coco, tuple(coco)):
        encoded = encode(obj)
        assert encoded is not None and _same(_back(encoded), obj)


def test_bytes_that_are_not_the_stream_are_refused_naming_the_rank():
    data = to_bytes(encode([{"text": "x" * 100, "n": 7}]))
    bad = data.copy()
    bad[len(bad) // 2 :] ^= 0xFF
    with pytest.raises(CorruptSpillError, match="rank 3"):
        decode(bad, rank=3)
    with pytest.raises(CorruptSpillError, match="rank 3"):
        decode(data[:10], rank=3)


def test_a_stream_without_its_container_is_refused():
    import pyarrow as pa

    batch = encode([{"n": 7}]).replace_schema_metadata({"container": "set"})
    with pytest.raises(CorruptSpillError, match="rank 1"):
        decode(to_bytes(batch), rank=1)
    with pytest.raises(CorruptSpillError, match="rank 1"):
        decode(to_bytes(pa.record_batch([pa.array([1])], names=["v"])), rank=1)


def test_records_files_come_back_and_damage_is_refused_naming_rank_and_path(tmp_path):
    """The drop-ins' records on every rank: one file a rank, checked against the size and CRC-32C
    its rank reported, before Arrow reads it."""
    call = str(tmp_path / "call")
    objs = [{f"p{i}": {"text": "é" * i, "ids": list(range(i))} for i in range(5)}, [{"a": None}, {"a": 1.5}]]
    sizes = [_put_records(call, r, encode(o), None) for r, o in enumerate(objs)]
    out = [None, None]
    _get_records(call, sizes, None, out)
    assert all(_same(g, w) for g, w in zip(out, objs, strict=True))
    path = tmp_path / "call" / "00000001.arrow"
    good = path.read_bytes()
    path.write_bytes(good[:-9] + bytes([good[-9] ^ 1]) + good[-8:])  # one bit flipped
    with pytest.raises(CorruptSpillError, match=r"rank 1's records at .*00000001\.arrow"):
        _get_records(call, sizes, None, [None, None])
    path.write_bytes(good[:-1])
    with pytest.raises(CorruptSpillError, match="rank 1"):
        _get_records(call, sizes, None, [None, None])
    path.unlink()
    with pytest.raises(CorruptSpillError, match="rank 1.*missing"):
        _get_records(call, sizes, None, [None, None])
