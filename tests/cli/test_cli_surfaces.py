"""The CLI as a user types it, with wrong paths and options out of range: one line naming the path
or option, exit 1, and nothing the command reads changed."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from test_cli import assert_one_line_error, cli_run

import spillmerge
from spillmerge import SpillMergeError
from spillmerge._storage import Storage


def _output(tmp_path: Path) -> tuple[Path, Path]:
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    for r in range(2):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=2) as w:
            for f in range(r, 6, 2):
                w.write("clip a.mp4", f, {"mask": torch.full((4, 4), float(f)), "score": f / 10})
    spillmerge.merge(str(root), str(out), progress=False)
    return root, out


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_export_into_the_output_it_reads_is_refused_and_the_output_stays_whole(tmp_path):
    _, out = _output(tmp_path)
    before = _tree(out)
    for target in (out / "zarr.json", out / "columns" / "x.parquet", out, tmp_path / "x" / ".." / "out.zarr" / "p"):
        assert_one_line_error(cli_run("export", str(out), "--parquet", str(target)), "would write into the output")
    with pytest.raises(SpillMergeError, match="would write into the output"):
        spillmerge.open(str(out)).to_parquet(f"file://{out}/index/x.parquet")
    assert _tree(out) == before
    assert cli_run("verify", str(out)).returncode == 0


def test_export_errors_name_the_parquet_path_not_a_temporary_one(tmp_path):
    _, out = _output(tmp_path)
    (tmp_path / "a-dir").mkdir()
    for target in (tmp_path / "a-dir", tmp_path / "no" / "such" / "x.parquet"):
        p = cli_run("export", str(out), "--parquet", str(target))
        assert_one_line_error(p, f"cannot write {target}:")
        assert ".tmp-" not in p.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["a-dir", "out.zarr", "spill"]


@pytest.mark.parametrize("size", ["0", "-1"])
def test_export_batch_size_out_of_range_is_one_line(tmp_path, size):
    _, out = _output(tmp_path)
    p = cli_run("export", str(out), "--parquet", str(tmp_path / "x.parquet"), "--batch-size", size)
    assert_one_line_error(p, "batch_size must be a positive number of rows", size)
    assert not (tmp_path / "x.parquet").exists()


def _s3_flags(flag: str, endpoint: str) -> list[str]:
    client = json.dumps({"endpoint_url": endpoint, "region_name": "us-east-1"})
    return [f"{flag}={k}={v}" for k, v in (("key", "test"), ("secret", "test"), ("client_kwargs", client))]


def test_export_to_s3_gets_the_storage_options_given(s3, tmp_path):
    import pyarrow.parquet as pq
    from _s3 import storage_options

    _output(tmp_path)
    out, flags = "s3://test/run/out.zarr", _s3_flags("--storage-option", s3.endpoint)
    p = cli_run("merge", str(tmp_path / "spill"), "--out", out, *_s3_flags("--out-storage-option", s3.endpoint))
    assert p.returncode == 0, p.stderr
    p = cli_run("export", out, "--parquet", "s3://test/run/preds.parquet", *flags)
    assert p.returncode == 0, p.stderr
    with Storage("s3://test/run", storage_options(s3.endpoint)).fs.open("test/run/preds.parquet", "rb") as f:
        assert pq.read_table(f).num_rows == 6
    assert_one_line_error(
        cli_run("export", out, "--parquet", f"{out}/zarr.json", *flags), "would write into the output"
    )
    assert cli_run("verify", out, *flags).returncode == 0


def test_options_out_of_range_are_one_line_errors(tmp_path):
    root, out = _output(tmp_path)
    before = _tree(out)
    for n in ("-1", "-5"):
        assert_one_line_error(cli_run("inspect", str(out), "--max-files", n), "--max-files", n)
    for s in ("-1", "0", "nan"):
        assert_one_line_error(cli_run("status", str(root), "--watch", "--interval", s), "--interval", s)
    assert_one_line_error(cli_run("status", str(root), "--expected", "-5"), "expected", "-5")
    for s in ("-5", "nan"):
        assert_one_line_error(cli_run("status", str(root), "--stall-after", s), "stall_after", s)
    for n in ("0", "-1"):
        p = cli_run("merge", str(root), "--out", str(tmp_path / "again"), "--world-size", n)
        assert_one_line_error(p, "world_size must be a positive int", n)
    assert not (tmp_path / "again").exists()
    assert _tree(out) == before
    assert "0 missing" in cli_run("inspect", str(out), "--max-files", "0").stdout


def test_inspect_never_draws_its_plot_into_what_it_reads(tmp_path):
    pytest.importorskip("matplotlib")
    root, out = _output(tmp_path)
    trees = {p: _tree(p) for p in (root, out)}
    commit = next(root.rglob("commit.json"))
    for path, plot in ((out, out / "zarr.json"), (out, out / "x.png"), (root, commit), (root, root / "c.png")):
        assert_one_line_error(cli_run("inspect", str(path), "--plot", str(plot)), f"--plot {plot} lies inside")
    assert {p: _tree(p) for p in (root, out)} == trees
    assert cli_run("inspect", str(out), "--plot", str(tmp_path / "c.png")).returncode == 0
    assert (tmp_path / "c.png").stat().st_size > 0


def test_demo_never_replaces_a_spill_root_or_output_it_did_not_write(tmp_path):
    root, out = _output(tmp_path)  # a user's job: tmp_path/spill, and its output
    trees = {p: _tree(p) for p in (root, out)}
    p = cli_run("demo", "--out", str(tmp_path), "--ranks", "1", "--files", "1")
    assert_one_line_error(p, str(root), "'clip a.mp4'", "choose another --out")
    assert _tree(root) == trees[root]
    shutil.move(out, tmp_path / "merged.zarr")
    shutil.rmtree(root)
    p = cli_run("demo", "--out", str(tmp_path), "--ranks", "1", "--files", "1")
    assert_one_line_error(p, str(tmp_path / "merged.zarr"), "'clip a.mp4'", "choose another --out")
    assert _tree(tmp_path / "merged.zarr") == trees[out]


def test_an_output_given_as_the_spill_root_is_named_so(tmp_path):
    _, out = _output(tmp_path)
    p = cli_run("merge", str(out), "--out", str(tmp_path / "again"))
    assert_one_line_error(p, str(out), "it is a merged output, not a spill root")
    assert not (tmp_path / "again").exists()


def test_a_manifest_saved_with_a_byte_order_mark_is_read(tmp_path):
    _, out = _output(tmp_path)
    manifest = tmp_path / "m.csv"
    manifest.write_bytes("filename,n_frames\r\nclip a.mp4,8\r\n".encode("utf-8-sig"))  # Excel's "CSV UTF-8"
    p = cli_run("inspect", str(out), "--expected", str(manifest))
    assert p.returncode == 1 and not p.stderr, p.stderr  # frames 6 and 7 are missing
    assert "2 missing" in p.stdout


def test_a_nan_timeout_is_refused_not_waited_on_forever(tmp_path):
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=2) as w:  # rank 1 never commits
        w.write("clip a.mp4", 0, torch.zeros(2))
    ran: list = []
    t = threading.Thread(target=lambda: ran.append(cli_run("merge", str(root), "--out", str(tmp_path / "o"),
                                                           "--timeout", "nan")), daemon=True)  # fmt: skip
    t.start()
    t.join(30)
    assert ran, "merge --timeout nan still polling after 30 s"
    assert_one_line_error(ran[0], "timeout must be a number of seconds", "nan")
