"""SpillWriter.write_batch: a batch is stored exactly as its row-by-row writes, or not at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import spillmerge

# Fields of the output's JSON objects that say when, where and by whom it was written, not what:
# "plan" digests the source segments' names (a new one per writer session), "session" counts
# writer sessions in this process.
_VOLATILE = {"created", "finished", "started", "written_by", "spill_root", "run_id", "time", "plan", "session"}


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in _VOLATILE}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _tree(out: Path) -> dict[str, Any]:
    """Every file under a merged output: its bytes, or for JSON its content less timestamps."""
    files: dict[str, Any] = {}
    for p in sorted(out.rglob("*")):
        if p.is_file():
            raw = p.read_bytes()
            files[str(p.relative_to(out))] = _strip(json.loads(raw)) if p.name.endswith(".json") else raw
    return files


def _merge(tmp: Path, name: str, writes: Any, **opts: Any) -> dict[str, Any]:
    # A small chunk size makes batches straddle data chunks.
    with spillmerge.SpillWriter(str(tmp / f"{name}.spill"), 0, 1, chunk_bytes=4096, **opts) as w:
        writes(w)
    w.merge(str(tmp / f"{name}.zarr"))
    return _tree(tmp / f"{name}.zarr")


def _batches(kind: str) -> list[tuple[list[str], Any, Any, list[Any]]]:
    """(filenames, batch, frame_idx, the items written row by row, built by hand) per batch."""
    g = torch.Generator().manual_seed(0)
    out = []
    for b, size in enumerate((5, 1, 7)):
        names = [f"img/{b}_{j}.jpg" for j in range(size)]
        frames: Any = None
        if kind in ("dense", "wide"):  # logits fp16, embedding bf16, an int label, a nested dict
            # dense: 1,512 bytes a frame, so frames straddle the 4 KiB chunks; wide: frames larger than a chunk
            width = 700 if kind == "dense" else 3000
            logits = torch.randn(size, width, generator=g).half()
            emb = torch.randn(size, 50, generator=g).bfloat16()
            label = torch.randint(0, 9, (size,), generator=g)
            batch = {"logits": logits, "emb": emb, "meta": {"label": label, "score": logits.float().numpy()[:, 0]}}
            rows = [
                {"logits": logits[j], "emb": emb[j], "meta": {"label": label[j], "score": logits.float().numpy()[j, 0]}}
                for j in range(size)
            ]
        elif kind == "tensor":  # a plain bfloat16 tensor, video frames with explicit indices
            batch = torch.randn(size, 3, 4, generator=g).bfloat16()
            names = [f"clip{j % 2}.mp4" for j in range(size)]
            frames = torch.arange(size) + 10 * b
            rows = [batch[j] for j in range(size)]
        elif kind == "detections":  # torchvision's list of per-image dicts, ragged
            batch = []
            for j in range(size):
                k = (j * 3 + b) % 4
                batch.append(
                    {"boxes": torch.rand(k, 4, generator=g), "labels": torch.arange(k), "scores": torch.rand(k)}
                )
            rows = [dict(d) for d in batch]
        elif kind == "text":  # strings, ragged token lists, a list of str per item; frame_idx a list
            text = [f"caption {b}-{j} " + "ü" * j for j in range(size)]
            ids = [list(range(j + 1)) for j in range(size)]
            tags = [[f"t{j}"] * (j % 3 + 1) for j in range(size)]
            batch = {"text": text, "ids": ids, "tags": tags}
            frames = [j % 2 for j in range(size)]
            names = [f"doc{b}_{j // 2}" for j in range(size)]
            rows = [{"text": text[j], "ids": ids[j], "tags": tags[j]} for j in range(size)]
        elif kind == "records":  # COCO results and generation outputs: Python dicts of one structure
            batch = [
                {
                    "image_id": 10 * b + j,  # keys out of sorted order, at both levels
                    "instances": [
                        {"score": 0.5 + i, "category_id": i, "bbox": [1.0 * i, 2.0, 3.0, 4.5], "crowd": i % 2 == 0,
                         "name": f"c{i}", "mask": [i]}
                        for i in range((j * 5 + b) % 4)  # items without instances too
                    ],
                    "text": "é" * j,
                    "token_ids": list(range(j)),
                    "tags": [f"t{i}" for i in range(j % 3)],
                    "logprob": -0.25 * j,
                    "stop": j % 2 == 0,
                    "none": None,
                    "\x1fx": j,  # a key starting with the marker
                }
                for j in range(size)
            ]  # fmt: skip
            rows = [dict(d) for d in batch]
        elif kind == "coco":  # COCO detections: records of numbers, images without any among them
            batch = [
                {
                    "image_id": 10 * b + j,  # keys out of sorted order, at both levels
                    "instances": [
                        {"score": 0.5 + i, "category_id": i, "bbox": [1.0 * i, 2.0, 3.0, 4.5 + j], "crowd": i % 2 == 0}
                        for i in range((j * 5 + b) % 4 * 40)  # rows larger than a chunk too
                    ],
                }
                for j in range(size)
            ]  # fmt: skip
            rows = [dict(d) for d in batch]
        elif kind == "flat":  # generation outputs: flat dicts of strings, scalars and number lists
            batch = [
                {
                    "text": "ü" * (j * 900 + b),  # rows and frames larger than a chunk too
                    "token_ids": list(range(-1, 3 * j + b)) if (b, j) != (2, 3) else [],  # [] is a float list
                    "logprob": -0.25 * j,
                    "stop": j % 2 == 0,
                    "mask": [j % 2 == 0, True],
                    "probs": [0.5] * (j + 1),
                    "none": None,
                    "\x1fx": j,  # a key starting with the marker
                }
                for j in range(size)
            ]  # fmt: skip
            frames = [b * j for j in range(size)]
            rows = [dict(d) for d in batch]
        else:  # a nested TensorDict
            td = pytest.importorskip("tensordict")
            x = torch.randn(size, 5, generator=g)
            batch = td.TensorDict({"x": x, "n": {"y": x[:, :2].double()}}, batch_size=[size])
            rows = [{"x": x[j], "n": {"y": x[j, :2].double()}} for j in range(size)]
        out.append((names, batch, frames, rows))
    return out


def _write_rows(w: spillmerge.SpillWriter, batches: list[tuple[list[str], Any, Any, list[Any]]]) -> None:
    """Every item of ``batches`` (as ``_batches`` makes them) written with ``write``, in order."""
    for names, _, frames, rows in batches:
        idx = [0] * len(names) if frames is None else [int(f) for f in frames]
        for name, f, row in zip(names, idx, rows, strict=True):
            w.write(name, f, row)


@pytest.mark.parametrize(
    "kind", ["dense", "wide", "tensor", "detections", "text", "records", "coco", "flat", "tensordict"]
)
def test_a_batch_is_stored_byte_for_byte_as_its_row_by_row_writes(tmp_path, kind):
    batches = _batches(kind)

    def by_row(w: spillmerge.SpillWriter) -> None:
        _write_rows(w, batches)

    def by_batch(w: spillmerge.SpillWriter) -> None:
        for names, batch, frames, _ in batches:
            w.write_batch(names, batch, frame_idx=frames)

    rows, batched = _merge(tmp_path, "rows", by_row), _merge(tmp_path, "batch", by_batch)
    assert rows.keys() == batched.keys()
    for path in rows:
        assert rows[path] == batched[path], path
    res = spillmerge.open(str(tmp_path / "batch.zarr"))
    assert len(res.filenames) > 1 and res.to_arrow().num_rows == sum(len(b[0]) for b in batches)


def test_frame_idx_none_writes_frame_0_and_a_tensor_batch_reads_back(tmp_path):
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    with spillmerge.SpillWriter(str(tmp_path / "s"), 0, 1) as w:
        w.write_batch(("a.jpg", "b.jpg", "c.jpg", "d.jpg"), x)
        w.write_batch(np.array(["e.jpg"]), {"v": np.ones((1, 3), np.float32)}["v"], frame_idx=np.array([0]))
    w.merge(str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    assert sorted(res.filenames) == ["a.jpg", "b.jpg", "c.jpg", "d.jpg", "e.jpg"]
    assert [res.frames(f).tolist() for f in res.filenames] == [[0]] * 5
    assert res["c.jpg"][0].tolist() == [6.0, 7.0, 8.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_one_element_tensors_of_any_stride_are_written(tmp_path, dtype):
    """torch calls a tensor of one element contiguous whatever its stride (``scores[i, :1]``); its
    bytes are what it holds, by ``write`` and ``write_batch`` alike."""
    base = torch.arange(8, dtype=torch.float32).reshape(2, 4).to(dtype)
    one = base.t()[2, 1:2]  # base[1, 2], shape (1,), stride 4
    with spillmerge.SpillWriter(str(tmp_path / "s"), 0, 1) as w:
        w.write("one", 0, one)
        w.write("dict", 0, {"x": one, "y": base[1, 2:3]})
        w.write_batch(["b0"], base.t()[2:3, 1:2])  # a batch of one item: base[1, 2], strides (1, 4)
        w.write_batch(["c0", "c1"], base[:, 1:2].t().contiguous().t())  # base[0, 1] and base[1, 1], strides (1, 2)
    w.merge(str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    want = base.float()
    assert res.value("one", 0, as_torch=True).float().tolist() == [want[1, 2].item()]
    got = res.value("dict", 0, as_torch=True)
    assert got["x"].float().tolist() == [want[1, 2].item()] and got["y"].float().tolist() == [want[1, 2].item()]
    assert res.value("b0", 0, as_torch=True).float().tolist() == [want[1, 2].item()]
    assert [res.value(f"c{i}", 0, as_torch=True).float().tolist() for i in (0, 1)] == [
        [want[0, 1].item()],
        [want[1, 1].item()],
    ]


_GOOD = {"logits": torch.ones(2, 3), "name": ["p", "q"]}


@pytest.mark.parametrize(
    ("names", "batch", "frames", "match"),
    [
        # leaves disagreeing in length: the first item without a value is named with its filename
        (["x0", "x1", "x2"], {"logits": torch.ones(3, 3), "name": ["p", "q"]}, None, r"leaf 'name' has 2 items.*item 2 \('x2'\)"),
        # a leaf longer than the filename list
        (["x0"], _GOOD, None, r"leaf 'logits' has 2 items but the batch has 1 filenames; its item 1 has no filename"),
        # frame_idx of the wrong length
        (["x0", "x1"], _GOOD, [0], r"2 filenames but 1 frame indices; item 1 \('x1'\) has no frame index"),
        # a value the writer refuses, deep in item 1
        (["x0", "x1"], [{"v": 1}, {"v": object()}], None, r"write_batch item 1 of 2 \('x1'\): leaf 'v' of 'x1'.*cannot store"),
        # a leaf that is not batched
        (["x0", "x1"], {"logits": torch.ones(2, 3), "model": "resnet"}, None, r"leaf 'model' is a str, not batched"),
        # a bad filename / frame index at position 1
        (["x0", 7], _GOOD, None, r"write_batch item 1 of 2: filename must be a str"),
        (["x0", "x1"], _GOOD, [0, -1], r"write_batch item 1 of 2 \('x1'\): frame_idx must be in"),
        # flat records: an int beyond int64, a lone surrogate in item 1
        (["x0", "x1"], [{"ids": [1, 2], "t": "a"}, {"ids": [1, 2**63], "t": "b"}], None, r"write_batch item 1 of 2 \('x1'\).*ids"),
        (["x0", "x1"], [{"ids": [1, 2], "t": "a"}, {"ids": [1], "t": "\ud800"}], None, r"write_batch item 1 of 2 \('x1'\).*surrogate"),
        # records whose bad item holds an empty list (it goes item by item, checked first)
        (["x0", "x1", "x2"], [{"ids": [1], "t": "a"}, {"ids": [2], "t": "b"}, {"ids": [], "t": "\ud800"}], None, r"write_batch item 2 of 3 \('x2'\).*surrogate"),
        # a dict with a non-str key deep in item 1 (a layout change between frames is no error
        # since format 3: the leaf becomes a union)
        (["x0", "x1"], [{"v": 1}, {"v": {3: 1}}], None, r"write_batch item 1 of 2 \('x1'\): dict keys must be str.*key 3 at 'v'"),
        (["x0", "x1"], [{"\ud800": 1}, {"\ud800": 2}], None, r"write_batch item 0 of 2 \('x0'\).*lone surrogate"),
        (["x0", "x1"], {"\ud800": torch.ones(2, 1)}, None, r"write_batch item 0 of 2 \('x0'\).*lone surrogate"),
        # a duplicate key inside the batch with different bytes
        (["x0", "x0"], [torch.ones(2), torch.zeros(2)], None, r"write_batch item 1 of 2 \('x0'\): frame 0 of 'x0' was already"),
        # a duplicate of a key written before the batch
        (["x1", "before0"], [torch.ones(2), torch.ones(2)], None, r"write_batch item 1 of 2 \('before0'\).*already written"),
    ],
)  # fmt: skip
def test_a_bad_batch_raises_naming_the_leaf_and_position_and_writes_nothing(tmp_path, names, batch, frames, match):
    with spillmerge.SpillWriter(str(tmp_path / "s"), 0, 1, chunk_bytes=4096) as w:
        w.write_batch(["before0", "before1"], torch.zeros(2, 2))
        with pytest.raises(spillmerge.SpillValueError, match=match) as ei:
            w.write_batch(names, batch, frame_idx=frames)
        w.write_batch(["after0"], torch.full((1, 2), 5.0))
    assert "write_batch" in str(ei.value)
    w.merge(str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    # the rows before and after the bad batch are kept; no row of the bad batch appears
    assert sorted(res.filenames) == ["after0", "before0", "before1"] and res.to_arrow().num_rows == 3
    assert res["before0"][0].tolist() == [0.0, 0.0] and res["after0"][0].tolist() == [5.0, 5.0]


def test_a_bad_batch_names_the_leaf_in_the_error_fields(tmp_path):
    with spillmerge.SpillWriter(str(tmp_path / "s"), 0, 1) as w:
        with pytest.raises(spillmerge.SpillValueError) as ei:
            w.write_batch(["a", "b", "c"], {"m": {"boxes": [torch.ones(1, 4), torch.ones(2, 4), {"k": object()}]}})
    assert (ei.value.leaf, ei.value.filename, ei.value.batch_index) == ("m/boxes/k", "c", 2)


@pytest.mark.parametrize("kind", ["list", "tensor", "records"])
def test_duplicate_policies_apply_inside_a_batch_as_row_by_row(tmp_path, kind):
    def run(name: str, policy: str, batched: bool) -> dict[str, Any]:
        def writes(w: spillmerge.SpillWriter) -> None:
            w.write("k", 0, torch.tensor([1.0]))
            names, vals = ["k", "j", "j"], [torch.tensor([2.0]), torch.tensor([3.0]), torch.tensor([4.0])]
            if kind == "records":  # flat dicts, a new file repeating inside the batch
                names, vals = ["i", "j", "j"], [{"t": "a" * i, "ids": [i] * i} for i in (2, 3, 4)]
            if batched:  # a list of per-item values, or one tensor with the batch first
                w.write_batch(names, torch.stack(vals) if kind == "tensor" else vals)
            else:
                for n, v in zip(names, vals, strict=True):
                    w.write(n, 0, v)

        return _merge(tmp_path, name, writes, on_duplicate=policy)

    for policy in ("first", "last"):
        assert run(f"r-{policy}", policy, False) == run(f"b-{policy}", policy, True)
    last = spillmerge.open(str(tmp_path / "b-last.zarr"))
    first = spillmerge.open(str(tmp_path / "b-first.zarr"))
    if kind == "records":
        assert (last.value("j", 0)["ids"], first.value("j", 0)["ids"]) == ([4] * 4, [3] * 3)
        return
    assert (last["k"][0].item(), last["j"][0].item()) == (2.0, 4.0)
    assert (first["k"][0].item(), first["j"][0].item()) == (1.0, 3.0)


def test_a_flipped_byte_in_a_batch_block_fails_the_merge_and_verify_names_it(tmp_path):
    # write_batch's rows are checked by one CRC-32C per leaf of a block (docs/FORMAT.md, checks):
    # damage anywhere in a block is caught by the merge, by `spillmerge verify` and by a
    # duplicate's byte comparison, as a per-row checksum would be.
    import shutil

    from test_cli import cli_run

    root = tmp_path / "spill"
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 300, generator=g).half()
    with spillmerge.SpillWriter(str(root), 0, 1) as w:
        w.write_batch([f"img/{i:03d}.jpg" for i in range(64)], {"logits": logits, "label": torch.arange(64)})
    commit = json.loads(next(root.glob("rank-00000/seg-*/commit.json")).read_text())
    assert commit["n_checks"] == 2  # one block checksum per leaf of the batch
    intact = tmp_path / "intact"
    shutil.copytree(root, intact)
    chunk = next(root.glob("rank-00000/seg-*/data/c/0"))
    raw = bytearray(chunk.read_bytes())
    raw[64 * 8 + 1000] ^= 0x01  # inside row 1 of "logits" (the int64 "label" block comes first)
    chunk.write_bytes(bytes(raw))
    with pytest.raises(
        spillmerge.CorruptSpillError,
        match=r"mismatch for 'img/000.jpg' frame 0 leaf 'logits' .*in the block at bytes 512..38912",
    ):
        spillmerge.merge(str(root), str(tmp_path / "out.zarr"), progress=False)
    p = cli_run("verify", str(root))
    assert p.returncode == 1 and f"CORRUPT {chunk}: checksum mismatch in a block of rows" in p.stdout, p.stdout
    p = cli_run("verify", str(intact))
    assert p.returncode == 0, p.stdout + p.stderr
    spillmerge.merge(str(intact), str(tmp_path / "ok.zarr"), progress=False)
    res = spillmerge.open(str(tmp_path / "ok.zarr"))
    assert np.array_equal(res.column("logits")[:], logits.numpy())


def _structures() -> list[dict[str, Any]]:
    """Values of new files that repeat one structure, then break it in each way write()'s
    template of the last structure checks, then repeat the new one."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 700, generator=g).half(), torch.randn(6, 40, generator=g)
    be = b[0].numpy().astype(">f4")  # the same values big-endian: stored little-endian
    return [
        {"logits": a[0], "emb": b[0]},
        {"logits": a[1], "emb": b[1]},  # the template
        {"emb": b[2], "logits": a[2]},  # the same keys inserted in another order
        {"logits": a[3].numpy(), "emb": b[3].numpy()},  # numpy arrays of the same dtypes
        {"logits": a[4].float(), "emb": b[4]},  # another dtype
        {"logits": a[5], "emb": b[5]},
        {"logits": a[0, :350], "emb": b[0]},  # another shape
        {"logits": a[:2, :4].t(), "emb": b[1]},  # not contiguous
        {"logits": a[1], "emb": b[2].clone().requires_grad_()},  # autograd: detached by the general walk
        {"logits": a[2], "emb": be},  # big-endian
        {"logits": a[3], "emb": b[3], "extra": torch.zeros(0)},  # one more key, an empty leaf
        {"logits": a[4], "emb": b[4]},
        {"logits": a[5], "emb": {"x": b[5]}},  # a nested dict
        {"logits": a[0], "emb": b[0]},
    ]


