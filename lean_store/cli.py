"""The ``lean-store`` command: inspect, verify, diff, convert, export and import checkpoints.

Exit status: 0 success (for ``verify`` and ``diff``: no problem, identical); 1 a problem was
found in the data (corrupt or incomplete checkpoint, checksum mismatch, differences); 2 a usage
or other error (bad arguments, missing file, a path that is not a regular file or directory, a
format the target cannot hold), and also any unexpected failure; 130 interrupted; 141 (128 +
SIGPIPE, what a shell reports for a command a closed pipe stopped) when the reader of the
output went away (``lean-store diff a b | head``), quietly, so that a cut-off ``diff`` or
``verify`` never reads as "differ" or "corrupt". Errors are one clear line on stderr, never a
traceback (set ``LEAN_STORE_DEBUG=1`` to see one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, IntegrityError, LayoutError

if TYPE_CHECKING:
    from .stores.base import StorageDescription

EXIT_OK, EXIT_PROBLEM, EXIT_ERROR = 0, 1, 2
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE
MAX_PRINTED = 50  # problems ``verify`` prints one per line; --json lists every one

EPILOG = """\
examples:
  lean-store inspect run.h5                   table of tensors
  lean-store inspect run.zarr --stats --json  exact min/max/mean/NaN/inf, machine-readable
  lean-store verify run.h5                    every checksum and the layout; exit 1 if bad
  lean-store diff a.h5 b.zarr                 layout, bit identity, max abs/rel/ULP; exit 1 if
                                              they differ
  lean-store convert model.safetensors run.h5 exact bits; refused if the target cannot hold them
  lean-store convert run.h5 model.pt          torch state dict (read back with weights_only)
  lean-store convert state.tlsf32 run.zarr    TorchLean streamed float32 file
  lean-store export run.h5 --json > s.json    TorchLean Checkpoint.State JSON (raw words)
  lean-store import s.json run.h5             the inverse of export
"""


class UsageError(Exception):
    """A problem with the command line rather than with any data."""


# ---------------------------------------------------------------------------------- output


def _console(stream: Any = None) -> Any:
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich exits with status 1 here, which for diff and verify means "differ" or
            # "corrupt": handed to main instead, like any other write to a closed pipe
            raise BrokenPipeError

    stream = stream or sys.stdout
    width = None if stream.isatty() else 200
    return _Console(file=stream, width=width, highlight=False, soft_wrap=False)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return "-"  # pragma: no cover


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, complex):
        return f"{value.real:.6g}{value.imag:+.6g}j"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


# ---------------------------------------------------------------------------------- inspect


def _ratio(stored: int | None, raw: int) -> float | None:
    """Stored bytes (chunks, checksums, shard indexes) over the tensor's raw bytes."""
    if stored is None or raw <= 0:
        return None
    return round(stored / raw, 4)


def _compression(storage: StorageDescription) -> str:
    sharded = ["sharded"] if "ShardingCodec" in storage.codecs else []
    names = sharded + list(storage.compression)
    return ",".join(names) if names else "none"


