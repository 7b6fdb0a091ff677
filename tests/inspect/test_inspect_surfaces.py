"""``verify``, ``inspect`` and ``status`` on damaged, partial and empty outputs: no traceback, no
false "OK", no false "corrupt"."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_cli import assert_one_line_error, cli_run

import spillmerge


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("out")
    root, out = base / "spill", base / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for f in range(4):
            w.write("clip a.mp4", f, {"mask": torch.full((4, 4), float(f))})
    spillmerge.merge(str(root), str(out), progress=False)
    return out


@pytest.mark.parametrize("marker", ["{", "", None])
def test_verify_reads_the_completion_marker_as_open_does(output, tmp_path, marker):
    out = tmp_path / "out.zarr"
    shutil.copytree(output, out)
    done = out / "spillmerge-complete.json"
    done.unlink()
    if marker is None:  # a folder where the marker should be
        (done / "x").mkdir(parents=True)
    else:
        done.write_text(marker)
    with pytest.raises(spillmerge.SpillMergeError):
        spillmerge.open(str(out))
    p = cli_run("verify", str(out))
    assert p.returncode == 1 and "OK" not in p.stdout, p.stdout
    assert f"CORRUPT {done}" in p.stdout and "Traceback" not in p.stderr


def test_verify_of_a_whole_output_is_ok(output):
    p = cli_run("verify", str(output))
    assert p.returncode == 0 and "OK" in p.stdout and "CORRUPT" not in p.stdout


@pytest.mark.parametrize("doc", ["{", '{"zarr_format": 3, "node_type": "group", "attributes": {}}'])
def test_a_folder_whose_zarr_json_is_not_ours_is_named_so_not_said_to_lack_one(output, tmp_path, doc):
    out = tmp_path / "out.zarr"
    shutil.copytree(output, out)
    (out / "zarr.json").write_text(doc)
    for cmd in ("inspect", "verify"):
        p = cli_run(cmd, str(out))
        assert_one_line_error(p, f"{out / 'zarr.json'} is no spillmerge output's root document")
        assert "no zarr.json" not in p.stderr


def test_verify_lists_every_damaged_commit_record_and_checks_the_rest(tmp_path):
    root = tmp_path / "spill"
    for r in range(3):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=3) as w:
            w.write(f"clip {r}.mp4", 0, torch.full((2,), float(r)))
    torn = sorted(root.glob("rank-0000[02]/*/commit.json"))
    for c in torn:
        c.write_text("{")
    p = cli_run("verify", str(root))
    assert p.returncode == 1 and not p.stderr, p.stderr
    assert [ln.split(":")[0] for ln in p.stdout.splitlines() if ln.startswith("CORRUPT")] == [
        f"CORRUPT {c}" for c in torn
    ]
    assert f"spill {root}: 2 problem(s); 3 objects, 8 B of payload verified" in p.stdout  # rank 1 checked


def test_inspect_names_leaves_whose_paths_read_alike_apart(tmp_path):
    """A key holding ``/`` beside nested dicts of that path: each file's leaves are listed by the
    names ``MergedStore.columns`` gives them, not both as ``a/b``."""
    from spillmerge._inspect.summary import summarize

    with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
        w.write("x.png", 0, {"a/b": 1, "a": {"b": torch.ones(2)}})
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"), progress=False)
    (f,) = summarize(str(tmp_path / "out.zarr"))["files"]
    assert sorted(x["leaf"] for x in f["leaves"]) == ['["a/b"]', "a/b"]
