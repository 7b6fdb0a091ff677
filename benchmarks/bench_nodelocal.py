"""Node-local spill roots (issue 5): spillmerge's shard transfer against gather_object and the link.

W gloo ranks on 127.0.0.1 simulate two hosts, each with its own spill root (its "node-local
disk"): ranks 0..W/2-1 are host A (rank 0 merges), ranks W/2..W-1 host B, which holds the whole
payload P (fp16 frames, the workload of common.py). Rank 0 cannot see host B's root, so
``SpillWriter.merge(out, transport="gloo")`` moves host B's committed shards to rank 0 (one sender,
rank W/2, in ``transfer_chunk_bytes`` pieces through one staging buffer), then merges. Methods, each
in fresh processes, interleaved repeat by repeat, medians printed:

  raw_send       dist.send of one uint8 tensor of the same bytes from rank W/2 to rank 0, received
                 into a fresh tensor (the practical limit of the link)
  spillmerge     spill on every rank (timed on its own, not part of the comparison), barrier, then
                 w.merge(out, transport="gloo"): the transfer phase (report.phases["transfer"]) and
                 the whole call; also run at a second, smaller payload to show memory is flat
  gather_object  dist.gather_object of each rank's dict {(file, frame): CPU tensor} to rank 0

Memory: peak extra anonymous memory (RssAnon + RssShmem, sampled every 5 ms by common.PeakMemory)
minus the value just before the measured call, on the receiver (rank 0) and the sender (the max
over the other ranks). For spillmerge rank 0's transfer phase is measured on its own (from the
merge call until the last shard is received) besides the whole merge.

Every result is verified after the clock stops: every frame of the merged store, every frame of
gather_object's result, every byte of the raw tensor; a wrong result is reported as FAILED.

The library's VISIBILITY_GRACE (seconds rank 0 re-checks a commit record it cannot see before
moving it, 5 s by default, for shared file systems with stale directory caches) is set to 0 here:
the roots really are separate, and the fixed wait would only hide the throughput.

Usage: python benchmarks/bench_nodelocal.py [--payload 512MiB] [--world 2|4] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from common import (
    MiB,
    PeakMemory,
    context,
    expected_by_file,
    fmt_size,
    free_port,
    make_frame,
    parse_size,
    pool,
    verify_spillmerge,
    workload,
)

METHODS = ["raw_send", "spillmerge", "gather_object"]
GB = 1e9
RUN_TIMEOUT = 600.0


# ------------------------------------------------------------------------------------ workload
def host_b(world: int) -> list[int]:
    """Ranks of host B (the one that holds the payload); its lowest rank is the sender."""
    return list(range(world // 2, world))


def assign(cfg: dict, world: int) -> dict[int, list[tuple[str, int]]]:
    """Keys per rank: the whole payload dealt (unevenly) over host B's ranks, nothing on host A."""
    ranks = host_b(world)
    dealt = workload(cfg["payload"], tuple(cfg["shape"]), cfg["files"], len(ranks), cfg["seed"])
    out: dict[int, list[tuple[str, int]]] = {r: [] for r in range(world)}
    for i, r in enumerate(ranks):
        out[r] = dealt[i]
    return out


