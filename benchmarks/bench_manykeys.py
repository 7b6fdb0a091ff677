"""Many keys (issue 14): N filenames x 1 frame, the image / text-dataset regime.

    python benchmarks/bench_manykeys.py                          # N = 10k, 100k, 1M; 3 repeats
    python benchmarks/bench_manykeys.py --n 10000 100000 --repeats 3
    python benchmarks/bench_manykeys.py --quick                  # N = 2,000, 1 repeat: does it work
    python benchmarks/bench_manykeys.py --s3 --s3-n 100000       # also count a merge's S3 requests

Every key ``images/NNNNNNN.jpg`` has one frame ``{"logits": fp16[1000], "emb": fp16[512]}``
(3,024 bytes; every value distinct: a pool row stamped with the key's number). Keys are shuffled
and dealt to W ranks. Methods, in fresh processes, alternated and rotated repeat by repeat:

- ``spillmerge``: W gloo ranks each write their keys with ``SpillWriter`` (the spill: slowest
  rank from a barrier until its commit record is durable); then ``spillmerge.merge(root, out)`` in
  a fresh process (the merge: its wall time, peak extra anonymous memory and VmHWM); then a fresh
  process opens the output (``spillmerge.open``), reads one file's value (median over 50 random
  files, cold first read included in the max), reads the whole logits column with
  ``res.column("logits")[:]`` and checks both columns bit for bit against the generated data.
- ``torch_save``: one process holds the same dict ``{filename: {"logits", "emb"}}`` and calls
  ``torch.save`` (fsync) then ``torch.load``.
- ``parquet``: one process turns the same dict into a pyarrow table (filename, frame_idx,
  logits fixed_size_list<float16>[1000], emb [512]), ``pq.write_table`` (fsync), ``pq.read_table``;
  then reads the logits column alone into an (N, 1000) numpy array (the column baseline).
- ``gather_object``: W gloo ranks, ``dist.gather_object`` of each rank's dict to rank 0 (the call
  alone, rank 0's wall time; nothing is written).

Every process calls ``torch.set_num_threads(1)``. Memory is sampled from /proc/self/status every
5 ms (RssAnon + RssShmem, as benchmarks/common.py does). Quote ratios from one run.

``--s3``: the same keys spilled by W writers to a moto ThreadedMotoServer on 127.0.0.1 (through a
loopback proxy that counts requests by HTTP method), then one ``spillmerge.merge`` s3 -> s3; the
PUT count of the merge is the issue's figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import MiB, PeakMemory, context, free_port, in_process, tree_bytes  # noqa: E402

METHODS = ["spillmerge", "torch_save", "parquet", "gather_object"]
LOGITS, EMB = 1000, 512
POOL_ROWS = 257
ROW_BYTES = 2 * (LOGITS + EMB)
RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------------------- workload
def key_name(i: int) -> str:
    return f"images/{i:07d}.jpg"


def _pools() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn((POOL_ROWS, LOGITS), generator=g).half(), torch.randn((POOL_ROWS, EMB), generator=g).half()


def expected_matrix(idx: np.ndarray, leaf: str) -> np.ndarray:
    """The values of keys ``idx`` for one leaf, (len(idx), width) float16: pool rows, each stamped
    with its key number in its first two elements (as int16 bits)."""
    lp, ep = _pools()
    pool = (lp if leaf == "logits" else ep).numpy()
    m = pool[idx % POOL_ROWS].copy()
    bits = m.view(np.int16)
    bits[:, 0] = idx & 0x7FFF
    bits[:, 1] = idx >> 15
    return m


def rank_keys(n: int, world: int, rank: int, seed: int = 0) -> np.ndarray:
    """Key numbers of one rank: a seeded shuffle of 0..n-1 dealt round-robin."""
    return np.random.default_rng(seed).permutation(n)[rank::world]


def make_values(idx: np.ndarray) -> dict[str, dict[str, torch.Tensor]]:
    """``{filename: {"logits", "emb"}}`` of keys ``idx``; every tensor owns its storage (as a
    model's per-sample outputs after ``.clone()``), so no method saves a shared buffer once."""
    logits = torch.from_numpy(expected_matrix(idx, "logits"))
    emb = torch.from_numpy(expected_matrix(idx, "emb"))
    return {key_name(int(i)): {"logits": logits[j].clone(), "emb": emb[j].clone()} for j, i in enumerate(idx)}


# ---------------------------------------------------------------------------- process bodies
def _vmhwm() -> int:
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rank_main(rank: int, world: int, port: int, method: str, cfg: dict[str, Any], result: str) -> None:
    """One of W gloo ranks: spill with SpillWriter, or gather_object."""
    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    preds = make_values(rank_keys(cfg["n"], world, rank))
    dist.barrier()
    mem = PeakMemory()
    t0 = time.perf_counter()
    if method == "spillmerge":
        with spillmerge.SpillWriter(cfg["root"]) as w:
            for name, value in preds.items():
                w.write(name, 0, value)
    else:
        parts: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(preds, parts, dst=0)
        if rank == 0:
            assert parts is not None and sum(len(p) for p in parts) == cfg["n"]
    wall = time.perf_counter() - t0
    peak = mem.stop()
    with open(f"{result}.{rank}", "w") as fh:
        json.dump({"wall_s": wall, "anon": peak["anon"]}, fh)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(method: str, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    result = f"{cfg['work']}/{method}-{time.time_ns()}.result"
    ctx = context()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, method, cfg, result)) for r in range(world)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(cfg["timeout"])
    try:
        if any(pr.exitcode != 0 for pr in procs):
            for pr in procs:
                if pr.is_alive():
                    pr.kill()
            return [{"error": f"exit codes {[pr.exitcode for pr in procs]}"}]
        return [json.loads(Path(f"{result}.{r}").read_text()) for r in range(world)]
    finally:
        for r in range(world):
            Path(f"{result}.{r}").unlink(missing_ok=True)