def cmd_inspect(args: argparse.Namespace) -> int:
    from . import checkpoint

    steps = None if _lean_store_path(args.checkpoint) else _steps_of(args.checkpoint)
    if steps is not None:
        return _print_steps(args, steps)

    with checkpoint.open(args.checkpoint) as ck:
        rows: list[dict[str, Any]] = []
        for entry in ck.layout:
            handle = ck[entry.name]
            storage = ck.describe(entry.name)
            rows.append({
                "index": entry.index,
                "name": entry.name,
                "shape": list(entry.shape),
                "format": entry.format.tag,
                "width": entry.format.width,
                "chunks": list(handle.chunks[: max(1, len(entry.shape))]),
                "bytes": entry.nbytes,
                "bytes_on_disk": storage.stored_bytes,
                "compression": _compression(storage),
            })
            rows[-1]["ratio"] = _ratio(rows[-1]["bytes_on_disk"], entry.nbytes)
        stats: dict[str, Any] = {}
        if args.stats:
            from .inspection.stats import tensor_stats
            from .progress import make_progress

            with make_progress(None, "stats", ck.layout.nbytes) as bar:
                for entry in ck.layout:
                    stats[entry.name] = tensor_stats(ck, entry.name, progress=bar)
        header = {"path": str(args.checkpoint), "backend": ck.backend, "kind": ck.kind,
                  "format_version": ck.format_version, "tensor_count": len(ck)}
        from .inspection.plain_data import plain_data

        plain = plain_data(ck)  # a training checkpoint's step, extras, ... (FORMAT.md 7)
    if args.json:
        for row in rows:
            if row["name"] in stats:
                row["stats"] = stats[row["name"]].to_json()
        _print_json({**header, "plain_data": plain, "tensors": rows})
        return EXIT_OK
    from rich.table import Table

    title = (f"{header['path']}  ({header['backend']}, {header['kind']}, "
             f"{header['tensor_count']} tensors)")
    table = Table(title=title)
    columns = ["#", "name", "shape", "format", "width", "chunks", "bytes on disk", "ratio",
               "compression"]
    if args.stats:
        columns += ["min", "max", "mean", "NaN", "inf"]
    for col in columns:
        right = col in ("#", "width", "bytes on disk", "ratio")
        table.add_column(col, justify="right" if right else "left", overflow="fold")
    for row in rows:
        cells = [str(row["index"]), row["name"], str(tuple(row["shape"])), row["format"],
                 str(row["width"]), str(tuple(row["chunks"])), _size(row["bytes_on_disk"]),
                 "-" if row["ratio"] is None else f"{row['ratio']:.3f}", row["compression"]]
        if args.stats:
            s = stats[row["name"]]
            cells += [_num(s.min), _num(s.max), _num(s.mean), str(s.nan),
                      str(s.posinf + s.neginf)]
        table.add_row(*cells)
    console = _console()
    console.print(table)
    for key, tree in plain.items():
        console.print(f"{key}: {_summary(tree)}", markup=False)
    return EXIT_OK


def _steps_of(path: str) -> list[dict[str, Any]] | None:
    """For a local path no checkpoint format recognises: when it is a Checkpointer's
    directory of steps (``step_<n>`` checkpoints), each step's number, path, bytes on disk
    and plain data (``training_info``, nothing changed, no tensor read; None for a step that
    is not a training checkpoint or cannot be read). None for anything else."""
    from .training import Checkpointer, training_info

    p = Path(path)
    if "://" in path or not p.is_dir():
        return None
    run = Checkpointer(p, create=False)
    steps = run.steps()
    if not steps:
        return None
    rows = []
    for step in steps:
        where = run.path(step)
        try:
            info: Any = training_info(where)
        except (CheckpointError, ImportError):  # not a training checkpoint; torch tensors
            info = None  # in its plain data where torch is not installed
        size = _bytes_on_disk(where)
        if size is None or not os.path.lexists(where):  # pruned while listed (a training
            continue  # job's Checkpointer): no longer one of the run's steps
        rows.append({"step": step, "path": str(where), "bytes_on_disk": size,
                     "extra": None if info is None else info.extra,
                     "data": None if info is None else info.data})
    return rows


def _bytes_on_disk(path: Path) -> int | None:
    """The bytes of a checkpoint's files (a file, or a directory's files once each: a
    Zarr step's chunk files hard-linked to another step's count here too); None when it was
    removed meanwhile."""
    try:
        if not path.is_dir():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.rglob("*")
                   if f.is_file() and not f.is_symlink())
    except FileNotFoundError:
        return None


