"""The README's Python examples run as printed (its paths under a temporary folder, ``.cuda()``
dropped): the drop-ins in a one-rank gloo group, the writer loop and the reading block on its output."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

import spillmerge

README = Path(__file__).resolve().parents[2] / "README.md"


def _example(marker: str, tmp_path: Path) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block.replace("/shared/run1", str(tmp_path)).replace(".cuda()", "")


def _model(frames: torch.Tensor) -> dict[str, object]:
    """Logits of 1,000 classes and a different number of boxes per frame."""
    n = frames.shape[0]
    return {"logits": frames[:, :1].expand(n, 1000) * 2, "boxes": [torch.ones(int(k) % 3, 4) for k in frames[:, 0]]}


def test_the_drop_in_example_fills_the_list_as_torch_does(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILLMERGE_ROOT", str(tmp_path))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        preds = {"img_0.jpg": {"logits": torch.arange(4.0), "label": 3}}
        ns = {"spillmerge": spillmerge, "rank": 0, "preds": preds, "gathered": [None]}
        exec(_example("gather_object(", tmp_path), ns)
    finally:
        dist.destroy_process_group()
    ((got,),) = [ns["gathered"]]
    assert list(got) == ["img_0.jpg"] and got["img_0.jpg"]["label"] == 3
    assert torch.equal(got["img_0.jpg"]["logits"], preds["img_0.jpg"]["logits"])
    assert [p.name for p in tmp_path.iterdir()] == ["pg"]  # nothing left in the root


def test_the_writer_and_reading_examples_run_on_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    loader = [
        {"frames": torch.arange(f, f + 4.0)[:, None].expand(4, 3), "filename": ["video_001.mp4"] * 4,
         "frame_idx": torch.arange(f, f + 4)}
        for f in range(0, 20, 4)
    ]  # fmt: skip
    ns = {"spillmerge": spillmerge, "loader": loader, "model": _model}
    exec(_example("SpillWriter(", tmp_path), ns)
    assert ns["report"].n_frames == 20
    exec(_example("spillmerge.open(", tmp_path), ns)
    res, boxes = ns["res"], ns["boxes"]
    assert list(res.filenames) == ["video_001.mp4"]
    assert res.value("video_001.mp4", 17)["logits"][0] == 34
    assert res.column("logits")[:].shape == (20, 1000)
    assert [len(b) for b in boxes.to_list()] == [f % 3 for f in range(20)]
