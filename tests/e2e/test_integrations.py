"""In-process integrations: TensorDict / dataclass values, the Lightning callback on one process
(pytorch_lightning flavour, custom key_fn, failure record), missing-dependency hints, and reading
merged stores with numpy / torch (no extra copy), xarray and tensorstore."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import raw_bytes

import spillmerge


def _merge(tmp_path, frames: dict[str, dict[int, object]]) -> spillmerge.MergedStore:
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for name, values in frames.items():
            for f, v in values.items():
                w.write(name, f, v)
    spillmerge.merge(str(root), str(out))
    return spillmerge.open(str(out))


@dataclasses.dataclass
class Detection:
    boxes: torch.Tensor
    scores: np.ndarray
    meta: dict[str, object]


def test_tensordict_and_dataclass_values_are_stored_as_nested_leaves(tmp_path):
    td_mod = pytest.importorskip("tensordict")
    g = torch.Generator().manual_seed(0)

    def frame(i: int) -> dict[str, torch.Tensor]:
        return {"mask": torch.randn(4, 4, generator=g).to(torch.bfloat16), "emb": torch.randn(3, generator=g)}

    @td_mod.tensorclass
    class Pred:
        logits: torch.Tensor
        label: torch.Tensor

    plain = {i: frame(i) for i in range(3)}
    td = {i: td_mod.TensorDict({"a": v, "nested": {"b": v["emb"] * 2}}, batch_size=[]) for i, v in plain.items()}
    tc = {i: Pred(logits=v["emb"], label=torch.tensor(i), batch_size=[]) for i, v in plain.items()}
    dc = {i: Detection(v["mask"][:2].float(), np.arange(i, i + 2.0), {"n": i}) for i, v in plain.items()}
    res = _merge(tmp_path, {"td.mp4": td, "tc.mp4": tc, "dc.mp4": dc})
    got = res["td.mp4"]
    assert sorted(got) == ["a", "nested"] and sorted(got["a"]) == ["emb", "mask"] and sorted(got["nested"]) == ["b"]
    for i, v in plain.items():
        assert (
            raw_bytes(got["a"]["mask"].to_torch()[i]) == raw_bytes(v["mask"])
            and got["a"]["mask"].dtype_name == "bfloat16"
        )
        assert raw_bytes(got["nested"]["b"].to_torch()[i]) == raw_bytes(v["emb"] * 2)
    got = res["tc.mp4"]
    assert sorted(got) == ["label", "logits"]
    assert got["label"][:].tolist() == [0, 1, 2] and torch.equal(got["logits"].to_torch()[2], plain[2]["emb"])
    got = res["dc.mp4"]
    assert sorted(got) == ["boxes", "meta", "scores"] and got["meta"]["n"][:].tolist() == [0, 1, 2]
    assert got["scores"][:].tolist() == [[0.0, 1.0], [1.0, 2.0], [2.0, 3.0]]

    # A TensorDict leaf that is not a tensor (NonTensorData) is a value like any other (format 2):
    # a str is a str leaf and round-trips; an arbitrary object is still refused by name.
    class Thing:
        pass

    root, out = tmp_path / "nt", tmp_path / "nt.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(2):
            w.write("x", i, td_mod.TensorDict({"x": torch.full((1,), float(i)), "note": f"hello {i}"}, batch_size=[]))
        with pytest.raises(spillmerge.SpillValueError, match=r"leaf 'obj' of 'x' frame 2: cannot store a Thing without pickle"):
            w.write("x", 2, td_mod.TensorDict({"x": torch.ones(1), "obj": Thing()}, batch_size=[]))
    spillmerge.merge(str(root), str(out))
    got = spillmerge.open(str(out))["x"]
    assert sorted(got) == ["note", "x"] and got["note"].kind == "str"
    assert got["note"].to_list() == ["hello 0", "hello 1"] and got["x"][:, 0].tolist() == [0.0, 1.0]


def test_dataclass_class_object_is_not_a_value(tmp_path):
    with spillmerge.SpillWriter(str(tmp_path / "s"), rank=0, world_size=1) as w:
        with pytest.raises(spillmerge.SpillValueError, match="cannot store a type"):
            w.write("x", 0, Detection)


def test_numpy_and_torch_views_add_no_copy(tmp_path):
    n = 8 << 20  # bytes per leaf
    res = _merge(tmp_path, {"f": {0: {"raw": torch.arange(n // 2, dtype=torch.int16).view(torch.bfloat16),
                                      "x": torch.arange(n // 4, dtype=torch.float32)}}})  # fmt: skip
    bf, x = res["f"]["raw"], res["f"]["x"]

    def peak(fn) -> int:
        tracemalloc.start()
        try:
            fn()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    baseline = peak(lambda: np.asarray(x.zarr[...]))  # what reading from zarr costs by itself
    assert baseline >= n
    for fn in (lambda: np.asarray(x), lambda: x.to_torch(), lambda: bf.to_torch(), lambda: np.asarray(x, x.dtype)):
        assert peak(fn) < baseline + n // 4, "a copy beyond zarr's read"
    t = bf.to_torch()
    # from_numpy storage (not resizable) viewed as bfloat16: the decoded array itself, no torch copy.
    assert t.dtype == torch.bfloat16 and not t.untyped_storage().resizable()
    assert t.untyped_storage().nbytes() == t.numel() * 2
    assert torch.equal(t.view(torch.int16)[0], torch.arange(n // 2, dtype=torch.int16))
    with pytest.raises(ValueError, match="needs a copy"):
        x.__array__(np.float64, copy=False)
    assert np.asarray(x, dtype=np.float64).dtype == np.float64


def test_xarray_reads_the_merged_store(tmp_path):
    """Format 2 with plain xarray: the index, and each leaf column as a dataset whose rows of file i
    are ``values[offsets[off[i]]:offsets[off[i + 1]]]`` (docs/FORMAT.md section 2)."""
    xr = pytest.importorskip("xarray")
    res = _merge(tmp_path, {
        "a.mp4": {f: torch.full((2, 3), float(f)) for f in (3, 1, 2)},
        "dets/b.mp4": {f: {"boxes": torch.full((5, 4), f, dtype=torch.int32), "m": {"s": torch.tensor(f * 0.5)},
                           "bf": torch.tensor([f, -f], dtype=torch.bfloat16)} for f in range(4)},
    })  # fmt: skip
    out = str(tmp_path / "out.zarr")
    index = xr.open_zarr(out, group="index", consolidated=True)
    raw, fo = index["filenames"].values.tobytes(), index["filename_offsets"].values  # UTF-8 bytes + offsets
    assert [raw[a:b].decode() for a, b in zip(fo[:-1], fo[1:], strict=True)] == ["a.mp4", "dets/b.mp4"] and index.sizes[
        "row"
    ] == 7
    assert index["frame_idx"].values.tolist() == [1, 2, 3, 0, 1, 2, 3]
    off = index["frame_offsets"].values
    assert off.tolist() == [0, 3, 7]
    a = xr.open_zarr(out, group="columns/_value", consolidated=True)
    assert a.attrs["spillmerge"]["leaf"] == [] and a.attrs["spillmerge"]["dtype"] == "float32"
    assert a["values"].dims == ("_value.elem", "_value.dim_1", "_value.dim_2") and a.sizes["row"] == 7
    assert a["valid"].values.tolist() == [True] * 3 + [False] * 4  # dets/b.mp4 has no plain value
    o = a["offsets"].values
    got = a["values"].values[o[off[0]] : o[off[1]]]
    assert np.array_equal(got, res["a.mp4"][:]) and got[:, 0, 0].tolist() == [1.0, 2.0, 3.0]
    tree = xr.open_datatree(out, engine="zarr", consolidated=True)
    by_leaf = {tuple(node.attrs["spillmerge"]["leaf"]): node for node in tree["columns"].children.values()}
    assert sorted(by_leaf) == [(), ("bf",), ("boxes",), ("m", "s")]

    def rows(node, i: int) -> np.ndarray:
        o = node["offsets"].values
        return node["values"].values[o[off[i]] : o[off[i + 1]]]

    b = by_leaf[("boxes",)]
    assert b["values"].dims == ("boxes.elem", "boxes.dim_1", "boxes.dim_2")
    assert rows(b, 1)[:, 0, 0].tolist() == [0, 1, 2, 3] and len(rows(b, 0)) == 0
    assert rows(by_leaf[("m", "s")], 1).tolist() == [0.0, 0.5, 1.0, 1.5]
    # bfloat16: raw uint16 bits in xarray too; the real dtype is in the column header.
    bf = by_leaf[("bf",)]
    assert bf["values"].dtype == np.uint16 and bf.attrs["spillmerge"]["dtype"] == "bfloat16"
    assert torch.equal(torch.from_numpy(rows(bf, 1)).view(torch.bfloat16), res["dets/b.mp4"]["bf"].to_torch())
    # With the frame indices as a coordinate:
    ob = b["offsets"].values
    ds = (
        b.to_dataset()
        .isel({"boxes.elem": slice(int(ob[off[1]]), int(ob[off[2]]))})
        .rename({"boxes.elem": "frame"})
        .assign_coords(frame=res.frames("dets/b.mp4"))
    )
    assert ds.sel(frame=2)["values"].values[0, 0] == 2


def test_tensorstore_reads_the_merged_store(tmp_path):
    ts = pytest.importorskip("tensorstore")
    res = _merge(tmp_path, {"a.mp4": {f: torch.full((3,), f, dtype=torch.int64) for f in range(5)}})
    out = tmp_path / "out.zarr"
    assert res["a.mp4"].zarr.path == "columns/_value/values"

    def read(rel: str) -> list:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(out / rel)}}
        return ts.open(spec, read=True).result().read().result().tolist()

    # One file, every row has the leaf: the column's values are the file's rows, no offsets.
    assert read(res["a.mp4"].zarr.path) == res["a.mp4"][:].tolist()
    assert read("index/frame_offsets") == [0, 5] and read("index/frame_idx") == [0, 1, 2, 3, 4]
    assert not (out / "columns" / "_value" / "offsets").exists()
    meta = json.loads((out / "columns" / "_value" / "zarr.json").read_text())
    assert meta["attributes"]["spillmerge"]["leaf"] == [] and meta["attributes"]["spillmerge"]["dtype"] == "int64"


def test_tensorstore_alone_maps_rows_to_filenames_and_reads_strings(tmp_path):
    """Format 3 stores every string as UTF-8 bytes + int64 offsets: tensorstore's zarr3 driver,
    which has no string type, reads the filenames, which rows are whose, and a ``str`` column."""
    ts = pytest.importorskip("tensorstore")
    files = {
        f"img_{i:03d} é.jpg": {0: {"caption": f"a photo number {i} ✓", "score": torch.tensor(i / 2)}} for i in range(40)
    }
    files["vid.mp4"] = {f: {"caption": "" if f == 1 else f"frame {f}", "score": torch.tensor(-1.0)} for f in range(3)}
    res = _merge(tmp_path, files)
    out = tmp_path / "out.zarr"

    def read(rel: str) -> np.ndarray:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(out / rel)}}
        return ts.open(spec, read=True).result().read().result()

    def strings(values: np.ndarray, offsets: np.ndarray) -> list[str]:
        raw = values.tobytes()
        return [raw[a:b].decode("utf-8") for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]

    names = strings(read("index/filenames"), read("index/filename_offsets"))
    assert names == sorted(files) == list(res.filenames)
    rows = read("index/frame_offsets")
    file_of_row = np.repeat(np.array(names, dtype=object), np.diff(rows))  # which file each row is
    captions = strings(read("columns/caption/values"), read("columns/caption/offsets"))
    scores = read("columns/score/values")
    frames = read("index/frame_idx")
    got = {(f, int(fr)): (c, float(s)) for f, fr, c, s in zip(file_of_row, frames, captions, scores, strict=True)}
    want = {(f, fr): (v["caption"], float(v["score"])) for f, by in files.items() for fr, v in by.items()}
    assert got == want
    # The heads (first name of each block) let a tensorstore reader bisect too.
    assert strings(read("index/filename_heads"), read("index/filename_head_offsets"))[0] == names[0]


# ------------------------------------------------------------------------------------- Lightning
def test_missing_lightning_gives_the_install_hint(monkeypatch):
    for mod in [m for m in sys.modules if m.startswith(("lightning", "spillmerge.integrations."))]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "lightning", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(spillmerge.MissingDependencyError, match=r"pip install 'spillmerge\[lightning\]'") as ei:
        importlib.import_module("spillmerge.integrations.lightning")
    assert isinstance(ei.value, ImportError) and ei.value.package == "lightning"


def test_default_key_mapping_errors_say_what_to_do():
    from spillmerge.integrations._prediction_writer import batch_keys

    key_fn = batch_keys()
    with pytest.raises(
        spillmerge.SpillValueError, match=r"batch 3 is a tuple, not a dict with a 'filename' entry.*key_fn"
    ):
        list(key_fn((["a"], torch.tensor([0])), 3, 0, torch.zeros(1, 2)))
    with pytest.raises(
        spillmerge.SpillValueError, match=r"batch 2 has no 'filename' entry \(its keys: 'image', 'path'\)"
    ):
        list(key_fn({"image": torch.zeros(1), "path": ["a"]}, 2, 0, torch.zeros(1, 2)))
    batch = {"filename": ["a", "b"], "frame_idx": torch.tensor([0, 1])}
    with pytest.raises(
        spillmerge.SpillValueError, match="batch 0: write_batch: leaf '<batch>' has 3 items but the batch has 2"
    ):
        list(key_fn(batch, 0, 0, torch.zeros(3)))
    with pytest.raises(spillmerge.SpillValueError, match="is a str, not batched"):
        list(key_fn(batch, 0, 0, "text"))
    rows = list(key_fn(batch, 0, 0, {"x": torch.tensor([[1, 2], [3, 4]]), "y": [5, 6]}))
    assert [(n, f, v["x"].tolist(), v["y"]) for n, f, v in rows] == [("a", 0, [1, 2], 5), ("b", 1, [3, 4], 6)]
    with pytest.raises(spillmerge.SpillValueError, match="is a 0-d Tensor"):
        list(key_fn(batch, 0, 0, torch.tensor(1.0)))
    # an image dataset has no frame index: every sample is frame 0
    assert [(n, f) for n, f, _ in key_fn({"filename": ["a", "b"]}, 0, 0, torch.zeros(2, 1))] == [("a", 0), ("b", 0)]
    td_mod = pytest.importorskip("tensordict")
    td = td_mod.TensorDict({"x": torch.tensor([[1, 2], [3, 4]]), "n": {"z": torch.tensor([7, 8])}}, batch_size=[2])
    rows = list(key_fn(batch, 0, 0, td))
    assert [(n, f, v["x"].tolist(), v["n"]["z"].item()) for n, f, v in rows] == [
        ("a", 0, [1, 2], 7),
        ("b", 1, [3, 4], 8),
    ]


def test_pytorch_lightning_callback_with_key_fn_and_a_failing_batch(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    td_mod = pytest.importorskip("tensordict")
    from spillmerge.integrations.pytorch_lightning import SpillPredictionWriter

    class Model(pl.LightningModule):
        fail_at: int | None = None

        def predict_step(self, batch, batch_idx):
            if batch_idx == self.fail_at:
                raise RuntimeError("bad batch")
            clip, start, x = batch
            return td_mod.TensorDict({"y": x * 2, "first": x[:, :1]}, batch_size=[len(x)])

    # Tuple batches: (clip ids, first frame of each window, inputs); key_fn names each sample.
    def key_fn(batch, batch_idx, dataloader_idx, prediction):
        clip, start, _ = batch
        for j in range(len(clip)):
            yield f"clip{int(clip[j])}.mp4", int(start[j]), prediction[j]

    data = [(i % 2, i // 2, torch.arange(3, dtype=torch.float32) + i) for i in range(10)]
    loader = torch.utils.data.DataLoader(data, batch_size=4)

    def trainer(writer):
        return pl.Trainer(accelerator="cpu", devices=1, callbacks=[writer], logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))  # fmt: skip

    writer = SpillPredictionWriter(str(tmp_path / "spill"), str(tmp_path / "out.zarr"), key_fn=key_fn)
    assert trainer(writer).predict(Model(), dataloaders=loader, return_predictions=False) is None
    assert writer.report is not None and writer.report.n_frames == 10
    res = spillmerge.open(str(tmp_path / "out.zarr"))
    assert res.filenames == ["clip0.mp4", "clip1.mp4"] and res.frames("clip1.mp4").tolist() == [0, 1, 2, 3, 4]
    assert res["clip1.mp4"]["y"][:, 0].tolist() == [2.0 * i for i in (1, 3, 5, 7, 9)]
    assert res["clip0.mp4"]["first"][:, 0].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]

    # A predict_step that raises leaves a failure record, so a merge names the rank at once.
    failing = Model()
    failing.fail_at = 1
    writer = SpillPredictionWriter(str(tmp_path / "spill2"), None, key_fn=key_fn)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer(writer).predict(failing, dataloaders=loader, return_predictions=False)
    with pytest.raises(spillmerge.RankFailedError, match="bad batch") as ei:
        spillmerge.merge(str(tmp_path / "spill2"), str(tmp_path / "out2.zarr"))
    assert list(ei.value.failures) == [0]


def test_lightning_ddp_spawn_report_reaches_the_launching_process(tmp_path):
    """Under ``ddp_spawn`` the ranks are child processes and the launching process runs no hook:
    ``writer.report`` there reads the report the merging rank left in the spill root (and the
    callback, default key mapping included, pickles into the ranks). Only the script imports
    lightning: this process need not pay seconds of CPU for it."""
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")

    script = Path(__file__).parents[1] / "_ddp_spawn_scenario.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    for _ in range(3):  # the free port the launcher picked can be taken by a parallel test before its rank binds it
        shutil.rmtree(tmp_path / "spill", ignore_errors=True)
        shutil.rmtree(tmp_path / "out.zarr", ignore_errors=True)
        p = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "spill"), str(tmp_path / "out.zarr")],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        if "EADDRINUSE" not in p.stderr:
            break
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["before"] and got["type"] == "MergeReport", got
    assert (got["n_frames"], got["ranks"], got["dropped"]) == (7, [0, 1], 0), got
    assert got["frames"] == list(range(7))
    assert got["later"]  # a later callback (another run) does not take this run's report for its own


def test_lightning_callback_writes_an_image_dataset_a_batch_at_a_time(tmp_path):
    """A dataset of images returns a filename and no frame index: each sample is frame 0; the
    callback writes each batch with write_batch, and a bad batch writes nothing of itself."""
    L = pytest.importorskip("lightning.pytorch")
    from spillmerge.integrations.lightning import SpillPredictionWriter

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"filename": f"img/{i:02d}.jpg", "image": torch.full((3,), float(i))}

    class Model(L.LightningModule):
        bad_batch: int | None = None

        def predict_step(self, batch, batch_idx):
            x = batch["image"]
            n = len(x) + (batch_idx == self.bad_batch)  # one row too many in the bad batch
            dets = [{"boxes": torch.ones(int(v[0]) % 3, 4), "label": f"c{int(v[0])}"} for v in x]
            return {"logits": torch.ones(n, 2) * x[:1, :1], "dets": dets}

    def predict(writer, model):
        trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[writer], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))  # fmt: skip
        loader = torch.utils.data.DataLoader(Images(), batch_size=4)
        return trainer.predict(model, dataloaders=loader, return_predictions=False)

    writer = SpillPredictionWriter(str(tmp_path / "spill"), str(tmp_path / "out.zarr"))
    predict(writer, Model())
    res = spillmerge.open(str(tmp_path / "out.zarr"))
    assert res.filenames == [f"img/{i:02d}.jpg" for i in range(10)]
    assert all(res.frames(f).tolist() == [0] for f in res.filenames)
    dets = res["img/05.jpg"]["dets"]
    assert dets["label"][0] == "c5" and dets["boxes"][0].shape == (2, 4) and res["img/05.jpg"]["logits"][0][0] == 4.0
    # a second predict through the same callback would mix both runs in one output: refused at its start
    with pytest.raises(spillmerge.ConfigError, match="already committed a predict run"):
        predict(writer, Model())
    assert spillmerge.open(str(tmp_path / "out.zarr")).filenames == res.filenames

    bad = Model()
    bad.bad_batch = 1
    writer = SpillPredictionWriter(str(tmp_path / "spill2"), None)
    with pytest.raises(
        spillmerge.SpillValueError, match=r"batch 1: write_batch: leaf 'logits' has 5 items but the batch"
    ):
        predict(writer, bad)
    # batch 0's four samples were written; nothing of batch 1 was
    assert writer.writer is not None and writer.writer.stats()["frames"] == 4 and writer.writer.state == "failed"


def test_lightning_callback_keeps_predict_dataloaders_apart_and_leaves_no_spill_root(tmp_path):
    """Two predict dataloaders that yield the same filenames: each filename is written under its
    dataloader's index, so neither's rows collide with the other's. With ``remove_spill`` the
    spill root is gone after predict (the report file does not bring it back)."""
    L = pytest.importorskip("lightning.pytorch")
    from spillmerge.integrations.lightning import SpillPredictionWriter

    class Model(L.LightningModule):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return batch["x"] + 100 * dataloader_idx

    data = [{"filename": f"img/{i}.jpg", "x": torch.full((2,), float(i))} for i in range(3)]
    loaders = [torch.utils.data.DataLoader(data, batch_size=2) for _ in range(2)]
    writer = SpillPredictionWriter(
        str(tmp_path / "spill"), str(tmp_path / "out.zarr"), merge_options={"remove_spill": True}
    )
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[writer], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))  # fmt: skip
    trainer.predict(Model(), dataloaders=loaders, return_predictions=False)
    assert writer.report is not None and writer.report.n_frames == 6
    assert not (tmp_path / "spill").exists()
    res = spillmerge.open(str(tmp_path / "out.zarr"))
    assert res.filenames == [f"dataloader_{d}/img/{i}.jpg" for d in range(2) for i in range(3)]
    assert res["dataloader_1/img/2.jpg"][0].tolist() == [102.0, 102.0]
    assert res["dataloader_0/img/2.jpg"][0].tolist() == [2.0, 2.0]
