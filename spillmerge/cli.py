"""Command line: ``spillmerge merge | inspect | verify | status | export | demo``. A thin shell
over the library: library errors become one-line messages and a non-zero exit code; a reader of
stdout that goes away (``| head``) ends the command quietly, with status 141 as for SIGPIPE."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from ._errors import ConfigError, OutputExistsError, SpillMergeError, require_torch
from ._merge import options as _options

_MERGE_KEYS = {"root": str, "out": str, **_options.config_keys()}
"""The ``[merge]`` table of a config file: the spill root, the output and every option with a config key."""
_STORAGE_OPTION_HELP = (
    "fsspec option (repeatable); VALUE is read as JSON where it is JSON (a number, true, {...}), else as a "
    """string: quote a string that looks like JSON (secret='"123456"')"""
)
MAX_INTERVAL = 86400
"""The longest ``status --watch --interval`` (seconds): ``time.sleep`` overflows a few orders above."""
_DEMO_KEYS = {"ranks": int, "files": int, "frames_per_file": int, "frame_shape": list, "out": str, "seed": int}


def _load_config(path: str | None, section: str, schema: dict[str, type]) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist", key=None) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{section}] must be a table", key=section)
    out = {}
    for key, value in table.items():
        if key not in schema:
            raise ConfigError(
                f"{path}: unknown key {section}.{key} (known: {', '.join(sorted(schema))})", key=f"{section}.{key}"
            )
        want = schema[key]
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            raise ConfigError(
                f"{path}: {section}.{key} must be {'an' if want is int else 'a'} {want.__name__}, got {value!r}",
                key=f"{section}.{key}",
            )
        out[key] = value
    return out


def _storage_options(pairs: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs: VALUE as JSON where it is JSON (numbers such as a block size, true,
    false, null, ``client_kwargs={...}``, a quoted string), else the string itself."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ConfigError(f"--storage-option expects KEY=VALUE, got {pair!r}", key="storage_option")
        k, v = pair.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes joined by x, e.g. 3x64x64, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spillmerge",
        description="Gather distributed inference predictions through storage: spill per rank, merge once.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example:\n  spillmerge demo\n  spillmerge merge ./spill --out ./merged.zarr\n  spillmerge inspect ./merged.zarr",
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"spillmerge {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, summary: str, description: str, epilog: str) -> argparse.ArgumentParser:
        """A subcommand whose examples (``epilog``) keep their line breaks; all but merge and demo
        take ``--storage-option``."""
        c = sub.add_parser(name, help=summary, description=description, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        if name not in ("merge", "demo"):
            c.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help=_STORAGE_OPTION_HELP)
        return c

    m = command(
        "merge",
        "merge a spill root into one Zarr store",
        "Merge every committed segment of a spill root into one consolidated Zarr v3 store "
        "(one array per leaf column across every (filename, frame) row, rows grouped by file in frame "
        "order; docs/FORMAT.md). Read it with spillmerge.open(OUT).",
        "Example:\n  spillmerge merge /scratch/run1/spill --out /scratch/run1/preds.zarr\n"
        "  spillmerge merge --config configs/demo.toml --timeout 600 --codec zstd\n"
        "Scale out over N independent processes (e.g. a SLURM array of N tasks), then finalize once:\n"
        "  spillmerge merge /scratch/run1/spill --out /scratch/run1/preds.zarr --part $SLURM_ARRAY_TASK_ID/N\n"
        "  spillmerge merge /scratch/run1/spill --out /scratch/run1/preds.zarr --finalize\n"
        "Salvage a run with dead ranks and list exactly what is missing against a manifest:\n"
        "  spillmerge merge ./spill --out ./preds.zarr --allow-partial --expected manifest.csv\n\n"
        "manifest.csv has a header and one row per file:\n  filename,n_frames\n  video_001.mp4,240\n\n"
        "Exit status: 0; 1 on an error, or when --expected finds missing frames (the output is still complete "
        "and lists what it holds).",
    )
    m.add_argument("root", nargs="?", help="spill root (path or fsspec URL)")
    m.add_argument("--out", help="output store (path or fsspec URL)")
    m.add_argument(
        "--config", help="TOML file with a [merge] table (a relative expected = path lies beside it); flags override it"
    )
    exclusive: dict[str, Any] = {}
    for name, flag in _options.flags().items():
        if flag.exclusive is not None and flag.exclusive not in exclusive:
            exclusive[flag.exclusive] = m.add_mutually_exclusive_group()
        where = m if flag.exclusive is None else exclusive[flag.exclusive]
        where.add_argument(flag.name, dest=name, default=None, help=flag.help, **flag.argparse)

    i = command(
        "inspect",
        "summarise a spill root or a merged store",
        "Summarise a spill root (ranks, segments, files, frames, bytes, dtypes) or a merged store "
        "(files, frames, leaf columns and their dtypes).",
        "Example:\n  spillmerge inspect ./spill\n  spillmerge inspect ./merged.zarr --json\n"
        "  spillmerge inspect ./merged.zarr --expected manifest.csv --plot coverage.png\n\n"
        "manifest.csv has a header and one row per file:\n  filename,n_frames\n  video_001.mp4,240\n\n"
        "Exit status: 0, or 1 when --expected finds missing frames (or on an error).",
    )
    i.add_argument("path", help="spill root or merged output")
    i.add_argument("--json", action="store_true", help="print JSON instead of text (with a 'coverage' section)")
    i.add_argument(
        "--expected",
        metavar="CSV",
        help="manifest (columns filename,n_frames): report frames missing against it; exit 1 if any",
    )
    i.add_argument(
        "--plot",
        metavar="PNG",
        help="draw which frames of which file came from which rank, and the missing / duplicated ones "
        "(needs matplotlib: pip install 'spillmerge[plot]')",
    )
    i.add_argument("--overwrite", action="store_true", help="replace an existing --plot file")
    i.add_argument(
        "--max-files", "--files", type=int, default=20, metavar="N",
        help="files listed, in the text and in --json (default 20; those with problems first); totals count all",
    )  # fmt: skip

    v = command(
        "verify",
        "check every checksum of a spill root or merged store",
        "Verify the CRC-32C of every index, catalog and frame of a spill root, or of every "
        "chunk of a merged store. Lists each corrupt or missing object (CORRUPT) and each segment or merge "
        "that did not finish (UNFINISHED); exits 1 if there is any.",
        "Example:\n  spillmerge verify ./spill\n  spillmerge verify ./merged.zarr",
    )
    v.add_argument("path", help="spill root or merged output")

    st = command(
        "status",
        "show a running job: per rank frames, rate, last write, stalled / failed / missing ranks",
        "Show the job writing to a spill root, from storage alone (local disk or object store): "
        "per rank its state (writing, committed, failed, missing), frames and bytes durable so far, rate and "
        "time since its last durable write, stalled ranks, an estimate of the end when the expected number "
        "of frames is known, and the merge's progress when --out names its output. It reads a few small "
        "records per rank and never writes, so it does not slow or block the writers.",
        "Example:\n  spillmerge status ./spill\n  spillmerge status ./spill --watch --expected 120000\n"
        "  spillmerge status s3://bucket/run1/spill --out s3://bucket/run1/preds.zarr --json\n\n"
        "Exit status: 0; 1 when a rank failed or its records are unreadable, or on an error (a path that is "
        "no spill root).",
    )
    st.add_argument("root", help="spill root (path or fsspec URL)")
    st.add_argument("--out", help="the merge's output: show its parts and progress too")
    st.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    st.add_argument(
        "--watch", action="store_true", help="redraw until every rank has committed, failed or has unreadable records"
    )
    st.add_argument("--interval", type=float, default=3.0, help="seconds between redraws with --watch (default 3)")
    st.add_argument(
        "--expected", type=int, metavar="N", help="frames the whole job writes (default: what the writers recorded)"
    )
    st.add_argument(
        "--stall-after", type=float, default=120.0, metavar="SECONDS",
        help="flag a writing rank with no durable write for this long as stalled (default 120)",
    )  # fmt: skip

    e = command(
        "export",
        "write a merged store as Parquet (for polars, DuckDB, pandas, Hugging Face datasets)",
        "Write every row of a merged store to one Parquet file, batch by batch (memory stays one "
        "batch): columns filename, frame_idx, rank, then one per leaf (named by its path, 'value' for plain "
        "tensor values). Needs pyarrow (pip install 'spillmerge[arrow]'); torch is not needed.",
        "Example:\n  spillmerge export ./merged.zarr --parquet preds.parquet\n"
        "  spillmerge export ./merged.zarr --parquet boxes.parquet --columns boxes,scores --compression zstd\n"
        "Then: polars.scan_parquet('preds.parquet'), duckdb.sql(\"SELECT * FROM 'preds.parquet'\"), "
        "datasets.load_dataset('parquet', data_files='preds.parquet')",
    )
    e.add_argument("path", help="merged output (path or fsspec URL)")
    e.add_argument("--parquet", required=True, metavar="FILE", help="the Parquet file to write (path or fsspec URL)")
    e.add_argument(
        "--columns", metavar="A,B", help="leaf columns to export, comma-separated (default: all; the keys always)"
    )
    e.add_argument("--batch-size", type=int, help="rows per batch and row group (default: about 64 MiB of payload)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --parquet file")
    e.add_argument(
        "--compression", default="snappy", choices=["none", "snappy", "zstd", "gzip", "lz4", "brotli"],
        help="Parquet compression (default snappy)",
    )  # fmt: skip

    d = command(
        "demo",
        "run a small multi-rank spill + merge on CPU",
        "Spawn N CPU ranks on gloo that run a fake inference loop with uneven, shuffled frames, "
        "spill them, merge into OUT/merged.zarr, check the result bit-exactly and print a summary.",
        "Example:\n  spillmerge demo\n  spillmerge demo --ranks 2 --out /tmp/demo\n  spillmerge demo --config configs/demo.toml --files 4",
    )
    d.add_argument("--config", help="TOML file with a [demo] table; flags override it")
    d.add_argument("--ranks", type=int, help="number of ranks (default 4)")
    d.add_argument("--files", type=int, help="number of fake videos (default 8)")
    d.add_argument("--frames-per-file", type=int, help="mean frames per video (default 40)")
    d.add_argument("--frame-shape", type=_shape, metavar="CxHxW", help="e.g. 3x64x64")
    d.add_argument("--out", help="output directory (default ./spillmerge-demo)")
    d.add_argument("--seed", type=int, help="workload seed (default 0)")
    return p


def _merge(args: argparse.Namespace) -> int:
    from ._merge.job import merge

    opts = _load_config(args.config, "merge", _MERGE_KEYS)
    if opts.get("expected"):  # a manifest named in a config file lies beside it
        opts["expected"] = os.path.join(os.path.dirname(args.config), opts["expected"])
    for name in ("root", "out", *_options.flags()):  # a flag given overrides the config file
        given = getattr(args, name)
        if _MERGE_KEYS.get(name) is dict:  # repeatable KEY=VALUE flags update the config's table
            given = {**opts.pop(name, {}), **_storage_options(given)} or None
        if given is not None:
            opts[name] = given
    root, out = opts.pop("root", None), opts.pop("out", None)
    if not root:
        raise ConfigError("merge needs a spill root: spillmerge merge ROOT --out OUT", key="root")
    if not out:
        raise ConfigError("merge needs an output: --out OUT (or out = ... in the config)", key="out")
    report = merge(root, out, **opts)
    print(report)
    for seg in report.abandoned_segments:
        print(f"note: ignored uncommitted segment {seg} (superseded by a later commit of the same rank)")
    return 1 if report.expected_files is not None and report.frame_gaps else 0


def _inspect(args: argparse.Namespace) -> int:
    from ._inspect.coverage import cover, plot
    from ._inspect.summary import format_coverage, format_text, summarize_read
    from ._storage import Storage, overlaps
    from ._util.frames import read_manifest

    if args.max_files < 0:
        raise ConfigError(f"--max-files must be 0 or more, got {args.max_files}", key="max_files")
    storage = Storage(args.path, _storage_options(args.storage_option) or None)
    if args.plot and overlaps(storage, Storage(args.plot)):
        raise ConfigError(f"--plot {args.plot} lies inside {args.path}, which inspect only reads", key="plot")
    if args.plot and not args.overwrite and os.path.lexists(args.plot):
        raise OutputExistsError(f"--plot {args.plot} exists; pass --overwrite to replace it", path=args.plot)
    expected = read_manifest(args.expected) if args.expected else None
    s, read = summarize_read(storage, args.max_files)  # each segment loaded, the output opened, once
    cov = None
    if read is not None:  # an interrupted merge has no index to cover
        cov = cover(storage, read, expected)
        cov.manifest = args.expected
        if args.json:  # the text report builds only what it prints
            s["coverage"] = cov.to_json(max_files=args.max_files)
    elif expected is not None or args.plot:
        flag = "--expected" if expected is not None else "--plot"
        raise ConfigError(f"{args.path} is an interrupted merge; {flag} needs a complete output", key=flag[2:])
    if args.plot and cov is not None:
        plot(cov, args.plot)
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=True, ensure_ascii=False))
    else:
        print(format_text(s))
        if cov is not None:
            print(format_coverage(cov, max_files=args.max_files))
    if args.plot and cov is not None:
        print(f"coverage plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 1 if expected is not None and cov is not None and cov.n_missing else 0


def _verify(args: argparse.Namespace) -> int:
    from ._inspect.summary import verify
    from ._util.units import size_text

    rep = verify(args.path, _storage_options(args.storage_option) or None)
    for problem in rep.problems:
        print(f"{'UNFINISHED' if problem in rep.unfinished else 'CORRUPT'} {problem}")
    status = "OK" if rep.ok else f"{len(rep.problems)} problem(s)"
    print(
        f"{rep.kind} {rep.path}: {status}; {rep.checked_objects} objects, {size_text(rep.checked_bytes)} of payload verified"
    )
    return 0 if rep.ok else 1


def _status(args: argparse.Namespace) -> int:
    import time

    from ._inspect.status import format_status, status

    if not 0 < args.interval <= MAX_INTERVAL:  # NaN and inf too (time.sleep overflows)
        raise ConfigError(
            f"--interval must be a number of seconds above 0, at most {MAX_INTERVAL} (a day), got {args.interval}",
            key="interval",
        )
    opts = {"out": args.out, "expected": args.expected, "stall_after": args.stall_after,
            "storage_options": _storage_options(args.storage_option) or None}  # fmt: skip
    tty = sys.stdout.isatty()
    while True:
        js = status(args.root, **opts)
        if args.json:
            print(json.dumps(js.to_dict(), sort_keys=True), flush=True)
        else:
            if args.watch and tty:
                print("\x1b[H\x1b[2J", end="")  # redraw in place on a terminal
            print(format_status(js), flush=True)
        # (records that cannot be read do not mend by waiting: such a rank has ended too)
        ended = js.world_size is not None and all(r.state in ("committed", "failed", "unreadable") for r in js.ranks)
        if not args.watch or ended:
            return 1 if any(r.state in ("failed", "unreadable") for r in js.ranks) else 0
        time.sleep(args.interval)


def _export(args: argparse.Namespace) -> int:
    from ._format.output import what_is
    from ._read.store import open as open_store
    from ._storage import Storage, output_options, overlaps

    so = _storage_options(args.storage_option) or None
    store = open_store(args.path, so)
    dest_options = output_options(args.path, args.parquet, so, None)  # the same credentials, one protocol
    dest = Storage(args.parquet, dest_options)
    # (a path inside the output is refused by to_parquet, whatever is there)
    if not args.overwrite and not overlaps(store.storage, dest) and what_is(dest) == "file":
        where = dest.describe()
        raise OutputExistsError(f"--parquet {where} exists; pass --overwrite to replace it", path=where)
    columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
    rows = store.to_parquet(
        args.parquet, columns=columns, batch_size=args.batch_size, compression=args.compression,
        storage_options=dest_options,
    )  # fmt: skip
    print(f"{args.parquet}: {rows} rows from {args.path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    require_torch("spillmerge demo")  # one line naming the install, not an import traceback
    from ._demo import DemoConfig, run
    from ._inspect.summary import format_text, summarize

    opts = _load_config(args.config, "demo", _DEMO_KEYS)
    opts |= {key: getattr(args, key) for key in _DEMO_KEYS if getattr(args, key) is not None}
    if "frame_shape" in opts:
        shape = opts["frame_shape"]
        if len(shape) < 2 or not all(isinstance(x, int) and x >= 1 for x in shape):
            raise ConfigError(
                f"frame_shape must have 2 or more sizes >= 1 (e.g. 3x64x64), got {shape!r}", key="frame_shape"
            )
        opts["frame_shape"] = tuple(shape)
    for key in ("ranks", "files", "frames_per_file"):
        if key in opts and opts[key] < 1:
            raise ConfigError(f"{key} must be at least 1, got {opts[key]}", key=key)
    dc = DemoConfig(**opts)
    print(f"spillmerge demo: {dc.ranks} ranks on gloo, {dc.files} videos, writing to {Path(dc.out).resolve()}")
    print(run(dc), end="")
    merged = str(Path(dc.out) / "merged.zarr")
    print(format_text(summarize(merged, max_files=5)))
    print(f"output: {Path(merged).resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command == "merge" and args.out is None and not unknown[0].startswith("-"):  # `merge ROOT OUT`
        print(f"spillmerge merge: error: merge takes one path, the spill root; did you mean --out {unknown[0]}?",
              file=sys.stderr)  # fmt: skip
        return 1
    if unknown:
        parser.parse_args(argv)  # argparse's own message (and exit status 2) for anything else
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"merge": _merge, "inspect": _inspect, "verify": _verify, "status": _status, "export": _export,
               "demo": _demo}[args.command]  # fmt: skip
    try:
        code = handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:  # the reader of stdout went away (`spillmerge inspect OUT | head`): exit quietly
        # with the status of a process killed by SIGPIPE, as other command-line tools do; stdout
        # points at devnull so that the flush at exit does not raise again (Python's docs)
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stdout without a file descriptor
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13  # 141: 128 + SIGPIPE
    except SpillMergeError as exc:
        msg = " ".join(str(exc).split("\n"))
        print(f"spillmerge {args.command}: error: {msg}", file=sys.stderr)
        return 1
    except OSError as exc:  # the file system refused something the user named (a path, a permission)
        where = f": {exc.filename}" if exc.filename else ""
        print(f"spillmerge {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("spillmerge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
