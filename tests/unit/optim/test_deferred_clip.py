"""An offloaded model's clip, deferred: ``max_grad_norm`` leaves the gradients in host memory as they are and
the update scales them as it reads them (Shards.clip_grad_norm_'s ``defer``, transfer.py's reads). On the GPU
machine the optimizer defers for a model FSDP2's CPU offload streams to a GPU; here the same reads run on the
CPU, deferred by hand, against the same optimizer scaling in place: the weights after every step are bitwise the
same, on both update paths, streamed from disk or not, and the deferred run's ``.grad`` keep the sum backward
made."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48)).to(dtype)


def _train(tmp_path, name: str, dtype: torch.dtype, defer: bool, **kw) -> tuple[list[torch.Tensor], list[float]]:
    model = _model(dtype)
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randn(16, 48, generator=g).to(dtype) for _ in "xy"] for _ in range(4)]
    norms = []
    with TieredOptimizer(model, tmp_path / name, lr=1e-2, max_grad_norm=0.05, chunk_bytes="16KiB", **kw) as opt:
        opt._defer_clip = defer
        for x, y in batches:
            nn.functional.mse_loss(model(x).float(), y.float()).backward()
            before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            opt.step()
            after = [p.grad for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(after, before)) == defer  # type: ignore[arg-type]
            assert opt.stats()["last_step"]["clip_s"] > 0
            norms.append(opt.stats()["grad_norm"])
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("update_on", ["host", "device"])
@pytest.mark.parametrize("host_budget", ["1GiB", "48KiB"], ids=["in-ddr", "from-disk"])
def test_a_deferred_clip_trains_bitwise_as_the_clip_in_place(tmp_path, dtype, update_on, host_budget) -> None:
    kw = dict(update_on=update_on, host_budget=host_budget)
    ref, ref_norms = _train(tmp_path, "in-place", dtype, False, **kw)
    ours, norms = _train(tmp_path, "deferred", dtype, True, **kw)
    assert min(ref_norms) > 0.05  # the clip fired on every step
    assert norms == ref_norms
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_gather_applies_the_scale_in_the_gradients_dtype_and_leaves_them(dtype) -> None:
    """The GPU path's read (``gather_grads``: into an fp32 row on the update's device), run here on the CPU."""
    from tiered.layout.chunking import Chunk, Piece
    from tiered.optim.groups import Groups
    from tiered.optim.transfer import ParamCopies

    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (5, 11)]
    for p in params:
        p.grad = torch.randn(p.numel()).to(dtype) * 7
    held = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    pieces = (Piece(param=0, param_start=0, chunk_start=0, numel=5),
              Piece(param=1, param_start=2, chunk_start=5, numel=9))  # fmt: skip
    chunk = Chunk(key="c", group=0, numel=14, pieces=pieces)
    copies = ParamCopies(params, Groups([{}]), updater=None)
    copies.grad_scale = torch.tensor(0.3, dtype=dtype)
    got = copies.gather_grads(chunk, torch.empty(14), [0, 1])
    want = [held[0] * copies.grad_scale, (held[1] * copies.grad_scale)[2:11]]
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and torch.equal(g, w.float())
    assert all(torch.equal(p.grad, h) for p, h in zip(params, held))  # type: ignore[arg-type]
