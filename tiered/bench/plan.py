"""`tiered-bench plan`: how large a model one machine can train with tiered, and with DeepSpeed's offloads.

Computed, not measured: arithmetic over the memory model of docs/capacity.md, for a box given as one
GPU's memory, the host's RAM and the free space on its NVMe. ``plan(Box(...), params=...)`` returns a
``PlanResult``: for each option (``OPTIONS``) the largest model and the constraint that binds it, and, for
``params``, whether that model fits, with what ``host_budget`` and how many bytes on NVMe, and if not, what
would. ``report.render_plan`` is the human form; ``dataclasses.asdict`` of the result is the ``--json``
form (the command is in commands.py, as every subcommand's).

Where the figures come from (each checked against the code by tests/tools/test_plan.py):

- state bytes a parameter and chunk sizes: ``tiered.layout.chunking`` (``Layout``, the record formats);
- what part of ``host_budget`` holds state for good and what streams: ``tiered.optim.budget.plan_budget`` (the
  resident chunks, the stream reserve), here in closed form so that a 100B-parameter plan stays instant;
- ``host_budget`` at most 90 % of RAM: ``tiered.config.TierConfig``;
- the optimizer's GPU scratch: ``tiered.optim.device_update.DeviceUpdate`` and ``tiered.optim.update.ChunkUpdater``;
- DeepSpeed: ZeRO-3's ``stage3.py`` and ``swap_tensor/`` (0.19), as docs/capacity.md cites.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ..layout.sizes import FORMATS, chunk_numel, pool, record_bytes
from .model_shape import ModelShape
from .plan_memory import (
    CAP as _CAP,
)
from .plan_memory import (
    DS_INFINITY_HOST,
    DS_INFINITY_NVME,
    DS_OFFLOAD_HOST,
    DS_PARAMS,
    OFFLOAD_HOST,
    Assumptions,
    GiB,
    KiB,
    MiB,
    StateSplit,
    default_activations,
    device_scratch_bytes,
    ds_gpu_bytes,
    ds_infinity_host_bytes,
    ds_params_gpu_bytes,
    host_budget_max,
    offload_gpu_bytes,
    offload_host_bytes,
    recommend_gpu_budget,
    recommend_host_budget,
    state_placement,
    state_split,
    tiered_gpu_bytes,
)
from .plan_memory import (
    largest_that as _largest,
)
from .plan_text import budget_str, count_str, gb, gib_str

__all__ = [
    "OPTIONS", "Assumptions", "Box", "Fit", "OptionPlan", "PlanResult", "StateSplit", "host_budget_max", "plan",
    "recommend_gpu_budget", "recommend_host_budget", "state_split", "tiered_gpu_bytes", "device_scratch_bytes",
    "ds_gpu_bytes", "ds_infinity_host_bytes", "chunk_numel", "record_bytes", "FORMATS", "KiB", "MiB", "GiB",
]  # fmt: skip

NOTE = "computed by tiered-bench plan from the memory model of docs/capacity.md, not measured"


# ------------------------------------------------------------------------------------------ the inputs
@dataclass(frozen=True)
class Box:
    """One machine: one GPU's memory, the host's RAM, the free space of the disk that holds the state (bytes)."""

    gpu: int
    ram: int
    disk: int

    def __post_init__(self) -> None:
        for name in ("gpu", "ram", "disk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Box.{name} must be a byte count >= 0, got {v!r}")
        if self.gpu == 0 or self.ram == 0:
            raise ValueError("the box needs GPU memory and RAM: --gpu and --ram must be > 0")
        for name in ("gpu", "ram", "disk"):  # a size given without its unit ("--gpu 24") counts bytes
            v = getattr(self, name)
            if 0 < v < MiB:
                raise ValueError(f"--{name} {v} is {v} bytes: give a unit (did you mean {v}GB?)")


@dataclass(frozen=True)
class Option:
    key: str
    label: str
    exact: bool  # the state stays fp32 (masters and moments): no rounding that AdamW over fp32 masters lacks
    fmt: str | None  # tiered's record format; None for DeepSpeed
    offload: bool = False  # parameters and gradients in host RAM (tiered.offload_model), the update on their GPU


OPTIONS = (
    Option("tiered", "tiered (defaults)", True, "split"),
    Option("tiered-offload", "tiered, parameters offloaded", True, "split", offload=True),
    Option("tiered-offload-int8", "tiered, offloaded, 8-bit moments", False, "split-int8", offload=True),
    Option("tiered-bf16-moments", "tiered, bf16 moments", False, "packed"),
    Option("tiered-int8-moments", "tiered, 8-bit moments", False, "split-int8"),
    Option("tiered-fp32-masters", "tiered, split_masters=False", True, "full"),
    Option("zero-offload", "DeepSpeed ZeRO-Offload", True, None),
    Option("zero-infinity", "DeepSpeed ZeRO-Infinity", True, None),
    # ZeRO-3's offload_param: the weights off the GPU too, where the optimizer's state goes (cpu or nvme).
    Option("zero-offload-params", "DeepSpeed, offload_param cpu", True, None),
    Option("zero-infinity-params", "DeepSpeed, offload_param nvme", True, None),
)
_BY_KEY = {o.key: o for o in OPTIONS}


# DeepSpeed ZeRO-3 with offload_optimizer, bf16 model, one GPU (docs/capacity.md says where each comes from):
@dataclass(frozen=True)
class _Constraint:
    name: str
    have: int
    need: Callable[[int], int | None]  # bytes a model of N parameters needs; None: it cannot run at all

    def ok(self, params: int) -> bool:
        need = self.need(params)
        return need is not None and need <= self.have


def _largest_run(search: list[_Constraint], run: list[_Constraint]) -> int | None:
    """The largest model that ``run`` (the needs of the placement the run takes) allows, or None past _CAP.
    ``search``: needs that grow with n and are never above ``run``'s (``_search_constraints``), so that
    ``_largest`` can search them and no model past their largest can run. A model that meets them but not
    ``run``'s keeps its weights on the GPU, and so does every smaller one (up to KEEP_SHARE of it): below it
    ``run``'s needs grow with n too."""
    most = _largest(lambda n: all(c.ok(n) for c in search))
    if not most or all(c.ok(most) for c in run):
        return most
    return _largest(lambda n: n <= most and all(c.ok(n) for c in run))


