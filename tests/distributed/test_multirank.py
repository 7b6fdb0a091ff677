"""Four real gloo ranks (torch.multiprocessing, forked from a forkserver that has imported torch)
writing through SpillWriter and merging with ``w.merge``, checked against
``torch.distributed.gather_object`` of the same inputs.

Process start is slow, so one start runs every scenario of ``_mp_scenarios`` in the same four
processes; the ranks report in ``tmp_path/results/rank-R.json`` and this test asserts on those.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from _mp_scenarios import HOSTILE, WORLD, all_keys, check_with_plain_zarr, kinds_keys, worker
from _procs import ranks_fixture

SPAWN_TIMEOUT = 240.0  # seconds for the whole spawn; a hang fails the test instead of blocking it


ranks = ranks_fixture(worker, WORLD, "multirank", SPAWN_TIMEOUT)


# ---------------------------------------------------------------------------------- main scenario
def test_main_matches_gather_object_bit_exactly(ranks):
    _, results = ranks
    r0 = results[0]["main"]
    assert r0["problems"] == [], "\n".join(r0["problems"])
    keys = all_keys()
    n_keys = len(keys)
    assert len(set(keys)) == n_keys > 100
    # Every rank wrote something, unevenly, and gather_object saw exactly the same keys.
    mine = [results[r]["main"]["n_mine"] for r in range(WORLD)]
    assert sum(mine) == n_keys and min(mine) > 0 and len(set(mine)) > 1, mine
    assert r0["gathered_frames"] == n_keys and r0["gathered_overlap"] == 0
    assert r0["frames_checked"] == n_keys and r0["leaves_checked"] > n_keys
    rep = r0["report"]
    assert rep["n_frames"] == n_keys and rep["n_files"] == len(HOSTILE)
    assert rep["ranks"] == list(range(WORLD)) and rep["segments"] == WORLD and rep["duplicates"] == 0
    assert rep["nbytes"] == r0["gathered_nbytes"]
    # Rank 3 committed only after rank 0 had called merge(): the merge waited for it on storage
    # (and its frames are all there, checked above) instead of merging without it.
    assert r0["last_committed_before_merge"] is False
    assert rep["wait_seconds"] > 0 and rep["missing_ranks"] == []
    for r in range(1, WORLD):
        assert results[r]["main"]["report"] is None  # merge returns None off the dst rank


def test_main_reads_back_with_plain_zarr(ranks):
    """Without spillmerge's reader: original filenames, file layouts, column headers, frame
    index, raw bits (format 2: columns/<col>/values, offsets where rows vary)."""
    base, _ = ranks
    check_with_plain_zarr(str(base / "main" / "out"), all_keys())


def _allowed_node_name(name: str, parent: Path, out: Path) -> bool:
    if parent == out / "columns" and re.fullmatch(r"_value(\.[a-z0-9_]+)?", name):
        return True  # the plain tensor values' column(s), per dtype (FORMAT.md section 2)
    return (
        name.isascii()
        and 0 < len(name) <= 100
        and "/" not in name
        and "\\" not in name
        and name not in (".", "..")
        and not name.startswith((".", "__"))
    )


def test_nothing_is_written_outside_the_trees(ranks):
    base, _ = ranks
    assert sorted(os.listdir(base)) == sorted(
        [
            "results", "main", "dup", "identical", "dup_leaf", "mismatch", "mismatch_files", "mismatch_shape",
            "mismatch_ndim", "parallel", "kinds",
        ]
    )  # fmt: skip
    assert sorted(os.listdir(base / "results")) == [f"rank-{r}.json" for r in range(WORLD)]
    assert sorted(os.listdir(base / "main")) == ["out", "spill"]
    # Failed merges leave no output behind.
    assert sorted(os.listdir(base / "dup")) == ["first", "last", "spill"]
    assert sorted(os.listdir(base / "dup_leaf")) == ["spill"]
    assert sorted(os.listdir(base / "mismatch")) == ["out", "spill"]  # version 3: variants merge
    assert sorted(os.listdir(base / "mismatch_ndim")) == ["out", "spill"]
    assert sorted(os.listdir(base / "mismatch_files")) == ["out", "spill"]
    assert sorted(os.listdir(base / "mismatch_shape")) == ["out", "spill"]
    assert sorted(os.listdir(base / "identical")) == ["out", "spill"]
    assert sorted(os.listdir(base / "kinds")) == ["one", "par", "spill"]
    scenarios = ("main", "dup", "identical", "dup_leaf", "mismatch", "mismatch_files", "mismatch_shape",
                 "mismatch_ndim", "parallel", "kinds")  # fmt: skip
    for scenario in scenarios:
        spill = base / scenario / "spill"
        assert sorted(os.listdir(spill)) == [f"rank-{r:05d}" for r in range(WORLD)]
        for r in range(WORLD):
            segs = os.listdir(spill / f"rank-{r:05d}")
            assert len(segs) == 1 and segs[0].startswith("seg-"), segs
            assert (spill / f"rank-{r:05d}" / segs[0] / "commit.json").is_file()
            assert not (spill / f"rank-{r:05d}" / segs[0] / "failed.json").exists()
    out = (base / "main" / "out").resolve()
    assert sorted(os.listdir(out)) == ["columns", "index", "spillmerge-complete.json", "zarr.json"]
    chunk_name = re.compile(r"^[0-9]+$")
    for dirpath, dirnames, filenames in os.walk(out):
        here = Path(dirpath).resolve()
        assert here == out or out in here.parents
        for d in dirnames:
            assert _allowed_node_name(d, here, out), f"unsafe node name {d!r} in {dirpath}"
            assert not (here / d).is_symlink()
        for f in filenames:
            assert f in ("zarr.json", "spillmerge-complete.json") or chunk_name.match(f), f"{dirpath}/{f}"
    # Nothing from '../../etc/passwd' or '..' escaped anywhere near the output.
    for _dirpath, _, filenames in os.walk(base):
        assert "passwd" not in filenames
    assert not (base.parent / "etc").exists() and not (base / "etc").exists()


# ------------------------------------------------------------------------------- duplicate frames
def test_cross_rank_duplicate_is_an_error_naming_the_ranks(ranks):
    _, results = ranks
    err = results[0]["duplicates"]["error"]
    assert err["type"] == "DuplicateFrameError", err
    assert err["is_spillmerge_error"] and err["is_value_error"]
    assert err["filename"] == "clip.mp4" and err["frame_idx"] == 5 and err["ranks"] == [1, 2], err
    assert "clip.mp4" in err["msg"] and "5" in err["msg"] and "[1, 2]" in err["msg"]
    for r in range(1, WORLD):
        assert results[r]["duplicates"]["merge_returned"] == "None"


def test_cross_rank_duplicate_first_and_last_policies(ranks):
    _, results = ranks
    d = results[0]["duplicates"]
    # Rank 2's segment started before rank 1's (the ranks were ordered by a barrier).
    assert d["first"]["clip_5"] == [2.0, 2.0, 2.0]
    assert d["last"]["clip_5"] == [1.0, 1.0, 1.0]
    for policy in ("first", "last"):
        rep = d[policy]["report"]
        assert d[policy]["clip_frames"] == [5, 10, 11, 12, 13]
        assert d[policy]["same_bits"] == [[0x7F81, 3]]
        assert rep["n_frames"] == 6 and rep["ranks"] == [0, 1, 2, 3]
        assert rep["duplicates"] == 2  # one copy dropped by the policy, one identical copy


def test_identical_duplicates_across_ranks_are_not_an_error(ranks):
    _, results = ranks
    ident = results[0]["identical"]
    rep = ident["report"]
    # same.mp4 twice, same_dict.mp4 twice, all.mp4 frame 0 three times; rank 2 wrote nothing.
    assert rep["duplicates"] == 1 + 1 + 2
    assert rep["ranks"] == [0, 1, 2, 3] and rep["n_files"] == 3
    assert ident["frames"] == {"all.mp4": [0, 1, 2, 4], "same.mp4": [0], "same_dict.mp4": [3]}
    assert ident["same_bits"] == [[0x7F81, 3]]
    assert ident["same_dict"] == {"a": [[0, 1, 2]], "c": [2.5]}
    assert ident["all"] == [[0, 1, 2, 3], [0, 0, 0, 0], [0, 1, 2, 3], [0, 3, 6, 9]]


def test_dict_value_differing_in_one_leaf_is_a_duplicate(ranks):
    _, results = ranks
    err = results[0]["dict_leaf_duplicate"]["error"]
    assert err["type"] == "DuplicateFrameError", err
    assert err["filename"] == "d.mp4" and err["frame_idx"] == 7 and err["ranks"] == [0, 3], err


# -------------------------------------------------------------------------------- layout mismatch
def test_cross_rank_dtype_mismatch_in_one_file_is_one_column_per_dtype(ranks):
    """Version 3 (issue 23): format 2 refused a leaf of two dtypes in one file; now each dtype is
    a column of its own and every row keeps its dtype."""
    _, results = ranks
    assert results[0]["mismatch"]["dtype"]["type"] is None, results[0]["mismatch"]["dtype"]
    for r in range(1, WORLD):
        assert results[r]["mismatch"]["dtype"] == "None"


def test_cross_rank_dtype_mismatch_between_files_is_one_column_per_dtype(ranks):
    """Format 2 changed this on purpose: float32 in a.mp4 (rank 0) and float16 in b.mp4 (ranks
    1-3) merge into columns _value.float32 and _value.float16, nothing converted."""
    base, results = ranks
    m = results[0]["mismatch"]
    assert m["dtype_files"]["type"] is None, m["dtype_files"]
    rep = m["dtype_files"]["report"]
    assert rep["n_files"] == 2 and rep["n_frames"] == 4 and rep["ranks"] == [0, 1, 2, 3]
    assert m["files_column_dirs"] == ["_value.float16", "_value.float32", "zarr.json"]
    assert m["files"] == {
        "a.mp4": {"dtype": "float32", "frames": [0], "bits": [[0x7F800001, -0x80000000]]},
        "b.mp4": {"dtype": "float16", "frames": [1, 11, 12], "bits": [[0x7C01, -0x8000], [0x3C00] * 2, [0x4000] * 2]},
    }
    # A column per dtype over all four rows, the other dtype's file absent there.
    assert m["files_columns"] == {
        "float16": {"valid": [False, True, True, True], "rows": [None, [0x7C01, -0x8000], [0x3C00] * 2, [0x4000] * 2]},
        "float32": {"valid": [True, False, False, False], "rows": [[0x7F800001, -0x80000000], None, None, None]},
    }
    err = m["files_column_error"]
    assert err["type"] == "UnknownColumnError" and err["known"] == ["float16", "float32"], err
    assert "pass dtype=" in err["msg"]
    for r in range(1, WORLD):
        assert results[r]["mismatch"]["dtype_files"] == "None"


def test_cross_rank_nested_leaf_shape_change_is_a_ragged_column(ranks):
    """Format 2 changed this on purpose: meta/box (4,) on ranks 0, 1, 3 and (5,) on rank 2 is one
    ragged column, each row as written."""
    _, results = ranks
    m = results[0]["mismatch"]
    assert m["shape"]["type"] is None and m["shape"]["report"]["n_frames"] == WORLD, m["shape"]
    box = m["shape_box"]
    assert box["kind"] == "ragged" and box["pred_kind"] == "fixed" and box["frames"] == [0, 1, 2, 3]
    assert box["dtypes"] == ["float32"]
    assert box["rows"] == [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0, 24.0],
                           [30.0, 31.0, 32.0, 33.0]]  # fmt: skip


def test_cross_rank_nested_leaf_ndim_mismatch_is_one_column_per_variant(ranks):
    _, results = ranks
    assert results[0]["mismatch"]["ndim"]["type"] is None, results[0]["mismatch"]["ndim"]


def test_parallel_merge_names_a_rank_that_never_takes_part(ranks):
    _, results = ranks
    err = results[0]["parallel"]["missing"]
    assert err["type"] == "PartsTimeout" and err["is_spillmerge_error"], err
    assert err["missing"] == [2] and "part 2/4 (rank 2)" in err["msg"], err
    for r in (1, 3):  # the others wrote their parts and returned
        assert results[r]["parallel"]["missing"]["type"] is None
        assert results[r]["parallel"]["missing"]["report"] is None


# ------------------------------------------------------------------------------- every value kind
def test_every_value_kind_matches_gather_object_bit_exactly(ranks):
    """Ragged boxes and maps, token lists, str, lists of str, bytes, None rows and absent leaves
    from four ranks: the plain merge and merge(parallel=True) both hold exactly what
    gather_object gathered, and write the same objects."""
    _, results = ranks
    k = results[0]["kinds"]
    n_keys = len(kinds_keys())
    mine = [results[r]["kinds"]["n_mine"] for r in range(WORLD)]
    assert sum(mine) == n_keys == k["gathered_frames"] and min(mine) > 0, mine
    for tag in ("one", "par"):
        assert k[tag]["problems"] == [], "\n".join(k[tag]["problems"])
        assert k[tag]["frames_checked"] == n_keys and k[tag]["leaves_checked"] == 7 * n_keys
    assert k["tree_diff"] == [], k["tree_diff"]
    for rep in (k["report"], k["parallel_report"]):
        assert rep["n_frames"] == n_keys and rep["ranks"] == list(range(WORLD)) and rep["duplicates"] == 0
    assert k["parallel_report"]["parts"] == WORLD and k["report"]["parts"] == 1
    assert k["column_kinds"] == {
        "boxes": "ragged", "emb": "ragged", "tokens": "ragged", "caption": "str", "labels": "strlist",
        "raw": "bytes", "score": "fixed",
    }  # fmt: skip
    assert k["column_rows"] == {p: True for p in ("boxes", "emb", "tokens", "caption", "labels", "raw")}
    assert k["boxes_flat"] and k["emb_shapes"]
    assert k["boxes_slice"]["type"] == "RaggedShapeError" and k["boxes_slice"]["is_value_error"], k["boxes_slice"]
    assert k["boxes_stacked"] and k["boxes_stacked_rows"] >= 1
    for r in range(1, WORLD):
        assert results[r]["kinds"]["report"] is None and results[r]["kinds"]["parallel_report"] is None
