"""Scale-out merge (``part=(i, n)`` + ``finalize``, the CLI's ``--part`` / ``--finalize``) and the
output codecs. The multi-rank ``parallel=True`` run is in test_multirank.py (one shared spawn)."""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from _helpers import raw_bytes
from _mp_scenarios import output_tree, tree_diff
from test_cli import assert_one_line_error, run

import spillmerge
from spillmerge import _format as F

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip
OPTS = {"chunk_bytes": 8192, "codec": "zstd"}


def _value(i: int, frame: int) -> object:
    """Uneven files: sizes differ by file so the split has something to balance; some dict values."""
    g = torch.Generator().manual_seed(i * 1000 + frame)
    t = torch.randint(-1000, 1000, (4 + 60 * (i % 4), 8), generator=g).to(torch.bfloat16)
    if i % 3 == 0:
        return {"pred": t, "meta": {"score": frame / 7, "box": np.full(4, frame, dtype=np.float32)}}
    return t


def _spill(root: Path, world: int = 3, files: int = 8, frames: int = 12) -> None:
    for r in range(world):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=world, chunk_bytes=4096) as w:
            for i in range(files):
                for f in range(r, frames + i, world):
                    w.write(f"clip {i}.mp4", f, _value(i, f))


def _parts(root: Path, out: Path, n: int, **kw: object) -> list[spillmerge.MergeReport]:
    return [spillmerge.merge(str(root), str(out), part=(i, n), **{**OPTS, **kw}) for i in range(n)]  # type: ignore[arg-type]


def _same_values(a: str, b: str) -> None:
    ra, rb = spillmerge.open(a), spillmerge.open(b)
    assert ra.filenames == rb.filenames
    for name in ra.filenames:
        assert ra.frames(name).tolist() == rb.frames(name).tolist()
        xa, xb = ra[name], rb[name]
        pairs = (
            [(xa, xb)]
            if not isinstance(xa, dict)
            else [(xa["pred"], xb["pred"]), (xa["meta"]["box"], xb["meta"]["box"])]
        )
        for u, v in pairs:
            assert raw_bytes(u.to_torch()) == raw_bytes(v.to_torch()), name