GPU, HOST, NVME, STATE = "GPU memory", "host RAM", "NVMe", "host RAM + NVMe"


def _constraints(opt: Option, box: Box, a: Assumptions, *, keep: bool = True) -> list[_Constraint]:
    """What n parameters need of each part of the box. ``keep``: as in ``state_placement``; False: the weights
    streamed again for backward, whose needs grow with n (a model just past KEEP_SHARE would otherwise leave more
    room in HBM than one just below it: ``_search_constraints``); a fit is judged with the placement the run takes
    (True)."""
    usable = max(0, box.ram - a.ram_reserve)  # DeepSpeed has no 90 % rule; the same reserve stands
    if opt.key == "zero-offload-params":
        ds_gpu = _Constraint(GPU, box.gpu, lambda n: ds_params_gpu_bytes(n, a))
        return [ds_gpu, _Constraint(HOST, usable, lambda n: (DS_OFFLOAD_HOST + DS_PARAMS) * n)]
    if opt.key == "zero-infinity-params":
        return [
            _Constraint(GPU, box.gpu, lambda n: ds_params_gpu_bytes(n, a)),
            _Constraint(HOST, usable, lambda n: ds_infinity_host_bytes(n, a) + 2 * a.ds_param_buffers),
            _Constraint(NVME, box.disk, lambda n: (DS_INFINITY_NVME + DS_PARAMS) * n),
        ]

    def nvme(n: int) -> int | None:  # the state that HBM (offloaded) and host_budget leave: on NVMe
        split = state_placement(n, opt.fmt or "split", box.gpu, box.ram, a, offload=opt.offload, keep=keep)[2]
        return None if split is None else split.nvme_bytes

    if opt.offload:  # the GPU holds a window, not the model; RAM holds the weights and gradients first
        fmt, kept_on = opt.fmt or "split", box.gpu if keep else 0
        return [
            _Constraint(GPU, box.gpu, lambda n: offload_gpu_bytes(n, fmt, a, gpu=kept_on)),
            _Constraint(HOST, usable, offload_host_bytes),
            _Constraint(STATE, box.disk, nvme),
        ]
    if opt.fmt is not None:
        fmt = opt.fmt
        return [
            _Constraint(GPU, box.gpu, lambda n: tiered_gpu_bytes(n, fmt, a)),
            _Constraint(STATE, box.disk, nvme),
        ]
    gpu = _Constraint(GPU, box.gpu, lambda n: ds_gpu_bytes(n, a))
    if opt.key == "zero-offload":
        return [gpu, _Constraint(HOST, usable, lambda n: DS_OFFLOAD_HOST * n)]
    return [
        gpu,
        _Constraint(HOST, usable, lambda n: ds_infinity_host_bytes(n, a)),
        _Constraint(NVME, box.disk, lambda n: DS_INFINITY_NVME * n),
    ]