def test_write_of_a_repeated_structure_is_stored_as_the_general_walk_stores_it(tmp_path):
    # write() stages a new file whose value repeats the last new file's structure from a template
    # of it; an OrderedDict never takes that path (nor flatten_dense's): the reference.
    from collections import OrderedDict

    values = _structures()

    def fast(w: spillmerge.SpillWriter) -> None:
        for i, v in enumerate(values):
            w.write(f"img/{i:03d}.jpg", 0, v)
        w.write("img/000.jpg", 1, {"logits": values[1]["logits"], "emb": values[1]["emb"]})  # a file written before
        w.write("img/000.jpg", 0, values[0])  # the same key and bytes again: kept once

    def general(w: spillmerge.SpillWriter) -> None:
        for i, v in enumerate(values):
            w.write(f"img/{i:03d}.jpg", 0, OrderedDict(v))
        w.write("img/000.jpg", 1, OrderedDict({"logits": values[1]["logits"], "emb": values[1]["emb"]}))
        w.write("img/000.jpg", 0, OrderedDict(values[0]))

    got, want = _merge(tmp_path, "fast", fast), _merge(tmp_path, "general", general)
    assert got.keys() == want.keys()
    for path in got:
        assert got[path] == want[path], path
    res = spillmerge.open(str(tmp_path / "fast.zarr"))
    assert np.array_equal(res["img/003.jpg"]["logits"][0], values[3]["logits"])
    assert np.array_equal(res["img/009.jpg"]["emb"][0], values[9]["emb"].astype("<f4"))
    assert np.array_equal(res["img/000.jpg"]["emb"][1], values[1]["emb"].numpy())


