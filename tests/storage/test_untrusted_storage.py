"""Conformance suite for untrusted storage (docs/GUARANTEES.md, *Threat model*).

Every object kind of a spill root and of a merged output × every attack a hostile writer of the
storage can make: each reader (merge, verify, inspect + coverage, committed_keys; open + read,
the parts barrier of finalize) must end within seconds with a ``SpillMergeError`` or the correct
result, within a memory cap, without following a link or blocking on a FIFO. The readers run in
child processes (tests/_untrusted_workers.py), so a hang or a runaway read fails a case instead
of the session.

A new format object joins by adding one line to ``KINDS``; a new attack by one function in
``ATTACKS``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
import torch
from _procs import rank_context
from _untrusted_workers import MEMORY_HEADROOM
from _untrusted_workers import main as run_cases

import spillmerge
import spillmerge._format.spill

# object kind -> (tree it lives in, glob of its path in a freshly built spill root / output)
KINDS: dict[str, tuple[str, str]] = {
    "segment header": ("spill", "rank-00000/seg-*/zarr.json"),
    "data chunk": ("spill", "rank-00000/seg-*/data/c/0"),
    "journal entry": ("spill", "rank-00001/seg-*/journal/000000"),
    "index chunk": ("spill", "rank-00000/seg-*/index/c/0/0"),
    "catalog chunk": ("spill", "rank-00000/seg-*/catalog/c/0"),
    "block checksums chunk": ("spill", "rank-00000/seg-*/checks/c/0/0"),
    "commit record": ("spill", "rank-00000/seg-*/commit.json"),
    "failure record": ("spill", "rank-00001/seg-*/failed.json"),
    "root document": ("out", "zarr.json"),
    "part record": ("out", "spillmerge-parts/part-*-of-*.json"),
    "completion marker": ("out", "spillmerge-complete.json"),
    "index frame_idx": ("out", "index/frame_idx/c/0"),
    "index frame_offsets": ("out", "index/frame_offsets/c/0"),
    "index filenames": ("out", "index/filenames/c/0"),
    "index file_layout": ("out", "index/file_layout/c/0"),
    "index filename_offsets": ("out", "index/filename_offsets/c/0"),
    "index filename_heads": ("out", "index/filename_heads/c/0"),
    "index filename_head_offsets": ("out", "index/filename_head_offsets/c/0"),
    "output data chunk": ("out", "columns/x/values/c/0/0"),
    "ragged column offsets": ("out", "columns/m/offsets/c/0"),
    "ragged column shapes": ("out", "columns/m/shapes/c/0/0"),
    "column valid": ("out", "columns/o/valid/c/0"),
    "column none": ("out", "columns/o/none/c/0"),
    "fixed column offsets": ("out", "columns/o/offsets/c/0"),
    "string column values": ("out", "columns/t/values/c/0"),
    "union type ids": ("out", "columns/u.str/valid/c/0"),
    "union variant offsets": ("out", "columns/u.float32.1d/offsets/c/0"),
    "list header": ("out", "columns/l__~*/values/c/0"),
    "list offsets": ("out", "lists/l___~*/offsets/c/0"),
    "list item variant": ("out", "columns/l___~*.str/valid/c/0"),
    "merge failure record": ("spill", "spillmerge-failed.json"),
    "progress record": ("spill", "rank-00000/seg-*/progress.json"),
    "callback report": ("spill", "spillmerge-report.json"),
    "lease lock file": ("out", "spillmerge-lease/output.lock"),
}


def _replace(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def _fifo(p: Path, outside: Path) -> None:
    _replace(p)
    os.mkfifo(p)


def _directory(p: Path, outside: Path) -> None:
    _replace(p)
    p.mkdir()


def _link_out(p: Path, outside: Path) -> None:
    # A FIFO outside the root: a reader following the link blocks in open() (the case times out),
    # and the workers' audit hook names any open of a link without O_NOFOLLOW.
    target = outside / f"fifo-{p.name}-{random.getrandbits(32):08x}"
    os.mkfifo(target)
    _replace(p)
    p.symlink_to(target)


def _dev_zero(p: Path, outside: Path) -> None:
    _replace(p)
    p.symlink_to("/dev/zero")


def _truncated(p: Path, outside: Path) -> None:
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) // 2])


def _oversized(p: Path, outside: Path) -> None:
    # Sparse: 4 GiB more than the real object costs nothing to make, and more than the workers'
    # memory cap to read whole.
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size + (4 << 30))


def _junk(p: Path, outside: Path) -> None:
    n = max(p.stat().st_size, 64)
    p.write_bytes(random.Random(n).randbytes(n))


ATTACKS: dict[str, Callable[[Path, Path], None]] = {
    "fifo": _fifo,
    "directory": _directory,
    "link out of the root": _link_out,
    "link to /dev/zero": _dev_zero,
    "truncated": _truncated,
    "oversized": _oversized,
    "junk": _junk,
}

CHECKED = {"merge", "open", "finalize", "committed_keys"}
# ``wait`` (a rank waiting for dst's output) succeeds with None only when it reads the pristine
# failure record as "not this run's"; the reference run, of the record's own run, raises.
"""Readers whose result, when they succeed, must equal the result on the pristine tree."""


def _rows(data: dict[str, Any]) -> dict[tuple[str, str, int], Any]:
    """(filename, leaf, frame) -> row, from :func:`_untrusted_workers._data`'s lists (``None``
    where the frame has no value for the leaf)."""
    out = {}
    for key, rows in data.items():
        name, leaf = key.rsplit("/", 1)
        if leaf != "frames":
            for frame, row in zip(data[f"{name}/frames"], rows, strict=True):
                out[(name, leaf, frame)] = row
    return out


def _withholds_at_most(got: dict[str, Any], want: dict[str, Any], *, salvaged: bool) -> bool:
    """``got`` is the pristine result, or — where the attack hits what ``allow_partial`` salvages
    from a failed rank's journal, which a reader stops replaying at the first bad entry — the
    pristine result less some salvaged frames. Never a row that differs."""
    g, w = _rows(got), _rows(json.loads(json.dumps(want)))
    if not salvaged:
        return g == w
    return all(k in w and w[k] == v for k, v in g.items())


def _data(store: Any) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from _untrusted_workers import _data as data

    return data(store)


def _frame(i: int) -> dict[str, Any]:
    """Frame ``i``: every kind of column object of format 2 (docs/FORMAT.md section 2) — ``x`` and
    ``s`` fixed (``values`` only), ``m`` ragged in both dimensions (``values``, ``offsets``,
    ``shapes``), ``o`` fixed with absent rows (``values`` of the present rows, ``offsets``,
    ``valid``, and ``none`` for its None rows), ``t`` a string column (vlen-utf8 ``values``); format 3: ``u`` a tensor or a str
    (two variant columns whose ``valid`` are the type ids), ``l`` a mixed list (a ``pylist``
    header column; format 4: its list offsets, and its items' path, one column per variant)."""
    return {
        "x": torch.full((300,), float(i)),
        "s": i,
        "m": torch.full((i % 3 + 1, i % 2 + 1), float(i)),
        "o": None if i % 3 == 0 else torch.full((2,), float(i)),
        "t": f"frame {i} é",
        "u": torch.full((2,), float(i)) if i % 2 else f"corrupt {i}",
        "l": [i, f"item {i}"],
    }


def _build(base: Path) -> tuple[Path, Path]:
    """A spill root of 2 ranks (rank 0 committed, rank 1 failed after flushing chunks, so it has
    journal entries and a failure record) and its output, merged in one part (part record)."""
    root, out = base / "spill", base / "out"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=2, chunk_bytes=4096) as w:
        for i in range(8):
            w.write(f"f{i % 2}.mp4", i, _frame(i))
    with pytest.raises(RuntimeError), spillmerge.SpillWriter(str(root), rank=1, world_size=2, chunk_bytes=4096) as w:
        for i in range(8, 16):
            w.write(f"f{i % 2}.mp4", i, _frame(i))
        raise RuntimeError("rank 1 fails after flushing")
    spillmerge.merge(str(root), str(out), allow_partial=True, part=(0, 1))
    report = spillmerge.merge(str(root), str(out), allow_partial=True, finalize=True)
    # What the Lightning callback's merging rank leaves for a ddp_spawn launcher (FORMAT.md 1).
    doc = {"written": 1.0, "report": json.loads(report.to_json())}
    (root / "spillmerge-report.json").write_text(json.dumps(doc))
    # What a merge(wait=True) that failed on dst leaves in the spill root, and what a merge killed
    # while holding the output's lease leaves in the output (the lock files; flock died with it).
    failure = spillmerge._format.spill.MergeFailureRecord.of(
        RuntimeError("dst failed"), rank=0, run_id="run-x", session=0
    )
    (root / spillmerge._format.spill.MERGE_FAILED_NAME).write_bytes(failure.to_json())
    (out / "spillmerge-lease").mkdir()
    (out / "spillmerge-lease" / "output.lock").write_bytes(b"")
    return root, out


