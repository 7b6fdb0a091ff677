"""Every kind of value a model produces, through every path a user takes: local, memory:// and a
real S3 server; one process and parts + finalize; duplicates and their policies; a rank killed
mid-spill salvaged with --allow-partial; resume; inspect and verify through the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_cli import cli_run

import spillmerge


def value(i: int) -> dict:
    """Frame ``i``'s prediction: a detector's ragged outputs, generated tokens and text, a mask of
    changing size, bytes, an optional leaf, a plain scalar and a bfloat16 embedding."""
    k = i % 4  # 0 boxes in some frames
    return {
        "boxes": torch.arange(k * 4, dtype=torch.float32).reshape(k, 4) + i,
        "scores": torch.linspace(0, 1, k),
        "labels": [i % 3] * k,
        "tokens": torch.arange(i % 9 + 1) * i,
        "text": ["", "a\x00b", "héllo ☃", "x" * 1000][i % 4],
        "names": ["cat", "dog"][: i % 3],
        "mask": torch.ones(i % 3 + 1, i % 5 + 1, dtype=torch.uint8) * i,
        "raw": bytes([i % 256]) * (i % 6),
        "maybe": None if i % 2 else torch.tensor([i, -i]),
        "score": float(i) / 7,
        "emb": (torch.arange(8, dtype=torch.float32) * i).to(torch.bfloat16),
    }


def check(res: spillmerge.MergedStore, want: dict[tuple[str, int], dict]) -> None:
    seen = 0
    for name in res.filenames:
        v = res[name]
        for j, f in enumerate(res.frames(name).tolist()):
            exp = want[(name, f)]
            assert np.array_equal(v["boxes"][j], exp["boxes"].numpy()) and v["boxes"][j].shape == (f % 4, 4)
            assert np.array_equal(v["scores"][j], exp["scores"].numpy())
            assert v["labels"][j].tolist() == exp["labels"]
            assert np.array_equal(v["tokens"][j], exp["tokens"].numpy())
            assert v["text"][j] == exp["text"] and v["names"][j] == exp["names"] and v["raw"][j] == exp["raw"]
            assert np.array_equal(v["mask"][j], exp["mask"].numpy())
            assert (v["maybe"][j] is None) if exp["maybe"] is None else np.array_equal(v["maybe"][j], exp["maybe"])
            assert v["score"][j] == exp["score"]
            assert torch.equal(v["emb"].to_torch()[j], exp["emb"])
            seen += 1
    assert seen == len(want)


def spill(url: str, opts: dict, world: int = 2, frames: int = 24) -> dict[tuple[str, int], dict]:
    want = {}
    for r in range(world):
        with spillmerge.SpillWriter(url, rank=r, world_size=world, storage_options=opts, chunk_bytes=4096) as w:
            for i in range(r, frames, world):
                name = f"clip_{i % 4}.mp4"  # [] and lists of names mix within a file
                w.write(name, i, value(i))
                want[(name, i)] = value(i)
    return want


def test_every_kind_round_trips_on_local_and_memory_storage(backend_no_s3):
    backend = backend_no_s3
    want = spill(backend.url("spill"), backend.options)
    out = backend.url("out")
    rep = spillmerge.merge(backend.url("spill"), out, storage_options=backend.options, chunk_bytes=512)
    assert rep.n_frames == len(want)
    res = spillmerge.open(out, storage_options=backend.options)
    check(res, want)
    assert spillmerge.verify(out, storage_options=backend.options).ok
    assert len(res.column("tokens").to_list()) == len(want)
    done = spillmerge.committed_keys(backend.url("spill"), storage_options=backend.options)
    assert {(name, f) for name, frames in done.items() for f in frames} == set(want)


@pytest.mark.parametrize("codec", ["none", "zstd", "blosc-lz4"])
def test_every_kind_in_parts_with_every_codec(tmp_path, codec):
    want = spill(str(tmp_path / "s"), {})
    out = str(tmp_path / "o")
    for i in range(3):
        spillmerge.merge(str(tmp_path / "s"), out, part=(i, 3), codec=codec, chunk_bytes=256)
    spillmerge.merge(str(tmp_path / "s"), out, finalize=True)
    check(spillmerge.open(out), want)


def test_duplicates_of_every_kind_follow_the_policy(tmp_path):
    root = str(tmp_path / "s")
    for r, shift in ((0, 0), (1, 100)):
        with spillmerge.SpillWriter(root, rank=r, world_size=2) as w:
            w.write("a", 0, {"text": f"v{shift}", "tokens": torch.arange(shift % 7 + 1)})
            w.write("b", 0, {"text": "same", "tokens": torch.arange(3)})  # identical on both ranks
    with pytest.raises(spillmerge.DuplicateFrameError, match="frame 0 of 'a'"):
        spillmerge.merge(root, str(tmp_path / "o"))
    spillmerge.merge(root, str(tmp_path / "first"), on_duplicate="first")
    res = spillmerge.open(str(tmp_path / "first"))
    assert res["a"]["text"][0] == "v0" and res["b"]["text"][0] == "same"
    spillmerge.merge(root, str(tmp_path / "last"), on_duplicate="last")
    last = spillmerge.open(str(tmp_path / "last"))
    assert last["a"]["text"][0] == "v100" and last["a"]["tokens"][0].tolist() == [0, 1, 2]
    assert last.frame_copies("b").tolist() == [2]


def test_big_values_round_trip_exactly(tmp_path):
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    big = "é" * (5 << 20)  # a 10 MB string
    with spillmerge.SpillWriter(root, staging_bytes=4 << 20, chunk_bytes=1 << 20) as w:
        w.write("doc", 0, {"text": big, "ids": list(range(1_000_000)), "boxes": torch.zeros(0, 4)})
        w.write("doc", 1, {"text": "", "ids": [], "boxes": torch.ones(2, 4)})
    spillmerge.merge(root, out, chunk_bytes=1 << 20)
    res = spillmerge.open(out)
    assert res["doc"]["text"][0] == big and res["doc"]["text"][1] == ""
    assert np.array_equal(res["doc"]["ids"][0], np.arange(1_000_000)) and len(res["doc"]["ids"][1]) == 0
    assert res["doc"]["boxes"][0].shape == (0, 4) and res["doc"]["boxes"][1].tolist() == [[1.0] * 4] * 2


def test_pickle_only_when_both_sides_opt_in(tmp_path):
    class Odd:
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Odd)

    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root) as w, pytest.raises(spillmerge.SpillValueError, match="'obj'.*Odd"):
        w.write("f", 0, {"obj": Odd()})
    with spillmerge.SpillWriter(root, allow_pickle=True) as w:
        w.write("f", 1, {"obj": {1, 2}, "n": 1})
    spillmerge.merge(root, out)
    with pytest.raises(spillmerge.PickleNotAllowedError, match="allow_pickle=True"):
        spillmerge.open(out)["f"]["obj"][0]
    assert spillmerge.open(out, allow_pickle=True)["f"]["obj"][0] == {1, 2}


def test_cli_inspect_and_verify_on_every_kind(tmp_path):
    spill(str(tmp_path / "s"), {})
    out = str(tmp_path / "o")
    run = cli_run("merge", str(tmp_path / "s"), "--out", out)
    assert run.returncode == 0, run.stderr
    info = cli_run("inspect", out, "--json")
    assert info.returncode == 0, info.stderr
    doc = json.loads(info.stdout)
    assert doc["frames"] == 24 and doc["n_files"] == 4 and "list[str]" in doc["dtypes"], doc
    ver = cli_run("verify", out)
    assert ver.returncode == 0, ver.stdout + ver.stderr
    for path in (tmp_path / "o" / "columns" / "text" / "values" / "c").iterdir():
        path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))  # flip a CRC bit
        break
    ver = cli_run("verify", out)
    assert ver.returncode == 1 and "columns/text/values" in ver.stdout + ver.stderr
