"""Rank bodies for tests/distributed/test_multirank.py, run by ``torch.multiprocessing`` with the spawn start
method (so this module must stay importable on its own: no pytest, no fixtures).

One spawn of ``WORLD`` gloo ranks runs every scenario in the same processes, each on its own spill
root under ``base``. Expected errors are caught and described in ``base/results/rank-R.json``; the
parent test asserts on those files. Anything unexpected propagates, so the spawn fails with the
worker's traceback.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import random
import time
from typing import Any

import numpy as np
import torch
from _helpers import bits, zarr_filenames

from spillmerge._format import common as F

WORLD = 4
MERGE_TIMEOUT = 90.0  # seconds rank 0 waits on storage for commit records; the parent's limit is larger

HOSTILE = [
    "video_001.mp4",
    "Video_001.MP4",  # differs from the one above only by case
    "ünïcødé 视频 🎥.mp4",
    "e\u0301.mp4",  # decomposed é ...
    "\u00e9.mp4",  # ... and the composed one: different names that look the same
    "with space/and/slashes.mp4",
    "a/b/../c d.mp4",
    "/abs/path.mp4",
    "C:\\Windows\\evil.mp4",
    "../../etc/passwd",
    "..",
    ".",
    ".hidden",
    "..leading-dots.mp4",
    "50%off%2F.mp4",
    "%2e%2e%2fetc%2fpasswd",
    "x" * 300,
    "é" * 150,  # 300 bytes of UTF-8
    "zarr.json",
    "CON.mp4",
    "tab\there\nnewline",
    "nul\x00byte.mp4",
    "",
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool]
SHAPES = [(2, 3, 5), (7,), (), (16, 8), (3, 1, 4)]

# Bit patterns forced into the first elements of float frames: a signalling NaN with a payload,
# negative zero and +inf, which value-based comparisons would not check.
_SPECIAL_BITS = {
    torch.bfloat16: (torch.int16, [0x7F81, -0x8000, 0x7F80]),
    torch.float16: (torch.int16, [0x7C01, -0x8000, 0x7C00]),
    torch.float32: (torch.int32, [0x7F800001, -0x80000000, 0x7F800000]),
}


# ------------------------------------------------------------------------------ shared data
def _random_with_specials(dt: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random bits of dtype ``dt``: every pattern is possible, NaN payloads included."""
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dt == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if dt == torch.int64:
        return torch.randint(-(2**63), 2**63 - 1, shape, generator=g, dtype=torch.int64)
    bits_dt, special = _SPECIAL_BITS[dt]
    info = torch.iinfo(bits_dt)
    bits = torch.randint(info.min, info.max, shape, generator=g, dtype=bits_dt)
    flat = bits.view(-1)
    n = min(len(special), flat.numel())
    flat[:n] = torch.tensor(special[:n], dtype=bits_dt)
    return bits.view(dt)