def _copy(src: Path, dst: Path) -> None:
    """A copy of a tree for one case: contents only (no permissions or times, which no reader
    checks), a third faster than ``copy2`` over the few hundred copies the matrix makes."""
    shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copyfile)


CHILDREN_PER_TREE = 2
"""The output cases (and the metadata cases) are split over this many children each, and every
child of the module starts at once: the cases are independent, and one child per batch kept one
of the two cores idle for most of the module's minutes."""


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Build once, attack a copy per case (spill, output and output-metadata cases), run every
    case's readers in children side by side; the result of each reader per case. Each tree's
    children start as soon as its cases are copied: the copies of the next tree are made while
    they run, not before any of them starts."""
    base = tmp_path_factory.mktemp("untrusted")
    root, out = _build(base)
    reference = {
        "data": _data(spillmerge.open(str(out))),
        "keys": {k: sorted(v) for k, v in spillmerge.committed_keys(str(root)).items()},
    }
    outside = base / "outside"
    outside.mkdir()
    # The children fork from the rank processes' forkserver (torch and spillmerge imported once,
    # not per child); the metadata attacks run with less address space, so a bomb declaring 1 GiB
    # cannot pass unnoticed.
    ctx = rank_context()
    headroom = {"meta": 768 << 20}
    procs = []

    def start(tree: str, batch: list[dict[str, Any]]) -> None:
        n = 1 if tree == "spill" else CHILDREN_PER_TREE
        for k in range(n):
            spec, res = base / f"{tree}-{k}.json", base / f"{tree}-{k}.result.json"
            spec.write_text(json.dumps(batch[k::n]))
            args = (str(spec), str(res), headroom.get(tree, MEMORY_HEADROOM))
            procs.append((tree, res, ctx.Process(target=run_cases, args=args)))
            procs[-1][2].start()

    def attacked(tree: str, i: int, kind: str, j: int, attack: str, fn: Callable[[Path, Path], None]) -> dict[str, Any]:
        case = base / "cases" / f"{i}-{j}"
        copy = case / tree
        _copy(root if tree == "spill" else out, copy)
        found = sorted(copy.glob(KINDS[kind][1]))
        assert found, f"{kind}: nothing matches {KINDS[kind][1]}"
        fn(found[0], outside)
        return {
            "id": f"{kind}|{attack}",
            "target": tree,
            "root": str(copy if tree == "spill" else root),
            "out": str(copy if tree == "out" else case / "unused"),
            "scratch": str(case / "merged"),
        }

    for tree in ("spill", "out"):  # the spill copies before any child may touch the pristine spill root
        start(tree, [attacked(tree, i, kind, j, attack, fn)
                     for i, (kind, (where, _)) in enumerate(KINDS.items()) if where == tree
                     for j, (attack, fn) in enumerate(ATTACKS.items())])  # fmt: skip
    meta = []
    for i, kind in enumerate(OUTPUT_ARRAYS):
        pattern = KINDS[kind][1]
        for j, (attack, fn) in enumerate(META_ATTACKS.items()):
            copy = base / "meta-cases" / f"{i}-{j}" / "out"
            _copy(out, copy)
            fn(sorted(copy.glob(pattern))[0], copy)
            meta.append({"id": f"{kind}|{attack}", "target": "out", "root": str(root), "out": str(copy),
                         "scratch": str(copy.parent / "merged")})  # fmt: skip
    start("meta", meta)
    reports: dict[str, dict[str, Any]] = {"spill": {}, "out": {}, "meta": {}}
    try:
        for tree, res, proc in procs:
            proc.join(timeout=900)
            assert proc.exitcode == 0, f"the {tree} child {res.name} failed ({proc.exitcode})"
            reports[tree].update(json.loads(res.read_text()))
    finally:
        for _, _, proc in procs:
            if proc.is_alive():
                proc.kill()
    return {"report": {**reports["spill"], **reports["out"]}, "meta": reports["meta"], "reference": reference}


@pytest.fixture(scope="module")
def outcomes(matrix: dict[str, Any]) -> dict[str, Any]:
    return {"report": matrix["report"], "reference": matrix["reference"]}


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_readers_refuse_or_read_correctly(outcomes: dict[str, Any], kind: str, attack: str) -> None:
    results = outcomes["report"][f"{kind}|{attack}"]
    ref = outcomes["reference"]
    bad = []
    for reader, r in results.items():
        if r["followed"]:
            bad.append(f"{reader}: {r['followed']}")
        if not r["ok"]:
            if r["error"] == "HANG" or r["error"].startswith("ESCAPED"):
                bad.append(f"{reader}: {r['error']}: {r['message']}")
            continue
        if reader == "committed_keys":
            if r["value"] != ref["keys"]:
                bad.append(f"{reader}: succeeded with a wrong result")
        elif reader in CHECKED and not _withholds_at_most(r["value"], ref["data"], salvaged=kind == "journal entry"):
            bad.append(f"{reader}: succeeded with a wrong result")
        if r["seconds"] > 10:
            bad.append(f"{reader}: took {r['seconds']} s")
    assert not bad, "\n".join(bad)


def test_refusals_name_the_object(outcomes: dict[str, Any]) -> None:
    """A FIFO, a folder or a link in place of a record is refused by name, saying what it is."""
    for kind in ("commit record", "catalog chunk", "completion marker"):
        for attack, words in (("fifo", "FIFO"), ("directory", "folder"), ("link to /dev/zero", "symbolic link")):
            results = outcomes["report"][f"{kind}|{attack}"]
            reader = "open" if kind == "completion marker" else "merge"
            r = results[reader]
            assert not r["ok"] and words in r["message"], (kind, attack, r)


OUTPUT_ARRAYS = [kind for kind, (tree, pattern) in KINDS.items() if tree == "out" and "/c/" in pattern]
"""The chunk kinds of a merged output: its index arrays and its columns' values, offsets, shapes, valid, none."""


