"""The timed steps of `tiered-bench optim`, shared by the one-process run (optim.py) and each rank (ranks.py).

Call order: ``params = synthetic_params(n, device, dtype)``; ``stats, lasts, before = time_steps(opts, cls,
params, state_root, cfg, cuda)``.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import UsageError, progress

__all__ = ["DTYPES", "TENSOR_NUMEL", "synthetic_params", "time_steps"]

TENSOR_NUMEL = 1 << 22  # synthetic parameters come as tensors of up to 4M elements, like a model's layers
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def synthetic_params(n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    """`n` parameters in tensors of up to TENSOR_NUMEL, each with a random gradient of its dtype."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for start in range(0, n, TENSOR_NUMEL):
        k = min(TENSOR_NUMEL, n - start)
        p = torch.nn.Parameter(torch.randn(k, generator=gen).to(device, dtype))
        p.grad = (torch.randn(k, generator=gen) * 1e-3).to(device, dtype)
        out.append(p)
    return out


def time_steps(opts: Any, cls: Any, params: list[torch.nn.Parameter], state_root: Any, cfg: Any, cuda: bool,
               before_step: Any = None) -> tuple[dict[str, Any], list[dict[str, float]], dict[str, Any]]:  # fmt: skip
    """Build the optimizer under `state_root` and time its steps: (the last stats, each timed step's
    `last_step`, the stats before the last step). `before_step()` runs before each step (ranks: a barrier)."""
    kwargs: dict[str, Any] = dict(host_budget=opts.host_budget, gpu_budget=opts.gpu_budget, io=cfg)
    if opts.chunk_bytes is not None:
        kwargs["chunk_bytes"] = opts.chunk_bytes
    if opts.split_masters is not None:  # else the optimizer's defaults (and a smaller contract for fakes)
        kwargs["split_masters"] = opts.split_masters
    if opts.update_on != "auto":
        kwargs["update_on"] = opts.update_on
    try:
        opt = cls(params, nvme_path=state_root, **kwargs)
    except (ValueError, TypeError) as e:  # e.g. a host budget below one chunk: the message names the fix
        raise UsageError(str(e)) from e
    lasts: list[dict[str, float]] = []
    stats = before = opt.stats()
    try:
        with progress(opts.warmup + opts.steps, "optim", enabled=opts.progress, unit="step") as bar:
            for i in range(opts.warmup + opts.steps):
                if before_step is not None:
                    before_step()
                opt.step()
                if cuda:
                    torch.cuda.synchronize()
                before, stats = stats, opt.stats()
                if i >= opts.warmup:
                    lasts.append(dict(stats["last_step"]))
                bar.update(1)
    finally:
        opt.close()
    return stats, lasts, before