def test_a_key_written_again_after_templated_writes_is_a_duplicate(tmp_path):
    # The index rows of templated frames are written lazily: the duplicate check reads them back.
    with pytest.raises(spillmerge.DuplicateFrameError, match="img/001.jpg"):
        with spillmerge.SpillWriter(str(tmp_path / "s"), 0, 1) as w:
            for i in range(5):
                w.write(f"img/{i:03d}.jpg", 0, {"v": torch.full((8,), float(i))})
            w.write("img/001.jpg", 0, {"v": torch.full((8,), 1.0)})  # the same bytes: kept once
            assert w.stats()["identical_rewrites"] == 1
            w.write("img/001.jpg", 0, {"v": torch.full((8,), 9.0)})


def test_a_key_starting_with_the_marker_is_stored_alike_by_write_and_write_batch(tmp_path):
    from collections import OrderedDict

    from spillmerge._format.common import MARK

    x, y = torch.arange(6.0).reshape(2, 3), torch.ones(2, 1)

    def rows(w: spillmerge.SpillWriter) -> None:
        for i, name in enumerate(["a", "b"]):
            w.write(name, 0, {MARK + "k": x[i], "y": y[i]})

    def general(w: spillmerge.SpillWriter) -> None:
        for i, name in enumerate(["a", "b"]):
            w.write(name, 0, OrderedDict({MARK + "k": x[i], "y": y[i]}))

    def batch(w: spillmerge.SpillWriter) -> None:
        w.write_batch(["a", "b"], {MARK + "k": x, "y": y})

    want = _merge(tmp_path, "general", general)
    assert _merge(tmp_path, "rows", rows) == want
    assert _merge(tmp_path, "batch", batch) == want


