"""Format version 3's value model (issue 23): anything built from dicts, lists, tuples, scalars,
str, bytes, None, tensors and arrays is written without pickle and read back by ``res.value()``
equal in type and content, with kind, dtype, shape and structure free to differ between frames
and files; bad input names filename, frame and path, and loses nothing committed."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import value_diffs

import spillmerge


def same(got: Any, want: Any) -> bool:
    """Equal in type and content (a tensor reads back as a numpy array of its dtype and shape)."""
    return value_diffs(got, want) == []


VALUES: dict[str, Any] = {
    "dict-of-scalars": {"key1": 3, "key2": 4.5, "key3": {"nested": True}, "c": 1 + 2j},
    "str": "foo",
    "bytes": b"\x00raw",
    "none": None,
    "mixed-list": [1, 2, True, "string", [4, 5, "nested"]],
    "tuple": (1, 2.5, None, b"x", "s"),
    "list-of-tensors": [torch.arange(3), torch.zeros(2, 2), torch.tensor(7.0)],
    "tuple-of-tensors": (torch.rand(1, 5), torch.rand(1, 5)),
    "zero-d": torch.tensor(3),
    "bf16": torch.ones(2, 3, dtype=torch.bfloat16),
    "numpy": np.arange(6, dtype=np.uint16).reshape(2, 3),
    "per-image": [
        {"boxes": torch.rand(2, 4), "labels": torch.tensor([1, 2]), "scores": torch.rand(2)},
        {"boxes": torch.rand(0, 4), "labels": torch.zeros(0, dtype=torch.int64), "scores": torch.rand(0)},
    ],
    "coco": [{"bbox": [1.0, 2.0, 3.0, 4.0], "category_id": 3}, {"bbox": [5.0, 6.0, 7.0, 8.0], "category_id": 1}],
    "nested": {"a": [{"b": (1, [2, {"c": None}])}], "e": {}, "l": [], "ll": [[1, 2], [3, 4]], "t": ((1,),)},
    "empty-dict": {},
    "empty-tuple": (),
    "strs": ["a", "", "b\x00c"],
    "floats-and-ints": [1, 2.5],
    "big-int-in-list": [1, 2**62],
    "marker-key": {"\x1fodd": 1, "\x1f": [2]},
}


def _write_merge(tmp_path: Path, frames: dict[tuple[str, int], Any], **kw: Any) -> Any:
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root, **kw) as w:
        for (name, frame), v in frames.items():
            w.write(name, frame, v)
    spillmerge.merge(root, out)
    return spillmerge.open(out, allow_pickle=kw.get("allow_pickle", False))


def test_every_kind_reads_back_equal_in_type_and_content(tmp_path: Path) -> None:
    res = _write_merge(tmp_path, {(k, 0): v for k, v in VALUES.items()})
    for name, want in VALUES.items():
        got = res.value(name)
        assert same(got, want), (name, got, want)
    assert type(res.value("dict-of-scalars")["key1"]) is int and type(res.value("mixed-list")[2]) is bool
    # the leaf views keep working beside value(): a one-type leaf is the column format 2 made
    assert res["numpy"][0].shape == (2, 3) and res["str"][0] == "foo"


def test_kind_dtype_shape_and_structure_differ_between_frames_and_files(tmp_path: Path) -> None:
    frames = {
        ("decoded.mp4", 0): {"result": torch.ones(3, 4, 4, dtype=torch.float16)},
        ("decoded.mp4", 1): {"result": torch.ones(5)},  # float32, 1-d
        ("decoded.mp4", 2): {"result": "corrupt header"},
        ("decoded.mp4", 3): {"result": [torch.ones(2), "x"]},  # a list where a value was
        ("decoded.mp4", 4): {"result": None},
        ("broken.mp4", 0): {"result": "corrupt header"},
        ("audio.wav", 0): {"result": np.zeros((2, 100), dtype=np.int16)},
        ("other", 0): 5,
        ("other", 1): (5,),
        ("other", 2): [5],
    }
    res = _write_merge(tmp_path, frames)
    for (name, frame), want in frames.items():
        assert same(res.value(name, frame), want), (name, frame)
    with pytest.raises(KeyError, match="no frame 7"):
        res.value("decoded.mp4", 7)


def test_value_as_torch_gives_tensors(tmp_path: Path) -> None:
    want = {"x": [torch.arange(4), torch.ones(2, dtype=torch.bfloat16)], "n": 2}
    res = _write_merge(tmp_path, {("f", 0): want})
    got = res.value("f", as_torch=True)
    assert got["n"] == 2 and torch.equal(got["x"][0], want["x"][0])
    assert got["x"][1].dtype == torch.bfloat16 and torch.equal(got["x"][1], want["x"][1])


def test_ml_dtypes_arrays_are_stored_as_the_torch_dtype_of_their_name(tmp_path: Path) -> None:
    # What value() returns for a bfloat16 / float8 tensor (an ml_dtypes array) is a value too:
    # write() and write_batch() store it as the tensor's bits, not refuse it for its numpy kind.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bits = np.array([0x3FC0, 0x8000, 0x7FC1, 0xFF80], dtype=np.uint16)  # 1.5, -0.0, a NaN payload, -inf
    arrays = {
        "bfloat16": bits.view(ml_dtypes.bfloat16),
        "float8_e4m3fn": np.array([0x3C, 0x80, 0x7F], np.uint8).view(ml_dtypes.float8_e4m3fn),
        "float8_e5m2": np.array([0x3C, 0x80, 0x7F], np.uint8).view(ml_dtypes.float8_e5m2),
    }
    want = {"zero-d": np.array(1.5, ml_dtypes.bfloat16), "strided": bits.view(ml_dtypes.bfloat16)[::2], **arrays}
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root, fsync=False) as w:
        for name, arr in want.items():
            w.write(name, 0, arr)
        w.write_batch(["batch"], [{"x": arrays["bfloat16"]}])
        w.write("tensor", 0, torch.from_numpy(bits).view(torch.bfloat16))
    spillmerge.merge(root, out, progress=False, fsync=False)
    res = spillmerge.open(out)
    for name, arr in [*want.items(), ("batch", arrays["bfloat16"]), ("tensor", arrays["bfloat16"])]:
        got = res.value(name)
        got = got["x"] if name == "batch" else got
        assert got.dtype == arr.dtype and got.shape == arr.shape and got.tobytes() == arr.tobytes(), name
    assert res.value("tensor", as_torch=True).dtype == torch.bfloat16


class Opaque:
    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


@dataclasses.dataclass
class Pred:
    ids: list[int]
    note: str


def test_allow_pickle_applies_at_any_depth_and_only_to_other_objects(tmp_path: Path) -> None:
    want = {"items": [1, Opaque(2), {"deep": (Opaque(3), "s")}], "big": 2**70}
    res = _write_merge(tmp_path, {("f", 0): want, ("g", 0): Pred([1, 2], "n")}, allow_pickle=True)
    assert same(res.value("f"), want)
    assert res.value("g") == {"ids": [1, 2], "note": "n"}  # a dataclass reads as the dict of its fields
    kinds = {c.info.dtype for c in res.files.columns.values()}
    assert "pickle" in kinds and "pyint" in kinds  # the int 1 and the list [1, 2] are not pickled
    closed = spillmerge.open(str(tmp_path / "o"))
    with pytest.raises(spillmerge.PickleNotAllowedError):
        closed.value("f")


def _cycle() -> dict[str, Any]:
    d: dict[str, Any] = {"a": [1]}
    d["a"].append(d)
    return d


@pytest.mark.parametrize(
    "value, where, match",
    [
        ({"a": [{1: 2}]}, "a/[0]", "dict keys must be str"),
        ({"a": {"ok": 1, "\ud800": 2}}, "a", "lone surrogate"),  # no UTF-8: the catalog could not be written
        ({"r": [{"\udc80": 1}, {"\udc80": 2}]}, "r/[0]", "lone surrogate"),  # records: a column a key
        (_cycle(), "a/[1]", "cycle"),
        ({"g": [(x for x in ())]}, "g/[0]", "generator"),
        ({"o": (1, Opaque(1))}, "o/[1]", "without pickle"),
    ],
)
def test_bad_input_names_filename_frame_and_path_and_loses_nothing(
    tmp_path: Path, value: Any, where: str, match: str
) -> None:
    root = str(tmp_path / "s")
    with spillmerge.SpillWriter(root) as w:
        w.write("f", 0, {"ok": [1, "a"]})
        with pytest.raises(spillmerge.SpillValueError, match=match) as info:
            w.write("f", 3, value)
        err = info.value
        assert (err.filename, err.frame_idx, err.leaf) == ("f", 3, where), (err.filename, err.frame_idx, err.leaf)
        assert "'f' frame 3" in str(err) and repr(where) in str(err)
        w.write("f", 4, {"ok": [2, "b"]})  # the writer stays usable
    spillmerge.merge(root, str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    assert res.frames("f").tolist() == [0, 4] and res.value("f", 4) == {"ok": [2, "b"]}


@pytest.mark.parametrize("in_list", [False, True], ids=["leaf", "list-items"])
def test_a_row_valid_in_two_variants_is_refused_by_open_and_verify(tmp_path: Path, in_list: bool) -> None:
    """The variant columns' ``valid`` arrays are the union's type ids: damaged so that a row has
    a value in two variants of one leaf (or a list's item in two variants of the items), the
    output is refused (docs/FORMAT.md, *Invariants*)."""
    import zarr
    from test_cli import cli_run

    value = [1.5, "corrupt header"] if in_list else "corrupt header"
    res = _write_merge(tmp_path, {("f", 0): {"result": torch.ones(2)}, ("f", 1): {"result": value}})
    assert res.value("f", 1) == {"result": value}
    out = tmp_path / "o"
    (col,) = (out / "columns").glob("result*.str")
    valid = zarr.open_array(str(col / "valid"), mode="r+")
    valid[:] = True  # row (item) 0 now has a value in two variants, one of them str
    with pytest.raises(spillmerge.CorruptSpillError, match="more than one variant"):
        spillmerge.open(str(out))
    done = cli_run("verify", str(out))
    assert done.returncode != 0 and "more than one variant" in done.stdout + done.stderr, done.stdout + done.stderr


def test_a_damaged_list_length_is_refused_not_built(tmp_path: Path) -> None:
    """A list header's length is checked against the item columns its file has: a hostile
    length cannot make ``value()`` build a huge list."""
    import zarr

    res = _write_merge(tmp_path, {("f", 0): {"l": [1, "a"]}})
    assert res.value("f") == {"l": [1, "a"]}
    header = next(c for c in res.files.columns.values() if c.info.dtype == "pylist")
    arr = zarr.open_array(str(tmp_path / "o" / "columns" / header.info.name / "values"), mode="r+")
    arr[:] = 10**9
    with pytest.raises(spillmerge.CorruptSpillError, match="has 1000000000 items"):
        spillmerge.open(str(tmp_path / "o")).value("f")
    with pytest.raises(spillmerge.CorruptSpillError, match="has 1000000000 items"):
        list(spillmerge.open(str(tmp_path / "o")).iter_values())


def test_iter_values_gives_every_row_in_order_as_value_gives_it(tmp_path: Path) -> None:
    # Every kind of VALUES, frames whose kinds differ within a file, and enough files and rows to
    # cross iter_values' blocks of files (1,024) and of rows (4,096) inside a file of many frames.
    frames: dict[tuple[str, int], Any] = {(k, 0): v for k, v in VALUES.items()}
    kinds = list(VALUES.values())
    for j in range(1500):
        frames[(f"many-{j:05d}", 0)] = kinds[j % len(kinds)]
    for f in range(3000):  # one file of 3,000 frames, straddling the row blocks
        frames[("video.mp4", f)] = {"n": f, "box": torch.full((f % 3, 4), float(f)), "tag": None if f % 7 else "k"}
    res = _write_merge(tmp_path, frames)
    got = list(res.iter_values())
    want = [(name, frame, res.value(name, frame)) for name in res.filenames for frame in res.frames(name).tolist()]
    assert [(n, f) for n, f, _ in got] == [(n, f) for n, f, _ in want] and len(got) == len(frames)
    for (name, frame, g), (_, _, w) in zip(got, want, strict=True):
        assert same(g, w) and same(g, frames[(name, frame)]), (name, frame, g, w)
    torch_got = {(n, f): v for n, f, v in res.iter_values(as_torch=True) if n in ("list-of-tensors", "bf16")}
    assert torch.equal(torch_got[("bf16", 0)], VALUES["bf16"]) and torch_got[("bf16", 0)].dtype == torch.bfloat16
    assert all(
        torch.equal(a, b) for a, b in zip(torch_got[("list-of-tensors", 0)], VALUES["list-of-tensors"], strict=True)
    )


def test_iter_values_reads_large_rows_one_by_one_and_keeps_the_pickle_rule(tmp_path: Path) -> None:
    # two 20 MiB rows: more than a block holds at once (32 MiB), read as value() reads them
    big = {("big", f): {"x": torch.full((5 << 20,), float(f)), "o": Opaque(f)} for f in range(2)}
    res = _write_merge(tmp_path, big, allow_pickle=True)
    for name, frame, v in res.iter_values():
        assert same(v, big[(name, frame)])
    closed = spillmerge.open(str(tmp_path / "o"))
    with pytest.raises(spillmerge.PickleNotAllowedError):
        list(closed.iter_values())


def test_iter_values_unpickles_nothing_unasked_and_refuses_only_the_pickled_row(tmp_path: Path) -> None:
    # a leaf pickled in one frame and an int in the other: without allow_pickle, the int's row
    # reads (as value() reads it) and the pickled row is refused when it is reached
    res = _write_merge(tmp_path, {("f", 0): {"u": 1}, ("f", 1): {"u": Opaque(2)}}, allow_pickle=True)
    closed = spillmerge.open(str(tmp_path / "o"))
    rows = closed.iter_values()
    assert next(rows) == ("f", 0, {"u": 1}) and closed.value("f", 0) == {"u": 1}
    with pytest.raises(spillmerge.PickleNotAllowedError):
        next(rows)
    assert [v for _, _, v in res.iter_values()] == [{"u": 1}, {"u": Opaque(2)}]


class Holder:
    def __init__(self, **tensors: Any) -> None:
        self.__dict__.update(tensors)


def test_tensors_inside_pickled_objects_come_back_as_torch_pickles_them(tmp_path: Path) -> None:
    # spillmerge pickles plain CPU tensors through numpy (much cheaper than torch's torch.save of
    # each storage); every other tensor takes torch's reduce: all come back equal in type and content
    tagged = torch.arange(3)
    tagged.note = "kept"  # type: ignore[attr-defined]
    tensors = {
        "f32": torch.randn(3, 3), "i64": torch.arange(5), "bool": torch.tensor([True, False]),
        "zero_d": torch.tensor(2.5), "empty": torch.zeros(0, 4), "c64": torch.randn(2, dtype=torch.complex64),
        "bf16": torch.randn(2, 3).to(torch.bfloat16), "strided": torch.arange(12).reshape(3, 4).t(),
        "grad": torch.ones(2, requires_grad=True), "param": torch.nn.Parameter(torch.ones(2)),
        "conj": torch.randn(2, dtype=torch.complex64).conj(), "tagged": tagged,
        "offset": torch.arange(10)[4:],
    }  # fmt: skip
    res = _write_merge(tmp_path, {("f", 0): Holder(**tensors)}, allow_pickle=True)
    got = res.value("f").__dict__
    for k, want in tensors.items():
        g = got[k]
        assert type(g) is type(want) and g.dtype == want.dtype and g.shape == want.shape, k
        assert torch.equal(g.detach().resolve_conj(), want.detach().resolve_conj()), k
        assert g.requires_grad == want.requires_grad and g.is_conj() == want.is_conj(), k
    assert got["strided"].stride() == tensors["strided"].stride() and got["tagged"].note == "kept"
    assert got["f32"].numpy().flags.writeable  # a tensor that owns writable memory


def _exact(got: Any, want: Any, at: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` in type, dict key order, length or value (floats by
    their bits: NaN and -0.0 included)."""
    if type(got) is not type(want):
        return [f"{at}: {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{at}: keys {list(got)} != {list(want)}"]
        return [d for k in want for d in _exact(got[k], want[k], f"{at}/{k}")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{at}: {len(got)} items != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in _exact(g, w, f"{at}[{i}]")]
    if isinstance(want, float):
        return [] if struct.pack("<d", got) == struct.pack("<d", want) else [f"{at}: {got!r} != {want!r}"]
    return [] if got == want else [f"{at}: {got!r} != {want!r}"]


PAYLOAD_SHAPES: dict[str, Any] = {
    "number-kinds-mixed": [1, 2.0, True, False, 3, -0.0],
    "bools-then-int": [True, 1],
    "ints-near-int64-limits": [2**63 - 1, -(2**63), 0],
    "floats-nan-negzero": [float("nan"), -0.0, 0.0, float("inf"), -1.5e308],
    "empty-lists": {"a": [], "b": [[]], "c": [[], [1]], "d": [[], []]},
    "dicts-differing-keys": [{"a": 1}, {"b": 2.0}, {"a": 3, "b": None}, {}],
    "dicts-same-keys-other-order": [{"x": 1, "y": 2}, {"y": 3, "x": 4}],
    "nested-lists-of-dicts": [[{"x": 1, "y": [1.0, 2.0]}], [], [{"x": 2, "y": []}, {"x": 3, "y": [0.5]}]],
    "records-column-mixes-int-and-float": [{"s": 1, "t": "a"}, {"s": 2.5, "t": "b"}],
    "records-column-of-tuples": [{"p": (1, 2)}, {"p": (3, 4)}],
    "records-column-none-and-str": [{"n": None, "u": "é数\U0001f600"}, {"n": "x", "u": ""}],
    "coco-images": [
        {"image_id": 7, "instances": [
            {"image_id": 7, "category_id": 3, "bbox": [1.0, 2.5, 30.25, 40.0], "score": 0.93},
            {"image_id": 7, "category_id": 1, "bbox": [0.0, -0.0, 1e-300, 2.0], "score": float("nan")},
        ]},
        {"image_id": 8, "instances": []},
        {"image_id": 9, "instances": [{"image_id": 9, "category_id": 2, "bbox": [1, 2, 3, 4], "score": 1}]},
    ],
    "llm-outputs": {
        "p-1": {"text": "a\x00b é", "token_ids": [5, 2**40, 0], "logprob": -1.25, "finish_reason": "stop"},
        "p-0": {"text": "", "token_ids": [], "logprob": -0.0, "finish_reason": None},
    },
    "ragged-number-rows": [[1, 2, 3], [4], [], [5, 6]],
    "list-items-number-lists-absent": [{"v": [1, 2]}, {"w": 3}, {"v": None}, {"v": []}, {"v": [[1.5]], "w": 1}],
    "rows-of-bools": [[True, False], [False, True]],
    "tuples-of-numbers": [(1, 2), (3, 4)],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PAYLOAD_SHAPES))