def _search_constraints(opt: Option, box: Box, a: Assumptions) -> list[_Constraint]:
    """The needs ``_largest_run`` searches: each the lesser of an offloaded model's two placements, its weights
    streamed again (``keep=False``: no jump at the keep rule) or kept, which leaves more HBM room where they are
    smaller than the window (the streamed one alone missed models that fit so)."""

    def least(never: Callable[[int], int | None], run: Callable[[int], int | None]) -> Callable[[int], int | None]:
        def need(n: int) -> int | None:
            needs = [x for x in (never(n), run(n)) if x is not None]
            return min(needs) if needs else None

        return need

    pairs = zip(_constraints(opt, box, a, keep=False), _constraints(opt, box, a))
    return [_Constraint(f.name, f.have, least(f.need, r.need)) for f, r in pairs]


# ------------------------------------------------------------------------------------------ the results
@dataclass
class Fit:
    """One model on one option: the bytes it needs where, whether they fit, and if not what would."""

    params: int
    fits: bool
    gpu_bytes: int  # what the GPU must hold
    host_bytes: int  # tiered: the host_budget to pass (pinned); DeepSpeed: the host RAM it takes
    host_budget: str | None  # tiered: host_budget= as the optimizer parses it
    ddr_state_bytes: int  # optimizer state held in host RAM
    nvme_bytes: int  # optimizer state (and ZeRO-Infinity's gradients) on NVMe
    nvme_bytes_per_step: int  # read plus written a step
    min_disk: int | None  # the free NVMe it needs with this RAM (None: host_budget cannot hold one chunk)
    min_ram: int | None  # the RAM (whole GiB) it needs with this disk (None: no RAM is enough)
    short: list[str] = field(default_factory=list)  # each constraint that fails, with need and have
    would_fit: list[str] = field(default_factory=list)  # a fix for each constraint in short: all are needed
    instead: list[str] = field(default_factory=list)  # other ways: bf16 moments, the largest model that fits
    hbm_state_bytes: int = 0  # offloaded: optimizer state the GPU's spare room keeps (gpu_budget)


@dataclass
class OptionPlan:
    key: str
    label: str
    exact: bool
    bytes_per_param: dict[str, float]  # where each parameter's bytes live: gpu, state (DDR or NVMe), host, nvme
    largest_params: int | None  # None: no limit (none up to the search's cap, 2**50 parameters)
    bound_by: str | None  # the constraint with the smallest limit; None where none limits
    limits: dict[str, int | None]  # each constraint's own largest model (None: no limit)
    fit: Fit | None = None


@dataclass
class PlanResult:
    box: Box
    assumptions: Assumptions
    host_budget_max: int
    params: int | None
    options: list[OptionPlan]
    verdict: str | None  # for params: one paragraph on the default option and the others
    note: str = NOTE
    model: ModelShape | None = None  # where params came from a config.json (--config)
    # The activations are default_activations(box.gpu), not given (--activations): a larger GPU brings larger ones.
    activations_default: bool = False