def test_batches_of_a_repeated_flat_structure_are_stored_as_row_by_row_writes(tmp_path):
    # write_batch stages a flat dict batch whose structure an earlier batch of new files had
    # from that batch's template; every break of the structure, and a batch naming a file
    # written before or twice, takes the general way. The reference: the same items written
    # one by one as OrderedDicts (never a template).
    from collections import OrderedDict

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(40, 700, generator=g).half(), torch.randn(40, 40, generator=g)
    be = b[:3].numpy().astype(">f4")  # big-endian values: stored little-endian
    batches: list[tuple[list[int], dict[str, Any], Any]] = [
        ([0, 1, 2], {"logits": a[0:3], "emb": b[0:3]}, None),
        ([3, 4], {"logits": a[3:5], "emb": b[3:5]}, None),  # the template's
        ([5, 6, 7], {"emb": b[5:8], "logits": a[5:8]}, [0, 2, 1]),  # keys in another order, frame indices
        ([8, 9], {"emb": b[8:10], "logits": a[8:10]}, None),  # that order again
        ([10], {"logits": a[10:11].numpy(), "emb": b[10:11].numpy()}, None),  # numpy arrays
        ([11, 12], {"logits": a[11:13].numpy(), "emb": b[11:13].numpy()}, None),
        ([13, 14], {"logits": a[13:15].float(), "emb": b[13:15]}, None),  # another dtype
        ([15, 16], {"logits": a[15:17, :350], "emb": b[15:17]}, None),  # another item shape
        ([17, 18], {"logits": a[17:19, ::2], "emb": b[17:19]}, None),  # not contiguous
        ([19, 20], {"logits": a[19:21], "emb": b[19:21].clone().requires_grad_()}, None),  # autograd
        ([21, 22, 23], {"logits": a[21:24], "emb": be}, None),  # big-endian
        ([24, 25], {"logits": a[24:26], "emb": b[24:26], "extra": torch.zeros(2, 0)}, None),  # an empty leaf
        ([26, 0], {"logits": a[26:28], "emb": b[26:28]}, [0, 5]),  # a file written before, another frame
        ([27, 27], {"logits": a[28:30], "emb": b[28:30]}, [0, 1]),  # one file twice in the batch
        ([28, 29], {"logits": a[30:32], "emb": b[30:32]}, None),  # the template's again
    ]

    def rows(w: spillmerge.SpillWriter, general: bool) -> None:
        for files, batch, frames in batches:
            for j, f in enumerate(files):
                item = {k: v[j] for k, v in batch.items()}
                w.write(f"img/{f:03d}.jpg", 0 if frames is None else frames[j], OrderedDict(item) if general else item)

    def batched(w: spillmerge.SpillWriter) -> None:
        for files, batch, frames in batches:
            w.write_batch([f"img/{f:03d}.jpg" for f in files], batch, frame_idx=frames)

    want = _merge(tmp_path, "general", lambda w: rows(w, True))
    got = _merge(tmp_path, "batch", batched)
    assert got.keys() == want.keys()
    for path in want:
        assert got[path] == want[path], path
    res = spillmerge.open(str(tmp_path / "batch.zarr"))
    assert np.array_equal(res["img/006.jpg"]["logits"][0], a[6].numpy())
    assert np.array_equal(res["img/023.jpg"]["emb"][0], be[2].astype("<f4"))
    assert res.frames("img/000.jpg").tolist() == [0, 5] and res.frames("img/027.jpg").tolist() == [0, 1]