def merge_body(root: str, out: str) -> dict[str, Any]:
    """``spillmerge.merge`` in a fresh process: wall time and memory of the merge alone."""
    import spillmerge

    mem = PeakMemory()
    t0 = time.perf_counter()
    report = spillmerge.merge(root, out, progress=False)
    wall = time.perf_counter() - t0
    peak = mem.stop()
    phases = getattr(report, "phases", None) or {}
    return {"ok": True, "merge_s": wall, "anon": peak["anon"], "vmhwm": _vmhwm(),
            "phases": {k: float(v) for k, v in phases.items() if isinstance(v, (int, float))}}  # fmt: skip


def read_body(out: str, n: int) -> dict[str, Any]:
    """Open the output, read single files' values and the whole logits column; verify every row."""
    import spillmerge

    t0 = time.perf_counter()
    res = spillmerge.open(out)
    open_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    picks = rng.choice(n, size=min(50, n), replace=False)
    one: list[float] = []
    for i in picks:
        t0 = time.perf_counter()
        v = res[key_name(int(i))]
        lg, em = np.asarray(v["logits"][0]), np.asarray(v["emb"][0])
        one.append(time.perf_counter() - t0)
        assert lg.tobytes() == expected_matrix(np.array([i]), "logits").tobytes(), i
        assert em.tobytes() == expected_matrix(np.array([i]), "emb").tobytes(), i
    out_d: dict[str, Any] = {"ok": True, "open_s": open_s, "one_ms": [x * 1e3 for x in one]}
    if not hasattr(res, "column"):
        out_d["column_s"] = None  # this build has no res.column (format 1)
        return out_d
    t0 = time.perf_counter()
    col = np.asarray(res.column("logits")[:])
    out_d["column_s"] = time.perf_counter() - t0
    idx = np.arange(n)  # rows are in filename order, and filenames sort as their key numbers
    out_d["verified"] = bool(
        col.view(np.uint16).tobytes() == expected_matrix(idx, "logits").view(np.uint16).tobytes()
        and np.asarray(res.column("emb")[:]).view(np.uint16).tobytes()
        == expected_matrix(idx, "emb").view(np.uint16).tobytes()
    )
    return out_d


