"""Coverage reports: `spillmerge inspect --json / --expected / --plot` on real spill roots and
merged stores (per-frame ranks and copies recorded by the merge)."""

from __future__ import annotations

import io
import json
import shutil
import sys

import numpy as np
import pytest
import torch

import spillmerge
from spillmerge._inspect.coverage import coverage
from spillmerge._util.frames import read_manifest
from spillmerge.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _spill(root, frames_by_rank: dict[int, dict[str, list[int]]]) -> None:
    world = len(frames_by_rank)
    for r, files in frames_by_rank.items():
        with spillmerge.SpillWriter(str(root), rank=r, world_size=world) as w:
            for name, frames in files.items():
                for f in frames:
                    w.write(name, f, torch.full((2,), float(f)))


# clip.mp4: frames 0..9 dealt round-robin, frame 5 lost, frame 0 written by both ranks.
LAYOUT = {0: {"clip.mp4": [0, 2, 4, 6, 8], "only0.mp4": [0, 1]}, 1: {"clip.mp4": [0, 1, 3, 7, 9]}}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The spill root and output ``merged`` copies, spilled and merged once for the module."""
    base = tmp_path_factory.mktemp("coverage")
    _spill(base / "spill", LAYOUT)
    spillmerge.merge(str(base / "spill"), str(base / "out.zarr"))
    return base


@pytest.fixture
def merged(pristine, tmp_path):
    """The test's own copy of a spill root and its output."""
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    shutil.copytree(pristine / "spill", root)
    shutil.copytree(pristine / "out.zarr", out)
    return root, out


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_merged_store_records_source_rank_and_copies(merged):
    _, out = merged
    res = spillmerge.open(str(out))
    assert res.frames("clip.mp4").tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert res.frame_ranks("clip.mp4").tolist() == [0, 1, 0, 1, 0, 0, 1, 0, 1]  # frame 0: rank 0 wrote first
    assert res.frame_copies("clip.mp4").tolist() == [2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert res.frame_ranks("only0.mp4").tolist() == [0, 0]
    assert spillmerge.verify(str(out)).ok  # the new index arrays carry checksums too


def test_unknown_filename_is_a_keyerror_that_names_it_and_suggests(merged):
    res = spillmerge.open(str(merged[1]))
    with pytest.raises(spillmerge.UnknownFileError, match=r"'clip.mp5' is not a filename of .*did you mean 'clip.mp4'"):
        res["clip.mp5"]
    with pytest.raises(KeyError):  # still a KeyError for `except KeyError` / Mapping idioms
        res.frames("nope.mp4")
    assert res.get("nope.mp4") is None and "nope.mp4" not in res


def test_json_coverage_of_spill_root_and_merged_store_agree(merged, capsys):
    root, out = merged
    covs = {}
    for path in (root, out):
        rc, stdout, _ = _cli(capsys, "inspect", str(path), "--json")
        assert rc == 0
        covs[path] = json.loads(stdout)["coverage"]
    for c in covs.values():
        clip = next(f for f in c["files"] if f["filename"] == "clip.mp4")
        assert clip["frames"] == 9 and clip["missing"] == [[5, 5]] and clip["duplicated"] == [[0, 0]]
        assert clip["by_rank"] == [[0, 0, 0], [1, 1, 1], [2, 2, 0], [3, 3, 1], [4, 4, 0], [6, 6, 0], [7, 7, 1],
                                   [8, 8, 0], [9, 9, 1]]  # fmt: skip
        assert c["missing_frames"] == 1 and c["duplicated_frames"] == 1
    assert covs[root]["kind"] == "spill" and covs[out]["kind"] == "merged"
    assert [f["by_rank"] for f in covs[root]["files"]] == [f["by_rank"] for f in covs[out]["files"]]


def test_expected_manifest_reports_missing_frames_and_exits_1(merged, tmp_path, capsys):
    _, out = merged
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("filename,n_frames\nclip.mp4,12\nonly0.mp4,2\nnever.mp4,3\n")
    rc, stdout, _ = _cli(capsys, "inspect", str(out), "--expected", str(manifest))
    assert rc == 1
    assert "'clip.mp4': missing 5, 10..11; duplicated 0" in stdout
    assert "'never.mp4': missing 0..2" in stdout and "6 missing (1 files entirely)" in stdout
    assert "'only0.mp4': missing" not in stdout  # complete: no problem listed
    rc, stdout, _ = _cli(capsys, "inspect", str(out), "--expected", str(manifest), "--json")
    cov = json.loads(stdout)["coverage"]
    assert rc == 1 and cov["missing_frames"] == 6 and cov["missing_files"] == ["never.mp4"]
    assert cov["manifest"] == str(manifest)
    manifest.write_text("filename,n_frames\nclip.mp4,10\nonly0.mp4,2\n")
    manifest_ok = tmp_path / "ok.csv"
    manifest_ok.write_text("filename,n_frames\nclip.mp4,5\nonly0.mp4,2\n")
    assert _cli(capsys, "inspect", str(out), "--expected", str(manifest))[0] == 1  # frame 5 still missing
    rc, stdout, _ = _cli(capsys, "inspect", str(out), "--expected", str(manifest_ok))
    assert rc == 0 and "beyond the manifest's 5 frames: 6..9" in stdout


def test_merge_expected_lists_missing_frames_per_file(tmp_path):
    root = tmp_path / "spill"
    _spill(root, LAYOUT)
    want = {"clip.mp4": 12, "only0.mp4": 2, "never.mp4": 3}
    rep = spillmerge.merge(str(root), str(tmp_path / "a"), expected=want)
    assert rep.frame_gaps == {"clip.mp4": [5, 10, 11], "never.mp4": [0, 1, 2]} and rep.expected_files == 3
    assert "6 frame(s) missing in 2 file(s) against the expected counts" in str(rep)
    assert "'clip.mp4': frames 5, 10..11" in str(rep) and "'never.mp4': frames 0..2" in str(rep)
    # The same from a CSV path; in parts (each plans every file: parts own output chunks, not
    # files), each part lists the gaps of the files merged, and the finalize also the files no rank wrote.
    manifest = tmp_path / "m.csv"
    manifest.write_text("filename,n_frames\n" + "".join(f"{k},{v}\n" for k, v in want.items()))
    reps = [spillmerge.merge(str(root), str(tmp_path / "b"), part=(i, 2), expected=str(manifest)) for i in range(2)]
    assert [r.frame_gaps for r in reps] == [{"clip.mp4": [5, 10, 11]}] * 2
    fin = spillmerge.merge(str(root), str(tmp_path / "b"), finalize=True, expected=str(manifest))
    assert fin.frame_gaps == rep.frame_gaps
    ok = spillmerge.merge(str(root), str(tmp_path / "c"), expected={"clip.mp4": 5, "only0.mp4": 2})
    assert ok.frame_gaps == {} and "every frame of the 2 expected files is present" in str(ok)
    with pytest.raises(spillmerge.SpillValueError, match=r"expected\['clip.mp4'\] must map"):
        spillmerge.merge(str(root), str(tmp_path / "d"), expected={"clip.mp4": -1})
    with pytest.raises(spillmerge.ConfigError, match="no-such.csv"):
        spillmerge.merge(str(root), str(tmp_path / "d"), expected=str(tmp_path / "no-such.csv"))
    assert not (tmp_path / "d").exists()  # refused before anything was written


def test_huge_expected_count_lists_a_bounded_number_of_frames(tmp_path):
    root = tmp_path / "spill"
    _spill(root, {0: {"clip.mp4": [0, 3]}})
    rep = spillmerge.merge(str(root), str(tmp_path / "o"), expected={"clip.mp4": 10**12, "gone.mp4": 10**12})
    assert rep.frame_gaps["clip.mp4"][:3] == [1, 2, 4] and len(rep.frame_gaps["clip.mp4"]) == 10000
    assert rep.frame_gaps["gone.mp4"] == list(range(10000))


@pytest.mark.parametrize(
    "text, needle",
    [
        ("name,count\nclip.mp4,3\n", "line 1: expected a header with columns filename,n_frames"),
        ("filename,n_frames\nclip.mp4,3\nb.mp4,three\n", "line 3: n_frames 'three' of 'b.mp4'"),
        ("filename,n_frames\nclip.mp4,-1\n", "line 2: n_frames '-1'"),
        ("filename,n_frames\nclip.mp4,3\n\nclip.mp4,4\n", "line 4: 'clip.mp4' is listed twice"),
        ("filename,n_frames\nclip.mp4\n", "line 2: expected filename,n_frames"),
    ],
)
def test_bad_manifest_rows_name_the_line(tmp_path, text, needle):
    p = tmp_path / "m.csv"
    p.write_text(text)
    with pytest.raises(spillmerge.ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        read_manifest(str(p))


def test_manifest_with_quoted_names_and_extra_columns(tmp_path):
    p = tmp_path / "m.csv"
    p.write_text('n_frames,filename,note\n3,"a, b.mp4",x\n0,"é\u00a0c.mp4",\n')
    assert read_manifest(str(p)) == {"a, b.mp4": 3, "é\u00a0c.mp4": 0}


def _png(path) -> np.ndarray:
    from PIL import Image

    raw = path.read_bytes()
    assert raw[:8] == PNG_MAGIC and len(raw) > 1000
    with Image.open(io.BytesIO(raw)) as im:
        im.verify()
    with Image.open(io.BytesIO(raw)) as im:
        assert im.format == "PNG" and im.width > 100 and im.height > 100
        return np.asarray(im.convert("RGB"))


def test_plot_is_a_png_that_depends_on_the_coverage(merged, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("PIL")
    root, out = merged
    other_root, other_out = tmp_path / "spill2", tmp_path / "out2.zarr"
    _spill(other_root, {0: {"clip.mp4": [0, 1, 2, 3, 4]}, 1: {"clip.mp4": [5, 6, 7, 8, 9], "only0.mp4": [0, 1]}})
    spillmerge.merge(str(other_root), str(other_out))
    images = {}
    for name, path in (("a", out), ("b", other_out), ("spill", root)):
        png = tmp_path / f"{name}.png"
        rc, stdout, _ = _cli(capsys, "inspect", str(path), "--plot", str(png))
        assert rc == 0 and f"coverage plot: {png}" in stdout, stdout
        images[name] = _png(png)
    a, b = images["a"], images["b"]
    assert a.shape == b.shape and not np.array_equal(a, b)
    # Red marks missing frames: only the legend's swatch in b (nothing missing), a bar in a.
    red_a, red_b = (int(np.count_nonzero(np.all(x.reshape(-1, 3) == (255, 0, 0), axis=1))) for x in (a, b))
    assert red_a > red_b + 500, (red_a, red_b)


def test_plot_without_matplotlib_gives_the_install_hint(merged, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    from spillmerge._inspect.coverage import plot

    cov = coverage(str(merged[1]))
    with pytest.raises(spillmerge.MissingDependencyError, match=r"pip install 'spillmerge\[plot\]'") as ei:
        plot(cov, str(tmp_path / "x.png"))
    assert isinstance(ei.value, ImportError) and ei.value.extra == "plot"
    assert not (tmp_path / "x.png").exists()


def _drop_provenance(out) -> None:
    """Remove index/frame_rank and index/frame_copies (arrays and consolidated metadata)."""
    for name in ("frame_rank", "frame_copies"):
        shutil.rmtree(out / "index" / name)
    root_doc = json.loads((out / "zarr.json").read_text())
    for name in ("index/frame_rank", "index/frame_copies"):
        del root_doc["consolidated_metadata"]["metadata"][name]
    (out / "zarr.json").write_text(json.dumps(root_doc))


def test_an_output_without_provenance_is_damage_named(merged, capsys):
    """An output always has index/frame_rank and index/frame_copies (docs/FORMAT.md section 2,
    *Invariants*): one without them is damaged, and open, inspect and coverage refuse it by name
    rather than report ranks as unknown."""
    _, out2 = merged
    _drop_provenance(out2)
    for fn in (lambda: spillmerge.open(str(out2)), lambda: coverage(str(out2))):
        with pytest.raises(spillmerge.CorruptSpillError, match=r"index/frame_rank: missing from the output's index"):
            fn()
    rc, _, stderr = _cli(capsys, "inspect", str(out2))
    assert rc != 0 and "index/frame_rank: missing" in stderr
    rep = spillmerge.verify(str(out2))
    assert not rep.ok and [p.rsplit("/", 1)[-1] for p in rep.problems] == [
        "frame_rank: missing from the output's index",
        "frame_copies: missing from the output's index",
    ]