def test_a_flat_batch_repeating_a_written_file_is_refused_whole(tmp_path):
    # A batch of the template's structure that names a file written before with other bytes:
    # DuplicateFrameError naming it, nothing of the batch staged, the rows before it kept.
    x = torch.arange(12.0).reshape(6, 2)
    with spillmerge.SpillWriter(str(tmp_path / "s"), 0, 1) as w:
        w.write_batch(["a", "b"], {"v": x[0:2]})
        w.write_batch(["c", "d"], {"v": x[2:4]})
        with pytest.raises(spillmerge.DuplicateFrameError, match=r"write_batch item 1 of 2 \('a'\)") as ei:
            w.write_batch(["e", "a"], {"v": x[4:6]})
        assert ei.value.batch_index == 1
        w.write_batch(["e", "f"], {"v": x[4:6]})
    w.merge(str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    assert list(res.filenames) == ["a", "b", "c", "d", "e", "f"]
    assert res.column("v")[:].tolist() == x.tolist()


def test_a_flat_batch_of_a_known_structure_with_a_short_leaf_names_it_and_writes_nothing(tmp_path):
    # After a batch of new files taught the writer a flat dict's structure, a batch of the same
    # keys whose leaf has the wrong length is refused by name, as the general way refuses it.
    x = torch.arange(20.0).reshape(10, 2)
    with spillmerge.SpillWriter(str(tmp_path / "s"), 0, 1) as w:
        w.write_batch(["a", "b"], {"v": x[0:2], "w": x[0:2, 0]})
        w.write_batch(["c", "d"], {"v": x[2:4], "w": x[2:4, 0]})
        with pytest.raises(
            spillmerge.SpillValueError, match=r"leaf 'w' has 1 items.*item 1 \('f'\) has no value"
        ) as ei:
            w.write_batch(["e", "f"], {"v": x[4:6], "w": x[4:5, 0]})
        assert (ei.value.leaf, ei.value.filename) == ("w", "f")
        w.write_batch(["e", "f"], {"v": x[4:6], "w": x[4:6, 0]})
    w.merge(str(tmp_path / "o"))
    res = spillmerge.open(str(tmp_path / "o"))
    assert list(res.filenames) == ["a", "b", "c", "d", "e", "f"]
    assert res.column("v")[:].tolist() == x[:6].tolist() and res.column("w")[:].tolist() == x[:6, 0].tolist()


def test_the_cuda_batch_copy_keeps_item_containers_and_leaves_odd_batches_alone():
    """``_batch.cuda_to_host``'s walk, on host tensors standing for CUDA ones (the copy itself
    runs in tests/e2e/test_gpu.py): above the items a mapping becomes a dict; inside an item dicts,
    lists and tuples keep their type; a dataclass, a namedtuple or a dict subclass inside an
    item, or a mapping with keys other than str, leaves the batch to the item-by-item path."""
    import collections
    import dataclasses

    from spillmerge._write import batch as _batch

    a, b = torch.zeros(2), torch.ones(2)
    swap = {id(a): b}
    batch = [{"pair": (a, "x"), "ids": [a, 1]}, {"pair": (a, "y"), "ids": []}]
    out = _batch._replace(batch, swap)
    assert type(out) is list and type(out[0]) is dict and type(out[0]["pair"]) is tuple
    assert type(out[0]["ids"]) is list and out[0]["pair"][0] is b and out[0]["ids"][0] is b
    assert out[0]["pair"][1] == "x" and out[1]["ids"] == []
    assert _batch._cuda_leaves(batch, [], 0) is True

    @dataclasses.dataclass
    class Box:
        x: torch.Tensor

    Pair = collections.namedtuple("Pair", "x y")
    assert _batch._cuda_leaves({"b": Box(a)}, [], 0) is False
    assert _batch._cuda_leaves([Pair(a, a)], [], 0) is False
    assert _batch._cuda_leaves([collections.OrderedDict(x=a)], [], 0) is False
    assert _batch._cuda_leaves({1: a}, [], 0) is False
    assert _batch._cuda_leaves({"top": collections.OrderedDict(x=a)}, [], 0) is True  # above the items
    assert _batch.cuda_to_host(batch) is batch  # host tensors: nothing to copy
    # the first tensor is found past a leaf of strings, not only down the first branch
    assert _batch._first_tensor({"text": ["x", "y"], "emb": b}, 0) is b


def test_many_numbers_with_an_odd_item_anywhere_are_stored_as_row_by_row_writes(tmp_path):
    """write_batch converts a column of marshalled.SHORT numbers or more (token ids, the boxes and
    ids of detections) with marshal: an item of another exact type anywhere in one (a bool, a
    float among ints, an int among floats, None, a str of an int's or a float's marshal size, an
    int past 32 or 64 bits) stores the batch exactly as its row-by-row writes store it."""
    odd = [True, 2.5, 7, None, "", "abcd", 1 << 31, -(1 << 31) - 1, 1 << 70]
    batches = []
    for j, item in enumerate(odd):
        for column in ("ids", "box", "cls"):
            items = [
                {"ids": list(range(i, 30 + i)), "dets": [{"box": [0.5 * k, 2.0], "cls": k} for k in range(20 + i)]}
                for i in range(3)
            ]
            at = items[j % 3]
            if column == "ids":
                at["ids"][-1 - j] = item
            elif column == "box":
                at["dets"][j]["box"][j % 2] = item
            else:
                at["dets"][-1 - j]["cls"] = item
            batches.append(([f"{column}-{j}-{i}" for i in range(3)], items))

    def by_row(w: spillmerge.SpillWriter) -> None:
        for names, items in batches:
            for name, item in zip(names, items, strict=True):
                w.write(name, 0, item)

    def by_batch(w: spillmerge.SpillWriter) -> None:
        for names, items in batches:
            w.write_batch(names, items)

    rows = _merge(tmp_path, "rows", by_row, allow_pickle=True)
    assert rows == _merge(tmp_path, "batch", by_batch, allow_pickle=True)


_VALUE_KINDS = {
    "str": st.text(max_size=40),
    "int": st.integers(min_value=-(2**64), max_value=2**64),  # past int64 too: item by item, named
    "float": st.floats(allow_nan=False),
    "bool": st.booleans(),
    "none": st.none(),
    "ints": st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=6),
    "floats": st.lists(st.floats(allow_nan=False), max_size=6),
    "bools": st.lists(st.booleans(), min_size=1, max_size=6),
    "strs": st.lists(st.text(max_size=8), max_size=4),
    "records": st.lists(
        st.fixed_dictionaries(
            {
                "s": st.floats(allow_nan=False),
                "c": st.integers(-5, 5),
                "bb": st.lists(st.floats(0, 9), min_size=2, max_size=2),
                "n": st.text(max_size=4),
            }
        ),
        max_size=3,
    ),
}