def value_for(name: str, frame: int) -> Any:
    """Deterministic per (filename, frame); the leaf layout depends only on the filename."""
    i = HOSTILE.index(name)
    g = torch.Generator().manual_seed(i * 1_000_003 + frame % 1_000_000_007)
    dt = DTYPES[i % len(DTYPES)]
    shape = SHAPES[i % len(SHAPES)]
    if len(shape) == 2:  # a non-contiguous view, as model outputs often are
        t = _random_with_specials(dt, shape[::-1], g).t()
    else:
        t = _random_with_specials(dt, shape, g)
    kind = (i + i // len(DTYPES)) % 3
    # A leaf keeps its ndim across the whole merge (docs/FORMAT.md section 2; its dtype may differ
    # between files: one column each): plain tensor values are the 2-d ones, and the dict leaves
    # holding the per-file tensor are named by its ndim.
    if kind == 0 and t.dim() == 2:
        return t
    nd = f"{t.dim()}d"
    if kind in (0, 1):
        return {
            f"pred_{nd}": t,
            "meta": {
                "score": frame / 3.0,  # Python float -> float64
                "label": frame % 7 - 3,  # Python int -> pyint (stored as int64)
                "ok": frame % 2 == 0,  # Python bool -> bool
                "box": np.arange(4, dtype=np.float32) * 0.5 + frame,
                "empty": np.zeros((0, 2), dtype=np.int32),
            },
        }
    return {  # hostile leaf names
        f"../up.{nd}": t,
        "x/y": {"..": np.float16(frame % 1000), "ü 视": torch.tensor(frame % 100_000, dtype=torch.int32)},
        "zarr.json": torch.full((2,), frame % 3 == 0),
    }


def all_keys(seed: int = 0) -> list[tuple[str, int]]:
    """Every (filename, frame) of the main scenario: uneven lengths, sparse and huge frame indices."""
    rng = random.Random(seed)
    keys: list[tuple[str, int]] = []
    for i, name in enumerate(HOSTILE):
        n = rng.choice([1, 2, 5, 9, 14, 40])
        frames = rng.sample(range(200), n)
        if i % 5 == 0:
            frames.append(2**40 + i)
        keys.extend((name, f) for f in frames)
    return keys


def assignment(world: int = WORLD, seed: int = 0) -> dict[int, list[tuple[str, int]]]:
    """Shuffled keys, dealt unevenly (rank weights 1, 2, 3, 6): frames of one file on every rank."""
    rng = random.Random(seed + 1)
    keys = all_keys(seed)
    rng.shuffle(keys)
    weights = [1, 2, 3, 6][:world] if world <= 4 else [r + 1 for r in range(world)]
    out: dict[int, list[tuple[str, int]]] = {r: [] for r in range(world)}
    for k in keys:
        out[rng.choices(range(world), weights=weights)[0]].append(k)
    return out


# Every value kind of format 2 in one spill root: ragged boxes (only the first dimension varies),
# ragged bfloat16 maps (both dimensions vary, NaN payloads included), token lists (``[]`` too),
# str, lists of str, bytes, None rows and frames that lack a leaf.
KIND_FILES = ["det/img 001.jpg", "Det/IMG 001.JPG", "ünï 视频.jpg", "../../etc/passwd", "tokens.txt", ""]


def kinds_keys() -> list[tuple[str, int]]:
    return [(name, f) for j, name in enumerate(KIND_FILES) for f in range(0, 6 * (j + 2), 1 + j % 3)]


def kinds_assignment(world: int = WORLD, seed: int = 5) -> dict[int, list[tuple[str, int]]]:
    """The keys of :func:`kinds_keys` dealt at random: one file's frames come from several ranks."""
    rng = random.Random(seed)
    out: dict[int, list[tuple[str, int]]] = {r: [] for r in range(world)}
    for k in kinds_keys():
        out[rng.randrange(world)].append(k)
    return out


def kinds_value(name: str, frame: int) -> dict[str, Any]:
    j = KIND_FILES.index(name)
    g = torch.Generator().manual_seed(7919 * j + frame)
    n_boxes = int(torch.randint(0, 6, (), generator=g))  # 0 to 5 boxes, none included
    value: dict[str, Any] = {
        "boxes": torch.rand(n_boxes, 4, generator=g),
        "emb": _random_with_specials(torch.bfloat16, (1 + frame % 3, 1 + (frame * 5 + j) % 4), g),
        "tokens": [int(x) for x in torch.randint(-(2**40), 2**40, ((frame + j) % 7,), generator=g)],
        "caption": f"{name} #{frame} ✓ e\u0301 \x00 视" * (frame % 3),  # "" included
        "labels": [f"cls-{int(x)}" for x in torch.randint(0, 9, ((frame + j) % 4,), generator=g)],
        "raw": bytes(torch.randint(0, 256, ((frame * 3 + j) % 9,), dtype=torch.uint8, generator=g).tolist()),
        "score": None if frame % 4 == 0 else frame / 7.0,
    }
    if frame % 3 == 1:
        del value["caption"]  # a frame without the leaf: that row reads as None
    return value


def leaves(value: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(leaf path, leaf) pairs of a value, sorted by path."""
    if isinstance(value, dict):
        out = []
        for k in sorted(value):
            out.extend(leaves(value[k], (*prefix, k)))
        return out
    return [(prefix, value)]


def as_torch(x: Any) -> torch.Tensor:
    """The tensor (of the stored dtype) a leaf should read back as."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, bool):
        return torch.tensor(x, dtype=torch.bool)
    if isinstance(x, int):
        return torch.tensor(x, dtype=torch.int64)
    if isinstance(x, float):
        return torch.tensor(x, dtype=torch.float64)
    return torch.from_numpy(np.array(x))


def raw_bytes(x: Any) -> bytes:
    return bytes(bits(as_torch(x)).numpy().tobytes())


def get_leaf(node: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        node = node[k]
    return node


def file_rows(res: Any, name: str) -> dict[tuple[str, ...], list[Any]]:
    """Every leaf of file ``name`` of a ``spillmerge.open`` result, row by row: a tensor of the
    real dtype for numeric leaves (fixed or ragged), else what the view gives (``str``, ``bytes``,
    a list of ``str``); ``None`` where the row has no value for the leaf."""
    node = res[name]
    views = dict(leaves(node)) if isinstance(node, dict) else {(): node}
    out: dict[tuple[str, ...], list[Any]] = {}
    for path, view in views.items():
        valid = view.valid
        if view.kind == "fixed":
            t = view.to_torch()
            out[path] = [t[i] if valid is None or valid[i] else None for i in range(len(view))]
        elif view.kind == "ragged":
            out[path] = [view.to_torch(i) if valid is None or valid[i] else None for i in range(len(view))]
        else:
            out[path] = view.to_list()
    return out


def stacked(view: Any) -> torch.Tensor:
    """A file's rows of a numeric leaf as one tensor of the real dtype. The column may be ragged
    because another file's rows of it have another shape; this file's rows must share one."""
    if view.kind == "fixed":
        return view.to_torch()  # type: ignore[no-any-return]
    return torch.stack([view.to_torch(i) for i in range(len(view))])


def same_leaf(got: Any, want: Any) -> bool:
    """``got`` (a row of :func:`file_rows`) is exactly ``want`` (the value written): same kind,
    same dtype, shape and bits for numbers."""
    if want is None:
        return got is None
    if isinstance(want, (str, bytes)):
        return type(got) is type(want) and got == want
    if isinstance(want, list) and want and all(isinstance(x, str) for x in want):
        return isinstance(got, list) and all(type(x) is str for x in got) and got == want
    if isinstance(want, list) and not want and isinstance(got, list):
        return got == []  # [] in a list-of-strings column is an empty list of strings
    if not isinstance(got, torch.Tensor):
        return False
    w = as_torch(want)
    if isinstance(want, list) and w.numel() == 0:
        return tuple(got.shape) == tuple(w.shape)  # [] takes the column's dtype (FORMAT.md 2)
    return got.dtype == w.dtype and tuple(got.shape) == tuple(w.shape) and torch.equal(bits(got), bits(w))


def _show(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype}{tuple(x.shape)}"
    return f"{type(x).__name__} {x!r:.100}"


def compare_merged(res: Any, expected: dict[tuple[str, int], Any], limit: int = 20) -> tuple[int, int, list[str]]:
    """Check a ``spillmerge.open`` result against ``{(filename, frame): value}``: filenames, frame
    indices, each file's leaves (a frame lacking one reads as None there) and every row bit for bit.
    Returns (frames checked, leaves checked, problems)."""
    problems: list[str] = []
    want_names = sorted({name for name, _ in expected})
    if res.filenames != want_names:
        problems.append(f"filenames {res.filenames!r:.1000} != {want_names!r:.1000}")
    n_frames = n_leaves = 0
    for name in want_names:
        if name not in res:
            continue
        frames = res.frames(name)
        want_frames = sorted(f for n, f in expected if n == name)
        if frames.dtype != np.int64 or frames.tolist() != want_frames:
            problems.append(f"{name!r}: frames {frames.tolist()} ({frames.dtype}) != {want_frames}")
            continue
        schema = sorted({p for f in want_frames for p, _ in leaves(expected[(name, f)])})
        stored = file_rows(res, name)
        if sorted(stored) != schema:
            problems.append(f"{name!r}: leaves {sorted(stored)} != {schema}")
            continue
        for row, f in enumerate(want_frames):
            want_leaves = dict(leaves(expected[(name, f)]))
            for path in schema:
                rows = stored[path]
                want = want_leaves.get(path)  # a leaf this frame lacks reads as None
                if len(rows) != len(want_frames) or not same_leaf(rows[row], want):
                    got = rows[row] if row < len(rows) else "<no row>"
                    problems.append(f"{name!r} frame {f} leaf {path}: got {_show(got)}, want {_show(want)}")
                n_leaves += 1
            n_frames += 1
        if len(problems) >= limit:
            break
    return n_frames, n_leaves, problems[:limit]


def output_tree(out: str) -> dict[str, Any]:
    """Every object of a merged output that two merges of the same plan must write identically:
    chunk bytes and zarr.json documents (parsed; the root header's creation time left out). The
    completion marker (a timestamp) and the part records of a parallel merge are not compared."""
    tree: dict[str, Any] = {}
    for dirpath, _dirs, files in os.walk(out):
        rel_dir = os.path.relpath(dirpath, out)
        if rel_dir.split(os.sep)[0] == "spillmerge-parts":
            continue
        for f in files:
            rel = os.path.normpath(os.path.join(rel_dir, f))
            if rel == "spillmerge-complete.json":
                continue
            with open(os.path.join(dirpath, f), "rb") as fh:
                raw = fh.read()
            if f == "zarr.json":
                doc = json.loads(raw)
                for d in (doc, *doc.get("consolidated_metadata", {}).get("metadata", {}).values()):
                    d.get("attributes", {}).get("spillmerge", {}).pop("created", None)
                tree[rel] = doc
            else:
                tree[rel] = raw
    return tree


def tree_diff(a: dict[str, Any], b: dict[str, Any], limit: int = 10) -> list[str]:
    """Human-readable differences between two ``output_tree`` results."""
    out = [f"only in first: {k}" for k in sorted(a.keys() - b.keys())]
    out += [f"only in second: {k}" for k in sorted(b.keys() - a.keys())]
    out += [f"differs: {k}" for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    return out[:limit]


def _report(rep: Any) -> dict[str, Any] | None:
    if rep is None:
        return None
    return {
        "n_files": rep.n_files,
        "n_frames": rep.n_frames,
        "nbytes": rep.nbytes,
        "ranks": rep.ranks,
        "segments": rep.segments,
        "duplicates": rep.duplicates,
        "wait_seconds": rep.wait_seconds,
        "missing_ranks": rep.missing_ranks,
        "parts": rep.parts,
        "part": rep.part,
        "codec": rep.codec,
    }


def _error(exc: BaseException) -> dict[str, Any]:
    import spillmerge

    return {
        "type": type(exc).__name__,
        "msg": str(exc),
        "filename": getattr(exc, "filename", None),
        "frame_idx": getattr(exc, "frame_idx", None),
        "leaf": getattr(exc, "leaf", None),
        "ranks": getattr(exc, "ranks", None),
        "is_spillmerge_error": isinstance(exc, spillmerge.SpillMergeError),
        "is_value_error": isinstance(exc, ValueError),
        "missing": getattr(exc, "missing", None),
        "failures": {str(k): v for k, v in (getattr(exc, "failures", None) or {}).items()},
    }


# --------------------------------------------------------------------------------- scenarios
def check_with_plain_zarr(out: str, keys: list[tuple[str, int]]) -> None:
    """Read a merged store of the main scenario without spillmerge's reader (format 2: original
    filenames, the header's file layouts, column headers, frame index, raw bits) and assert it
    holds exactly ``keys``."""
    import zarr

    import spillmerge

    g = zarr.open_group(out, mode="r")
    header = g.attrs["spillmerge"]
    assert header["format_version"] == spillmerge.FORMAT_VERSION == 7 and header["kind"] == "merged"
    names = zarr_filenames(g)
    offsets = np.asarray(g["index/frame_offsets"][:])
    frame_idx = np.asarray(g["index/frame_idx"][:])
    file_layout = np.asarray(g["index/file_layout"][:])
    assert names == sorted({name for name, _ in keys})
    assert header["n_files"] == len(names) == len(file_layout) and header["n_frames"] == len(keys)
    assert offsets[0] == 0 and offsets[-1] == len(frame_idx) == len(keys)
    expected_frames: dict[str, list[int]] = {}
    for name, f in keys:
        expected_frames.setdefault(name, []).append(f)
    for i, name in enumerate(names):
        a, b = int(offsets[i]), int(offsets[i + 1])
        frames = frame_idx[a:b].tolist()
        assert frames == sorted(expected_frames[name]), name
        layout = header["file_layouts"][int(file_layout[i])]
        groups = {col: g[f"columns/{col}"] for col in layout}
        by_leaf = {tuple(grp.attrs["spillmerge"]["leaf"]): col for col, grp in groups.items()}
        schema = leaves(value_for(name, frames[0]))
        assert len(by_leaf) == len(layout) and sorted(by_leaf) == [p for p, _ in schema], name
        for path, col in by_leaf.items():
            grp, meta = groups[col], groups[col].attrs["spillmerge"]
            # Every row of this file has the leaf (other files' rows of the column may not).
            assert meta["has_valid"] == ("valid" in grp), (name, col)
            assert "valid" not in grp or bool(np.all(grp["valid"][a:b])), (name, col)
            if "offsets" in grp:  # ragged, or fixed with absent rows: row a + j is values[o[j]:o[j + 1]]
                o = np.asarray(grp["offsets"][a : b + 1])
                data = np.asarray(grp["values"][int(o[0]) : int(o[-1])])
                rows = [data[o[j] - o[0] : o[j + 1] - o[0]] for j in range(b - a)]
            else:  # fixed, every row has it: row a + j is values[a + j]
                data = np.asarray(grp["values"][a:b])
                rows = [data[j] for j in range(b - a)]
            for row, f in enumerate(frames):
                want = as_torch(dict(leaves(value_for(name, f)))[path])
                stored = F.DTYPES[meta["dtype"]].storage if meta["dtype"] in F.PY_SCALARS else meta["dtype"]
                assert stored == str(want.dtype).removeprefix("torch.") and meta["ndim"] == want.dim(), (
                    name, col, meta,
                )  # fmt: skip
                if "shapes" in grp:
                    assert tuple(grp["shapes"][a + row]) == tuple(want.shape), (name, f, path)
                got = np.ascontiguousarray(rows[row]).tobytes()
                assert got == raw_bytes(want), (name, f, path, meta["dtype"])


def scenario_main(rank: int, world: int, base: str) -> dict[str, Any]:
    """Uneven shuffled frames, many dtypes, nested dicts, hostile names; compared with gather_object."""
    import torch.distributed as dist

    import spillmerge

    mine = assignment(world)[rank]
    inputs = {k: value_for(*k) for k in mine}
    spill, out = f"{base}/main/spill", f"{base}/main/out"
    # Small chunks and staging: frames cross chunk boundaries and write() hits backpressure.
    with spillmerge.SpillWriter(spill, chunk_bytes=4096, staging_bytes=2 * 4096) as w:
        # All three input shapes of the contract: write, update((frame, value)), update({frame: value}).
        for j in range(0, len(mine), 3):
            batch = mine[j : j + 3]
            name, f = batch[0]
            w.write(name, f, inputs[(name, f)])
            if len(batch) == 2:
                name, f = batch[1]
                w.update({name: (f, inputs[(name, f)])})
            elif len(batch) == 3:
                grouped: dict[str, dict[int, Any]] = {}
                for name, f in batch[1:]:
                    grouped.setdefault(name, {})[f] = inputs[(name, f)]
                w.update(grouped)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(inputs, gathered, dst=0)
        if rank == world - 1:
            # Commit late, ordered by an event rather than a sleep: only once rank 0 has called
            # merge(), which must then wait for this commit record on storage.
            store = dist.distributed_c10d._get_default_store()
            store.wait(["main/rank0-merging"], datetime.timedelta(seconds=MERGE_TIMEOUT))
    last_committed_before_merge = None
    if rank == 0:
        last_committed_before_merge = any(glob.glob(f"{spill}/rank-{world - 1:05d}/seg-*/commit.json"))
        dist.distributed_c10d._get_default_store().set("main/rank0-merging", "1")
    rep = w.merge(out, timeout=MERGE_TIMEOUT, chunk_bytes=4096, progress=False)
    result: dict[str, Any] = {"report": _report(rep), "n_mine": len(mine), "segment": w.segment}
    if rank == 0:
        result["last_committed_before_merge"] = last_committed_before_merge
    if rank == 0:
        assert gathered is not None
        everything: dict[tuple[str, int], Any] = {}
        overlap = 0
        for part in gathered:
            overlap += len(everything.keys() & part.keys())
            everything.update(part)
        n_frames, n_leaves, problems = compare_merged(spillmerge.open(out), everything)
        result.update(
            gathered_frames=len(everything),
            gathered_overlap=overlap,
            gathered_nbytes=sum(len(raw_bytes(leaf)) for v in everything.values() for _, leaf in leaves(v)),
            frames_checked=n_frames,
            leaves_checked=n_leaves,
            problems=problems,
        )
    return result


def scenario_duplicates(rank: int, world: int, base: str) -> dict[str, Any]:
    """Ranks 1 and 2 write the same key with different content; rank 2's segment starts first."""
    import torch.distributed as dist

    import spillmerge

    root = f"{base}/dup"
    # An explicit run id: opening the writer then needs no collective, so the barrier below
    # orders the segments' start times (the order the first/last policies use).
    if rank == 1:
        dist.barrier()
    with spillmerge.SpillWriter(f"{root}/spill", run_id="dup-run") as w:
        if rank != 1:
            dist.barrier()
        if rank in (1, 2):
            w.write("clip.mp4", 5, torch.full((3,), float(rank), dtype=torch.bfloat16))
        if rank in (0, 3):  # identical content (a NaN with a payload included) from two ranks is fine
            w.write("same.mp4", 0, torch.tensor([0x7F81, 3], dtype=torch.int16).view(torch.bfloat16))
        w.write("clip.mp4", 10 + rank, torch.zeros(3, dtype=torch.bfloat16))
    result: dict[str, Any] = {}
    if rank != 0:
        result["merge_returned"] = repr(w.merge(f"{root}/err", timeout=MERGE_TIMEOUT))
        return result
    try:
        rep = w.merge(f"{root}/err", timeout=MERGE_TIMEOUT, progress=False)
        result["error"] = {"type": None, "report": _report(rep)}
    except spillmerge.SpillMergeError as exc:
        result["error"] = _error(exc)
    for policy in ("first", "last"):
        out = f"{root}/{policy}"
        rep = w.merge(out, on_duplicate=policy, timeout=MERGE_TIMEOUT, progress=False)
        res = spillmerge.open(out)
        clip = stacked(res["clip.mp4"])  # a ragged column: same.mp4's rows are (2,)
        frames = res.frames("clip.mp4").tolist()
        result[policy] = {
            "report": _report(rep),
            "clip_frames": frames,
            "clip_5": clip[frames.index(5)].float().tolist(),
            "same_bits": stacked(res["same.mp4"]).view(torch.int16).tolist(),
        }
    return result


def scenario_identical(rank: int, world: int, base: str) -> dict[str, Any]:
    """Identical duplicates from several ranks merge under the default policy; rank 2 writes nothing."""
    import spillmerge

    root = f"{base}/identical"
    with spillmerge.SpillWriter(f"{root}/spill") as w:
        if rank in (0, 3):
            w.write("same.mp4", 0, torch.tensor([0x7F81, 3], dtype=torch.int16).view(torch.bfloat16))
        if rank in (1, 3):
            w.update({"same_dict.mp4": {3: {"a": np.arange(3, dtype=np.uint8), "b": {"c": 2.5}}}})
        if rank != 2:
            w.write("all.mp4", 0, torch.arange(4, dtype=torch.int64))
            w.write("all.mp4", 1 + rank, torch.arange(4, dtype=torch.int64) * rank)
    rep = w.merge(f"{root}/out", timeout=MERGE_TIMEOUT, progress=False)
    result: dict[str, Any] = {"report": _report(rep)}
    if rank == 0:
        res = spillmerge.open(f"{root}/out")
        result["frames"] = {name: res.frames(name).tolist() for name in res.filenames}
        result["same_bits"] = stacked(res["same.mp4"]).view(torch.int16).tolist()
        result["same_dict"] = {
            "a": res["same_dict.mp4"]["a"][...].tolist(),
            "c": res["same_dict.mp4"]["b"]["c"][...].tolist(),
        }
        result["all"] = res["all.mp4"][...].tolist()
    return result


def scenario_dict_leaf_duplicate(rank: int, world: int, base: str) -> dict[str, Any]:
    """A dict value written by two ranks that agrees on one leaf and differs on another is an error."""
    import spillmerge

    root = f"{base}/dup_leaf"
    with spillmerge.SpillWriter(f"{root}/spill") as w:
        if rank in (0, 3):
            w.write("d.mp4", 7, {"a": torch.ones(2), "b": torch.tensor([rank], dtype=torch.int64)})
        w.write("d.mp4", 100 + rank, {"a": torch.ones(2), "b": torch.tensor([0], dtype=torch.int64)})
    if rank != 0:
        w.merge(f"{root}/out", timeout=MERGE_TIMEOUT)
        return {}
    try:
        rep = w.merge(f"{root}/out", timeout=MERGE_TIMEOUT, progress=False)
        return {"error": {"type": None, "report": _report(rep)}}
    except spillmerge.SpillMergeError as exc:
        return {"error": _error(exc)}


def scenario_mismatch(rank: int, world: int, base: str) -> dict[str, Any]:
    """Dtypes and shapes that differ between ranks. One file, float32 (4,) on rank 0 and float16
    (4,) on rank 3: an error naming file, leaf and ranks. Two files, float32 on rank 0 and float16
    on rank 3: one column per dtype, nothing converted. A nested dict leaf whose shape is (5,) on
    rank 2 and (4,) elsewhere: a ragged column. Its ndim differing between ranks: an error."""
    import spillmerge

    result: dict[str, Any] = {}
    with spillmerge.SpillWriter(f"{base}/mismatch/spill") as w:
        if rank == 0:
            w.write("m.mp4", 0, torch.zeros(4, dtype=torch.float32))
        elif rank == 3:
            w.write("m.mp4", 1, torch.zeros(4, dtype=torch.float16))
        else:
            w.write("other.mp4", rank, torch.zeros(4, dtype=torch.float16))
    with spillmerge.SpillWriter(f"{base}/mismatch_files/spill") as wf:
        if rank == 0:
            wf.write("a.mp4", 0, torch.tensor([0x7F800001, -0x80000000], dtype=torch.int32).view(torch.float32))
        elif rank == 3:
            wf.write("b.mp4", 1, torch.tensor([0x7C01, -0x8000], dtype=torch.int16).view(torch.float16))
        else:
            wf.write("b.mp4", 10 + rank, torch.full((2,), float(rank), dtype=torch.float16))
    with spillmerge.SpillWriter(f"{base}/mismatch_shape/spill") as w2:
        n = 5 if rank == 2 else 4
        box = np.arange(n, dtype=np.float32) + 10 * rank
        w2.write("s.mp4", rank, {"pred": torch.zeros(2), "meta": {"box": box}})
    with spillmerge.SpillWriter(f"{base}/mismatch_ndim/spill") as w3:
        box = np.zeros((1, 4) if rank == 2 else (4,), dtype=np.float32)
        w3.write("s.mp4", rank, {"pred": torch.zeros(2), "meta": {"box": box}})
    for tag, writer, out in (
        ("dtype", w, f"{base}/mismatch/out"),
        ("dtype_files", wf, f"{base}/mismatch_files/out"),
        ("shape", w2, f"{base}/mismatch_shape/out"),
        ("ndim", w3, f"{base}/mismatch_ndim/out"),
    ):
        if rank != 0:
            result[tag] = repr(writer.merge(out, timeout=MERGE_TIMEOUT))
            continue
        try:
            rep = writer.merge(out, timeout=MERGE_TIMEOUT, progress=False)
            result[tag] = {"type": None, "report": _report(rep)}
        except spillmerge.SpillMergeError as exc:
            result[tag] = _error(exc)
    if rank == 0:
        res = spillmerge.open(f"{base}/mismatch_files/out")
        try:
            res.column(None)
            result["files_column_error"] = None
        except spillmerge.SpillMergeError as exc:
            result["files_column_error"] = {**_error(exc), "known": getattr(exc, "known", None)}
        result["files"] = {
            name: {
                "dtype": res[name].dtype_name,
                "frames": res.frames(name).tolist(),
                "bits": res[name].to_torch().view(torch.int16 if name == "b.mp4" else torch.int32).tolist(),
            }
            for name in res.filenames
        }
        result["files_columns"] = {}
        for dt, bits_dt in (("float16", torch.int16), ("float32", torch.int32)):
            col = res.column(None, dtype=dt)
            valid = col.valid.tolist() if col.valid is not None else None
            rows = [None if valid is not None and not valid[i] else col.to_torch(i).view(bits_dt).tolist()
                    for i in range(len(col))]  # fmt: skip
            result["files_columns"][dt] = {"valid": valid, "rows": rows}
        result["files_column_dirs"] = sorted(os.listdir(f"{base}/mismatch_files/out/columns"))
        res2 = spillmerge.open(f"{base}/mismatch_shape/out")
        box = res2["s.mp4"]["meta"]["box"]
        result["shape_box"] = {
            "kind": box.kind,
            "pred_kind": res2["s.mp4"]["pred"].kind,
            "rows": [row.tolist() for row in box.to_list()],
            "dtypes": sorted({str(row.dtype) for row in box.to_list()}),
            "frames": res2.frames("s.mp4").tolist(),
        }
    return result


def scenario_parallel(rank: int, world: int, base: str) -> dict[str, Any]:
    """``merge(parallel=True)``: every rank writes its part of the output (blosc-lz4), rank 0
    finalizes; compared with a one-process merge of the same root, object by object. Then a rank
    that never takes part: rank 0 names it at the timeout instead of hanging."""
    import spillmerge

    root = f"{base}/parallel"
    mine = assignment(world)[rank]
    with spillmerge.SpillWriter(f"{root}/spill", chunk_bytes=4096) as w:
        for name, f in mine:
            w.write(name, f, value_for(name, f))
    opts: dict[str, Any] = {"timeout": MERGE_TIMEOUT, "chunk_bytes": 4096, "codec": "blosc-lz4", "progress": False}
    rep = w.merge(f"{root}/par", parallel=True, **opts)
    one = w.merge(f"{root}/one", **opts)
    result: dict[str, Any] = {"report": _report(rep), "one": _report(one)}
    if rank == 0:
        result["tree_diff"] = tree_diff(output_tree(f"{root}/one"), output_tree(f"{root}/par"))
        result["n_objects"] = len(output_tree(f"{root}/par"))
        expected = {k: value_for(*k) for k in all_keys()}
        result["frames_checked"], _, result["problems"] = compare_merged(spillmerge.open(f"{root}/par"), expected)
        result["part_records"] = sorted(os.listdir(f"{root}/par/spillmerge-parts"))
    if rank != 2:  # rank 2 "died" before its part
        try:
            got = w.merge(f"{root}/missing", parallel=True, **{**opts, "timeout": 2.0})
            result["missing"] = {"type": None, "report": _report(got)}
        except spillmerge.SpillMergeError as exc:
            result["missing"] = _error(exc)
    return result


def scenario_kinds(rank: int, world: int, base: str) -> dict[str, Any]:
    """Every value kind (ragged boxes and maps, token lists, str, lists of str, bytes, None rows,
    absent leaves) from every rank, one file's frames spread over ranks; rank 0 compares the
    merged result bit for bit with ``gather_object`` of the same values, for the plain merge
    and ``merge(parallel=True)``, which must write the same objects."""
    import torch.distributed as dist

    import spillmerge

    root = f"{base}/kinds"
    mine = kinds_assignment(world)[rank]
    inputs = {k: kinds_value(*k) for k in mine}
    # Small chunks: ragged rows, strings and bytes cross chunk edges.
    with spillmerge.SpillWriter(f"{root}/spill", chunk_bytes=4096) as w:
        for name, f in mine:
            w.write(name, f, inputs[(name, f)])
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(inputs, gathered, dst=0)
    opts: dict[str, Any] = {"timeout": MERGE_TIMEOUT, "chunk_bytes": 4096, "progress": False}
    rep = w.merge(f"{root}/one", **opts)
    par = w.merge(f"{root}/par", parallel=True, **opts)
    result: dict[str, Any] = {"report": _report(rep), "parallel_report": _report(par), "n_mine": len(mine)}
    if rank != 0:
        return result
    assert gathered is not None
    everything: dict[tuple[str, int], Any] = {}
    for part in gathered:
        everything.update(part)
    result["gathered_frames"] = len(everything)
    for tag in ("one", "par"):
        n_frames, n_leaves, problems = compare_merged(spillmerge.open(f"{root}/{tag}"), everything)
        result[tag] = {"frames_checked": n_frames, "leaves_checked": n_leaves, "problems": problems}
    result["tree_diff"] = tree_diff(output_tree(f"{root}/one"), output_tree(f"{root}/par"))
    # Whole columns, rows in output order (files sorted, frames ascending).
    res = spillmerge.open(f"{root}/one")
    order = sorted(everything)
    cols: dict[str, Any] = {p: res.column(p) for p in ("boxes", "emb", "tokens", "caption", "labels", "raw", "score")}
    result["column_kinds"] = {p: c.kind for p, c in cols.items()}
    boxes, emb = cols["boxes"], cols["emb"]
    want_boxes = [everything[k]["boxes"] for k in order]
    result["boxes_flat"] = bool(
        np.array_equal(np.diff(boxes.offsets), [len(b) for b in want_boxes])
        and raw_bytes(torch.from_numpy(boxes.values)) == raw_bytes(torch.cat(want_boxes))
    )
    result["emb_shapes"] = emb.shapes.tolist() == [list(everything[k]["emb"].shape) for k in order]
    result["column_rows"] = {
        p: all(same_leaf(c.to_torch(i) if c.kind == "ragged" and c[i] is not None else c[i], everything[k].get(p))
               for i, k in enumerate(order))
        for p, c in cols.items() if c.kind != "fixed"
    }  # fmt: skip
    try:
        boxes[0 : len(boxes)]
        result["boxes_slice"] = None
    except spillmerge.SpillMergeError as exc:
        result["boxes_slice"] = _error(exc)
    k = 1  # the first rows that share a shape do stack
    while k < len(want_boxes) and want_boxes[k].shape == want_boxes[0].shape:
        k += 1
    result["boxes_stacked_rows"] = k
    result["boxes_stacked"] = np.ascontiguousarray(boxes[0:k]).tobytes() == raw_bytes(torch.stack(want_boxes[:k]))
    return result


SCENARIOS = {
    "main": scenario_main,
    "duplicates": scenario_duplicates,
    "identical": scenario_identical,
    "dict_leaf_duplicate": scenario_dict_leaf_duplicate,
    "mismatch": scenario_mismatch,
    "parallel": scenario_parallel,
    "kinds": scenario_kinds,
}


def run_scenarios(
    rank: int, world: int, port: int, base: str, scenarios: dict[str, Any], *, barrier_between: bool = False
) -> None:
    """Join a gloo group on 127.0.0.1, run every scenario in order, write
    ``base/results/rank-R.json``. ``barrier_between`` keeps scenarios from overlapping."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)  # rank, world size and run id must come from the process group
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results: dict[str, Any] = {}
        for name, fn in scenarios.items():
            t0 = time.perf_counter()
            results[name] = fn(rank, world, base)
            results[name]["seconds"] = time.perf_counter() - t0
            if barrier_between:
                dist.barrier()
        os.makedirs(f"{base}/results", exist_ok=True)
        tmp = f"{base}/results/.rank-{rank}.json.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(results, fh)
        os.replace(tmp, f"{base}/results/rank-{rank}.json")
        dist.barrier()  # nobody tears the group down while another rank still needs it
    finally:
        dist.destroy_process_group()


def worker(rank: int, world: int, port: int, base: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes`` (the rank comes first)."""
    run_scenarios(rank, world, port, base, SCENARIOS)