def test_cli_parts_then_finalize_equal_one_process_merge(tmp_path):
    root, one, out = tmp_path / "spill", tmp_path / "one.zarr", tmp_path / "out.zarr"
    _spill(root)
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    common = ["--codec", "zstd", "--chunk-bytes", "8KiB", "--no-progress"]
    for i in (0, 1):
        p = run("merge", str(root), "--out", str(out), "--part", f"{i}/3", *common)
        assert p.returncode == 0, p.stderr
        assert f"part {i}/3: merged" in p.stdout
    # A missing part: one line naming it, exit 1, nothing lost.
    p = run("merge", str(root), "--out", str(out), "--finalize")  # codec and chunk size: from the parts
    assert_one_line_error(p, "1 of 3 part(s)", "part 2/3", "--part I/3")
    assert sorted(os.listdir(out / "spillmerge-parts")) == ["part-00000-of-00003.json", "part-00001-of-00003.json"]
    p = run("merge", str(root), "--out", str(out), "--part", "2/3", *common)
    assert p.returncode == 0, p.stderr
    p = run("merge", str(root), "--out", str(out), "--finalize", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "in 3 parts with zstd" in p.stdout
    # Object for object what one process writes (the root header's timestamp aside).
    assert tree_diff(output_tree(str(one)), output_tree(str(out))) == []
    _same_values(str(one), str(out))
    # Plain zarr reads it; the consolidated metadata is what zarr's own consolidation writes.
    g = zarr.open_group(str(out), mode="r")
    names = [str(x) for x in g["index/filenames"][:]]
    assert names == sorted(f"clip {i}.mp4" for i in range(8))
    arr = g[f"files/{g['index/keys'][1]}"]
    assert arr.attrs["spillmerge"]["dtype"] == "bfloat16" and arr.metadata.codecs[1].to_dict()["name"] == "zstd"
    ours = json.loads((out / "zarr.json").read_text())
    shutil.copytree(out, tmp_path / "z")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr warns about the marker and the part records
        zarr.consolidate_metadata(str(tmp_path / "z"))
    assert ours == json.loads((tmp_path / "z" / "zarr.json").read_text())
    p = run("verify", str(out))
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout
    p = run("merge", "--part", "3/3", str(root), "--out", str(out))
    assert p.returncode == 2 and "not in 0/N" in p.stderr


def test_part_rerun_is_idempotent_and_repairs_a_crashed_part(tmp_path):
    root, one, out = tmp_path / "spill", tmp_path / "one", tmp_path / "out"
    _spill(root)
    spillmerge.merge(str(root), str(one), **OPTS)  # type: ignore[arg-type]
    whole = spillmerge.open(str(one)).header
    reps = _parts(root, out, 3)
    # The split is by bytes: every part got files, the parts add up to the whole, none dominates.
    assert all(r.n_files > 0 and r.parts == 3 for r in reps) and [r.part for r in reps] == [0, 1, 2]
    assert sum(r.nbytes for r in reps) == whole["nbytes"] and sum(r.n_frames for r in reps) == whole["n_frames"]
    assert sum(r.n_files for r in reps) == 8 and max(r.nbytes for r in reps) < 0.6 * whole["nbytes"]
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = spillmerge.merge(str(root), str(out), part=(1, 3), **OPTS)  # type: ignore[arg-type]
    assert any("already complete" in n for n in again.notes) and "already complete" in str(again)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing rewritten
    # A crash of part 1 after some chunks: no record, a torn chunk, a stray chunk.
    (out / "spillmerge-parts" / "part-00001-of-00003.json").unlink()
    key = json.loads((out / "spillmerge-parts" / "part-00000-of-00003.json").read_text())  # sanity: readable
    assert key["kind"] == "merge-part" and key["parts"] == 3
    key = _files_of_part(root, 1, 3)[0].key
    torn = next(p for p in sorted((out / "files" / key).rglob("*")) if p.is_file() and p.name.isdigit())
    torn.write_bytes(torn.read_bytes()[:10])
    (torn.parent / "999").write_bytes(b"stray")
    with pytest.raises(spillmerge.MissingPartsError, match="part 1/3") as info:
        spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert info.value.missing == [1] and info.value.parts == 3
    spillmerge.merge(str(root), str(out), part=(1, 3), **OPTS)  # type: ignore[arg-type]
    assert not (torn.parent / "999").exists()
    rep = spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert rep.parts == 3 and rep.part is None and rep.n_files == 8
    assert tree_diff(output_tree(str(one)), output_tree(str(out))) == []
    assert spillmerge.verify(str(out)).ok
    # A complete output: parts and finalize refuse without overwrite, like the one-process merge.
    with pytest.raises(spillmerge.OutputExistsError, match="complete merge"):
        spillmerge.merge(str(root), str(out), part=(0, 3), **OPTS)  # type: ignore[arg-type]
    with pytest.raises(spillmerge.OutputExistsError, match="complete merge"):
        spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]


def _files_of_part(root: Path, i: int, n: int) -> list:
    from spillmerge._merge import _Job
    from spillmerge._plan import split

    job = _Job.open(str(root), str(root.parent / "unused"), **OPTS)  # type: ignore[arg-type]
    job.src.close()
    return [job.plan.files[k] for k in split(job.plan, n)[i]]