def raw_tensor(p: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` of pool bytes (deterministic, so rank 0 can rebuild them to verify)."""
    flat = p.reshape(-1).view(torch.uint8)
    return flat.repeat(-(-nbytes // flat.numel()))[:nbytes].clone()


# -------------------------------------------------------------------------------------- methods
def run_spillmerge(rank: int, world: int, mine, frames, work: Path, cfg: dict, info: dict) -> None:
    import torch.distributed as dist

    import spillmerge
    from spillmerge import _storage
    from spillmerge._dist import transfer as _transfer

    _transfer.VISIBILITY_GRACE = 0.0  # separate roots for sure; see the module docstring
    root = work / ("hostB" if rank in host_b(world) else "hostA") / "spill"
    t0 = time.perf_counter()
    with spillmerge.SpillWriter(str(root), rank=rank, world_size=world) as w:
        for (name, f), t in zip(mine, frames, strict=True):
            w.write(name, f, t)
    info["spill_s"] = time.perf_counter() - t0
    dist.barrier()  # every rank committed: the merge below waits for nobody

    mem = PeakMemory()
    receive = _transfer._receive

    def timed_receive(*args, **kwargs):  # instrumentation only: the end of rank 0's transfer phase
        t0 = time.perf_counter()
        try:
            return receive(*args, **kwargs)
        finally:
            info["in_receive_s"] = info.get("in_receive_s", 0.0) + time.perf_counter() - t0
            info["in_write_s"] = info.get("in_sink_s", 0.0)  # the merge after it may write through sinks too
            mem._sample()
            info["transfer_anon"] = mem.peak_anon - mem.base_anon

    _transfer._receive = timed_receive
    _time_calls(_transfer._Link, "send_bytes_piece", info, "in_send_s")  # where the transfer's time goes
    _time_calls(_transfer._Link, "recv_bytes_piece", info, "in_recv_s")
    if rank == 0:
        _time_calls(_storage._local._LocalSink, "write", info, "in_sink_s")
    else:  # on rank 0 read_into is the merge's, not the transfer's
        _time_calls(_storage.LocalStorage, "read_into", info, "in_read_s")
    t0 = time.perf_counter()
    report = w.merge(str(work / "out"), transport="gloo", transfer_chunk_bytes=cfg["chunk"], progress=False)
    info["wall_s"] = time.perf_counter() - t0
    info["peak_extra"] = mem.stop()["anon"]
    if report is not None:
        info["transfer_s"] = report.phases.get("transfer", float("nan"))
        info["transferred"] = sum(report.transferred.values())
        info["senders"] = {str(k): v for k, v in report.transfer_senders.items()}
        info["phases"] = report.phases


def _time_calls(cls: type, name: str, info: dict, key: str) -> None:
    """Instrumentation: add the seconds spent in ``cls.name`` to ``info[key]``."""
    original = getattr(cls, name)
    info[key] = 0.0

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            info[key] += time.perf_counter() - t0

    setattr(cls, name, timed)


def run_gather(rank: int, world: int, mine, frames, info: dict) -> dict | None:
    import torch.distributed as dist

    local = dict(zip(mine, frames, strict=True))
    dist.barrier()
    mem = PeakMemory()
    t0 = time.perf_counter()
    parts = [None] * world if rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    info["wall_s"] = time.perf_counter() - t0
    info["peak_extra"] = mem.stop()["anon"]
    return {k: v for part in parts for k, v in part.items()} if parts is not None else None


def run_raw(rank: int, world: int, p: torch.Tensor, nbytes: int, info: dict) -> torch.Tensor | None:
    import torch.distributed as dist

    sender = host_b(world)[0]
    data = raw_tensor(p, nbytes) if rank == sender else None  # held before the clock, like the frames
    dist.barrier()
    mem = PeakMemory()
    t0 = time.perf_counter()
    got = None
    if rank == 0:
        got = torch.empty(nbytes, dtype=torch.uint8)  # the receiver needs room for all of it
        dist.recv(got, src=sender)
    elif rank == sender:
        dist.send(data, dst=0)
    info["wall_s"] = time.perf_counter() - t0
    info["peak_extra"] = mem.stop()["anon"]
    return got


def rank_main(rank: int, world: int, port: int, method: str, cfg: dict, result: str) -> None:
    import torch.distributed as dist

    import spillmerge  # noqa: F401 - imported before any clock starts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    work = Path(cfg["work"])
    shape = tuple(cfg["shape"])
    assignment = assign(cfg, world)
    nbytes = sum(len(v) for v in assignment.values()) * int(np.prod(shape)) * 2
    mine = assignment[rank]
    p = pool(shape)
    info: dict = {"bytes": nbytes}
    if method == "raw_send":
        got = run_raw(rank, world, p, nbytes, info)
        if rank == 0:
            info["ok"] = bool(torch.equal(got, raw_tensor(p, nbytes)))
    else:
        frames = [make_frame(p, name, f) for name, f in mine]  # predictions already in CPU memory
        if method == "spillmerge":
            run_spillmerge(rank, world, mine, frames, work, cfg, info)
            if rank == 0:
                info["ok"] = verify_spillmerge(str(work / "out"), expected_by_file(assignment), p)
        else:
            merged = run_gather(rank, world, mine, frames, info)
            if rank == 0:
                want = {k for ks in assignment.values() for k in ks}
                info["ok"] = set(merged) == want and all(
                    torch.equal(t.view(torch.int16), make_frame(p, *k).view(torch.int16)) for k, t in merged.items()
                )
    with open(f"{result}.{rank}", "w") as fh:
        json.dump(info, fh)
    dist.barrier()
    dist.destroy_process_group()


def run_once(method: str, world: int, cfg: dict) -> list[dict]:
    """One run of ``method`` in ``world`` fresh processes; per-rank result dicts, rank 0 first."""
    work = Path(cfg["workdir"]) / f"{method}-{time.time_ns()}"
    work.mkdir(parents=True)
    cfg = {**cfg, "work": str(work)}
    result = str(work) + ".result"
    ctx = context()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, method, cfg, result)) for r in range(world)]
    deadline = time.monotonic() + RUN_TIMEOUT  # for the whole run, not per process
    try:
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, pr in enumerate(procs) if pr.is_alive()]
        for r in hung:  # a hung transfer: do not leave it behind
            procs[r].kill()
            procs[r].join()
        if hung:
            return [{"ok": False, "error": f"rank(s) {hung} still running after {RUN_TIMEOUT:.0f} s"}]
        if any(pr.exitcode != 0 for pr in procs):
            return [{"ok": False, "error": f"exit codes {[pr.exitcode for pr in procs]}"}]
        return [json.loads(Path(f"{result}.{r}").read_text()) for r in range(world)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for r in range(world):
            Path(f"{result}.{r}").unlink(missing_ok=True)


# ------------------------------------------------------------------------------------- report
def med(xs) -> float:
    return statistics.median(xs)


def table(rows: dict[str, list[list[dict]]], runs: list[tuple[str, str, int]], args, cfg: dict) -> str:
    def ok(key: str) -> bool:
        return all(r[0].get("ok") for r in rows[key])

    def sender_peak(res: list[dict]) -> int:
        return max(x["peak_extra"] for x in res[1:])

    def cell_mem(n: float, payload: int) -> str:
        return f"{n / MiB:.0f} MiB ({n / payload:.2f}x P)"

    raw_key = runs[0][0]
    raw_rate = None
    if ok(raw_key):
        raw_rate = med(r[0]["bytes"] / r[0]["wall_s"] for r in rows[raw_key])
    lines = [
        f"W={args.world} gloo ranks on 127.0.0.1, 2 simulated hosts (own spill root each); host B holds the "
        f"payload, rank 0 (host A) receives. fp16 {args.frame_shape} frames, {args.files} files, "
        f"transfer_chunk_bytes {fmt_size(cfg['chunk'])}, median of {args.repeats} run(s), fresh processes per run.",
        "",
        "| method | payload | time (median; all runs) | GB/s | vs raw send | receiver peak extra anon | "
        "sender peak extra anon | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, method, payload in runs:
        res = rows[key]
        views = [("raw send (link limit)", "wall_s", None)] if method == "raw_send" else []
        if method == "gather_object":
            views = [("gather_object", "wall_s", None)]
        if method == "spillmerge":
            views = [("spillmerge transfer", "transfer_s", "transfer_anon"), ("spillmerge whole merge", "wall_s", None)]
        for label, tkey, memkey in views:
            if not ok(key):
                err = next((r[0].get("error") for r in res if r[0].get("error")), "wrong result")
                lines.append(f"| {label} | {fmt_size(payload)} | FAILED ({err}) | | | | | no |")
                continue
            times = [r[0][tkey] for r in res]
            nbytes = res[0][0]["bytes"]
            gbs = med(nbytes / t for t in times)
            vs = f"{gbs / raw_rate:.2f}x" if raw_rate else "-"
            recv = med(r[0][memkey or "peak_extra"] for r in res)
            send = med(sender_peak(r) for r in res)
            all_t = ", ".join(f"{t:.2f}" for t in times)
            lines.append(
                f"| {label} | {fmt_size(nbytes)} | {med(times):.2f} s ({all_t}) | {gbs / GB:.2f} | {vs} | "
                f"{cell_mem(recv, nbytes)} | {cell_mem(send, nbytes)} | yes |"
            )
    sm, ga = f"spillmerge@{runs[0][2]}", f"gather_object@{runs[0][2]}"
    notes = [""]
    if sm in rows and ga in rows and ok(sm) and ok(ga):
        per = [g[0]["wall_s"] / s[0]["transfer_s"] for g, s in zip(rows[ga], rows[sm], strict=True)]
        notes.append(
            f"gather_object time / spillmerge transfer time: {med(per):.2f}x (per repeat: "
            f"{', '.join(f'{x:.2f}' for x in per)})"
        )
    for key, method, payload in runs:
        if method == "spillmerge" and ok(key):
            res = rows[key]
            sp = med(max(x["spill_s"] for x in r[1:]) for r in res)
            moved = med(r[0]["transferred"] for r in res)
            phases = res[0][0].get("phases", {})
            split = ", ".join(f"{k} {med(r[0]['phases'].get(k, 0.0) for r in res):.2f} s" for k in phases)
            notes.append(
                f"spillmerge at {fmt_size(payload)}: spill on host B {sp:.2f} s (not in the table), "
                f"{moved / MiB:.0f} MiB of shards moved by sender(s) {res[0][0]['senders']}; merge phases: {split}"
            )
            snd = host_b(args.world)[0]
            recv_s = med(r[0]["in_recv_s"] for r in res)
            send_s = med(r[snd]["in_send_s"] for r in res)
            read_s = med(r[snd]["in_read_s"] for r in res)
            moving = med(r[0]["in_receive_s"] for r in res)
            write_s = med(r[0]["in_write_s"] for r in res)
            notes.append(
                f"  transfer {med(r[0]['transfer_s'] for r in res):.2f} s = setup {med(r[0]['transfer_s'] - r[0]['in_receive_s'] for r in res):.2f} s "
                f"(gloo group, sender assignment, go) + moving the shards {moving:.2f} s; of the moving, rank 0 spent "
                f"{recv_s:.2f} s inside gloo receives and {write_s:.2f} s writing the pieces to its disk (the rest: "
                f"CRC, acks), the sender "
                f"{send_s:.2f} s inside gloo sends and {read_s:.2f} s reading its disk"
            )
    notes.append(
        "Memory: peak of RssAnon+RssShmem minus the value just before the call; receiver = rank 0, sender = max "
        "over the other ranks. spillmerge's transfer row: rank 0 from the merge call until the last shard is in."
    )
    return "\n".join(lines + notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, choices=[2, 4], help="ranks; half of them on each host")
    ap.add_argument("--payload", default="512MiB", help="bytes host B holds (default 512MiB)")
    ap.add_argument("--small-payload", default=None, help="spillmerge's second payload (default payload/4)")
    ap.add_argument("--transfer-chunk", default="64MiB", help="SpillWriter.merge(transfer_chunk_bytes=)")
    ap.add_argument("--frame-shape", default="3x256x256")
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="P=64MiB, 1 repeat: check that it works")
    ap.add_argument("--workdir", default=None, help="where the roots and outputs go (default: a temp dir)")
    ap.add_argument("--out-md", help="also write the table here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.payload, args.repeats = "64MiB", 1
    payload = parse_size(args.payload)
    small = parse_size(args.small_payload) if args.small_payload else payload // 4
    workdir = args.workdir or tempfile.mkdtemp(prefix="spillmerge-bench-nodelocal-")
    cfg = {
        "shape": [int(x) for x in args.frame_shape.split("x")],
        "files": args.files,
        "seed": args.seed,
        "chunk": parse_size(args.transfer_chunk),
        "workdir": workdir,
    }
    runs = [(f"{m}@{payload}", m, payload) for m in METHODS] + [(f"spillmerge@{small}", "spillmerge", small)]
    rows: dict[str, list[list[dict]]] = {}
    t_start = time.perf_counter()
    try:
        for rep in range(args.repeats):  # interleaved, so drift on the machine hits every method alike
            for key, method, size in runs:
                t0 = time.perf_counter()
                res = run_once(method, args.world, {**cfg, "payload": size})
                rows.setdefault(key, []).append(res)
                status = "ok" if res[0].get("ok") else f"FAILED {res[0].get('error', 'wrong result')}"
                print(f"  repeat {rep + 1}/{args.repeats} {key}: {res[0].get('wall_s', float('nan')):.2f} s {status} "
                      f"({time.perf_counter() - t0:.0f} s with process start and verification)",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    text = table(rows, runs, args, cfg)
    print(text)
    print(f"\n(total runtime {time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    if args.out_md:
        Path(args.out_md).write_text(text + "\n")


if __name__ == "__main__":
    main()