def _print_steps(args: argparse.Namespace, rows: list[dict[str, Any]]) -> int:
    if args.json:
        _print_json({"path": str(args.checkpoint), "steps": rows})
        return EXIT_OK
    from rich.table import Table

    table = Table(title=f"{args.checkpoint}  (a Checkpointer's directory, {len(rows)} steps)")
    for col in ("step", "checkpoint", "bytes on disk", "extra", "data"):
        table.add_column(col, justify="right" if col in ("step", "bytes on disk") else "left",
                         overflow="fold")
    for row in rows:
        table.add_row(str(row["step"]), Path(row["path"]).name, _size(row["bytes_on_disk"]),
                      "-" if row["extra"] is None else _summary(row["extra"]),
                      "-" if row["data"] is None else _summary(row["data"]))
    _console().print(table)
    return EXIT_OK


def _summary(tree: Any, limit: int = 300) -> str:
    """One line of a plain-data tree: its top-level scalars, and the class or size of the
    rest (``--json`` gives the whole tree)."""
    if not isinstance(tree, dict):
        text = json.dumps(tree)
    else:
        parts = []
        for key, value in tree.items():
            if isinstance(value, dict) and isinstance(value.get("class"), str):
                parts.append(f"{key}={value['class']}")
            elif isinstance(value, (dict, list)):
                what = "keys" if isinstance(value, dict) else "items"
                parts.append(f"{key}=({len(value)} {what})")
            else:
                parts.append(f"{key}={json.dumps(value)}")
        text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------- verify


def _lean_store_path(path: str) -> bool:
    """A usage error, not damaged data, for a path that holds no lean_store checkpoint: a
    missing path, a FIFO, a device, a dangling link, or a file of another format that
    ``convert`` and ``diff`` read (safetensors, torch, TorchLean, a Hugging Face model
    directory), saying which commands do. True: a URL, or a local HDF5/Zarr checkpoint;
    False: a local path no format recognises (opening it says why)."""
    if "://" in path:
        return True
    from .hardening import check_checkpoint_path
    from .interop.convert import format_of_path

    try:
        check_checkpoint_path(path)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    from .interop.foreign import file_kind, refusal_hint

    try:
        fmt: str | None = format_of_path(path, reading=True)
    except CheckpointError:
        fmt = None
    if fmt in ("hdf5", "zarr"):
        return True
    if fmt is not None and os.path.isfile(path) and file_kind(path) is None:
        fmt = None  # named like one by its suffix alone: not known
    if fmt is not None:
        raise UsageError(
            f"{path} is {'an' if fmt[0] in 'aeiou' else 'a'} {fmt} file, not a lean_store "
            f"checkpoint: 'lean-store diff' compares it with a checkpoint or another file, and "
            f"'lean-store convert {path} OUT.h5' makes a checkpoint of it (exact bits)")
    hint = refusal_hint(path)  # a zipped Zarr store, an .npz, a DCP directory
    if hint:
        raise UsageError(f"{path} is not a lean_store checkpoint{hint}")
    return False


def cmd_verify(args: argparse.Namespace) -> int:
    _lean_store_path(args.checkpoint)
    from .inspection.verify import verify

    report = verify(args.checkpoint)
    problems = [
        {"tensor": p.tensor, "chunk": list(p.chunk) if p.chunk is not None else None,
         "message": p.message}
        for p in report.problems
    ]
    summary = f"{report.tensors} tensors, {report.chunks} chunks, {_size(report.nbytes)}"
    ok = not problems
    if args.json:
        _print_json({"path": str(args.checkpoint), "ok": ok, "problems": problems})
    elif ok:
        print(f"OK {args.checkpoint}: layout and every checksum verified ({summary})")
    else:
        for p in problems[:MAX_PRINTED]:
            where = "checkpoint" if p["tensor"] is None else f"tensor {p['tensor']!r}"
            if p["chunk"] is not None:
                where += f" chunk {tuple(p['chunk'])}"
            print(f"BAD {args.checkpoint}: {where}: {p['message']}")
        if len(problems) > MAX_PRINTED:
            print(f"BAD {args.checkpoint}: ... and {len(problems) - MAX_PRINTED} more problems "
                  "(--json lists them all)")
    return EXIT_OK if ok else EXIT_PROBLEM


