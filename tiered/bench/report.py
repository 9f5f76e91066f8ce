"""How results leave the program: readable tables, stable JSON, and an optional bandwidth chart.

JSON: `{"schema": 1, "command": ..., "host": {...}, **fields of the result dataclass}`. The dataclasses
in the bench modules *are* the schema: renaming a field is a breaking change (tests/tools/test_cli.py pins
the key sets). Bandwidth is in GB/s (10**9 B/s), times in seconds, sizes in bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from pathlib import Path
from typing import Any

from io_engine import format_size

from .common import Stat, UsageError, host_info
from .io_types import IoResult, SweepRow
from .optim import TIME_PHASES, OptimResult
from .pcie import DIRECTIONS, KINDS, PcieResult
from .plan import GPU, HOST, NOTE, NVME, STATE, GiB, OptionPlan, PlanResult, budget_str, count_str, gb
from .tour import TourResult

SCHEMA = 1


# --------------------------------------------------------------------------------------------- JSON
def to_json(command: str, result: Any, *, host: bool = True) -> str:
    """``host``: name the machine it ran on (not for `plan`, which computes for the box it is given)."""
    doc = {
        "schema": SCHEMA,
        "command": command,
        **({"host": host_info()} if host else {}),
        **dataclasses.asdict(result),
    }
    return json.dumps(doc, indent=2)


# ------------------------------------------------------------------------------------------- tables
def table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = [headers, *rows]
    return "\n".join(
        indent + "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _cfg(block: int, threads: int) -> str:
    return f"block {format_size(block)}, {threads} threads"


def render_io(r: IoResult) -> str:
    mode = "O_DIRECT" if r.direct_effective else "buffered"
    if r.config.get("submit") == "aio":
        mode += " through kernel AIO from one thread (threads: requests in flight)"
    out = [
        f"io: {format_size(r.size_bytes)} file in {r.dir} ({r.filesystem}), {mode}, {r.request_bytes >> 20} MiB "
        f"requests; {r.warmup} warm-up + {r.loops} timed iterations a configuration, each an overwrite of one "
        f"laid-out file and a read back, median (min-max)"
    ]
    depths = len({row.queue_depth for row in r.sweep}) > 1
    fsync = r.direct_effective and all(row.fsync_s is not None for row in r.sweep)  # buffered: inside the write
    headers = ["block", "threads", *(["depth"] if depths else []), "read GB/s", "write GB/s"]
    headers += ["fsync after (ms)"] if fsync else []
    if any(row.validated for row in r.sweep):
        headers.append("validated")
    rows = []
    for row in r.sweep:
        cells = [format_size(row.block_size), str(row.threads)]
        cells += [str(row.queue_depth)] if depths else []
        cells += [row.read_gbps.spread(), row.write_gbps.spread()]
        cells += [f"{1000 * row.fsync_s.median:.1f}"] if fsync and row.fsync_s is not None else []
        cells += ["yes" if row.validated else "-"] if "validated" in headers else []
        rows.append(cells)
    out.append(table(headers, rows))
    out.append(f"  best read   {r.best_read.read_gbps:6.2f} GB/s  {_cfg(r.best_read.block_size, r.best_read.threads)}")
    out.append(
        f"  best write  {r.best_write.write_gbps:6.2f} GB/s  {_cfg(r.best_write.block_size, r.best_write.threads)}"
    )
    out.append(
        f"  best config (fastest to read and write the same bytes): {_cfg(r.best.block_size, r.best.threads)}, "
        f"read {r.best.read_gbps:.2f} / write {r.best.write_gbps:.2f} GB/s"
    )
    if r.fio is not None:
        f = r.fio
        out.append(
            f"  {f.version} ({f.ioengine}, iodepth {f.iodepth}): read {f.read_gbps.spread()} GB/s "
            f"(block {format_size(f.read_block_size)}), write {f.write_gbps.spread()} GB/s "
            f"(block {format_size(f.write_block_size)})"
        )
        out.append(f"  ours / fio  read {f.ours_over_fio_read:.2f}, write {f.ours_over_fio_write:.2f}")
    if r.aiofiles is not None:
        a = r.aiofiles
        out.append(
            f"  aiofiles (await f.read/write of {format_size(a.block_size)}): read {a.read_gbps.spread()} GB/s, "
            f"write {a.write_gbps.spread()} GB/s"
        )
        out.append(f"  aiofiles / ours  read {a.aiofiles_over_ours_read:.2f}, write {a.aiofiles_over_ours_write:.2f}")
    out += [f"  note: {n}" for n in r.notes]
    return "\n".join(out)


def render_pcie(r: PcieResult) -> str:
    if not r.available:
        return f"pcie: skipped. {r.reason}"
    by = {(row.memory, row.direction): row.gbps for row in r.rows}
    rows = [[k, *(by[(k, d)].spread() if (k, d) in by else "-" for d in DIRECTIONS)] for k in KINDS]
    return "\n".join(
        [
            f"pcie: {r.device}, {format_size(r.size_bytes)} copies, GB/s median (min-max) of {r.loops}",
            table(["host memory", "host->GPU", "GPU->host", "both ways (sum)"], rows),
        ]
    )


_PHASE_NAMES = {
    "clip_s": "clip",
    "read_wait_s": "read wait",
    "grad_d2h_s": "grads to host",
    "update_s": "update",
    "h2d_s": "params to device",
    "write_wait_s": "write wait",
    "drain_s": "waiting for updates backward started",
    "settle_s": "keeping what backward updated",
}


# The store's per-tier counters under names that say what they count. The store's "hit" is a pin that found
# the record in memory, read-ahead from NVMe included, so it is no measure of what the disk was spared: the
# per-step "not read from NVMe" figure is (the chunks' bytes less the NVMe bytes read).
_COUNTER_NAMES = {
    "hit_bytes": "in memory when pinned (read-ahead included)",
    "miss_bytes": "loaded while a pin waited",
    "made_bytes": "pinned buffers made",
    "bytes_read": "read",
    "bytes_written": "written (landed by the step's end)",
    "write_started_bytes": "written (begun in the step)",
}


def render_optim(r: OptimResult) -> str:
    out = []
    if r.io is not None:
        out += [render_io(r.io), ""]
    out.append(
        f"optim: {r.params:,} {r.dtype} params on {r.device}, state {format_size(r.state_bytes)} in {r.chunks} chunks "
        f"of {format_size(r.chunk_bytes)}, host budget {format_size(r.host_budget)}"
    )
    out.append(f"  step time     {_secs(r.step_s)} ({r.steps} steps after {r.warmup} warm-up)")
    if r.ranks:  # --nproc: the figures above are all ranks together, each step as slow as the slowest rank
        medians = [k.step_s.median for k in r.ranks]
        out.append(
            f"  ranks         {len(r.ranks)} on one disk: step medians "
            + ", ".join(f"{m:.3f}" for m in medians)
            + f" s; slowest / fastest {max(medians) / min(medians):.2f}"
        )
        for k in r.ranks:
            out.append(
                f"    rank {k.rank:<7} state {format_size(k.state_bytes)}, per step NVMe read "
                f"{format_size(k.nvme_read_bytes)}, written {format_size(k.nvme_write_bytes)}"
            )
    out.append("  phases        " + ", ".join(f"{_PHASE_NAMES[k]} {r.phases_s[k]:.3f} s" for k in TIME_PHASES))
    out.append(
        f"  per step      NVMe read {format_size(r.nvme_read_bytes)}, NVMe written {format_size(r.nvme_write_bytes)}, "
        f"state not read from NVMe {format_size(r.host_hit_bytes)}"
    )
    for tier, counters in r.tier_bytes.items():
        if any(counters.values()):
            names = {k: _COUNTER_NAMES.get(k, k.replace("_", " ")) for k in counters}
            moved = ", ".join(f"{names[k]} {format_size(v)}" for k, v in counters.items())
            out.append(f"  {tier + ' tier':<13} {moved}")
    if r.floor_s is not None:
        out.append(
            f"  disk floor    {r.floor_s:.3f} s = {format_size(r.nvme_read_bytes)} / {r.read_gbps:.2f} GB/s + "
            f"{format_size(r.nvme_write_bytes)} / {r.write_gbps:.2f} GB/s (this run's io sweep, best config)"
        )
        out.append(f"  step / floor  {r.step_over_floor:.2f}x the disk floor of this run's io sweep")
    if r.summary:  # the optimizer's own line, without its own ratio to the floor (optim.run_optim)
        out.append(f"  optimizer     {r.summary}")
    out += [f"  note: {n}" for n in r.notes]
    return "\n".join(out)


def _secs(s: Stat) -> str:
    if len(s.samples) == 1:
        return f"{s.median:.3f} s"
    return f"{s.median:.3f} s median ({s.min:.3f}-{s.max:.3f})"


def render_tour(r: TourResult) -> str:
    parts = [render_io(r.io), render_pcie(r.pcie)]
    if r.optim is not None:
        parts.append(render_optim(r.optim))
    parts += [f"note: {n}" for n in r.notes]
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------- plot
def _per_param(o: OptionPlan) -> str:
    b = o.bytes_per_param
    if "state" in b:  # tiered; with the parameters offloaded, their weights and gradients in RAM too
        if "host" in b:  # offloaded: the state also in the HBM the streamed layers leave spare
            return f"{b['host']:g} RAM + {b['state']:.2f} HBM/DDR/NVMe"
        return f"{b['gpu']:g} GPU + {b['state']:.2f} DDR/NVMe"
    gpu = f"{b['gpu']:g} GPU + " if b["gpu"] else ""  # DeepSpeed with offload_param: a window, not per parameter
    if "nvme" in b:
        return f"{gpu}{b['host']:g} RAM + {b['nvme']:g} NVMe"
    return f"{gpu}{b['host']:g} RAM"


_SHORT = {GPU: "GPU", HOST: "RAM", NVME: "NVMe", STATE: "RAM+NVMe"}


def render_plan(r: PlanResult) -> str:
    a, box = r.assumptions, r.box
    out = [
        f"tiered-bench plan: {NOTE}",
        f"box: GPU {gb(box.gpu)}, RAM {gb(box.ram)} ({box.ram / GiB:.1f} GiB), free NVMe {gb(box.disk)}",
        f"assumed: bf16 weights and gradients; activations {gb(a.activations)}, GPU reserve {gb(a.gpu_reserve)}, "
        f"RAM reserve {gb(a.ram_reserve)}; offloaded, a window of {gb(a.offload_window)}",
        f'tiered: host_budget at most "{budget_str(r.host_budget_max)}" ({gb(r.host_budget_max)}), '
        f"chunk_bytes {budget_str(a.chunk_bytes)}",
        "DeepSpeed: ZeRO-3 with offload_optimizer (cpu: ZeRO-Offload; nvme: ZeRO-Infinity), its default buffers;",
        "  offload_param: the weights too, where the optimizer's state goes",
        "",
        "largest model (B/param: the bytes a parameter takes, and where):",
    ]
    if r.model is not None:
        m = r.model
        out[2:2] = [
            f"model: {m.model_type} from its config, {count_str(m.params)} parameters ({m.layers} layers of "
            f"{count_str(m.layer_params)}, embeddings and head {count_str(m.root_params)}); offloaded, it holds "
            f"{gb(m.offload_window)} of blocks whole at once"
        ]
    rows = []
    for o in r.options:
        limits = ", ".join(f"{_SHORT[k]} {'-' if v is None else count_str(v)}" for k, v in o.limits.items())
        largest = "no limit" if o.largest_params is None else count_str(o.largest_params)
        rows.append([o.label, _per_param(o), largest, "-" if o.bound_by is None else _SHORT[o.bound_by], limits])
    out.append(table(["option", "B/param", "largest", "bound by", "each limit"], rows))
    crowded = [o.label for o in r.options if o.largest_params == 0 and o.bound_by == GPU]
    if crowded:  # the activations are an assumption: say so where they leave no room (an offloaded model's
        # window is not: at most its weights and gradients, 4 B/param, plan_memory.window_bytes)
        note = (
            f"note: the assumed activations ({gb(a.activations)}) and GPU reserve ({gb(a.gpu_reserve)})"
            f" leave no room on this GPU for {'; '.join(crowded)}. Activations depend on the micro-batch, its "
            "sequence and checkpointing: give yours with --activations (one micro-batch's forward and backward, "
            "torch.cuda.max_memory_allocated, less the weights the GPU holds)."
        )
        out += ["", textwrap.fill(note, 110, break_on_hyphens=False)]
    if r.params is not None:
        out += ["", f"{count_str(r.params)} parameters:"]
        rows = []
        for o in r.options:
            f = o.fit
            assert f is not None
            rows.append([
                o.label, "yes" if f.fits else "no", gb(f.gpu_bytes),
                f"host_budget={f.host_budget}" if f.host_budget else gb(f.host_bytes) + " RAM",
                gb(f.nvme_bytes), ", ".join(_SHORT[s.split(":")[0]] for s in f.short) or "-",
            ])  # fmt: skip
        out.append(table(["option", "fits", "GPU", "host", "on NVMe", "short of"], rows))
        out += ["", textwrap.fill(r.verdict or "", 110, break_on_hyphens=False)]
    return "\n".join(out)


def require_plotting(path: str) -> None:
    """Fail before measuring, not after, when --plot cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'tiered[bench]'), or drop --plot"
        ) from None
    parent = Path(path).expanduser().absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"--plot {path}: the folder {parent} does not exist or is not writable")


