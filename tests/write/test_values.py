"""Values a model produces (format version 2, issue 14; version 3's value model, issue 23): what ``flatten`` makes of each kind (the
exact bytes of docs/FORMAT.md section 1, *catalog*), its errors, and the writer's per-file layout
rule. Round trips read the committed spill back with ``_spillroot`` (the index, the catalog and
the data bytes by offset), so they do not depend on the merge."""

from __future__ import annotations

import dataclasses
import enum
import pickle
import struct
from typing import Any

import google_crc32c
import numpy as np
import pytest
import torch
from _helpers import value_diffs

import spillmerge
from spillmerge._format import common as F
from spillmerge._format import spill as FS
from spillmerge._spill import root as R
from spillmerge._storage import Storage
from spillmerge._write.flatten import flatten
from spillmerge._write.leaves import Leaf


def leaves(value: Any, **kw: Any) -> dict[tuple[str, ...], Leaf]:
    return {leaf.path: leaf for leaf in flatten(value, "f.mp4", 0, **kw)}


def one(value: Any, **kw: Any) -> Leaf:
    (leaf,) = flatten(value, "f.mp4", 0, **kw)
    return leaf


def raw(leaf: Leaf) -> bytes:
    assert isinstance(leaf.data, np.ndarray) and leaf.data.dtype == np.uint8 and leaf.data.ndim == 1
    assert leaf.data.size == leaf.nbytes == FS.Layout(leaf.path, leaf.dtype, leaf.shape).nbytes
    return leaf.data.tobytes()


def strlist_bytes(items: list[str]) -> bytes:
    enc = [s.encode("utf-8") for s in items]
    return b"".join(struct.pack("<I", len(e)) for e in enc) + b"".join(enc)


def decode(lay: FS.Layout, data: bytes) -> Any:
    """A stored row back to a Python value, by docs/FORMAT.md section 1 (the reader's job; kept
    here so these tests read the spill without the merge)."""
    if lay.kind == "num":
        dt = np.dtype(F.DTYPES[lay.dtype].storage).newbyteorder("<")
        return np.frombuffer(data, dtype=dt).reshape(lay.shape)
    if lay.kind == "str":
        return data.decode("utf-8")
    if lay.kind == "bytes":
        return data
    if lay.kind == "pickle":
        return pickle.loads(data)
    if lay.kind == "none":
        assert data == b""
        return None
    n = lay.shape[0]
    lens = np.frombuffer(data[: 4 * n], dtype="<u4")
    ends = 4 * n + np.cumsum(lens)
    return [data[int(e - ln) : int(e)].decode("utf-8") for e, ln in zip(ends, lens, strict=True)]


def read_spill(root: str) -> dict[tuple[str, int], dict[tuple[str, ...], tuple[FS.Layout, Any]]]:
    """(filename, frame) → {leaf path: (layout, value)} of every committed segment of ``root``,
    each row's bytes read by offset and checked against its CRC-32C."""
    st = Storage(root)
    out: dict[tuple[str, int], dict[tuple[str, ...], tuple[FS.Layout, Any]]] = {}
    try:
        for segs in R.scan(st).values():
            for seg in segs:
                if seg.commit is None:
                    continue
                assert seg.header["format_version"] == F.SPILL_FORMAT_VERSION == 4
                loaded = R.load_segment(st, seg)
                for fid, frame, lid, off, nb, crc in loaded.index.tolist():
                    buf = np.empty(nb, dtype=np.uint8)
                    if nb:
                        st.read_into(R.data_ranges(loaded, off, nb), memoryview(buf))
                    if crc >= 0:
                        assert google_crc32c.value(buf.tobytes()) == crc
                    else:  # version 3: checked by block checksum -1 - crc, which covers the row
                        assert loaded.checks is not None
                        b_off, b_nb, b_crc = loaded.checks[-1 - crc].tolist()
                        assert b_off <= off and off + nb <= b_off + b_nb
                        block = np.empty(b_nb, dtype=np.uint8)
                        st.read_into(R.data_ranges(loaded, b_off, b_nb), memoryview(block))
                        assert google_crc32c.value(block.tobytes()) == b_crc
                    lay = loaded.layouts[lid]
                    frame_rows = out.setdefault((loaded.filenames[fid], frame), {})
                    assert lay.leaf not in frame_rows
                    frame_rows[lay.leaf] = (lay, decode(lay, buf.tobytes()))
    finally:
        st.close()
    return out


