"""The subcommands of `tiered-bench` that measure, `tour`, `io`, `pcie`, `optim`, `tune`, and `plan`, which
computes (plan.py).

`command_specs()` gives each as the fields of `tiered.cli.Command` (as tiered/checkpoint/cli.py does for
`inspect` and `verify`): a function that adds its flags to an argparse parser, and one that runs it and
returns the exit code. The measuring itself is in the other modules of this package; only argument
parsing, the options objects and the output happen here. The measuring modules (torch, io_engine) are
imported when a command runs; the help of the sweep's flags reads its grids from io_types (which imports
io_engine), and tiered/cli.py's parser imports tiered.checkpoint too, so `--help` waits for `import torch`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from . import arg_types
from .common import DEFAULT_DIR, UsageError, check_env


# ------------------------------------------------------------------------------ shared flag groups
def _add_output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of tables")
    g.add_argument("--plot", metavar="FILE.png", help="also draw a bandwidth chart (needs matplotlib)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress lines or bars on stderr")


def _add_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        default=DEFAULT_DIR,
        help="folder on the disk to measure; created if missing; every file (and the folder, if this run "
        "created it and no other run still uses it then) is removed afterwards (default: %(default)s)",
    )


def _add_sweep(p: argparse.ArgumentParser, *, size: str | None, grid: str, baselines: bool = True) -> None:
    """``size``: the file size by default (None: the grid's); ``grid``: "quick" (with a ``--full`` flag for
    the whole grid) or "full" (``tune``, whose file outlasts the run)."""
    from .io_types import FULL_SWEEP, QUICK_BUDGET_S, QUICK_SWEEP

    def sizes(g: Any) -> str:
        return ",".join(f"{b >> 20}MiB" for b in g.block_sizes)

    def counts(g: Any) -> str:
        return ",".join(map(str, g.threads))

    def mib(n: int) -> str:
        return f"{n >> 30}GiB" if n % (1 << 30) == 0 else f"{n >> 20}MiB"

    q, f = QUICK_SWEEP, FULL_SWEEP
    p.set_defaults(sweep_grid=grid, sweep_size=size)
    g = p.add_argument_group("io sweep")
    if grid == "quick":
        g.add_argument(
            "--full", action="store_true",
            help=f"sweep the whole grid: block sizes {sizes(f)} x threads {counts(f)}"
            + ("" if size else f" on a {mib(f.size)} file") + " (minutes; the default takes under one)",
        )  # fmt: skip
        size_help = size or f"{mib(q.size)}; --full {mib(f.size)}"
        blocks_help, threads_help = f"{sizes(q)}; --full {sizes(f)}", f"{counts(q)}; --full {counts(f)}"
    else:
        size_help, blocks_help, threads_help = size or mib(f.size), sizes(f), counts(f)
    g.add_argument("--size", type=arg_types.size, default=None, help=f"test file size, e.g. 4GiB (default {size_help})")
    g.add_argument(
        "--block-sizes", type=arg_types.size_list, default=None, metavar="LIST", help=f"default {blocks_help}"
    )
    g.add_argument("--threads", type=arg_types.int_list, default=None, metavar="LIST", help=f"default {threads_help}")
    g.add_argument(
        "--depths",
        type=arg_types.int_list,
        default=None,
        metavar="LIST",
        help="IOConfig.queue_depth values (tasks queued in the engine; default: the engine's default only)",
    )
    g.add_argument(
        "--direct",
        choices=("auto", "on", "off"),
        default="auto",
        help="O_DIRECT: auto falls back to buffered I/O with a note where the filesystem refuses it (tmpfs)",
    )
    g.add_argument(
        "--submit",
        choices=("threads", "aio"),
        default="threads",
        help="IOConfig.submit: a blocking call a thread (default), or Linux kernel AIO from one thread with "
        "--threads requests in flight, as DeepSpeed's libaio handle",
    )
    always = "; the first configuration's layout, warm-up and first timed pass always run"
    budget_help = (f"seconds for the sweep and its baselines: configurations, loops and baselines that would end "
                   f"later are left out, with a note{always} (default {QUICK_BUDGET_S:.0f}; with --full none; 0: "
                   "none)" if grid == "quick" else "seconds for the sweep and its baselines: what would end later is "
                   f"left out, with a note{always} (default: none)")  # fmt: skip
    g.add_argument("--budget", type=arg_types.seconds, default=None, metavar="SECONDS", help=budget_help)
    g.add_argument(
        "--warmup", type=arg_types.nonneg, default=1, help="untimed iterations per configuration (default 1)"
    )
    g.add_argument("--loops", type=arg_types.positive, default=3, help="timed iterations per configuration (default 3)")
    g.add_argument("--validate", action="store_true", help="read every file back once more and check its bytes")
    if baselines:
        g.add_argument("--no-fio", dest="fio", action="store_false", help="skip the fio comparison even if fio exists")
        g.add_argument("--aiofiles", action="store_true", help="add the aiofiles `await f.read(n)` comparison row")


def _io_options(args: argparse.Namespace) -> Any:
    from .io_types import FULL_SWEEP, QUICK_BUDGET_S, QUICK_SWEEP, IoOptions

    defaults = IoOptions()
    grid = FULL_SWEEP if args.sweep_grid == "full" or getattr(args, "full", False) else QUICK_SWEEP
    budget = getattr(args, "budget", None)
    if budget is None:
        budget = QUICK_BUDGET_S if grid is QUICK_SWEEP else None
    elif budget == 0:
        budget = None
    size = args.size if args.size is not None else arg_types.size(args.sweep_size) if args.sweep_size else grid.size
    return IoOptions(
        dir=args.dir,
        size=size,
        block_sizes=args.block_sizes or grid.block_sizes,
        threads=args.threads or grid.threads,
        depths=args.depths or defaults.depths,
        direct=args.direct,
        submit=args.submit,
        warmup=args.warmup,
        loops=args.loops,
        validate=args.validate,
        fio=getattr(args, "fio", False),  # commands without the baseline flags run no baselines
        aiofiles=getattr(args, "aiofiles", False),
        progress=not args.quiet,
        budget_s=budget,
        # The grid's winners first, unless the user named the block sizes or threads (then their order).
        first=grid.first if not (args.block_sizes or args.threads) else (),
    )


def _emit(args: argparse.Namespace, command: str, result: Any, render: Callable[[Any], str]) -> int:
    from . import report

    print(report.to_json(command, result) if args.json else render(result))
    if args.plot:
        report.plot(result, args.plot)
        if not args.json:
            print(f"\nchart written to {args.plot}")
    return 0


def _check_plot(args: argparse.Namespace) -> None:
    if args.plot:
        from .report import require_plotting

        require_plotting(args.plot)


# ------------------------------------------------------------------------------------- subcommands
def _add_io(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    _add_sweep(p, size=None, grid="quick")
    _add_output(p)


def _sweep(args: argparse.Namespace) -> Any:
    """The io sweep of `io` and `tune`: every argument is checked before a folder is made."""
    from .disk import run_io
    from .workspace import Workspace

    _check_plot(args)
    opts = _io_options(args)
    opts.configs()
    check_env()
    with Workspace(args.dir) as ws:
        return run_io(opts, ws)


def _run_io(args: argparse.Namespace) -> int:
    from . import report

    return _emit(args, "io", _sweep(args), report.render_io)


def _add_tune(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument(
        "--out", default="./tiered-io.json", help="where to write the best IOConfig as JSON (default: %(default)s)"
    )
    _add_sweep(p, size=None, grid="full")
    _add_output(p)


def _run_tune(args: argparse.Namespace) -> int:
    from .tune import check_out, render_tune, write_tune

    out = check_out(args.out)  # before the sweep spends minutes
    return _emit(args, "tune", write_tune(_sweep(args), out), render_tune)


def _add_pcie(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=arg_types.size, default="1GiB", help="bytes per copy (default 1GiB)")
    p.add_argument("--warmup", type=arg_types.nonneg, default=1, help="untimed copies per test (default 1)")
    p.add_argument("--loops", type=arg_types.positive, default=5, help="timed copies per test (default 5)")
    p.add_argument("--device", type=arg_types.nonneg, default=0, help="CUDA device index (default 0)")
    _add_output(p)


def _run_pcie(args: argparse.Namespace) -> int:
    from . import report
    from .pcie import PcieOptions, run_pcie

    _check_plot(args)
    opts = PcieOptions(
        size=args.size, warmup=args.warmup, loops=args.loops, device=args.device, progress=not args.quiet
    )
    return _emit(args, "pcie", run_pcie(opts), report.render_pcie)


def _add_optim(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    g = p.add_argument_group("optimizer step")
    g.add_argument("--params", type=arg_types.count, default="50M", help="synthetic fp32 parameters (default 50M)")
    g.add_argument("--host-budget", type=arg_types.size, default="256MiB", help="pinned host bytes (default 256MiB)")
    g.add_argument("--gpu-budget", type=arg_types.size, default=0, help="HBM bytes for state (default 0)")
    g.add_argument(
        "--chunk-bytes", type=arg_types.size, default=None, help="state bytes per chunk (default: the optimizer's)"
    )
    g.add_argument("--steps", type=arg_types.positive, default=3, help="timed steps (default 3)")
    g.add_argument("--warmup-steps", type=arg_types.nonneg, default=1, help="untimed steps first (default 1)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where the parameters live")
    g.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="the parameters' dtype (bf16: fp32 masters)"
    )
    g.add_argument(
        "--split-masters", choices=("auto", "on", "off"), default="auto",
        help="with --dtype bf16: split the fp32 masters (auto: the optimizer's default)",
    )  # fmt: skip
    g.add_argument(
        "--update-on", choices=("auto", "host", "device"), default="auto",
        help="where AdamW runs (auto: the parameters' device)",
    )  # fmt: skip
    g.add_argument(
        "--nproc", type=arg_types.positive, default=1,
        help="ranks stepping at once on the disk, each with params/N of the parameters, so at most --params (gloo "
        "on CPU, NCCL on GPUs)",
    )  # fmt: skip
    _add_sweep(p, size="1GiB", grid="quick", baselines=False)
    _add_output(p)


def _run_optim(args: argparse.Namespace) -> int:
    from . import report
    from .optim import OptimOptions, run_optim
    from .workspace import Workspace

    _check_plot(args)
    io_opts = _io_options(args)
    io_opts.configs()
    opts = OptimOptions(
        params=args.params,
        host_budget=args.host_budget,
        gpu_budget=args.gpu_budget,
        chunk_bytes=args.chunk_bytes,
        steps=args.steps,
        warmup=args.warmup_steps,
        device=args.device,
        dtype=args.dtype,
        split_masters={"auto": None, "on": True, "off": False}[args.split_masters],
        update_on=args.update_on,
        nproc=args.nproc,
        io=io_opts,
        progress=not args.quiet,
    )
    opts.check()
    check_env()
    with Workspace(args.dir) as ws:
        result = run_optim(opts, ws)
    return _emit(args, "optim", result, report.render_optim)


def _add_tour(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument(
        "--size", type=arg_types.size, default="256MiB", help="io test file size (default 256MiB, at least 8MiB)"
    )
    p.add_argument("--no-fio", dest="fio", action="store_false", help="skip the fio comparison even if fio exists")
    _add_output(p)


def _run_tour(args: argparse.Namespace) -> int:
    from . import report
    from .tour import TourOptions, run_tour

    _check_plot(args)
    check_env()
    result = run_tour(TourOptions(dir=args.dir, size=args.size, fio=args.fio, progress=not args.quiet))
    return _emit(args, "tour", result, report.render_tour)


def _add_plan(p: argparse.ArgumentParser) -> None:
    from .plan import Assumptions

    d = Assumptions()
    model = p.add_mutually_exclusive_group()
    model.add_argument("--params", type=arg_types.count, default=None, help="a model to check, e.g. 13B, 6.7B, 350M")
    model.add_argument(
        "--config", default=None, metavar="PATH",
        help="a model to check, from its Hugging Face config.json (or the folder holding it): its parameter count "
        "and, with the parameters offloaded, its window, counted exactly for Llama, Mistral, Qwen2, Qwen3, Mixtral "
        "and Gemma",
    )  # fmt: skip
    p.add_argument("--gpu", type=arg_types.size, required=True, help="one GPU's memory, e.g. 141GB, 24GB, 80GiB")
    p.add_argument("--ram", type=arg_types.size, required=True, help="the host's RAM, e.g. 125GiB")
    p.add_argument(
        "--disk", type=arg_types.size, required=True, help="free space on the NVMe for the state, e.g. 64GB, 1TB"
    )
    g = p.add_argument_group("assumptions (docs/capacity.md)")
    g.add_argument(
        "--activations", type=arg_types.size, default=None,
        help="GPU bytes for activations; yours to set: they depend on batch, sequence and checkpointing (default: a "
        "quarter of --gpu, at most 8GiB)",
    )  # fmt: skip
    g.add_argument(
        "--gpu-reserve", type=arg_types.size, default=d.gpu_reserve,
        help="GPU bytes for the CUDA context, workspaces and allocator slack (default 2GiB)",
    )  # fmt: skip
    g.add_argument(
        "--ram-reserve", type=arg_types.size, default=d.ram_reserve,
        help="host RAM left to the OS and the training process, outside pinned memory (default 8GiB)",
    )  # fmt: skip
    g.add_argument(
        "--chunk-bytes", type=arg_types.size, default=d.chunk_bytes, help="TieredOptimizer's chunk_bytes (64MiB)"
    )
    g.add_argument(
        "--offload-window", type=arg_types.size, default=None,
        help="with the parameters offloaded, GPU bytes of the blocks held whole at once: two decoder layers, one "
        f"layer's gradients, the embeddings and head with theirs (default: counted from --config, else "
        f"{d.offload_window // (1 << 30)}GiB; a 10B Llama with a 32K vocabulary takes 2.3 GB, Llama 3 8B with its "
        "128K one 5.5 GB, a 1B Llama under 1 GB)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def _run_plan(args: argparse.Namespace) -> int:
    from . import report
    from .model_shape import read_config
    from .plan import Assumptions, Box, plan
    from .plan_memory import default_activations

    try:
        box = Box(gpu=args.gpu, ram=args.ram, disk=args.disk)
        model = None if args.config is None else read_config(args.config)
        window = args.offload_window
        if window is None:
            window = Assumptions().offload_window if model is None else model.offload_window
        a = Assumptions(
            activations=default_activations(box.gpu) if args.activations is None else args.activations,
            gpu_reserve=args.gpu_reserve,
            ram_reserve=args.ram_reserve,
            chunk_bytes=args.chunk_bytes,
            offload_window=window,
        )
        result = plan(box, args.params, a, model=model, activations_default=args.activations is None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(report.to_json("plan", result, host=False) if args.json else report.render_plan(result))
    return 0


def command_specs() -> list[dict[str, Any]]:
    """The measuring subcommands, `tour` (the default) first, and `plan`, as the fields of tiered.cli.Command."""
    return [
        dict(
            name="tour",
            summary="the default: a 256 MiB io sweep, PCIe copies, one small optimizer step (under a minute)",
            description="A quick look at everything: io sweep on a small file, host<->GPU copies, one offloaded "
            "AdamW step against the disk floor. Runs when no subcommand is given.",
            examples="examples:\n  tiered-bench\n  tiered-bench --dir /mnt/nvme/tmp --json > tour.json",
            add_arguments=_add_tour,
            run=_run_tour,
        ),
        dict(
            name="io",
            summary="sequential read/write GB/s through io_engine: block size x threads sweep, vs fio",
            description="Sweeps block size x threads (x queue depth) with O_DIRECT, each configuration's file "
            "laid out once and then overwritten (as a step overwrites its state), median of --loops after "
            "--warmup, prints the best configuration, and compares with fio (when installed) in the same run. By "
            "default 2 block sizes x 3 thread counts on a 4 GiB file, within a 50-second budget (what would end "
            "later is left out, with a note); --full sweeps 3 x 4 with no budget. A line on stderr "
            "names each configuration and the time left.",
            examples="examples:\n"
            "  tiered-bench io --dir /mnt/nvme/tmp\n"
            "  tiered-bench io --dir /mnt/nvme/tmp --full\n"
            "  tiered-bench io --size 1GiB --block-sizes 1MiB,8MiB --threads 8,16 --validate\n"
            "  tiered-bench io --aiofiles --json > io.json\n"
            "  tiered-bench io --plot io.png",
            add_arguments=_add_io,
            run=_run_io,
        ),
        dict(
            name="pcie",
            summary="host<->GPU GB/s, pinned and pageable, one way and both ways at once",
            description="Copies --size bytes between host and GPU memory. Without CUDA it says so and exits 0.",
            examples="examples:\n  tiered-bench pcie\n  tiered-bench pcie --size 256MiB --json",
            add_arguments=_add_pcie,
            run=_run_pcie,
        ),
        dict(
            name="optim",
            summary="one offloaded AdamW step through TieredOptimizer, per phase, against the disk floor",
            description="Measures the io sweep, then steps a TieredOptimizer over --params synthetic parameters "
            "with the best IOConfig and --host-budget, and reports step time / (NVMe bytes read / read GB/s + "
            "bytes written / write GB/s). fio/aiofiles rows are off here unless asked for.",
            examples="examples:\n"
            "  tiered-bench optim --params 50M --host-budget 256MiB\n"
            "  tiered-bench optim --params 1B --host-budget 8GiB --dir /mnt/nvme/tmp --size 4GiB --json\n"
            "  tiered-bench optim --params 2B --nproc 2 --host-budget 2GiB --dir /mnt/nvme/tmp   # two ranks, one disk",
            add_arguments=_add_optim,
            run=_run_optim,
        ),
        dict(
            name="tune",
            summary="run the io sweep and write the best IOConfig to a JSON file",
            description="Runs the io sweep and writes the best configuration (fastest to read and then write the "
            "same bytes, as an optimizer step does) with IOConfig.to_file. Load it with IOConfig.from_file(PATH) "
            "or by setting TIERED_IO_CONFIG=PATH.",
            examples="examples:\n"
            "  tiered-bench tune --dir /mnt/nvme/tmp --out tiered-io.json\n"
            "  export TIERED_IO_CONFIG=$PWD/tiered-io.json",
            add_arguments=_add_tune,
            run=_run_tune,
        ),
        dict(
            name="plan",
            summary="how large a model this box can train: tiered against DeepSpeed's offloads (computed)",
            description="Computes, from the memory model in docs/capacity.md (not measured), the largest model "
            "each option trains on one GPU with the given RAM and free NVMe, and the constraint that binds it; "
            "with --params (or --config, a model's config.json), whether that model fits, with what host_budget "
            "and how many bytes on NVMe, and if not, what would. Sizes: 141GB = 141e9 bytes, 125GiB = 125 * 2^30; "
            "counts: 13B, 6.7B, 350M.",
            examples="examples:\n"
            "  tiered-bench plan --gpu 141GB --ram 125GiB --disk 64GB\n"
            "  tiered-bench plan --params 13B --gpu 141GB --ram 125GiB --disk 64GB --json\n"
            "  tiered-bench plan --params 7B --gpu 24GB --ram 64GiB --disk 1TB --activations 4GiB\n"
            "  tiered-bench plan --config ./Meta-Llama-3-8B/config.json --gpu 24GB --ram 64GiB --disk 1TB",
            add_arguments=_add_plan,
            run=_run_plan,
        ),
    ]
