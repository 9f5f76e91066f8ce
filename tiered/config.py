"""TierConfig: every TieredOptimizer knob parsed, checked and resolved once, at the public boundary.

``TierConfig(host_budget="8GiB", ...)`` parses sizes and checks each value (a ``ValueError`` or ``TypeError``
that names the knob and the fix); ``resolve(cuda=..., device=...)`` then turns the "auto" choices into what this
model gets: where the update runs, whether bf16 masters are split, and ``gpu_budget="auto"``, read on the
parameters' GPU (``host_budget="auto"`` is read at once: the RAM is the machine's). The optimizer reads only
resolved values.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, cast

import psutil
import torch

from io_engine import IOConfig, format_size, parse_size

from .arguments import check_moments_dtype

__all__ = ["TierConfig", "UPDATE_ON"]

UPDATE_ON = ("auto", "host", "device")


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """The keyword-only knobs of ``TieredOptimizer`` (see its docstring for what each means)."""

    host_budget: int | str = "2GiB"
    gpu_budget: int | str = 0
    chunk_bytes: int | str = "64MiB"
    prefetch_depth: int = 8
    max_grad_norm: float | None = None
    io: IOConfig | None = None
    verify: bool = True
    moments_dtype: torch.dtype | str = torch.float32
    split_masters: bool | None = None
    update_on: str = "auto"
    update_in_backward: bool | str = "auto"
    tbw: float | None = None
    run_steps: int | None = None
    wear_share: float = 0.1

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        from .auto_budget import resolve_auto  # "auto" budgets: this machine's RAM, the GPU under its cap

        for name in ("host_budget", "gpu_budget", "chunk_bytes"):
            if name == "gpu_budget" and self.gpu_budget == "auto":
                continue  # read on the parameters' GPU, which resolve() is told
            set_(name, parse_size(resolve_auto(name, getattr(self, name)), name=name))
        host_budget, chunk_bytes = cast(int, self.host_budget), cast(int, self.chunk_bytes)  # parsed just above
        if chunk_bytes < 4096:  # below a page: a typo (0, or 64 meant as MiB); chunks round up to whole rows
            raise ValueError(
                f"chunk_bytes must be at least 4 KiB (one page; the default is 64MiB), got {self.chunk_bytes} bytes"
            )
        ram = psutil.virtual_memory().total
        if host_budget > 0.9 * ram:  # page-locked memory cannot be swapped: leave the OS room
            raise ValueError(
                f"host_budget {format_size(host_budget)} exceeds 90 % of this machine's "
                f"{format_size(ram)} of RAM: lower it (the rest of the state lives on NVMe)"
            )
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, numbers.Real) or not norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0 or None, got {norm!r}")
        depth = self.prefetch_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {depth!r}")
        if self.io is not None and not isinstance(self.io, IOConfig):
            raise TypeError(f"io must be an io_engine.IOConfig, got {type(self.io).__name__}")
        if not isinstance(self.verify, bool):
            raise TypeError(f"verify must be True or False, got {self.verify!r}")
        set_("moments_dtype", check_moments_dtype(self.moments_dtype))
        if self.update_on not in UPDATE_ON:
            raise ValueError(f"update_on must be 'auto', 'host' or 'device', got {self.update_on!r}")
        if self.split_masters is not None and not isinstance(self.split_masters, bool):
            raise TypeError(f"split_masters must be True, False or None, got {self.split_masters!r}")
        if not (isinstance(self.update_in_backward, bool) or self.update_in_backward == "auto"):
            raise TypeError(f"update_in_backward must be True, False or 'auto', got {self.update_in_backward!r}")
        if self.update_in_backward is True and self.update_on == "host":
            raise ValueError("update_in_backward=True needs the update on the device: update_on='device' or 'auto'")
        if self.tbw is not None and not (isinstance(self.tbw, int | float) and self.tbw > 0):
            raise ValueError(
                f"tbw (the drive's rated endurance, terabytes written) must be > 0 or None, got {self.tbw!r}"
            )
        steps = self.run_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"run_steps must be an int >= 1 or None, got {steps!r}")
        if not (isinstance(self.wear_share, int | float) and 0 < self.wear_share <= 1):
            raise ValueError(f"wear_share must be in (0, 1], got {self.wear_share!r}")
        self._check_split(hbm=False)  # what rules split masters out on any device; resolve() checks the rest

    def _split_blockers(self, *, hbm: bool) -> list[str]:
        """Why split masters cannot apply; ``hbm``: whether state chunks can live in HBM (``Planned.hbm``)."""
        blockers = []
        if self.moments_dtype == torch.bfloat16:
            blockers.append("moments_dtype is bf16")
        # HostUpdate.update_resident takes whole masters only. Without HBM for chunks gpu_budget is ignored (the
        # optimizer warns so), and a knob it ignores must not veto another.
        if hbm and self.gpu_budget and self.update_on == "host":
            blockers.append("gpu_budget is set with update_on='host' (its chunks in HBM keep full masters)")
        return blockers

    def _check_split(self, *, hbm: bool) -> None:
        blockers = self._split_blockers(hbm=hbm)
        if self.split_masters and blockers:
            raise ValueError(f"split_masters=True cannot apply: {' and '.join(blockers)}")

    def resolve(self, *, cuda: bool, offloaded: bool = False, device: torch.device | None = None) -> TierConfig:
        """The choices left to "auto" made for parameters on CUDA (``cuda``), kept in host memory by FSDP2's
        CPU offload and computed on a GPU (``offloaded``), or neither: the update runs on the device for the
        first two (for offloaded ones, on their GPU: the CPU's AdamW was the step's bottleneck, bench/RESULTS.md
        tenth session); split masters are on where it does and nothing rules them out (on the host they cost
        more CPU than the disk time they save: bench/RESULTS.md), and ``split_masters=True`` where something
        does is refused (a ``gpu_budget`` only where its chunks can be in HBM); the update under backward stays
        "auto" (measured, optim/under_backward/switch.py) only for CUDA parameters, and is off elsewhere.
        ``gpu_budget="auto"`` is read on ``device``, the GPU they compute on (a model on cuda:1 gets cuda:1's, not
        the current device's); for CPU parameters on the current one, as the optimizer then warns it ignores it."""
        if self.gpu_budget == "auto":
            from .auto_budget import auto_gpu_budget

            gpu = device if device is not None and device.type == "cuda" else None
            return dataclasses.replace(self, gpu_budget=auto_gpu_budget(gpu)).resolve(cuda=cuda, offloaded=offloaded)
        update_on = ("device" if cuda or offloaded else "host") if self.update_on == "auto" else self.update_on
        if self.update_in_backward is True and (update_on == "host" or offloaded):
            raise ValueError("update_in_backward=True needs update_on='device' and the parameters on the GPU "
                             "(on CPU parameters 'auto' is 'host'; offloaded ones update after backward)")  # fmt: skip
        early = self.update_in_backward
        if early == "auto" and not (cuda and update_on == "device"):
            early = False
        hbm = cuda or (offloaded and update_on == "device")  # as Planned.hbm: where gpu_budget applies
        self._check_split(hbm=hbm)
        split = self.split_masters
        if split is None:
            split = update_on == "device" and not self._split_blockers(hbm=hbm)
        return dataclasses.replace(self, update_on=update_on, split_masters=split, update_in_backward=early)

    def settled(self, resolved: TierConfig) -> TierConfig:
        """These knobs with the ``gpu_budget`` that ``resolved`` (their ``resolve()``) read for "auto": a layout
        again over other tensors (param_set.py) keeps the budget read when the optimizer was built, not one read
        while the old layout still holds its chunks on the GPU."""
        return dataclasses.replace(self, gpu_budget=resolved.gpu_budget)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moments_dtype"] = str(self.moments_dtype).removeprefix("torch.")
        d["io"] = None if self.io is None else self.io.to_dict()
        return d