def _bytes_per_param(opt: Option, a: Assumptions) -> dict[str, float]:
    if opt.fmt is not None:
        n = chunk_numel(opt.fmt, a.chunk_bytes)
        state = round(pool(record_bytes(opt.fmt, n)) / n, 4)
        return (
            {"gpu": 0.0, "host": float(OFFLOAD_HOST), "state": state} if opt.offload else {"gpu": 4.0, "state": state}
        )
    if opt.key == "zero-offload":
        return {"gpu": 2.0, "host": float(DS_OFFLOAD_HOST)}
    if opt.key == "zero-offload-params":
        return {"gpu": 0.0, "host": float(DS_OFFLOAD_HOST + DS_PARAMS)}
    if opt.key == "zero-infinity-params":
        return {"gpu": 0.0, "host": float(DS_INFINITY_HOST), "nvme": float(DS_INFINITY_NVME + DS_PARAMS)}
    return {"gpu": 2.0, "host": float(DS_INFINITY_HOST), "nvme": float(DS_INFINITY_NVME)}


def _plan_option(opt: Option, box: Box, a: Assumptions, params: int | None, sized: bool) -> OptionPlan:
    search, run = _search_constraints(opt, box, a), _constraints(opt, box, a)
    limits = {s.name: _largest_run([s], [r]) for s, r in zip(search, run)}
    # limits[k] is not None in the else: mypy does not narrow a subscript by a variable
    bound = min(limits, key=lambda k: _CAP if limits[k] is None else limits[k])  # type: ignore[arg-type,return-value]
    most = _largest_run(search, run)  # None: past the cap, which is the search's, not a limit of the box
    out = OptionPlan(opt.key, opt.label, opt.exact, _bytes_per_param(opt, a), most, None if most is None else bound,
                     limits)  # fmt: skip
    if params is not None:
        out.fit = _fit(opt, box, a, params, _constraints(opt, box, a), most, sized)
    return out


def _fit(opt: Option, box: Box, a: Assumptions, n: int, cons: list[_Constraint], largest: int | None,
         sized: bool) -> Fit:  # fmt: skip
    """n parameters on ``opt``: the figures of the placement the run takes, judged by ``cons`` (the same
    computation: ``_constraints``, ``state_placement``), so that a fit never prints a figure over its budget.
    ``sized``: the activations are ``default_activations(box.gpu)`` (``plan``'s ``activations_default``)."""
    gpu = cons[0].need(n) or 0  # offloaded: the weights where the runtime keeps them, else the window
    ram = _least_ram(opt, box, a, n)
    if opt.fmt is not None:
        in_hbm, budget, split = state_placement(n, opt.fmt, box.gpu, box.ram, a, offload=opt.offload)
        fit = Fit(n, False, gpu, budget, budget_str(budget), 0, 0, 0, None, ram)
        fit.hbm_state_bytes = (
            in_hbm // chunk_numel(opt.fmt, a.chunk_bytes) * record_bytes(opt.fmt, chunk_numel(opt.fmt, a.chunk_bytes))
        )
        if split is not None:
            fit.ddr_state_bytes, fit.nvme_bytes = split.resident_bytes, split.nvme_bytes
            fit.nvme_bytes_per_step = 2 * split.nvme_bytes  # each streamed chunk is read and written back
            fit.min_disk = split.nvme_bytes
    elif opt.key in ("zero-offload", "zero-offload-params"):
        fit = Fit(n, False, gpu, cons[1].need(n) or 0, None, 12 * n, 0, 0, 0, ram)
    else:  # ZeRO-Infinity: the state (and with offload_param the weights) on NVMe, read and written each step
        nvme = cons[2].need(n) or 0
        fit = Fit(n, False, gpu, cons[1].need(n) or 0, None, 0, nvme, 2 * nvme, nvme, ram)
    failing = [c for c in cons if not c.ok(n)]
    fit.fits = not failing
    for c in failing:
        need = c.need(n)
        if c.name == STATE:
            if need is None:  # what RAM leaves (less the reserve, and the 90 % rule) is under one chunk
                fit.short.append(f"{STATE}: host_budget {gb(fit.host_bytes)} cannot hold one chunk")
            else:
                fit.short.append(f"{STATE}: needs {gb(need, up=True)} on NVMe beside host_budget "
                                 f"{gb(fit.host_bytes)}, has {gb(c.have)} free")  # fmt: skip
        else:
            fit.short.append(f"{c.name}: needs {gb(need or 0, up=True)}, has {gb(c.have)}")
    if failing:
        _remedies(opt, box, a, fit, failing, largest, sized)
    return fit