# ------------------------------------------------------------------------------ flatten, per kind
def test_str_is_its_utf8_bytes():
    for text in ["caption", "", "a\x00b\x00", "héllo wörld ✓ 𝄞", "x" * 3]:
        leaf = one(text)
        assert (leaf.path, leaf.dtype, leaf.shape) == ((), "str", (len(text.encode()),))
        assert raw(leaf) == text.encode("utf-8")
    big = "ab\x00c" * (10 * 2**20 // 4)  # 10 MB
    assert raw(one(big)) == big.encode() and one(big).shape == (10 * 2**20,)
    assert one(np.str_("np")).dtype == "str"  # numpy's str scalar is a str


def test_bytes_bytearray_memoryview():
    assert raw(one(b"\x00\xff\x00")) == b"\x00\xff\x00" and one(b"ab").shape == (2,)
    assert one(b"").shape == (0,) and raw(one(b"")) == b""
    assert raw(one(bytearray(b"xyz"))) == b"xyz"
    arr = np.arange(6, dtype="<f4")
    assert raw(one(memoryview(arr))) == arr.tobytes()
    strided = memoryview(b"abcdef")[::2]  # not contiguous: copied
    assert raw(one(strided)) == b"ace" and one(strided).dtype == "bytes"
    assert raw(one(memoryview(arr.reshape(2, 3)))) == arr.tobytes()


def test_none_is_a_zero_byte_leaf():
    leaf = one(None)
    assert (leaf.path, leaf.dtype, leaf.shape, leaf.nbytes) == ((), "none", (), 0) and raw(leaf) == b""
    got = leaves({"boxes": None, "score": 1.0})
    assert got[("boxes",)].dtype == "none" and got[("score",)].dtype == "pyfloat"


@pytest.mark.parametrize(
    "value, dtype, shape",
    [
        ([True, False, True], "pybool", (3,)),
        ([1, -2, 3], "pyint", (3,)),
        ([1.5, 2.0], "pyfloat", (2,)),
        ([], "pyfloat", (0,)),
        ([[1, 2, 3], [4, 5, 6]], "pyint", (2, 3)),
        ([[1.0, 2], [3.5, 4.0]], None, None),  # 2 is an int: not one type, stored item by item
        ([[True], [False]], "pybool", (2, 1)),
        ([[], []], "pyfloat", (2, 0)),
        ([[[1], [2]], [[3], [4]]], "pyint", (2, 2, 1)),
    ],
)
def test_lists_of_one_python_number_type_become_arrays(value, dtype, shape):
    """Version 3: a list of one Python number type is one leaf of its ``py*`` dtype (read back as
    the same list); anything that would not come back as it went in is a list of items."""
    if dtype is None:
        assert ("\x1f",) in leaves(value)
        return
    leaf = one(value)
    assert (leaf.dtype, leaf.shape) == (dtype, shape)
    want = np.asarray(value, dtype=F.DTYPES[dtype].storage).reshape(shape)
    assert raw(leaf) == want.tobytes()


@pytest.mark.parametrize(
    "value",
    [(1, 2), [True, 2], [1, 2.5], [np.int8(1), np.uint16(2)], (), [(1, 2), [3, 4]], [1, "a"], [None, 1],
     [[1], [1, 2]], [torch.ones(2), torch.ones(3, 2)], [1 + 2j], [b"a", b"b"]],
)  # fmt: skip
def test_other_lists_and_tuples_are_a_header_and_items(value):
    got = leaves(value)
    head = got.pop(("\x1f",))
    assert head.dtype == ("pytuple" if isinstance(value, tuple) else "pylist")
    assert raw(head) == np.array([len(value)], "<i8").tobytes()
    assert sorted({p[0] for p in got}) == sorted(f"\x1f{i}" for i in range(len(value)))


def test_int_lists_never_round_silently():
    assert raw(one([2**63 - 1, -(2**63)])) == np.array([2**63 - 1, -(2**63)], dtype="<i8").tobytes()
    for bad, where in (([1, 2**63], "ids/[1]"), ([-(2**63) - 1], "ids/[0]"), ([[1], [2**64]], "ids/[1]/[0]")):
        with pytest.raises(spillmerge.SpillValueError, match="does not fit int64.*allow_pickle=True") as info:
            flatten({"ids": bad}, "f.mp4", 0)
        assert info.value.leaf == where and info.value.filename == "f.mp4" and info.value.frame_idx == 0


def test_a_million_element_list():
    ints = list(range(1_000_000))
    leaf = one(ints)
    assert (leaf.dtype, leaf.shape) == ("pyint", (1_000_000,))
    assert raw(leaf) == np.arange(1_000_000, dtype="<i8").tobytes()
    floats = [i / 3 for i in range(1_000_000)]
    assert raw(one(floats)) == np.array(floats, dtype="<f8").tobytes()
    words = [str(i) for i in range(1_000_000)]
    assert raw(one(words)) == strlist_bytes(words)


def test_list_of_str_is_a_strlist():
    items = ["cat", "", "a\x00b", "ü𝄞", "dog"]
    leaf = one(items)
    assert leaf.dtype == "strlist"
    body = sum(len(s.encode()) for s in items)
    assert leaf.shape == (5, 4 * 5 + body)  # n_bytes counts the 4-byte lengths
    assert raw(leaf) == strlist_bytes(items)
    assert one([""]).shape == (1, 4) and raw(one([""])) == b"\x00\x00\x00\x00"


def test_list_of_dicts_is_a_dict_of_columns_under_a_records_header():
    dets = [
        {"bbox": [1.0, 2.0, 3.0, 4.0], "category_id": 3, "label": "cat"},
        {"bbox": [5.0, 6.0, 7.0, 8.0], "category_id": 1, "label": "dog"},
    ]
    got = leaves({"dets": dets})
    assert sorted(got) == [("dets", "\x1f"), ("dets", "bbox"), ("dets", "category_id"), ("dets", "label")]
    assert got[("dets", "\x1f")].dtype == "pyrecords" and raw(got[("dets", "\x1f")]) == np.array([2], "<i8").tobytes()
    assert got[("dets", "bbox")].shape == (2, 4) and got[("dets", "bbox")].dtype == "pyfloat"
    assert raw(got[("dets", "category_id")]) == np.array([3, 1], dtype="<i8").tobytes()
    assert raw(got[("dets", "label")]) == strlist_bytes(["cat", "dog"])
    # dicts whose keys differ are a list of items
    got = leaves({"dets": [{"a": 1}, {"a": 2, "b": 3}]})
    assert got[("dets", "\x1f")].dtype == "pylist" and ("dets", "\x1f1", "b") in got


def test_nested_containers_and_dataclasses():
    @dataclasses.dataclass
    class Out:
        text: str
        ids: list[int]
        extra: Any = None

    got = leaves({"o": Out("hi", [1, 2]), "t": torch.ones(2, dtype=torch.bfloat16)})
    assert {p: lf.dtype for p, lf in got.items()} == {
        ("o", "extra"): "none",
        ("o", "ids"): "pyint",
        ("o", "text"): "str",
        ("t",): "bfloat16",
    }


def test_tensors_keep_their_fast_path():
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    leaf = one(t)
    assert (leaf.dtype, leaf.shape) == ("float16", (2, 3)) and raw(leaf) == t.numpy().tobytes()
    assert one(np.zeros((0, 4), dtype=np.float32)).shape == (0, 4)


# ------------------------------------------------------------------------------ flatten, errors
def test_lone_surrogates_are_refused_naming_filename_and_leaf():
    for value, leaf in (("\udc80abc", "<value>"), ({"cap": "ok\ud800"}, "cap"), ({"w": ["a", "\udfff"]}, "w")):
        with pytest.raises(spillmerge.SpillValueError, match="not valid Unicode") as info:
            flatten(value, "clip.mp4", 0)
        assert info.value.filename == "clip.mp4" and info.value.leaf == leaf
        assert "clip.mp4" in str(info.value) and repr(leaf) in str(info.value)


class Custom:
    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.n == self.n


@pytest.mark.parametrize("value", [Custom(1), {1, 2}, np.array(["a", "b"]), np.array([Custom(1)], dtype=object)])
def test_other_objects_need_pickle_opt_in(value):
    with pytest.raises(spillmerge.SpillValueError, match="without pickle") as info:
        flatten({"obj": value}, "f.mp4", 0)
    assert info.value.leaf == "obj" and "allow_pickle=True" in str(info.value)
    if not isinstance(value, np.ndarray):
        assert type(value).__name__ in str(info.value)
    leaf = one(value, allow_pickle=True)
    assert leaf.dtype == "pickle" and leaf.shape == (leaf.nbytes,)
    assert raw(leaf) == pickle.dumps(value, protocol=5)


def test_numpy_text_arrays_say_how_to_store_text():
    with pytest.raises(spillmerge.SpillValueError, match=r"tolist\(\)"):
        flatten(np.array(["a", "b"]), "f.mp4", 0)


def test_unpicklable_object_names_leaf():
    with pytest.raises(spillmerge.SpillValueError, match="cannot pickle a function") as info:
        flatten({"fn": lambda: 1}, "f.mp4", 0, allow_pickle=True)
    assert info.value.leaf == "fn"


# ------------------------------------------------------------------------------ writer
def test_ragged_none_str_and_missing_leaves_share_a_file(tmp_path):
    root = str(tmp_path / "s")
    frames = [
        {"boxes": torch.rand(3, 4), "scores": torch.rand(3), "label": "cat", "tokens": [1, 2, 3]},
        {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "label": "", "tokens": []},
        {"boxes": torch.rand(7, 4), "scores": None, "label": "a\x00b", "tokens": [5]},
        {"boxes": torch.rand(1, 4), "tokens": list(range(100))},  # leaves missing
        {"boxes": torch.rand(2, 4), "scores": torch.rand(2), "label": None, "tokens": [9, 9], "new": b"\x00"},
    ]
    masks = [torch.rand(h, w) for h, w in ((4, 5), (1, 1), (0, 3), (30, 2))]
    with spillmerge.SpillWriter(root) as w:
        for i, v in enumerate(frames):
            w.write("det.mp4", i, v)
        for i, m in enumerate(masks):
            w.write("mask.mp4", i, m)
        w.write("cap.mp4", 0, "first caption")
        w.write("cap.mp4", 1, "")
        w.write("cap.mp4", 2, "x" * (10 << 20))
        w.write("none.mp4", 0, None)
        w.write("none.mp4", 1, torch.ones(2))  # None in one frame, a value in the next
        w.write("words.mp4", 0, ["a", "", "b\x00c"])
        w.write("words.mp4", 1, ["one"])
        # An empty list is float64 (0,) (docs/FORMAT.md), and also an empty list of strings.
        w.write("words.mp4", 2, [])
        w.write("words.mp4", 3, [1.5])  # version 3: another variant of the leaf, not an error
        w.write("empty.mp4", 0, [])
    got = read_spill(root)
    for i, v in enumerate(frames):
        row = got[("det.mp4", i)]
        assert sorted(row) == sorted((k,) for k in v)
        for k, want in v.items():
            lay, value = row[(k,)]
            if isinstance(want, torch.Tensor):
                assert lay.shape == tuple(want.shape) and np.array_equal(value, want.numpy())
            elif isinstance(want, list):
                assert lay.dtype in ("pyint", "pyfloat") and value.tolist() == want
            else:
                assert value == want
    for i, m in enumerate(masks):
        lay, value = got[("mask.mp4", i)][()]
        assert lay.shape == tuple(m.shape) and np.array_equal(value, m.numpy())
    assert [got[("cap.mp4", i)][()][1] for i in range(2)] == ["first caption", ""]
    assert got[("cap.mp4", 2)][()][1] == "x" * (10 << 20)
    assert got[("none.mp4", 0)][()] == (FS.Layout((), "none", ()), None)
    assert got[("words.mp4", 0)][()][1] == ["a", "", "b\x00c"]
    assert got[("words.mp4", 1)][()][1] == ["one"] and got[("words.mp4", 3)][()][1].tolist() == [1.5]
    assert got[("words.mp4", 2)][()][0] == FS.Layout((), "pyfloat", (0,))  # [] kept; the merge reads it as []
    assert got[("empty.mp4", 0)][()][0] == FS.Layout((), "pyfloat", (0,))


def test_a_kind_change_within_a_file_is_another_variant(tmp_path):
    """Version 3: kind, dtype and ndim of a leaf may change between the frames of a file (each
    variant is a column of its own in the output, docs/FORMAT.md *Value model*)."""
    root = str(tmp_path / "s")
    frames = [
        torch.ones(2, dtype=torch.float32),
        torch.ones(2, dtype=torch.float16),
        torch.ones(2, 1),
        "text",
        b"text",
        ["a"],
        [1, 2],
        [1.5],
        {"x": torch.ones(1)},  # a dict after values at the root
    ]
    with spillmerge.SpillWriter(root, rank=2, world_size=4) as w:
        for i, v in enumerate(frames):
            w.write("f", i, v)
    got = read_spill(root)
    assert [got[("f", i)][()][0].dtype for i in range(len(frames) - 1)] == [
        "float32", "float16", "float32", "str", "bytes", "strlist", "pyint", "pyfloat",
    ]  # fmt: skip
    assert got[("f", 8)][("x",)][0].dtype == "float32"


@pytest.mark.parametrize(
    "first, then",
    [
        (torch.ones(1), {"x": torch.ones(1)}),
        ({"a": torch.ones(1)}, {"a": {"b": torch.ones(1)}}),
        ({"a": {"b": torch.ones(1)}}, {"a": torch.ones(1)}),
        ({"a": {"b": torch.ones(1)}}, {"a": None}),
        ({"a": [1, "x"]}, {"a": "x"}),
    ],
)
def test_structure_may_change_within_a_file(tmp_path, first, then):
    """Version 3: a path may be a value in one frame and a dict or list in another; each frame
    reads back as it was written."""
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        w.write("f", 0, first)
        w.write("f", 1, then)
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    for i, want in enumerate((first, then)):
        assert value_diffs(res.value("f", i), want) == []


def test_empty_rows_and_none_rows_take_any_dtype(tmp_path):
    root = str(tmp_path / "s")
    with spillmerge.SpillWriter(root) as w:
        w.write("t", 0, [])  # float64 (0,)
        w.write("t", 1, [1, 2])  # int64: the empty row said nothing about the dtype
        w.write("t", 2, np.zeros(0, dtype=np.float32))
        w.write("t", 3, None)
        w.write("t", 4, [3])
        w.write("t", 5, [0.5])  # version 3: another variant
        w.write("u", 0, None)
        w.write("u", 1, "now a str")
        w.write("u", 2, torch.ones(1))
    got = read_spill(root)
    assert [got[("t", i)][()][1] is None or got[("t", i)][()][1].tolist() for i in range(5)] == [
        [],
        [1, 2],
        [],
        True,
        [3],
    ]


def test_an_empty_array_keeps_its_dtype_and_an_empty_list_stays_a_list(tmp_path):
    """Beside other variants of their leaf: an empty array is no other dtype's empty array and no
    empty list; an empty list reads back as [] from a Python-number or string-list column."""
    values = [
        [],
        np.arange(3, dtype=np.int8),
        np.zeros(0, dtype=np.float32),
        torch.zeros(0, dtype=torch.bool),
        [1, 2],
        None,
        [[], []],
        np.zeros((0, 4), dtype=np.float16),
        ["a"],
        [],
    ]
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        for i, v in enumerate(values):
            w.write("t", i, v)
        w.write("u", 0, [])  # a list of strings elsewhere: [] joins it
        w.write("u", 1, ["x", "y"])
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    want = [v.numpy() if isinstance(v, torch.Tensor) else v for v in values]
    for i, v in enumerate(want):
        got = res.value("t", i)
        assert type(got) is type(v) and value_diffs(got, v) == [], (i, got)
        if isinstance(v, np.ndarray):
            assert got.dtype == v.dtype and got.shape == v.shape, (i, got)
    assert [res.value("u", 0), res.value("u", 1)] == [[], ["x", "y"]]


def test_a_rewrite_with_another_shape_is_not_identical(tmp_path):
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        w.write("f", 0, torch.zeros(2, 3))
        w.write("f", 0, torch.zeros(2, 3))  # same bytes, same shape: kept once
        with pytest.raises(spillmerge.DuplicateFrameError):
            w.write("f", 0, torch.zeros(3, 2))  # same bytes, another shape
        assert w.stats()["identical_rewrites"] == 1


def test_pickle_needs_the_writers_opt_in(tmp_path):
    with spillmerge.SpillWriter(str(tmp_path / "no")) as w:
        with pytest.raises(spillmerge.SpillValueError, match="allow_pickle=True") as info:
            w.write("f", 0, {"obj": Custom(3)})
        assert info.value.leaf == "obj" and "Custom" in str(info.value)
    root = str(tmp_path / "yes")
    with spillmerge.SpillWriter(root, allow_pickle=True) as w:
        w.write("f", 0, {"obj": Custom(3), "t": torch.ones(1)})
        w.write("f", 1, {"obj": {4, 5}, "t": torch.ones(1)})
    got = read_spill(root)
    assert got[("f", 0)][("obj",)][1] == Custom(3) and got[("f", 1)][("obj",)][1] == {4, 5}


class Level(enum.IntEnum):
    LOW = 1


class Reason(enum.StrEnum):
    STOP = "stop"


class Score(float):
    pass


def test_subclasses_of_plain_types_come_back_as_themselves_with_pickle_and_as_the_plain_type_without(tmp_path):
    # gather_object returns an IntEnum as an IntEnum: with allow_pickle, so does spillmerge (the
    # subclass is pickled); without it, the value is stored as the int, str or float it is.
    value = {"level": Level.LOW, "reason": Reason.STOP, "score": Score(0.5), "levels": [Level.LOW, 2], "n": 3}
    for allow in (True, False):
        store = spillmerge.gather(
            {"f": (0, value)}, str(tmp_path / f"o{allow}"), rank=0, world_size=1, allow_pickle=allow
        )
        assert store is not None
        got = store.value("f", 0)
        assert got == value and list(got) == list(value)
        types = {k: type(v) for k, v in got.items()} | {"levels[0]": type(got["levels"][0])}
        kept = {"level": Level, "reason": Reason, "score": Score, "levels[0]": Level}
        plain = {"level": int, "reason": str, "score": float, "levels[0]": int}
        assert types == {"levels": list, "n": int} | (kept if allow else plain)


def test_gather_passes_allow_pickle_to_the_writer_and_the_reader(tmp_path):
    # A set is no plain data: gather stores and reads it back only when allow_pickle reaches both
    # the writer and the reader; without it the writer refuses it by filename.
    store = spillmerge.gather({"f": {0: {4, 5}}}, str(tmp_path / "o"), rank=0, world_size=1, allow_pickle=True)
    assert store is not None and store.value("f", 0) == {4, 5}
    with pytest.raises(spillmerge.SpillMergeError, match="'f'"):
        spillmerge.all_gather({"f": {0: {4, 5}}}, str(tmp_path / "o2"), rank=0, world_size=1)


@pytest.mark.parametrize("kind", ["tensor", "str", "list"])
def test_a_value_larger_than_all_staging_streams_through_it(tmp_path, kind):
    """A single value many times the staging memory (the issue's 200 MB frame with 64 MiB of
    staging, scaled down): write() streams it through the same few buffers, chunk by chunk,
    waiting for the flush thread (backpressure); nothing grows with the value's size."""
    chunk = 64 << 10
    n = 40 * chunk  # 20x the two staging buffers
    g = torch.Generator().manual_seed(0)
    if kind == "tensor":
        value: Any = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
    elif kind == "str":
        value = "".join(chr(97 + i % 26) for i in range(n // 32)) * 32
    else:
        value = torch.randint(0, 1000, (n // 8,), generator=g).tolist()
    root = str(tmp_path / "s")
    with spillmerge.SpillWriter(root, chunk_bytes=chunk, staging_bytes=2 * chunk) as w:
        w.write("small", 0, torch.ones(3))
        w.write("big", 0, {"v": value, "tail": "after"})
        w.write("small", 1, torch.ones(3))
        assert w.stats()["staging_buffers"] <= 2
        assert w.stats()["chunks"] >= 40
    got = read_spill(root)
    stored = got[("big", 0)][("v",)][1]
    if kind == "tensor":
        assert np.array_equal(stored, value.numpy())
    elif kind == "str":
        assert stored == value
    else:
        assert stored.tolist() == value
    assert got[("big", 0)][("tail",)][1] == "after" and ("small", 1) in got


def test_salvage_of_a_journal_keeps_frames_with_fewer_leaves(tmp_path):
    """A salvaged journal keeps every frame it lists whole: a frame may lack leaves other frames
    of its file have, and a rewrite (on_duplicate='last') may have other leaves and shapes than
    the write it replaces."""
    root = str(tmp_path / "s")
    chunk = 4096
    with pytest.raises(RuntimeError, match="boom"):
        with spillmerge.SpillWriter(root, chunk_bytes=chunk, on_duplicate="last") as w:
            w.write("f", 0, {"a": torch.ones(10), "b": "x"})
            w.write("f", 1, {"a": torch.ones(20)})  # no "b"
            w.write("f", 2, {"a": torch.ones(5), "b": "y"})
            w.write("f", 2, {"a": torch.ones(7)})  # replaces frame 2: fewer leaves, other shape
            w.write("f", 3, {"b": None, "a": torch.ones(1)})
            w.write("f", 3, {"b": "z", "a": torch.ones(1)})  # same leaves again
            w.write("pad", 0, torch.zeros(4 * chunk, dtype=torch.uint8))  # flush everything above
            raise RuntimeError("boom")
    st = Storage(root)
    (seg,) = R.scan(st)[0]
    assert seg.commit is None and seg.failure is not None and seg.header["format_version"] == 4
    loaded, problems = R.load_flushed(st, seg)
    assert problems == []
    rows: dict[tuple[int, int], list[FS.Layout]] = {}
    for fid, frame, lid, *_ in loaded.index.tolist():
        rows.setdefault((fid, frame), []).append(loaded.layouts[lid])
    f = loaded.filenames.index("f")
    assert [lay.shape for lay in rows[(f, 0)]] == [(10,), (1,)]
    assert [lay.shape for lay in rows[(f, 1)]] == [(20,)]  # kept, though it lacks "b"
    assert rows[(f, 2)] == [FS.Layout(("a",), "float32", (7,))]  # only the last write
    assert rows[(f, 3)] == [FS.Layout(("a",), "float32", (1,), (1,)), FS.Layout(("b",), "str", (1,), (0,))]  # b came first
    st.close()


def test_index_naming_a_leaf_twice_in_a_frame_is_corrupt():
    lays = [FS.Layout(("a",), "float32", (2,)), FS.Layout(("a",), "float32", (3,))]
    index = np.array([[0, 0, 0, 0, 8, 0], [0, 0, 1, 8, 12, 0]], dtype=np.int64)

    def bad(msg: str, rel: str = "") -> Exception:
        return spillmerge.CorruptSpillError(msg)

    with pytest.raises(spillmerge.CorruptSpillError, match="twice"):
        R._validate_rows(bad, ["f"], lays, index, 100)
    R._validate_rows(bad, ["f"], lays, index[[0]], 100)
    # kind-aware sizes: a str row of 5 bytes, a none row of 0, a strlist of [2, 9]
    lays = [FS.Layout(("s",), "str", (5,)), FS.Layout(("n",), "none", ()), FS.Layout(("l",), "strlist", (2, 9))]
    index = np.array([[0, 0, 0, 0, 5, 0], [0, 0, 1, 5, 0, 0], [0, 0, 2, 5, 9, 0]], dtype=np.int64)
    R._validate_rows(bad, ["f"], lays, index, 14)
    index[2, FS.COL_NBYTES] = 8
    with pytest.raises(spillmerge.CorruptSpillError, match="sizes"):
        R._validate_rows(bad, ["f"], lays, index, 14)


def _fast_cases() -> list[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn((3, 5), generator=g)
    return [
        x,
        x[:, 1],  # not contiguous: the general path
        x.t(),
        x.half(),
        x.bfloat16(),  # numpy lacks it: the general path
        x > 0,
        torch.tensor(7),
        torch.zeros((0, 4)),
        x.clone().requires_grad_(),
        torch.ones(2, dtype=torch.complex64).conj(),
        {"b": x.numpy(), "a": x.to(torch.int32), "c": torch.tensor(3.5)},
        {"only": np.arange(6, dtype=">i4").reshape(2, 3)},  # big-endian: swapped by the general path
        {"nested": {"x": x}},
        {1: x},
        np.arange(4, dtype=np.uint16),
        np.array(["a"]),
    ]


_FAST = {0, 3, 5, 6, 7, 10, 14}  # plain contiguous host tensors / arrays of numpy dtypes, flat dicts of them


@pytest.mark.parametrize("case", range(len(_fast_cases())))
def test_the_write_fast_path_gives_the_leaves_of_the_general_walk(case: int) -> None:
    """What write() stores for a plain tensor / flat dict (the fast path) is what the general
    walk gives: same paths, dtypes, shapes and bytes; anything else is left to the walk."""
    from spillmerge._write.flatten import flatten, flatten_dense

    value = _fast_cases()[case]
    fast = flatten_dense(value)
    try:
        slow = flatten(value, "f", 0)
    except spillmerge.SpillValueError:
        assert fast is None
        return
    assert (fast is not None) == (case in _FAST), "the fast path took / left the wrong values"
    if fast is None:
        return
    assert [(lf.path, lf.dtype, lf.shape, lf.nbytes) for lf in fast] == [
        (lf.path, lf.dtype, lf.shape, lf.nbytes) for lf in slow
    ]
    for a, b in zip(fast, slow, strict=True):
        assert bytes(np.asarray(a.data)) == bytes(
            np.asarray(b.data.cpu() if isinstance(b.data, torch.Tensor) else b.data)
        )


def _llm(i: int, **over: Any) -> dict[str, Any]:
    out = {"text": "é数 " * (i % 7), "token_ids": list(range(i % 5 + 1)), "logprob": -0.5 * i, "finish_reason": "stop"}
    out.update(over)
    return out


_PY_CASES: list[tuple[str, Any]] = [
    ("empty-list", _llm(1, token_ids=[])),  # float64 (0,): another signature, the general way
    ("none", _llm(2, logprob=None)),
    ("bool-in-ints", _llm(3, token_ids=[1, True])),  # mixed types: a pylist of items, not pyint
    ("bools", _llm(4, token_ids=[True, False])),
    ("big-int", _llm(5, token_ids=[1 << 70])),  # beyond int64: pickled (allow_pickle) or refused
    ("big-scalar", _llm(6, logprob=1 << 64)),
    ("other-order", {"token_ids": [1], "text": "a", "logprob": 1.0, "finish_reason": "stop"}),
    ("floats", _llm(7, token_ids=[1.5, 2.0])),
    ("int-logprob", _llm(8, logprob=3)),
    ("empty-text", _llm(9, text="")),
    ("extra-key", {**_llm(10), "extra": 1}),
    ("nested", _llm(11, token_ids=[[1, 2], [3, 4]])),
]


def _assert_stored_as_walked(root: str, frames: list[tuple[str, int, Any]]) -> None:
    """Each ``(filename, frame, value)``'s stored layouts and bytes in the committed spill at
    ``root`` are what ``flatten`` (the general walk, ``allow_pickle``) makes of the value."""
    got = read_spill(root)
    for name, frame, v in frames:
        want = {
            lf.path: (
                FS.Layout(lf.path, lf.dtype, lf.shape, lf.pos),
                decode(FS.Layout(lf.path, lf.dtype, lf.shape), raw(lf)),
            )
            for lf in flatten(v, name, frame, allow_pickle=True)
        }
        row = got[(name, frame)]
        assert row.keys() == want.keys(), name
        for path, (lay, value) in want.items():
            assert row[path][0] == lay, (name, path)
            assert repr(row[path][1]) == repr(value), (name, path)


def test_python_dicts_of_one_structure_are_stored_as_the_general_walk_stores_them(tmp_path):
    """write() converts a flat dict of Python values like the last new file's (an LLM output:
    text, token ids, logprob, finish reason) without the walk: every frame's stored layouts and
    bytes are what ``flatten`` makes of it, whatever lengths its text and lists have and
    wherever a value of another kind or order (empty list, None, bools, ints beyond int64,
    floats, another key order, one more key) breaks the structure; all of it reads back equal,
    with its types and key order."""
    values = {f"p{i:04d}": _llm(i) for i in range(300)}
    for j, (name, v) in enumerate(_PY_CASES):
        values[f"p{20 * j + 7:04d}-{name}"] = v  # between frames of the common structure
    values = dict(sorted(values.items()))
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root, allow_pickle=True) as w:
        for name, v in values.items():
            w.write(name, 0, v)
        w.write("p0001", 1, _llm(1))  # a second frame of a file: the general way
        with pytest.raises(spillmerge.SpillValueError, match="lone surrogate"):
            w.write("bad", 0, _llm(3, text="a\udcff"))
    _assert_stored_as_walked(root, [*((n, 0, v) for n, v in values.items()), ("p0001", 1, _llm(1))])
    spillmerge.merge(root, out)
    res = spillmerge.open(out, allow_pickle=True)
    back = {f: v for f, fr, v in res.iter_values() if fr == 0}
    assert back.keys() == values.keys()
    for name, v in values.items():
        assert value_diffs(back[name], v, strict=True) == [], name  # types, content, key order


class _Int(int):
    pass


def test_long_number_lists_are_stored_as_the_general_walk_stores_them_whatever_item_breaks_them(tmp_path):
    """write() converts a list of ints or floats of marshalled.SHORT items or more (token ids) with
    marshal: an item of another exact type anywhere in it (a bool, a float among ints, an int
    among floats, None, a str of an int's or a float's marshal size, an int past 32 or 64 bits,
    an int subclass) makes what the general walk makes, as in a short list; NaN, -0.0 and the
    infinities keep their bits. All of it reads back equal, with its types."""
    ints = list(range(-40, 60))
    floats = [x / 3 for x in ints] + [float("nan"), -0.0, float("inf"), -float("inf")]
    odd = [True, 2.5, 7, None, "", "abcd", 1 << 31, -(1 << 31) - 1, (1 << 63) - 1, 1 << 70, _Int(5)]
    values = {}
    for kind, common in (("i", ints), ("f", floats)):
        values[f"{kind}"] = {"ids": common, "n": 1}
        for j, item in enumerate(odd):
            for at in (0, len(common) // 2, len(common) - 1):
                values[f"{kind}-{j:02d}-{at:03d}"] = {"ids": [*common[:at], item, *common[at + 1 :]], "n": 1}
                values[f"{kind}-{j:02d}-{at:03d}-next"] = {"ids": common[at:] + common[:at], "n": 2}  # the template's
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root, allow_pickle=True) as w:
        for name, v in values.items():
            w.write(name, 0, v)
    _assert_stored_as_walked(root, [(n, 0, v) for n, v in values.items()])
    spillmerge.merge(root, out)
    back = {f: v for f, _, v in spillmerge.open(out, allow_pickle=True).iter_values()}
    for name, v in values.items():  # the subclass comes back as the int it holds
        assert repr(back[name]) == repr({**v, "ids": [int(x) if type(x) is _Int else x for x in v["ids"]]}), name