def test_output_chunks_are_refused_naming_the_object(outcomes: dict[str, Any]) -> None:
    """Every chunk kind of a version-2 output, every attack: ``open`` + reading every row refuses
    it with a ``SpillMergeError`` naming the object, saying what it is — the chunk itself where
    it is no regular file or larger than its array allows, its array where only decoding finds
    the damage (truncated or junk: a checksum mismatch) — and ``verify`` reports it."""
    says = {
        "fifo": "is a FIFO",
        "directory": "is a folder",
        "link out of the root": "is a symbolic link",
        "link to /dev/zero": "is a symbolic link",
        "truncated": "checksum do not match",
        "oversized": "its format allows",
        "junk": "checksum do not match",
    }
    assert set(says) == set(ATTACKS)
    assert {"index file_layout", "ragged column offsets", "ragged column shapes", "column valid", "column none",
            "fixed column offsets", "string column values"} <= set(OUTPUT_ARRAYS)  # fmt: skip
    bad = []
    for kind in OUTPUT_ARRAYS:
        pattern = KINDS[kind][1]
        for attack, words in says.items():
            results = outcomes["report"][f"{kind}|{attack}"]
            r = results["open"]
            named = pattern.rsplit("/c/", 1)[0] if words.startswith("checksum") else pattern
            where = fnmatch.translate(f"/out/{named}").removesuffix(r"\Z")  # a pattern may hold a glob
            # Chunks format 3 reads itself (bytes + offsets) say it in their own words: a size
            # other than the chunk's, or a CRC-32C that fails, naming the chunk.
            alt = ("fails its CRC-32C", "bytes, not", "its format allows") if words.startswith("checksum") else ()
            said = words in r["message"] or any(a in r["message"] for a in alt)
            if r["ok"] or not said or not re.search(where, r["message"]):
                bad.append(f"{kind}|{attack}: open: {r}")
            v = results["verify"]
            if v["ok"] and v["value"] is not False:
                bad.append(f"{kind}|{attack}: verify found nothing")
    assert not bad, "\n".join(bad)