# ---------------------------------------------------------------------------------- diff


def _diff_side(path: str) -> Any:
    """A lean_store checkpoint, or any other file ``convert`` reads (safetensors, a Hugging
    Face sharded checkpoint, torch, TorchLean), for ``diff``."""
    from . import checkpoint
    from .interop.convert import format_of_path, open_input
    from .stores.commit import is_url

    if is_url(path) or format_of_path(path, reading=True) in ("hdf5", "zarr"):
        return checkpoint.open(path)
    from .inspection.foreign import InputBlocks

    return InputBlocks(open_input(path))


def cmd_diff(args: argparse.Namespace) -> int:
    from .inspection.diff import diff

    with _diff_side(args.a) as a, _diff_side(args.b) as b:
        report = diff(a, b)
    if args.json:
        _print_json({"a": str(args.a), "b": str(args.b), **report.to_json()})
        return EXIT_OK if report.identical else EXIT_PROBLEM
    out = _console()
    for d in report.layout:
        out.print(f"layout: {d}")
    for line in report.metadata:
        out.print(f"metadata: {line}", markup=False)
    from rich.table import Table

    table = Table(title=f"{args.a}  vs  {args.b}")
    for col in ("name", "bit-identical", "differing", "max abs", "max rel", "max ULP", "NaN≠"):
        table.add_column(col, overflow="fold")
    for t in report.tensors:
        same = "yes" if t.identical else ("no" if t.comparable else "shape differs")
        table.add_row(t.name, same, str(t.differing), _num(t.max_abs), _num(t.max_rel),
                      _num(t.max_ulp), str(t.nan_mismatch))
    out.print(table)
    out.print("identical" if report.identical else "DIFFERENT")
    return EXIT_OK if report.identical else EXIT_PROBLEM


# ---------------------------------------------------------------------------------- convert


def _check_target(path: str, force: bool) -> None:
    if os.path.lexists(path) and not force:
        raise UsageError(f"{path} exists; pass --force to replace it")


def _compression_arg(value: str | None) -> Any:
    if value in (None, "none"):
        return None
    if value.startswith("gzip:"):
        return ("gzip", int(value.split(":", 1)[1]))
    return value


def cmd_convert(args: argparse.Namespace) -> int:
    from .interop.convert import convert

    _check_target(args.dst, args.force)
    layout = convert(args.src, args.dst, src_format=args.src_format, dst_format=args.dst_format,
                     compression=_compression_arg(args.compression),
                     chunk_bytes=args.chunk_bytes, progress=None if args.progress else False,
                     tensors_only=args.tensors_only)
    print(f"converted {len(layout)} tensor{'' if len(layout) == 1 else 's'} "
          f"({_size(layout.nbytes)}): {args.src} -> {args.dst}",
          file=sys.stderr)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from .interop.convert import open_input
    from .interop.torchlean import encode_state_json
    from .interop.torchlean_bridge import state_json_of

    if not args.json:
        raise UsageError("choose an export form: --json (use 'convert' for other file formats)")
    with open_input(args.checkpoint) as inp:
        text = encode_state_json(state_json_of(inp.layout, inp.read_words))
    if args.output in (None, "-"):
        sys.stdout.buffer.write(text + b"\n")
        sys.stdout.flush()
    else:
        _check_target(args.output, args.force)
        from .interop.torchlean import STATE_JSON_FILE, atomic_write

        atomic_write(args.output, [text], STATE_JSON_FILE)
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from .interop.convert import open_input, write_output

    _check_target(args.dst, args.force)
    if args.src == "-":
        import tempfile

        data = sys.stdin.buffer.read()
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "stdin.json"
            src.write_bytes(data)
            with open_input(src, "torchlean-json") as inp:
                write_output(inp, args.dst, args.dst_format)
    else:
        with open_input(args.src, args.src_format) as inp:
            write_output(inp, args.dst, args.dst_format)
    return EXIT_OK