@st.composite
def _flat_batch(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Flat dicts of one key order, each key of one kind (or, rarely, of two)."""
    keys = draw(st.lists(st.sampled_from(["b", "a", "text", "\x1fm", "z", "ids"]), min_size=1, max_size=4, unique=True))
    kinds = {k: draw(st.sampled_from(sorted(_VALUE_KINDS))) for k in keys}
    mixed = draw(st.sampled_from([None, *keys])) if draw(st.booleans()) else None
    n = draw(st.integers(min_value=1, max_value=8))
    return [{k: draw(_VALUE_KINDS["str" if k == mixed and i == n - 1 else kinds[k]]) for k in keys} for i in range(n)]


@given(batches=st.lists(_flat_batch(), min_size=1, max_size=3))
@example(  # the writers meet the layouts of the last two files in the other order
    batches=[
        [{"b": b, "text": "", "a": False, "\x1fm": False} for b in ([], [0.0], [0.0])],
        [{"b": []}, {"b": ""}],
    ]
)
@example(  # they meet the variants of "\x1fm" in the other order: [] must join the same one either way
    batches=[
        [{"b": None, "a": None, "text": True, "\x1fm": False}, {"b": "ý", "a": None, "text": True, "\x1fm": False}],
        [
            {"z": [0.0] * 6, "b": False, "\x1fm": [], "a": None},
            {"z": [0.0] * 3, "b": False, "\x1fm": [0] * 6, "a": None},
            {"z": [0.0] * 2, "b": False, "\x1fm": [0] * 6, "a": None},
        ],
        [{"\x1fm": [0.0], "b": False, "a": False, "text": False}],
    ]
)
def test_batches_of_flat_records_are_stored_as_row_by_row_writes_or_refused_alike(tmp_path_factory, batches):
    tmp = tmp_path_factory.mktemp("flat")
    names = [[f"f{b}-{i}" for i in range(len(batch))] for b, batch in enumerate(batches)]
    refused: dict[str, list[str | None]] = {"rows": [], "batch": []}

    def by_row(w: spillmerge.SpillWriter) -> None:
        for b, batch in enumerate(batches):
            try:
                for name, item in zip(names[b], batch, strict=True):
                    w.write(name, 0, item)
            except spillmerge.SpillValueError as exc:
                refused["rows"].append(exc.filename)

    def by_batch(w: spillmerge.SpillWriter) -> None:
        for b, batch in enumerate(batches):
            try:
                w.write_batch(names[b], batch)
            except spillmerge.SpillValueError as exc:
                refused["batch"].append(exc.filename)

    with spillmerge.SpillWriter(str(tmp / "rows.spill"), 0, 1, chunk_bytes=4096) as w:
        by_row(w)
    with spillmerge.SpillWriter(str(tmp / "batch.spill"), 0, 1, chunk_bytes=4096) as w:
        by_batch(w)
    assert refused["rows"] == refused["batch"]  # the same first bad item named
    if not refused["rows"]:
        assert _merge(tmp, "r", by_row) == _merge(tmp, "b", by_batch)
