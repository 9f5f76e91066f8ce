"""`tiered-bench`: what this machine's disk, PCIe link and optimizer step can do, and a tuned IOConfig.

The entry point only: the parser, the default command and the exit codes. Each subcommand is a `Command`
in the `COMMANDS` registry: a function that adds its arguments and one that runs it and returns the exit
code. The measuring ones (`tour`, `io`, `pcie`, `optim`, `tune`) and the capacity calculator (`plan`) come
from `tiered.bench.commands`, the checkpoint tools (`inspect`, `verify`) from `tiered.checkpoint.cli`.
They are registered when `main` first builds the parser, not when this module is imported. Importing
`tiered.checkpoint` imports torch (through io_engine), so `--help` and argument errors take a few seconds
(the time of `import torch`); a Ctrl-C meanwhile ends the run as one during a measurement does ("interrupted",
exit code 130), without a traceback.

Exit codes: 0 done; 1 a measurement failed (I/O error, --validate mismatch, optimizer missing);
2 bad arguments or an unusable folder (nothing is left behind); 130 interrupted (files removed); 141 the output
was closed before it was all written (``| head``), silently, as a tool killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

PROG = "tiered-bench"
DEFAULT_COMMAND = "tour"


@dataclass(frozen=True)
class Command:
    """One subcommand. `add_arguments(parser)` declares its flags; `run(args) -> exit code` does it."""

    name: str
    summary: str  # one line, shown in `tiered-bench --help`
    description: str
    examples: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(cmd: Command) -> Command:
    """Add a subcommand. A module that brings subcommands gives their fields (`command_specs()`), and
    `_register_commands` below registers each as `Command(**spec)`."""
    if cmd.name in COMMANDS:
        raise ValueError(f"subcommand {cmd.name!r} is registered twice")
    COMMANDS[cmd.name] = cmd
    return cmd


def _register_commands() -> None:
    # The measuring commands live beside what they measure; `inspect` and `verify` beside the checkpoint
    # format they read. `tour` comes first: it is the default. Once: build_parser calls it.
    if COMMANDS:
        return
    from tiered.bench.commands import command_specs as bench_commands
    from tiered.bench.kv import command_spec as kv_command
    from tiered.checkpoint.cli import command_specs as checkpoint_commands

    for spec in (*bench_commands(), *checkpoint_commands(), kv_command()):
        register(Command(**spec))


# -------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    _register_commands()
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Measure what this machine's disk, PCIe link and offloaded optimizer step can do.",
        epilog="examples:\n"
        "  tiered-bench                         # the tour (default): io, pcie, optim at small size\n"
        "  tiered-bench io --dir /mnt/nvme/tmp --size 4GiB\n"
        "  tiered-bench tune --dir /mnt/nvme/tmp --out tiered-io.json\n"
        "  tiered-bench optim --params 50M --host-budget 256MiB --json\n"
        "  tiered-bench pcie\n"
        "  tiered-bench plan --params 13B --gpu 141GB --ram 125GiB --disk 64GB\n"
        "  tiered-bench verify ckpt/step-1000\n\n"
        "Figures: GB/s = 10^9 bytes/s; sizes accept 4GiB, 512MiB, 1MB. Run `tiered-bench COMMAND --help`.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for cmd in COMMANDS.values():
        p = sub.add_parser(
            cmd.name,
            help=cmd.summary,
            description=textwrap.fill(cmd.description, 100),
            epilog=cmd.examples,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd.add_arguments(p)
    return parser


def _version() -> str:
    try:
        from ._version import __version__
    except ImportError:
        return "unknown"
    return __version__


def _with_default_command(argv: list[str]) -> list[str]:
    """`tiered-bench` and `tiered-bench --json` mean the tour; `--help`/`--version` stay top-level."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        return [DEFAULT_COMMAND, *argv]
    return argv


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C: the Workspace removes its files on the way out


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()  # imports the commands' modules, torch among them: seconds
    except KeyboardInterrupt:  # nothing was made yet
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(_with_default_command(list(sys.argv[1:] if argv is None else argv)))
    from tiered.bench.common import BenchFailure, UsageError

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted; temporary files removed", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): not a failed measurement
        from tiered.interrupts import reader_gone

        return reader_gone()
    except (BenchFailure, OSError) as e:  # a failed measurement (disk full, bad data): the message says what
        if os.environ.get("TIERED_BENCH_DEBUG"):
            raise
        print(f"{PROG}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
