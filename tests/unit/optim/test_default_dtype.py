"""``torch.set_default_dtype(torch.float64)`` somewhere in the program changes nothing: torch.optim.AdamW is
indifferent to it, so TieredOptimizer must be too. The state is fp32 whatever the default: every scratch tensor
whose bytes are viewed as a record (split masters' joined rows, 8-bit moments' install buffer) once followed the
default and had twice the bytes, and the first step or load failed with a bare size mismatch, the optimizer
broken. Each run below must be bitwise the same run under the float32 default."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer
from tiered.checkpoint import import_torch_state_dict

KW = dict(lr=1e-2, host_budget="60KiB", chunk_bytes="12KiB", prefetch_depth=2)


def mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 40), nn.GELU(), nn.Linear(40, 4)).to(dtype)


BATCHES = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(5)]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    dtype = next(model.parameters()).dtype
    for s in steps:
        model(BATCHES[s].to(dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def run(tmp_path, default: torch.dtype, base: nn.Module, **kw) -> tuple[list[torch.Tensor], dict]:
    """Two steps, a state-dict round trip, a step, a checkpoint round trip, a step: under ``default``."""
    model = copy.deepcopy(base)  # built under the float32 default: float64 parameters are refused by name
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        with TieredOptimizer(model, tmp_path / str(default), **KW, **kw) as opt:
            train(model, opt, range(2))
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            train(model, opt, range(2, 3))
            opt.load_checkpoint(opt.save_checkpoint(tmp_path / f"ck-{default}"))
            train(model, opt, range(3, 5))
            state = {i: {k: v.float().clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    finally:
        torch.set_default_dtype(before)
    return [p.detach().clone() for p in model.parameters()], state


@pytest.mark.parametrize(
    "dtype, kw",
    [
        (torch.bfloat16, dict(split_masters=True)),
        (torch.bfloat16, dict(split_masters=True, update_on="device")),  # the CPU stand-in for the GPU path
        (torch.float32, dict(moments_dtype="int8")),
        (torch.bfloat16, dict(moments_dtype="int8", split_masters=True)),
        (torch.float32, dict(moments_dtype=torch.bfloat16)),
    ],
    ids=["split", "split-device", "int8", "int8-split", "bf16-moments"],
)
def test_a_float64_default_dtype_trains_and_loads_as_float32_does(tmp_path, dtype, kw):
    base = mlp(dtype)
    weights, state = run(tmp_path, torch.float32, base, **kw)
    weights64, state64 = run(tmp_path, torch.float64, base, **kw)
    assert all(torch.equal(a, b) for a, b in zip(weights, weights64))
    assert state.keys() == state64.keys() and all(
        s.keys() == state64[i].keys() and all(torch.equal(v, state64[i][k]) for k, v in s.items())
        for i, s in state.items()
    )


def test_a_torch_state_dict_imports_under_a_float64_default(tmp_path):
    """``import_torch_state_dict`` writes zero moments for a parameter without state: fp32 rows, whatever the
    default."""
    base = mlp(torch.float32)
    ref = copy.deepcopy(base)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    ref[2].bias.requires_grad_(False)  # no gradient, so no state: its moments are imported as zeros
    train(ref, torch_opt, range(2))
    ref[2].bias.requires_grad_(True)
    model = copy.deepcopy(ref)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        import_torch_state_dict(torch_opt.state_dict(), model, tmp_path / "ck")
        with TieredOptimizer(model, tmp_path / "opt", **KW) as opt:
            opt.load_checkpoint(tmp_path / "ck")
            train(model, opt, range(2, 4))
    finally:
        torch.set_default_dtype(before)
    train(ref, torch_opt, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