def test_python_payload_shapes_come_back_exactly(tmp_path: Path, name: str) -> None:
    """Every shape the column-wise paths take (and the ones they must leave to the item walk)
    comes back exactly, by ``value()`` and by ``iter_values()``: types, key order, list order,
    float bits."""
    want = PAYLOAD_SHAPES[name]
    other = {"k": [{"image_id": 1, "score": 0.5}], "z": [1.0, 2.0]}  # another file, another layout
    store = _write_merge(tmp_path, {("a", 0): want, ("a", 1): want, ("b", 0): other, ("c", 0): want})
    assert _exact(store.value("a", 0), want) == []
    assert _exact(store.value("c", 0), want) == []
    got = list(store.iter_values())
    assert [(n, f) for n, f, _ in got] == [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    for (_, _, v), w in zip(got, [want, want, other, want], strict=True):
        assert _exact(v, w) == []


def test_a_lone_surrogate_in_a_records_column_is_refused_naming_the_frame(tmp_path: Path) -> None:
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        with pytest.raises(spillmerge.SpillValueError, match=r"frame 3.*not valid Unicode|not valid Unicode.*frame 3"):
            w.write("f", 3, [{"t": "ok"}, {"t": "bad\udc80"}])
        w.write("f", 4, [{"t": "ok"}])
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"))
    assert spillmerge.open(str(tmp_path / "o")).value("f", 4) == [{"t": "ok"}]