def _remedies(opt: Option, box: Box, a: Assumptions, fit: Fit, failing: list[_Constraint], largest: int | None,
              sized: bool) -> None:  # fmt: skip
    """``fit.would_fit``: one fix per failing constraint (all of them needed); ``fit.instead``: other ways."""
    names = {c.name for c in failing}
    if GPU in names:
        least, room = _least_gpu(opt, box, a, fit.params, sized), box.gpu - (fit.gpu_bytes - a.activations)
        least = fit.gpu_bytes if least is None else least  # past the search (plan() in Python takes any count)
        notes = [f"with the {gb(default_activations(least))} of activations assumed on it"] if sized else []
        if room >= 1e8:  # the advice is rounded down to what --activations takes back
            notes.append(f"or at most {gb(room, down=True)} of activations: --activations")
        fit.would_fit.append(f"a GPU of {gb(least)} or more" + (f" ({'; '.join(notes)})" if notes else ""))
    if NVME in names:  # ZeRO-Infinity: its NVMe bytes do not depend on RAM
        fit.would_fit.append(f"{gb(fit.min_disk or 0, up=True)} of free NVMe or more")
    if STATE in names:  # tiered: RAM and disk add up, so either one helps
        fixes = [f"{gb(fit.min_disk, up=True)} of free NVMe with this RAM"] if fit.min_disk is not None else []
        fixes += [f"{gib_str(fit.min_ram)} of RAM with this disk"] if fit.min_ram is not None else []
        if fixes:
            fit.would_fit.append(" or ".join(fixes))
    if HOST in names and fit.min_ram is not None:
        fit.would_fit.append(f"{gib_str(fit.min_ram)} of RAM or more")
    if opt.offload and all(c.ok(fit.params) for c in _constraints(opt, box, a, keep=False)):
        # The weights kept (keep_for_backward="auto") take the HBM room that, streamed again, holds state.
        fit.instead.append("keep_for_backward=False in tiered.offload_model (the weights streamed again for "
                           "backward, their GPU room left to the state), which fits it on this box")  # fmt: skip
    if GPU in names and not opt.offload and opt.fmt is not None:
        alt = _BY_KEY["tiered-offload"]
        if all(c.ok(fit.params) for c in _constraints(alt, box, a)):
            rounded = f"{OFFLOAD_HOST:g} B/param"
            fit.instead.append("tiered.offload_model(model) before the optimizer (parameters and gradients in "
                               f"pinned host RAM, {rounded}; exact), which fits it on this box")  # fmt: skip
    if opt.key in ("tiered", "tiered-fp32-masters"):
        alt = _BY_KEY["tiered-bf16-moments"]
        if all(c.ok(fit.params) for c in _constraints(alt, box, a)):
            fit.instead.append("moments_dtype=torch.bfloat16 (8 B/param, not exact), which fits it on this box")
    if opt.key in ("tiered", "tiered-fp32-masters", "tiered-bf16-moments") and not fit.instead:
        alt = _BY_KEY["tiered-int8-moments"]
        if all(c.ok(fit.params) for c in _constraints(alt, box, a)):
            fit.instead.append('moments_dtype="int8" (4.16 B/param, not exact), which fits it on this box')
    # None: no limit. Not at or over this one: where more GPU keeps the weights, a larger one fits.
    if largest is not None and 0 < largest < fit.params:
        fit.instead.append(f"a model of at most {count_str(largest)} parameters")