# ---------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from .interop.convert import FORMATS

    parser = argparse.ArgumentParser(
        prog="lean-store",
        description="Inspect, verify, compare and convert lean_store checkpoints (HDF5/Zarr).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"lean_store {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, help: str, example: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=f"example:\n  {example}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p = add("inspect", "Show the tensors of a checkpoint.", "lean-store inspect run.h5 --stats")
    p.add_argument("checkpoint")
    p.add_argument("--stats", action="store_true",
                   help="add exact min/max/mean and NaN/inf counts (reads every tensor, streamed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = add("verify", "Check the layout and every checksum; exit 1 naming any bad tensor.",
            "lean-store verify run.zarr")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)

    p = add("diff", "Compare two checkpoints, or a checkpoint and any file 'convert' reads "
            "(safetensors, a Hugging Face model directory, .pt); exit 0 only when identical.",
            "lean-store diff model.safetensors model.h5")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_diff)

    p = add("convert", "Convert between lean_store, safetensors, torch and TorchLean files.",
            "lean-store convert model.safetensors model.h5")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--from", dest="src_format", choices=FORMATS, help="input format")
    p.add_argument("--to", dest="dst_format", choices=FORMATS, help="output format")
    p.add_argument("--compression", help="weights (both: Blosc shuffle+zstd); hdf5: "
                   "weights-gzip (no plugin needed), gzip, gzip:LEVEL, lzf; zarr: zstd, gzip, "
                   "blosc")
    p.add_argument("--chunk-bytes", type=int, help="chunk size for hdf5/zarr outputs")
    p.add_argument("--tensors-only", action="store_true",
                   help="drop a training checkpoint's or checkpoint dict's plain data (step, "
                        "hyperparameters, epochs) and write its tensors alone")
    p.add_argument("--force", action="store_true",
                   help="replace DST if it is a file of the kind written")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (default: a bar on a terminal for big inputs)")
    p.set_defaults(func=cmd_convert)

    p = add("export", "Write a checkpoint as TorchLean's exact JSON state text.",
            "lean-store export run.h5 --json -o state.json")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="TorchLean Checkpoint.State JSON")
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.add_argument("--force", action="store_true",
                   help="replace the output if it is TorchLean JSON state")
    p.set_defaults(func=cmd_export)

    p = add("import", "Make a lean_store checkpoint from TorchLean JSON state (or any input).",
            "lean-store import state.json run.h5")
    p.add_argument("src", help="input file, or - for JSON state on stdin")
    p.add_argument("dst", help="output checkpoint (.h5 or .zarr)")
    p.add_argument("--from", dest="src_format", choices=FORMATS, help="input format")
    p.add_argument("--to", dest="dst_format", choices=FORMATS, help="output format")
    p.add_argument("--force", action="store_true",
                   help="replace DST if it is a file of the kind written")
    p.set_defaults(func=cmd_import)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_CLOSED_PIPE
    except UsageError as exc:
        print(f"lean-store {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (IntegrityError, LayoutError) as exc:
        print(f"lean-store {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    except CheckpointError as exc:
        print(f"lean-store {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (OSError, ValueError, KeyError) as exc:
        print(f"lean-store {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        if os.environ.get("LEAN_STORE_DEBUG"):
            traceback.print_exc()
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"lean-store {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the command line never shows a traceback
        print(f"lean-store {args.command}: unexpected error: {type(exc).__name__}: "
              f"{_one_line(exc)} (set LEAN_STORE_DEBUG=1 for a traceback)", file=sys.stderr)
        if os.environ.get("LEAN_STORE_DEBUG"):
            traceback.print_exc()
        return EXIT_ERROR


def _stdout_to_devnull() -> None:
    """Send what is still buffered for the closed pipe nowhere, so that the interpreter's
    exit does not fail on it (the recipe of Python's signal module documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (a test's StringIO)
        pass


def _one_line(exc: BaseException, limit: int = 500) -> str:
    """The first line of an exception's message, at most ``limit`` characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else "(no message)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["build_parser", "main"]