def plot(result: Any, path: str) -> None:
    """A bandwidth chart: the io sweep (with fio/aiofiles lines) and the PCIe rows, whichever exist."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    io = _find(result, IoResult)
    pcie = _find(result, PcieResult)
    panels = [p for p in (io, pcie if pcie is not None and pcie.available else None) if p is not None]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(7 * max(1, len(panels)), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=False):
        if isinstance(panel, IoResult):
            _plot_io(ax, panel)
        else:
            _plot_pcie(ax, panel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _find(result: Any, kind: type) -> Any:
    if isinstance(result, kind):
        return result
    for f in dataclasses.fields(result):
        v = getattr(result, f.name)
        if isinstance(v, kind):
            return v
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            found = _find(v, kind)
            if found is not None:
                return found
    return None


def _bars(ax: Any, labels: list[str], series: dict[str, list[Stat]]) -> None:
    width = 0.8 / len(series)
    for i, (name, stats) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        med = [s.median for s in stats]
        err = [[s.median - s.min for s in stats], [s.max - s.median for s in stats]]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel("GB/s")


def _plot_io(ax: Any, r: IoResult) -> None:
    rows: list[SweepRow] = r.sweep
    labels = [f"{format_size(x.block_size).replace('.00', '')} x{x.threads}" for x in rows]
    _bars(ax, labels, {"read": [x.read_gbps for x in rows], "write": [x.write_gbps for x in rows]})
    for name, val, style in (
        ("fio read", r.fio.read_gbps.median if r.fio else None, "C0"),
        ("fio write", r.fio.write_gbps.median if r.fio else None, "C1"),
        ("aiofiles read", r.aiofiles.read_gbps.median if r.aiofiles else None, "C2"),
    ):
        if val is not None:
            ax.axhline(val, color=style, linestyle="--", linewidth=1, label=name)
    mode = "O_DIRECT" if r.direct_effective else "buffered"
    ax.set_title(f"io_engine, {format_size(r.size_bytes)} file, {mode} (block x threads)")
    ax.legend(fontsize=8)


def _plot_pcie(ax: Any, r: PcieResult) -> None:
    by = {(row.memory, row.direction): row.gbps for row in r.rows}
    _bars(ax, ["host->GPU", "GPU->host", "both ways (sum)"], {k: [by[(k, d)] for d in DIRECTIONS] for k in KINDS})
    ax.set_title(f"PCIe, {r.device}, {format_size(r.size_bytes)} copies")
    ax.legend(fontsize=8)
