"""Rank bodies for tests/test_distributed.py (importable by spawned processes)."""

from __future__ import annotations

import json
import os
import random
import traceback

import numpy as np
import torch

HOSTILE = [
    "video_001.mp4",
    "ünïcødé 视频 🎥.mp4",
    "with space/and/slashes.mp4",
    "../../etc/passwd",
    "..",
    ".hidden",
    "50%off%2F.mp4",
    "x" * 300,
    "zarr.json",
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool]


def value_for(name: str, frame: int):
    """Deterministic per key; the leaf layout depends only on the filename."""
    i = HOSTILE.index(name)
    g = torch.Generator().manual_seed(i * 100003 + frame)
    dt = DTYPES[i % len(DTYPES)]
    base = torch.randn(2, 3, 5, generator=g) * 100
    t = base > 0 if dt == torch.bool else base.to(dt)
    if i % 3 == 0:
        return t
    return {
        "pred": t,
        "meta": {"score": float(base.mean()), "label": int(frame % 7), "box": np.arange(4, dtype=np.float32) + frame},
    }


def assignment(world: int, seed: int = 0) -> dict[int, list[tuple[str, int]]]:
    rng = random.Random(seed)
    keys = [(name, f) for name in HOSTILE for f in range(rng.randint(3, 12))]
    rng.shuffle(keys)
    out: dict[int, list[tuple[str, int]]] = {r: [] for r in range(world)}
    for k in keys:  # uneven: rank r gets weight r + 1
        out[rng.choices(range(world), weights=[r + 1 for r in range(world)])[0]].append(k)
    return out


def _bits(x) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b""
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def flatten(v, prefix=()):
    if isinstance(v, dict):
        for k in sorted(v):
            yield from flatten(v[k], (*prefix, k))
    else:
        yield prefix, v


def rank_main(rank: int, world: int, port: int, base: str) -> None:
    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: dict = {}
    try:
        # 1. The main scenario: spillmerge and gather_object on the same inputs, compared bit-exactly.
        mine = assignment(world)[rank]
        with spillmerge.SpillWriter(f"{base}/main/spill", chunk_bytes=1 << 14) as w:
            for name, f in mine:
                w.write(name, f, value_for(name, f))
        report = w.merge(f"{base}/main/out")
        gathered = [None] * world if rank == 0 else None
        dist.gather_object({k: value_for(*k) for k in mine}, gathered, dst=0)
        if rank == 0:
            res = spillmerge.open(f"{base}/main/out")
            everything = {k: v for part in gathered for k, v in part.items()}
            checked = 0
            assert sorted(res.filenames) == sorted({k[0] for k in everything}), res.filenames
            for name in res.filenames:
                frames = res.frames(name).tolist()
                assert frames == sorted(f for (n, f) in everything if n == name)
                stored = res[name]
                for row, f in enumerate(frames):
                    want = everything[(name, f)]
                    for path, leaf in flatten(want):
                        arr = stored
                        for k in path:
                            arr = arr[k]
                        got = arr.to_torch()[row] if isinstance(leaf, torch.Tensor) else arr[row]
                        assert _bits(got) == _bits(leaf), (name, f, path)
                    checked += 1
            results["main"] = {"frames": checked, "n_frames": report.n_frames, "ranks": report.ranks}
        else:
            assert report is None

        # 2. The same key from two ranks with different content, then identical content.
        with spillmerge.SpillWriter(f"{base}/dup/spill") as w:
            if rank in (1, 2):
                w.write("clip.mp4", 5, torch.tensor([float(rank)]))
            if rank in (0, 3):
                w.write("same.mp4", 0, torch.tensor([7.0]))
            w.write("clip.mp4", 10 + rank, torch.tensor([0.0]))
        if rank == 0:
            try:
                w.merge(f"{base}/dup/out")
                results["dup"] = "no error"
            except spillmerge.DuplicateFrameError as exc:
                results["dup"] = {"filename": exc.filename, "frame": exc.frame_idx, "ranks": exc.ranks, "msg": str(exc)}
            rep = w.merge(f"{base}/dup/last", on_duplicate="last")
            results["dup_last"] = float(spillmerge.open(f"{base}/dup/last")["clip.mp4"][0, 0])
            results["dup_count"] = rep.duplicates
        else:
            w.merge(f"{base}/dup/out")

        # 3. A leaf whose dtype differs between ranks.
        with spillmerge.SpillWriter(f"{base}/mismatch/spill") as w:
            dt = torch.float16 if rank == 3 else torch.float32
            w.write("m.mp4", rank, {"logits": torch.zeros(4, dtype=dt)})
        if rank == 0:
            try:
                w.merge(f"{base}/mismatch/out")
                results["mismatch"] = "no error"
            except spillmerge.LayoutMismatchError as exc:
                results["mismatch"] = {"filename": exc.filename, "leaf": exc.leaf, "ranks": exc.ranks, "msg": str(exc)}
    except BaseException:
        results["crash"] = traceback.format_exc()
    finally:
        with open(f"{base}/result.{rank}.json", "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
