"""One output format and one spill format: a tree of any other version is refused, by every reader,
with one message naming the path, the version found and the version this spillmerge reads, and
what to do (docs/FORMAT.md, top). The versions are forged in real, current trees."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import spillmerge
import spillmerge.cli
from spillmerge._format import common as F


def _spill(root: Path) -> None:
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(3):
            w.write(f"f{i}.jpg", 0, {"x": torch.full((4,), float(i)), "s": f"text {i}"})


@pytest.fixture
def output(tmp_path: Path) -> Path:
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    spillmerge.merge(str(root), str(out), progress=False)
    return out


def _forge_output(out: Path, version: object) -> None:
    doc = json.loads((out / "zarr.json").read_text())
    doc["attributes"]["spillmerge"]["format_version"] = version
    (out / "zarr.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("version", [F.FORMAT_VERSION - 1, F.FORMAT_VERSION + 1, "5"])
def test_an_output_of_another_version_is_refused_naming_both_versions(output, version, capsys):
    assert spillmerge.open(str(output)).format_version == F.FORMAT_VERSION == spillmerge.FORMAT_VERSION
    _forge_output(output, version)
    said = (
        rf"{re.escape(str(output))}: an output of format version {re.escape(repr(version))}; this spillmerge reads "
        rf"output format version {F.FORMAT_VERSION} only: merge its spill root again with this spillmerge"
    )
    with pytest.raises(spillmerge.FormatVersionError, match=said) as info:
        spillmerge.open(str(output))
    assert (info.value.path, info.value.found, info.value.supported) == (str(output), version, F.FORMAT_VERSION)
    assert isinstance(info.value, spillmerge.SpillMergeError)
    with pytest.raises(spillmerge.FormatVersionError, match=said):
        spillmerge.OutputDataset(str(output))
    rep = spillmerge.verify(str(output))
    assert not rep.ok and len(rep.problems) == 1 and re.match(said, rep.problems[0]), rep.problems
    assert spillmerge.cli.main(["inspect", str(output)]) == 1
    assert re.search(said, capsys.readouterr().err)


@pytest.mark.parametrize("version", [F.SPILL_FORMAT_VERSION - 1, F.SPILL_FORMAT_VERSION + 1])
def test_a_spill_root_of_another_version_is_refused_naming_both_versions(tmp_path, version):
    root = tmp_path / "spill"
    _spill(root)
    seg = next(root.glob("rank-00000/seg-*"))
    commit = json.loads((seg / "commit.json").read_text())
    assert commit["format_version"] == F.SPILL_FORMAT_VERSION
    commit["format_version"] = version
    (seg / "commit.json").write_text(json.dumps(commit))
    said = (
        rf"{re.escape(str(seg / 'commit.json'))}: a spill root of format version {version}; this spillmerge reads "
        rf"spill root format version {F.SPILL_FORMAT_VERSION} only: run the job again with this spillmerge, or "
        "merge the spill root with the spillmerge that wrote it"
    )
    with pytest.raises(spillmerge.FormatVersionError, match=said) as info:
        spillmerge.merge(str(root), str(tmp_path / "out.zarr"), progress=False)
    assert (info.value.found, info.value.supported) == (version, F.SPILL_FORMAT_VERSION)
    assert not (tmp_path / "out.zarr" / "spillmerge-complete.json").exists()
    with pytest.raises(spillmerge.FormatVersionError, match=said):
        spillmerge.committed_keys(str(root))


def test_an_uncommitted_segment_of_another_version_is_not_salvaged(tmp_path):
    """``allow_partial`` rebuilds an uncommitted segment from its journal: one whose header says
    another version is refused, never read by this version's rules."""
    root = tmp_path / "spill"
    _spill(root)
    seg = next(root.glob("rank-00000/seg-*"))
    (seg / "commit.json").unlink()
    doc = json.loads((seg / "zarr.json").read_text())
    doc["attributes"]["spillmerge"]["format_version"] = F.SPILL_FORMAT_VERSION + 1
    (seg / "zarr.json").write_text(json.dumps(doc))
    said = rf"a spill root of format version {F.SPILL_FORMAT_VERSION + 1}; this spillmerge reads spill root format"
    with pytest.raises(spillmerge.FormatVersionError, match=said):
        spillmerge.merge(str(root), str(tmp_path / "out.zarr"), allow_partial=True, progress=False)


def test_a_column_naming_a_list_item_by_position_is_refused(output):
    """A spill names a list's items by position (``MARK`` + index); an output never does (its
    items are one path, ``MARK + "*"``): a column claiming such a leaf is refused at open."""
    leaf = ["x", F.MARK + "0"]
    out_doc = json.loads((output / "zarr.json").read_text())
    out_doc["consolidated_metadata"]["metadata"]["columns/x"]["attributes"]["spillmerge"]["leaf"] = leaf
    (output / "zarr.json").write_text(json.dumps(out_doc))
    col = json.loads((output / "columns/x/zarr.json").read_text())
    col["attributes"]["spillmerge"]["leaf"] = leaf
    (output / "columns/x/zarr.json").write_text(json.dumps(col))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"columns/x: .*names a list item by position"):
        spillmerge.open(str(output))