def torch_save_body(n: int, path: str) -> dict[str, Any]:
    d = make_values(np.arange(n))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(d, f)
        f.flush()
        os.fsync(f.fileno())
    save = time.perf_counter() - t0
    del d
    t0 = time.perf_counter()
    back = torch.load(path)
    load = time.perf_counter() - t0
    assert len(back) == n
    return {"ok": True, "save_s": save, "load_s": load, "bytes": os.path.getsize(path)}


def parquet_body(n: int, path: str) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = make_values(np.arange(n))
    t0 = time.perf_counter()
    names = list(d)
    logits = torch.stack([v["logits"] for v in d.values()]).numpy()
    emb = torch.stack([v["emb"] for v in d.values()]).numpy()
    table = pa.table({
        "filename": pa.array(names),
        "frame_idx": pa.array(np.zeros(n, dtype=np.int64)),
        "logits": pa.FixedSizeListArray.from_arrays(pa.array(logits.reshape(-1)), LOGITS),
        "emb": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), EMB),
    })  # fmt: skip
    with open(path, "wb") as f:
        pq.write_table(table, f)
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    del d, table, logits, emb
    t0 = time.perf_counter()
    back = pq.read_table(path)
    read = time.perf_counter() - t0
    assert back.num_rows == n
    del back
    t0 = time.perf_counter()
    col = pq.read_table(path, columns=["logits"]).column("logits").combine_chunks()
    mat = col.flatten().to_numpy().reshape(-1, LOGITS)
    column = time.perf_counter() - t0
    assert mat.shape == (n, LOGITS)
    return {"ok": True, "write_s": write, "read_s": read, "column_s": column, "bytes": os.path.getsize(path)}


