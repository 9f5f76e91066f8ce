"""`inspect PATH` and `verify PATH`: a checkpoint's summary, and a full read that checks every byte.

For the tiered-bench CLI (tiered/cli.py), either::

    from tiered.checkpoint.cli import command_specs
    for spec in command_specs():
        register(Command(**spec))          # fields: name, summary, description, examples, add_arguments, run

or, for any argparse parser, ``add_cli(subparsers)`` (each subparser gets ``run`` as a default: call
``args.run(args)`` for the exit code). ``python -m tiered.checkpoint inspect PATH`` works on its own.

Exit codes, as tiered-bench's (tiered/cli.py): 0 fine; 2 not a usable checkpoint: none there, damaged (verify
found a bad file; inspect a missing or wrong-sized one), or not one this version reads (a manifest or shard map
with a name, number or nesting no tiered writes, a file or rank folder that is a link), or an empty PATH (a usage
error: an unset variable, which would name the current folder); 1 a read that failed
for another reason (the I/O configuration, say). Errors are one line on stderr (a damaged checkpoint's adds a
line per bad file), never a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..interrupts import reader_gone
from .errors import CheckpointCorruptError, CheckpointError
from .fsops import readable
from .manifest import ELEMENT_BYTES, FORMAT, ROW_FILES, VERSION
from .reader import CheckpointReader
from .reshard import Parts
from .shardmap import is_sharded, rank_dir
from .validate import checkpoint_path
from .verify import verify_files

SHOW_PARAMS = 20  # params listed in the text summary; --json lists all


def inspect_checkpoint(path: str) -> dict[str, Any]:
    """Summary of a checkpoint from its manifest (of each rank's part, for one sharded across ranks), without
    reading the data: step, parameters (name, shape, dtype, step), files (size, crc32, segments), param
    groups, and ``problems`` (files missing or of the wrong size). For a sharded one the figures are the
    whole checkpoint's: global shapes, and ``numel`` and ``bytes`` summed over the parts. Raises
    CheckpointNotFoundError / CheckpointFormatError / CheckpointCorruptError (a damaged manifest)."""
    path = readable(checkpoint_path(path))  # an interrupted overwrite's aside put back first, or read where it is
    if is_sharded(path):
        return _inspect_sharded(path)
    return _summary(CheckpointReader(path, check_sizes=False))


def _summary(r: CheckpointReader) -> dict[str, Any]:
    m = r.manifest
    return {
        "path": r.path,
        "format": FORMAT,
        "version": VERSION,
        "step": m.step,
        "created": _iso(m.created_unix),
        "created_unix": m.created_unix,
        "versions": m.versions,
        "source": m.source,
        "num_params": len(m.params),
        "numel": m.numel,
        "state_bytes": len(ROW_FILES) * m.numel * ELEMENT_BYTES,
        "bytes": m.nbytes,
        "params": [
            {
                "name": p.name,
                "shape": list(p.shape),
                "dtype": p.dtype,
                "numel": p.numel,
                "group": p.group,
                "step": p.step,
            }
            for p in m.params
        ],
        "param_groups": m.param_groups,
        "has_scheduler": m.has_scheduler,
        "extra_keys": m.extra_keys,
        "files": {
            name: {"nbytes": f.nbytes, "crc32": f"{f.crc32:#010x}", "segments": len(f.segments)}
            for name, f in m.files.items()
        },
        "problems": [f"{file}: {what}" for file, what in r.size_problems()],
    }


def verify_checkpoint(path: str, *, io: Any = None) -> dict[str, Any]:
    """Read every file of the checkpoint and check every CRC segment (and the manifest's own CRC).

    Returns ``{"ok": True, "path", "step", "bytes", "seconds", "gbps", "files"}``; raises
    CheckpointCorruptError listing every missing, truncated or corrupted file, or CheckpointNotFoundError.
    """
    path = readable(checkpoint_path(path))  # as inspect_checkpoint
    if is_sharded(path):  # the map, then every rank's part, each as a checkpoint of its own and against the map
        root = os.path.abspath(path)
        parts = []
        with Parts(root) as opened:  # the map and every part through one descriptor: one checkpoint
            for k in range(len(opened.held)):
                r = opened.reader(k, check_sizes=False)
                parts.append({**verify_files(r, io), "step": r.manifest.step, "num_params": len(r.manifest.params)})
                r.close()
        dirs = [rank_dir(k) for k in range(len(parts))]
        files = {f"{d}/{name}": f for d, part in zip(dirs, parts) for name, f in part["files"].items()}
        seconds = sum(p["seconds"] for p in parts)
        nbytes = sum(p["bytes"] for p in parts)
        return {"ok": True, "path": root, "step": parts[0]["step"], "bytes": nbytes,
                "seconds": seconds, "gbps": nbytes / max(seconds, 1e-9) / 1e9, "files": files,
                "num_params": parts[0]["num_params"], "ranks": len(parts)}  # fmt: skip
    r = CheckpointReader(path, check_sizes=False)
    out = verify_files(r, io)
    return {**out, "step": r.manifest.step, "num_params": len(r.manifest.params)}


def _inspect_sharded(path: str) -> dict[str, Any]:
    root = os.path.abspath(path)
    with Parts(root) as opened:
        shards = opened.shards
        if shards is None:  # replaced by a single-process checkpoint since is_sharded(path) looked
            return _summary(CheckpointReader(root, check_sizes=False))
        parts = [_summary(opened.reader(k, check_sizes=False)) for k in range(shards.world_size)]
    first = parts[0]
    shapes = {s.name: list(s.shape) for s in shards.ranks[0]}
    numel: dict[str, int] = {}
    for part in parts:  # each rank holds some rows of every parameter: the whole is their sum
        for p in part["params"]:
            numel[p["name"]] = numel.get(p["name"], 0) + p["numel"]
    params = [{**p, "shape": shapes[p["name"]], "numel": numel[p["name"]]} for p in first["params"]]  # global
    dirs = [rank_dir(k) for k in range(len(parts))]
    return {**first, "path": root, "ranks": len(parts), "params": params, "bytes": sum(p["bytes"] for p in parts),
            "numel": sum(p["numel"] for p in parts), "state_bytes": sum(p["state_bytes"] for p in parts),
            "files": {f"{d}/{n}": f for d, part in zip(dirs, parts) for n, f in part["files"].items()},
            "problems": [f"{d}: {x}" for d, part in zip(dirs, parts) for x in part["problems"]]}  # fmt: skip


# ---------------------------------------------------------------------------------------- rendering
def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def render_inspect(s: dict[str, Any]) -> str:
    from io_engine import format_size

    v = s["versions"]
    lines = [
        f"checkpoint  {s['path']}" + (f" ({s['ranks']} ranks' shards)" if "ranks" in s else ""),
        f"saved       {s['created']} by tiered {v.get('tiered', '?')}, torch {v.get('torch', '?')}",
        f"step        {s['step']}",
        f"state       {s['num_params']} parameters, {s['numel']:,} elements: {format_size(s['state_bytes'])} of fp32 "
        "master, exp_avg, exp_avg_sq",
        f"scheduler   {'saved' if s['has_scheduler'] else 'none'}",
        f"extra       {', '.join(s['extra_keys']) or 'none'}",
        "param groups",
    ]
    for i, g in enumerate(s["param_groups"]):
        lines.append(f"  {i}: " + " ".join(f"{k}={g[k]}" for k in sorted(g)))
    lines.append("files")
    for name, f in s["files"].items():
        plural = "s" if f["segments"] != 1 else ""
        lines.append(f"  {name:<16}{format_size(f['nbytes']):>12}  crc32 {f['crc32']}  {f['segments']} segment{plural}")
    shown = s["params"][:SHOW_PARAMS]
    more = "; --json lists all" if len(shown) < s["num_params"] else ""
    lines.append(f"params ({len(shown)} of {s['num_params']}{more})")
    width = max([len(p["name"]) for p in shown] + [4])
    lines.append(f"  {'name':<{width}}  {'shape':<18}{'dtype':<10}{'group':>5}{'step':>8}")
    for p in shown:
        lines.append(f"  {p['name']:<{width}}  {str(p['shape']):<18}{p['dtype']:<10}{p['group']:>5}{p['step']:>8}")
    lines.append(
        "problems    "
        + (
            "; ".join(s["problems"])
            if s["problems"]
            else "none found from file sizes (`verify` reads and checks every byte)"
        )
    )
    return "\n".join(lines)


def render_verify(s: dict[str, Any]) -> str:
    from io_engine import format_size

    segs = sum(f["segments"] for f in s["files"].values())
    ranks = f" ({s['ranks']} ranks)" if "ranks" in s else ""
    return (
        f"OK  {s['path']}{ranks}: step {s['step']}, {len(s['files'])} files, {format_size(s['bytes'])}; all {segs} "
        f"crc32 segments match ({s['seconds']:.3f} s, {s['gbps']:.2f} GB/s)"
    )


# -------------------------------------------------------------------------------------------- argparse
def _add_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", metavar="PATH", help="checkpoint folder (holding manifest.json, or shards.json and a part a rank)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document (every parameter) instead of text")


_add_verify = _add_inspect


def run_inspect(args: argparse.Namespace) -> int:
    if _empty(args):
        return 2
    try:
        s = inspect_checkpoint(args.path)
    except (CheckpointError, OSError) as e:
        return _fail(args, e)
    print(json.dumps(s, indent=1) if args.json else render_inspect(s))
    return 2 if s["problems"] else 0


def run_verify(args: argparse.Namespace) -> int:
    from io_engine import IOConfig, hugepages

    if _empty(args):
        return 2
    try:  # the environment's configuration first: a bad one is its own error (exit 1), not the checkpoint's
        io = IOConfig.from_env()
        hugepages.from_env()  # read by the buffers verify makes: else a traceback from the first one
    except (ValueError, OSError) as e:
        return _fail(args, e)
    try:
        s = verify_checkpoint(args.path, io=io)
    except (CheckpointError, OSError) as e:
        return _fail(args, e)
    print(json.dumps(s, indent=1) if args.json else render_verify(s))
    return 0


def _empty(args: argparse.Namespace) -> bool:
    """Whether PATH is empty (``""``: an unset variable), said as a usage error is, argparse's and tiered-bench's
    (tiered/cli.py): one line, exit code 2, nothing read. It would otherwise name the current folder."""
    try:
        checkpoint_path(args.path)
    except ValueError as e:
        print(f"{getattr(args, 'prog_name', 'tiered-bench')}: error: {e}", file=sys.stderr)
        return True
    return False


def _fail(args: argparse.Namespace, e: Exception) -> int:
    """Report ``e`` (a CheckpointError, another OSError of a read, or the ValueError of a bad
    ``$TIERED_IO_CONFIG`` or ``$TIERED_HUGE_PAGES``) and return the exit code."""
    said = _denied(e) if isinstance(e, PermissionError) and not isinstance(e, CheckpointError) else str(e)
    if args.json:  # the path as a success reports it: absolute
        problems = [f"{f}: {w}" for f, w in e.problems] if isinstance(e, CheckpointCorruptError) else [said]
        print(json.dumps({"ok": False, "path": os.path.abspath(args.path), "error": type(e).__name__,
                          "problems": problems}, indent=1))  # fmt: skip
    text = e.report if isinstance(e, CheckpointCorruptError) else said  # no advice to run this very command
    print(f"{getattr(args, 'prog_name', 'tiered-bench')}: {type(e).__name__}: {text}", file=sys.stderr)
    return 2 if isinstance(e, CheckpointError) else 1


def _denied(e: PermissionError) -> str:
    """A folder this user may not open (its mode, its owner): the checkpoint may be whole, so no advice to load
    another one, as for a damaged file; what to change instead."""
    return (f"this user may not read {e.filename or 'the checkpoint'} ({e.strerror or e}); nothing says the "
            "checkpoint is damaged: give this user read access to the folder and its files, or read it as their "
            "owner")  # fmt: skip


def command_specs() -> list[dict[str, Any]]:
    """The two subcommands, as the fields of tiered.cli.Command."""
    return [
        dict(
            name="inspect",
            summary="summary of a checkpoint: step, parameters, files and their crc32",
            description="Reads a checkpoint's manifest (not its data) and prints the step, every parameter's "
            "name, shape, dtype and step count, the param groups, and each file's size, crc32 and segment "
            "count; a missing or wrong-sized file is listed as a problem (exit code 2).",
            examples="examples:\n  tiered-bench inspect ckpt/step-1000\n  tiered-bench inspect ckpt/step-1000 --json",
            add_arguments=_add_inspect,
            run=run_inspect,
        ),
        dict(
            name="verify",
            summary="read a checkpoint in full and check every crc32 segment",
            description="Reads every file of a checkpoint through io_engine and checks each CRC-32 segment "
            "against the manifest (of every rank's part, and against the map of the shards, for a checkpoint "
            "saved by several ranks). Exit code 0: intact; 2: damaged (every bad file is named), no checkpoint "
            "there, or one no tiered writes (a file name outside the checkpoint, a bad number, rows that do not "
            "tile a parameter, a link); 1: a read failed for another reason.",
            examples="examples:\n  tiered-bench verify ckpt/step-1000\n  tiered-bench verify ckpt/step-1000 --json",
            add_arguments=_add_verify,
            run=run_verify,
        ),
    ]


def add_cli(subparsers: Any) -> None:
    """Register `inspect PATH [--json]` and `verify PATH [--json]` on an argparse subparsers object."""
    for spec in command_specs():
        p = subparsers.add_parser(
            spec["name"],
            help=spec["summary"],
            description=spec["description"],
            epilog=spec["examples"],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        spec["add_arguments"](p)
        p.set_defaults(run=spec["run"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tiered.checkpoint", description="Inspect or verify a tiered checkpoint."
    )
    add_cli(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    args.prog_name = parser.prog
    try:
        return int(args.run(args))
    except BrokenPipeError:  # `... verify PATH | head` after head has exited: nothing lost, nothing to say
        return reader_gone()
    except KeyboardInterrupt:  # Ctrl-C during a long verify: a checkpoint is only read, so nothing to undo
        print(f"\n{parser.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