def _least_gpu(opt: Option, box: Box, a: Assumptions, n: int, sized: bool) -> int | None:
    """The least GPU, in whole tenths of a GB (the fix prints one decimal), on which n parameters meet the GPU's
    need, the rest of the box as it is. ``sized``: with the activations ``default_activations`` sizes to that GPU,
    which the CLI assumes when the fix is passed back as --gpu (the need at this GPU's activations did not fit)."""

    def short(tenths: int) -> bool:
        other = dataclasses.replace(box, gpu=tenths * 10**8)
        b = dataclasses.replace(a, activations=default_activations(other.gpu)) if sized else a
        return not all(c.ok(n) for c in _constraints(opt, other, b) if c.name == GPU)

    most = _largest(short)  # monotone: a larger GPU gives more than its larger activations take (a quarter)
    return None if most is None else (most + 1) * 10**8  # None: past 2**50 tenths of a GB, an absurd count


def _least_ram(opt: Option, box: Box, a: Assumptions, n: int) -> int | None:
    """The least RAM (whole GiB) with which the host-side constraints hold for n parameters, the rest of the
    box as it is; None when no RAM is enough (the disk is the limit)."""

    def ok(gib: int) -> bool:
        other = dataclasses.replace(box, ram=gib * GiB)
        return all(c.ok(n) for c in _constraints(opt, other, a) if c.name in (HOST, STATE))

    hi = max(1, box.ram // GiB)
    while not ok(hi):
        hi *= 2
        if hi > 1 << 30:
            return None
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi * GiB


def plan(box: Box, params: int | None = None, assumptions: Assumptions | None = None, *,
         model: ModelShape | None = None, activations_default: bool = False) -> PlanResult:  # fmt: skip
    """The largest model for each option on ``box``, and, for ``params`` parameters (or ``model``'s, read from its
    config: model_shape.read_config), whether it fits. Without ``assumptions``, ``Assumptions()``'s (the CLI sizes
    the activations to the GPU, ``default_activations``, and takes the window from ``model``).
    ``activations_default``: the activations are that default, not the user's (the CLI without --activations), so
    that a fix naming a larger GPU counts the larger activations the CLI will assume on it."""
    a = assumptions or Assumptions()
    if activations_default and a.activations != default_activations(box.gpu):
        raise ValueError(f"activations_default: the activations must be default_activations(box.gpu), "
                         f"{default_activations(box.gpu)}, got {a.activations}")  # fmt: skip
    if model is not None:
        if params is not None and params != model.params:
            raise ValueError(f"params {params} is not the config's {model.params}: give one of them")
        params = model.params
    if params is not None and (isinstance(params, bool) or not isinstance(params, int) or params < 1):
        raise ValueError(f"params must be a whole number >= 1, got {params!r}")
    options = [_plan_option(o, box, a, params, activations_default) for o in OPTIONS]
    verdict = _verdict(options) if params is not None else None
    cap = host_budget_max(box.ram, a.ram_reserve)
    return PlanResult(box, a, cap, params, options, verdict, model=model, activations_default=activations_default)


def _verdict(options: list[OptionPlan]) -> str:
    main = options[0]
    fit = main.fit
    assert fit is not None
    if fit.fits:
        where = (
            f"all {gb(fit.ddr_state_bytes)} of state in DDR, nothing on NVMe"
            if not fit.nvme_bytes
            else f"{gb(fit.ddr_state_bytes)} of state in DDR and {gb(fit.nvme_bytes)} on NVMe, "
            f"read and written back each step ({gb(fit.nvme_bytes_per_step)} of disk traffic a step)"
        )
        text = (
            f'{count_str(fit.params)} parameters fit with {main.label}: host_budget="{fit.host_budget}" keeps '
            f"{where}; GPU {gb(fit.gpu_bytes)}."
        )
    else:
        text = f"{count_str(fit.params)} parameters do not fit with {main.label}: {'; '.join(fit.short)}."
        ways = [w for w in (", and ".join(fit.would_fit), "; or ".join(fit.instead)) if w]
        if ways:  # the box's fixes, then the other ways; either may be none
            text += f" It would fit with {'; or with '.join(ways)}."
    others = [o for o in options[1:] if o.fit is not None]
    yes = [o.label for o in others if o.fit and o.fit.fits]
    no = [f"{o.label} ({', '.join(s.split(':')[0] for s in o.fit.short)})" for o in others if o.fit and not o.fit.fits]
    if yes:
        text += f" Also fits: {'; '.join(yes)}."
    if no:
        text += f" Does not fit: {'; '.join(no)}."
    return text