# ------------------------------------------------------------------------------------ methods
def count_objects(path: str | Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def run_method(method: str, n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    work = Path(cfg["workdir"]) / f"{method}-{n}-{time.time_ns()}"
    work.mkdir(parents=True)
    c = {**cfg, "n": n, "work": str(work), "root": str(work / "spill")}
    try:
        if method == "torch_save":
            return in_process(torch_save_body, timeout=cfg["timeout"], n=n, path=str(work / "preds.pt"))
        if method == "parquet":
            return in_process(parquet_body, timeout=cfg["timeout"], n=n, path=str(work / "preds.parquet"))
        if method == "gather_object":
            ranks = run_ranks(method, cfg["world"], c)
            if "error" in ranks[0]:
                return {"ok": False, "error": ranks[0]["error"]}
            return {"ok": True, "wall_s": ranks[0]["wall_s"], "anon0": ranks[0]["anon"]}
        ranks = run_ranks(method, cfg["world"], c)
        if "error" in ranks[0]:
            return {"ok": False, "error": ranks[0]["error"]}
        out = str(work / "out.zarr")
        m = in_process(merge_body, timeout=cfg["timeout"], root=c["root"], out=out)
        if not m.get("ok", True) or "error" in m:
            return {"ok": False, "error": m.get("error")}
        r = in_process(read_body, timeout=cfg["timeout"], out=out, n=n)
        if "error" in r:
            return {"ok": False, "error": r["error"]}
        return {"ok": True, "spill_s": max(x["wall_s"] for x in ranks), "spill_anon": max(x["anon"] for x in ranks),
                **m, **r, "objects": count_objects(out), "out_bytes": tree_bytes(out)}  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.sync()


def _med(xs: list[float | None]) -> float:
    ys = [x for x in xs if x is not None]
    return statistics.median(ys) if ys else float("nan")


def _runs(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def summarise(n: int, rows: dict[str, list[dict[str, Any]]], world: int) -> tuple[list[str], dict[str, Any]]:
    ok = {m: [r for r in rows[m] if r.get("ok")] for m in METHODS}
    lines: list[str] = []
    errors = [f"{m}: {r.get('error')}" for m in METHODS for r in rows[m] if not r.get("ok")]
    sm, ts, pq_, go = ok["spillmerge"], ok["torch_save"], ok["parquet"], ok["gather_object"]
    e2e = [r["spill_s"] + r["merge_s"] for r in sm]
    ts_t = [r["save_s"] + r["load_s"] for r in ts]
    pq_t = [r["write_s"] + r["read_s"] for r in pq_]
    go_t = [r["wall_s"] for r in go]
    s: dict[str, Any] = {"n": n, "e2e": _med(e2e), "torch_save": _med(ts_t), "parquet": _med(pq_t),
                         "gather_object": _med(go_t)}  # fmt: skip
    s["spill"] = _med([r["spill_s"] for r in sm])
    s["merge"] = _med([r["merge_s"] for r in sm])
    s["objects"] = max((r["objects"] for r in sm), default=0)
    s["out_bytes"] = max((r["out_bytes"] for r in sm), default=0)
    s["open"] = _med([r["open_s"] for r in sm])
    s["one_ms"] = _med([statistics.median(r["one_ms"]) for r in sm])
    s["one_ms_max"] = max((max(r["one_ms"]) for r in sm), default=float("nan"))
    s["column"] = _med([r.get("column_s") for r in sm])
    s["pq_column"] = _med([r["column_s"] for r in pq_])
    s["anon"] = max((r["anon"] for r in sm), default=0)
    s["vmhwm"] = max((r["vmhwm"] for r in sm), default=0)
    s["verified"] = all(r.get("verified", False) for r in sm) if sm else False
    s["phases"] = sm[0]["phases"] if sm else {}
    lines.append(f"\n### N = {n:,} keys (payload {n * ROW_BYTES / MiB:.0f} MiB), W={world}\n")
    lines.append("| method | median | runs (s) | vs torch.save |")
    lines.append("|---|---|---|---|")
    for label, xs in (("spillmerge spill + merge", e2e), ("torch.save + torch.load", ts_t),
                      ("Parquet write + read", pq_t), (f"gather_object (W={world})", go_t)):  # fmt: skip
        lines.append(f"| {label} | {_med(xs):.2f} s | {_runs(xs)} | {_med(xs) / s['torch_save']:.2f}x |")
    lines.append("")
    col_ratio = s["column"] / s["pq_column"] if s["column"] == s["column"] else float("nan")
    lines.append("| spillmerge | value |")
    lines.append("|---|---|")
    lines.append(f"| spill (slowest rank) / merge | {s['spill']:.2f} s / {s['merge']:.2f} s "
                 f"(runs {_runs([r['merge_s'] for r in sm])}) |")  # fmt: skip
    if s["phases"]:
        lines.append(
            "| merge phases (first run) | " + ", ".join(f"{k} {v:.2f} s" for k, v in s["phases"].items()) + " |"
        )
    lines.append(f"| end to end vs torch.save | {s['e2e'] / s['torch_save']:.2f}x (target <= 1x) |")
    lines.append(f"| end to end vs gather_object | {s['e2e'] / s['gather_object']:.2f}x (target < 1x) |")
    lines.append(f"| objects in the output | {s['objects']:,} (target <= 1,000 at 1M keys) |")
    lines.append(f"| output bytes | {s['out_bytes'] / MiB:.0f} MiB ({s['out_bytes'] / (n * ROW_BYTES):.2f}x payload) |")
    lines.append(f"| spillmerge.open | {s['open']:.3f} s (target <= 1 s) |")
    lines.append(f"| one file's value, median / max of 50 | {s['one_ms']:.2f} ms / {s['one_ms_max']:.1f} ms "
                 f"(target <= 10 ms) |")  # fmt: skip
    col_txt = "no res.column in this build" if s["column"] != s["column"] else f"{s['column']:.3f} s"
    lines.append(f"| logits column: res.column(...)[:] / Parquet column read | {col_txt} / {s['pq_column']:.3f} s "
                 f"= {col_ratio:.2f}x (target <= 2x) |")  # fmt: skip
    lines.append(f"| merge peak extra anon (max) | {s['anon'] / MiB:.0f} MiB = {s['anon'] / n:.0f} B per key "
                 f"(VmHWM {s['vmhwm'] / MiB:.0f} MiB: imports and mapped spill chunks included) |")  # fmt: skip
    lines.append(f"| column values verified bit for bit | {'yes' if s['verified'] else 'NO / not checked'} |")
    for e in errors:
        lines.append(f"\nFAILED {e}")
    return lines, s


# ------------------------------------------------------------------------------------------ S3
class CountingProxy:
    """A loopback HTTP proxy in front of the moto server that counts requests by method."""

    def __init__(self, upstream: str) -> None:
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        host, port = upstream.removeprefix("http://").split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.counts[self.command] = proxy.counts.get(self.command, 0) + 1
                conn = http.client.HTTPConnection(host, int(port), timeout=300)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self) -> dict[str, int]:
        with self.lock:
            c, self.counts = self.counts, {}
        return c


def s3_body(n: int, world: int) -> dict[str, Any]:
    """Spill n keys from W writers (one after another, no process group) to a moto server, then
    merge s3 -> s3 in this process; count the requests of each step."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    import spillmerge

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        proxy = CountingProxy(f"http://{host}:{port}")
        boto3.client("s3", endpoint_url=proxy.endpoint, aws_access_key_id="b", aws_secret_access_key="b",
                     region_name="us-east-1").create_bucket(Bucket="bench")  # fmt: skip
        opts = {
            "key": "b",
            "secret": "b",
            "client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": "us-east-1"},
        }
        proxy.take()
        t0 = time.perf_counter()
        for r in range(world):
            preds = make_values(rank_keys(n, world, r))
            with spillmerge.SpillWriter("s3://bench/spill", rank=r, world_size=world, storage_options=opts,
                                        run_id="manykeys") as w:  # fmt: skip
                for name, value in preds.items():
                    w.write(name, 0, value)
        spill_s = time.perf_counter() - t0
        spill_counts = proxy.take()
        t0 = time.perf_counter()
        spillmerge.merge("s3://bench/spill", "s3://bench/out.zarr", storage_options=opts, progress=False)
        merge_s = time.perf_counter() - t0
        merge_counts = proxy.take()
        t0 = time.perf_counter()
        res = spillmerge.open("s3://bench/out.zarr", storage_options=opts)
        np.asarray(res[key_name(n // 2)]["logits"][0])
        open_s = time.perf_counter() - t0
        open_counts = proxy.take()
        proxy.server.shutdown()
        return {"ok": True, "spill_s": spill_s, "merge_s": merge_s, "open_read_s": open_s, "spill": spill_counts,
                "merge": merge_counts, "open": open_counts}  # fmt: skip
    finally:
        server.stop()


# --------------------------------------------------------------------------------------- main
def machine() -> str:
    import zarr

    import spillmerge

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()  # fmt: skip
    except OSError:
        commit = "?"
    return (f"{os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}, torch "
            f"{torch.__version__}, zarr {zarr.__version__}, numpy {np.__version__}, spillmerge commit {commit} "
            f"(FORMAT_VERSION {spillmerge.FORMAT_VERSION}), load {os.getloadavg()[0]:.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="numbers of keys")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="N = 2,000, 1 repeat")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--s3", action="store_true", help="also count the S3 requests of a merge (moto server)")
    ap.add_argument("--s3-n", type=int, default=100_000)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--workdir", default=None, help="spills and outputs (default: a temp dir, removed)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/<date>-manykeys)")
    args = ap.parse_args()
    if args.quick:
        args.n, args.repeats, args.s3_n = [2000], 1, 2000
    methods = [m for m in METHODS if m in args.methods.split(",")]
    workdir = args.workdir or tempfile.mkdtemp(prefix="spillmerge-manykeys-")
    cfg = {"world": args.world, "workdir": workdir, "timeout": args.timeout}
    started = time.time()
    log: list[str] = []

    def note(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
        log.append(msg)

    header = [f"# Many keys (issue 14), {datetime.date.today()}", "",
              f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "", f"Machine: {machine()}", "",
              f"N filenames x 1 frame of {{logits fp16[{LOGITS}], emb fp16[{EMB}]}} ({ROW_BYTES} B per key), "
              f"W={args.world} gloo ranks, median of {args.repeats} (methods alternated, order rotated)."]  # fmt: skip
    body: list[str] = []
    summary: list[dict[str, Any]] = []
    try:
        for n in args.n:
            rows: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
            for rep in range(args.repeats):
                k = rep % len(methods)
                for m in methods[k:] + methods[:k]:
                    t0 = time.time()
                    r = run_method(m, n, cfg)
                    rows[m].append(r)
                    note(f"  N={n} repeat {rep + 1} {m}: {'ok' if r.get('ok') else 'FAILED ' + str(r.get('error'))[-300:]}"
                         f" ({time.time() - t0:.1f} s)")  # fmt: skip
            lines, s = summarise(n, rows, args.world)
            body.extend(lines)
            summary.append(s)
            print("\n".join(lines), flush=True)
        if len(summary) > 1:
            body.append("\n### Across N\n")
            body.append("| N | spill + merge / torch.save | / Parquet | / gather_object | objects | open | one value "
                        "| column / Parquet | merge anon |")  # fmt: skip
            body.append("|---|---|---|---|---|---|---|---|---|")
            for s in summary:
                body.append(f"| {s['n']:,} | {s['e2e'] / s['torch_save']:.2f}x | {s['e2e'] / s['parquet']:.2f}x | "
                            f"{s['e2e'] / s['gather_object']:.2f}x | {s['objects']:,} | {s['open']:.3f} s | "
                            f"{s['one_ms']:.2f} ms | {s['column'] / s['pq_column']:.2f}x | {s['anon'] / MiB:.0f} MiB |")  # fmt: skip
            a, b = summary[0], summary[-1]
            slope = (b["anon"] - a["anon"]) / max(b["n"] - a["n"], 1)
            body.append(f"\nMerge memory growth between N={a['n']:,} and N={b['n']:,}: {slope:.0f} bytes per key.")
        if args.s3:
            note(f"  S3: {args.s3_n} keys ...")
            r = in_process(s3_body, timeout=args.timeout, n=args.s3_n, world=args.world)
            if r.get("ok"):
                body.append(
                    f"\n### S3 (moto ThreadedMotoServer on 127.0.0.1), N = {args.s3_n:,} keys, W={args.world}\n"
                )
                body.append("| step | wall | requests by method |")
                body.append("|---|---|---|")
                for step, wall in (("spill (W writers, one after another)", r["spill_s"]),
                                   ("merge s3 -> s3", r["merge_s"]), ("open + one value", r["open_read_s"])):  # fmt: skip
                    key = step.split()[0]
                    counts = r[key]
                    body.append(f"| {step} | {wall:.2f} s | "
                                f"{', '.join(f'{k} {v:,}' for k, v in sorted(counts.items()))} |")  # fmt: skip
                body.append(f"\nPUTs of the merge: {r['merge'].get('PUT', 0):,} (+ {r['merge'].get('POST', 0):,} POST)")
            else:
                body.append(f"\nS3 run FAILED: {r.get('error')}")
            print("\n".join(body[-8:]), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    body.append(f"\nRuntime {time.time() - started:.0f} s.\n\n<details><summary>progress</summary>\n\n```\n"
                + "\n".join(log) + "\n```\n</details>\n")  # fmt: skip
    outdir = (
        Path(args.out) if args.out else RESULTS / f"{datetime.date.today()}-manykeys{'-quick' if args.quick else ''}"
    )
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "results.md").write_text("\n".join(header + body))
    (outdir / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nwrote {outdir / 'results.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