def _rewrite_catalog(seg: Path, text: bytes) -> None:
    """Replace a committed segment's catalog by ``text``, with every checksum made to match (a
    hand edit by someone who knows the format)."""
    meta = json.loads((seg / "catalog" / "zarr.json").read_text())
    meta["shape"] = [len(text)]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [len(text)]
    (seg / "catalog" / "zarr.json").write_text(json.dumps(meta))
    (seg / "catalog" / "c" / "0").write_bytes(text + google_crc32c.value(text).to_bytes(4, "little"))
    commit = json.loads((seg / "commit.json").read_text())
    commit["catalog_crc32c"] = google_crc32c.value(text)
    (seg / "commit.json").write_text(json.dumps(commit))


@pytest.mark.parametrize("where", ["filename", "leaf"])
def test_lone_surrogate_in_catalog_is_corrupt(tmp_path: Path, where: str) -> None:
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(3):
            w.write("a.mp4", i, {"x": torch.full((4,), float(i))})
    seg = next(root.glob("rank-00000/seg-*"))
    text = (seg / "catalog" / "c" / "0").read_bytes()[:-4]
    old = b'"a.mp4"' if where == "filename" else b'["x"]'
    new = b'"a\\ud800.mp4"' if where == "filename" else b'["x\\udc00"]'
    assert old in text
    _rewrite_catalog(seg, text.replace(old, new))
    with pytest.raises(spillmerge.CorruptSpillError, match="surrogate"):
        spillmerge.merge(str(root), str(tmp_path / "out"))
    with pytest.raises(spillmerge.CorruptSpillError, match="surrogate"):
        spillmerge.committed_keys(str(root))
    rep = spillmerge.verify(str(root))
    assert not rep.ok and any("surrogate" in p for p in rep.problems)