def test_parts_of_different_plans_never_mix(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out"
    _spill(root, world=2)
    _parts(root, out, 2)
    # Other output settings, or another part count: refused before anything is written.
    with pytest.raises(spillmerge.PlanMismatchError, match="different merge plan") as info:
        spillmerge.merge(str(root), str(out), part=(0, 2), chunk_bytes=8192, codec="blosc-lz4")
    assert info.value.parts == [0, 1] and "part-00000-of-00002.json" in str(info.value)
    with pytest.raises(spillmerge.PlanMismatchError, match="part count"):
        spillmerge.merge(str(root), str(out), part=(2, 3), **OPTS)  # type: ignore[arg-type]
    # The spill root changes between the parts and the finalize (a rank reran and committed more).
    with spillmerge.SpillWriter(str(root), rank=1, world_size=2) as w:
        w.write("late.mp4", 0, torch.ones(3))
    with pytest.raises(spillmerge.PlanMismatchError, match="part 0/2 .* part 1/2"):
        spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert len(os.listdir(out / "spillmerge-parts")) == 2  # refusing deletes nothing
    with pytest.raises(spillmerge.PlanMismatchError):
        spillmerge.merge(str(root), str(out), part=(0, 2), **OPTS)  # type: ignore[arg-type]
    # overwrite: the new plan's parts replace the old records; finalize prunes what no part owns.
    (out / "files" / "leftover").mkdir()
    (out / "files" / "leftover" / "zarr.json").write_text("{}")
    _parts(root, out, 3, overwrite=True)
    assert sorted(os.listdir(out / "spillmerge-parts")) == [f"part-0000{i}-of-00003.json" for i in range(3)]
    spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert not (out / "files" / "leftover").exists()
    spillmerge.merge(str(root), str(tmp_path / "one"), **OPTS)  # type: ignore[arg-type]
    assert tree_diff(output_tree(str(tmp_path / "one")), output_tree(str(out))) == []
    assert spillmerge.open(str(out)).filenames[-1] == "late.mp4"


def test_a_failed_part_is_named_and_the_other_parts_are_kept(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=2, chunk_bytes=4096) as w:
        for f in range(4):
            w.write("bad.mp4", f, torch.full((1024,), float(f)))
    with spillmerge.SpillWriter(str(root), rank=1, world_size=2, chunk_bytes=4096) as w:
        for i in range(6):
            w.write(f"good{i}.mp4", 0, torch.full((512,), float(i)))
    chunk = next(root.glob("rank-00000/seg-*/data/c/1"))
    raw = bytearray(chunk.read_bytes())
    raw[7] ^= 1
    chunk.write_bytes(bytes(raw))
    failed = []
    for i in range(3):
        try:
            spillmerge.merge(str(root), str(out), part=(i, 3))
        except spillmerge.CorruptSpillError:
            failed.append(i)
    assert len(failed) == 1, failed
    bad = failed[0]
    records = sorted(os.listdir(out / "spillmerge-parts"))
    assert f"part-{bad:05d}-of-00003.failed.json" in records and len(records) == 3
    t = time.perf_counter()
    with pytest.raises(
        spillmerge.PartFailedError, match=f"part {bad}/3: CorruptSpillError: .*checksum mismatch"
    ) as info:
        spillmerge.merge(str(root), str(out), finalize=True, timeout=30)
    assert time.perf_counter() - t < 10  # at once, not at the timeout
    assert list(info.value.failures) == [bad] and isinstance(info.value, spillmerge.RankFailedError)
    # The good parts' arrays are all still there.
    assert len([p for p in (out / "files").iterdir() if (p / "c").is_dir()]) >= 6
    # A failure record of another plan (an older merge) does not count: the part is just missing.
    failure = out / "spillmerge-parts" / f"part-{bad:05d}-of-00003.failed.json"
    rec = json.loads(failure.read_text())
    assert rec["kind"] == "merge-part-failure" and rec["error_type"] == "CorruptSpillError"
    failure.write_text(json.dumps({**rec, "plan": "0" * 32}))
    with pytest.raises(spillmerge.PartsTimeout, match=f"part {bad}/3") as info2:
        spillmerge.merge(str(root), str(out), finalize=True, timeout=0.3)
    assert info2.value.missing == [bad] and info2.value.waited_s >= 0.3
    # The spill is repaired; the failed part reruns alone and clears its failure record.
    raw[7] ^= 1
    chunk.write_bytes(bytes(raw))
    spillmerge.merge(str(root), str(out), part=(bad, 3))
    assert not failure.exists()
    rep = spillmerge.merge(str(root), str(out), finalize=True)
    assert rep.n_files == 7 and spillmerge.verify(str(out)).ok
    assert spillmerge.open(str(out))["bad.mp4"][3, 0] == 3.0


def test_parts_never_touch_a_folder_they_did_not_write(tmp_path):
    root = tmp_path / "spill"
    _spill(root, world=1, files=2, frames=2)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    for kw in ({"part": (0, 2)}, {"finalize": True}, {"part": (0, 2), "overwrite": True}):
        with pytest.raises(spillmerge.OutputExistsError, match="not a spillmerge output"):
            spillmerge.merge(str(root), str(mine), **kw)  # type: ignore[arg-type]
    assert os.listdir(mine) == ["thesis.tex"]
    with pytest.raises(spillmerge.MissingPartsError, match="no parts found"):
        spillmerge.merge(str(root), str(tmp_path / "nothing"), finalize=True)
    with pytest.raises(spillmerge.SpillValueError, match="not both"):
        spillmerge.merge(str(root), str(tmp_path / "x"), finalize=True, part=(0, 1))
    with pytest.raises(spillmerge.SpillValueError, match="0 <= i < n"):
        spillmerge.merge(str(root), str(tmp_path / "x"), part=(2, 2))
    with pytest.raises(spillmerge.SpillValueError, match="codec must be one of"):
        spillmerge.merge(str(root), str(tmp_path / "x"), codec="gzip")


def test_parts_on_every_backend(backend):
    root, out, one = backend.url("spill"), backend.url("out"), backend.url("one")
    for r in range(2):
        with spillmerge.SpillWriter(root, rank=r, world_size=2, storage_options=backend.options) as w:
            for i in range(5):
                w.write(f"v{i}/x.mp4", r, torch.arange(i + 3, dtype=torch.float16) + r)
    so = {"storage_options": backend.options, "codec": "blosc-lz4"}
    for i in range(3):
        spillmerge.merge(root, out, part=(i, 3), **so)  # type: ignore[arg-type]
    rep = spillmerge.merge(root, out, finalize=True, **so)  # type: ignore[arg-type]
    assert rep.parts == 3 and rep.n_frames == 10
    spillmerge.merge(root, one, **so)  # type: ignore[arg-type]
    a, b = spillmerge.open(out, backend.options), spillmerge.open(one, backend.options)
    for name in a.filenames:
        assert np.array_equal(a[name][...], b[name][...]) and a.frames(name).tolist() == [0, 1]
    assert spillmerge.verify(out, backend.options).ok


@pytest.mark.parametrize("codec", spillmerge.CODECS)
def test_every_codec_round_trips_every_dtype(tmp_path, codec):
    root, out = tmp_path / "s", tmp_path / "o"
    g = torch.Generator().manual_seed(0)
    expected = {}
    with spillmerge.SpillWriter(str(root), chunk_bytes=4096) as w:
        for i, dt in enumerate(DTYPES):
            for f in range(5):
                raw = torch.randint(
                    0, 256, (3 * 7 * torch.empty(0, dtype=dt).element_size(),), generator=g, dtype=torch.uint8
                )
                t = (raw % 2).bool()[:21].reshape(3, 7) if dt == torch.bool else raw.view(dt).reshape(3, 7)
                if f == 0:
                    t = torch.zeros_like(t)  # compressible
                expected[(str(dt), f)] = t
                w.write(str(dt), f, t)
            w.write("zeros", i, torch.zeros(512))
    rep = spillmerge.merge(str(root), str(out), codec=codec, chunk_bytes=1024)
    assert rep.codec == codec
    res = spillmerge.open(str(out))
    grp = zarr.open_group(str(out), mode="r")
    keys = dict(zip([str(x) for x in grp["index/filenames"][:]], [str(x) for x in grp["index/keys"][:]], strict=True))
    for (name, f), want in expected.items():
        got = res[name].to_torch()[f]
        assert got.dtype == want.dtype and raw_bytes(got) == raw_bytes(want), (codec, name, f)
        plain = np.asarray(grp[f"files/{keys[name]}"][f])  # raw bits for dtypes numpy lacks
        assert plain.tobytes() == raw_bytes(want), (codec, name, f)
    names = [c["name"] for c in json.loads((out / "files" / "zeros" / "zarr.json").read_text())["codecs"]]
    assert names == {"none": ["bytes", "crc32c"], "blosc-lz4": ["bytes", "blosc", "crc32c"],
                     "zstd": ["bytes", "zstd", "crc32c"]}[codec]  # fmt: skip
    # Chunk for chunk the bytes zarr itself writes with the same codec chain.
    for name in ("zeros", "torch.bfloat16"):
        arr = grp[f"files/{keys[name]}"]
        ref = zarr.create_array(
            store=str(tmp_path / "ref" / keys[name]), shape=arr.shape, chunks=arr.chunks, dtype=arr.dtype,
            serializer=arr.metadata.codecs[0], compressors=list(arr.metadata.codecs[1:]), fill_value=arr.fill_value,
            config={"write_empty_chunks": True},
        )  # fmt: skip
        ref[...] = arr[...]
        ours = {
            p.relative_to(out / "files" / keys[name]): p.read_bytes()
            for p in (out / "files" / keys[name]).rglob("c/**/*")
            if p.is_file()
        }
        theirs = {
            p.relative_to(tmp_path / "ref" / keys[name]): p.read_bytes()
            for p in (tmp_path / "ref" / keys[name]).rglob("c/**/*")
            if p.is_file()
        }
        assert ours == theirs and len(ours) >= (2 if name == "zeros" else 1), (codec, name)
    chunk = out / "files" / "zeros" / "c" / "0" / "0"
    assert (chunk.stat().st_size < 200) == (codec != "none")  # 1 KiB of zeros
    assert spillmerge.verify(str(out)).ok
    chunk.write_bytes(chunk.read_bytes()[:-5] + b"XXXXX")
    rep2 = spillmerge.verify(str(out))
    assert not rep2.ok and "zeros" in rep2.problems[0] and F.COMPLETE_NAME in os.listdir(out)