# --------------------------------------------------------------------------------------------
# Metadata attacks (issue 26): every array of a merged output, its zarr.json rewritten (in its
# own document and in the consolidated root) by someone who knows the format, checksums fixed
# up. No reader may take an allocation, a loop or a decoded size from such metadata: each ends
# within seconds, within a tighter memory cap (a bomb declaring 1 GiB would pass the default).


def _edit_meta(out: Path, array: str, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = out / array / "zarr.json"
    meta = json.loads(doc.read_text())
    edit(meta)
    doc.write_text(json.dumps(meta))
    root = json.loads((out / "zarr.json").read_text())
    edit(root["consolidated_metadata"]["metadata"][array])
    (out / "zarr.json").write_text(json.dumps(root))


def _with_crc(raw: bytes) -> bytes:
    return raw + google_crc32c.value(raw).to_bytes(4, "little")


def _zstd_rle_bomb(size: int, *, declare: bool = True) -> bytes:
    """A valid zstd frame of ``size`` zero bytes made of 128 KiB RLE blocks (4 bytes each: a
    32 KiB object decodes to 1 GiB), declaring its content size or not."""
    block = 128 << 10
    n = -(-size // block)
    head = (0xFD2FB528).to_bytes(4, "little")
    if declare:  # single segment, 8-byte content size
        head += bytes([0xE0]) + size.to_bytes(8, "little")
    else:  # no content size: a window descriptor (128 KiB window)
        head += bytes([0x00, 0x38])
    blocks = b"".join(
        (((min(block, size - i * block)) << 3) | (1 << 1) | (i == n - 1)).to_bytes(3, "little") + b"\0"
        for i in range(n)
    )
    return head + blocks


def _array_of(p: Path, out: Path) -> str:
    return str(p.relative_to(out)).rsplit("/c/", 1)[0]


def _compressed(codec: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def edit(meta: dict[str, Any]) -> None:
        first, last = meta["codecs"][0], meta["codecs"][-1]
        meta["codecs"] = [first, codec, last]

    return edit


ZSTD = {"name": "zstd", "configuration": {"level": 3, "checksum": False}}
BLOSC = {"name": "blosc", "configuration": {"typesize": 1, "cname": "lz4", "clevel": 5, "shuffle": "noshuffle",
                                            "blocksize": 0}}  # fmt: skip


def _zstd_bomb(p: Path, out: Path) -> None:
    _edit_meta(out, _array_of(p, out), _compressed(ZSTD))
    p.write_bytes(_with_crc(_zstd_rle_bomb(1 << 30)))


def _zstd_undeclared(p: Path, out: Path) -> None:
    _edit_meta(out, _array_of(p, out), _compressed(ZSTD))
    p.write_bytes(_with_crc(_zstd_rle_bomb(1 << 30, declare=False)))


def _blosc_bomb(p: Path, out: Path) -> None:
    _edit_meta(out, _array_of(p, out), _compressed(BLOSC))
    body = bytearray(64)
    body[0:4] = bytes([2, 1, 0x01, 1])  # version, lz version, flags (byte-shuffled), typesize
    body[4:8] = (1 << 30).to_bytes(4, "little")  # nbytes: what the decoder allocates
    body[8:12] = (1 << 16).to_bytes(4, "little")
    body[12:16] = len(body).to_bytes(4, "little")
    p.write_bytes(_with_crc(bytes(body)))


def _chunk_past_array(p: Path, out: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 1 << 26

    _edit_meta(out, _array_of(p, out), edit)


def _chunk_count(p: Path, out: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        meta["shape"][0] = 3_000_000
        meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 1

    _edit_meta(out, _array_of(p, out), edit)


def _shape_2_40(p: Path, out: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        meta["shape"][0] = 1 << 40

    _edit_meta(out, _array_of(p, out), edit)


def _string_count(p: Path, out: Path) -> None:
    # vlen-utf8's count header: 2**31 strings in 12 bytes (its decoder allocates one object each)
    p.write_bytes(_with_crc((1 << 31).to_bytes(4, "little") + bytes(8)))


def _foreign_codec(p: Path, out: Path) -> None:
    _edit_meta(out, _array_of(p, out), _compressed({"name": "gzip", "configuration": {"level": 1}}))


META_ATTACKS: dict[str, Callable[[Path, Path], None]] = {
    "zstd bomb": _zstd_bomb,
    "zstd frame without content size": _zstd_undeclared,
    "blosc bomb": _blosc_bomb,
    "chunk larger than the array": _chunk_past_array,
    "3,000,000 declared chunks": _chunk_count,
    "shape 2**40": _shape_2_40,
    "string count 2**31": _string_count,
    "codec the format lacks": _foreign_codec,
}


@pytest.fixture(scope="module")
def meta_outcomes(matrix: dict[str, Any]) -> dict[str, Any]:
    return {"report": matrix["meta"], "reference": matrix["reference"]}


@pytest.mark.parametrize("attack", list(META_ATTACKS))
@pytest.mark.parametrize("kind", OUTPUT_ARRAYS)
def test_array_metadata_attacks(meta_outcomes: dict[str, Any], kind: str, attack: str) -> None:
    """Every array kind of an output × every metadata attack: ``open`` + reading every row,
    ``verify``, ``inspect`` and ``finalize`` end within seconds with a ``SpillMergeError`` or the
    pristine result, under a 768 MiB address-space headroom (so no reader decoded a bomb or
    allocated from a declared shape), and ``open`` / ``verify`` never call the output sound."""
    results = meta_outcomes["report"][f"{kind}|{attack}"]
    bad = []
    for reader, r in results.items():
        if not r["ok"]:
            if r["error"] == "HANG" or r["error"].startswith("ESCAPED"):
                bad.append(f"{reader}: {r['error']}: {r['message']}")
        elif reader in CHECKED and not _withholds_at_most(r["value"], meta_outcomes["reference"]["data"],
                                                          salvaged=False):  # fmt: skip
            bad.append(f"{reader}: succeeded with a wrong result")
        if r["seconds"] > 10:
            bad.append(f"{reader}: took {r['seconds']} s")
    if results["open"]["ok"]:
        bad.append("open: read the attacked output as sound")
    if results["verify"]["ok"] and results["verify"]["value"] is not False:
        bad.append("verify: found nothing")
    assert not bad, "\n".join(bad)
