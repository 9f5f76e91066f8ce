"""The optimizer's own clip (``max_grad_norm``): asked whether it scaled (the update under backward must know) or
not (the host then does not wait for the GPU), the gradients come out with torch's bits: those of
``torch.nn.utils.clip_grad_norm_`` where it scales, untouched where it would multiply by 1, and untouched when the
norm is not finite in both forms."""

from __future__ import annotations

import pytest
import torch

from tiered.optim.shards import Shards


def _params(scale: float, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (7, 130, 33)]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(dtype)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [10.0, 1e-3])  # a norm far above max_norm, and one below it
@pytest.mark.parametrize("answer", [True, False])
def test_clip_gives_torchs_bits_asked_or_not(dtype: torch.dtype, scale: float, answer: bool) -> None:
    ours, ref = _params(scale, dtype), _params(scale, dtype)
    before = [p.grad.clone() for p in ours]  # type: ignore[union-attr]
    scaled = Shards(list(ours)).clip_grad_norm_([0, 1, 2], 1.0, answer=answer)
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    for p, r, b in zip(ours, ref, before):
        assert torch.equal(p.grad, r.grad)  # type: ignore[arg-type]
        assert torch.equal(p.grad, b) == (scale < 1)  # type: ignore[arg-type]
    assert scaled is ((scale > 1) if answer else None)


@pytest.mark.parametrize("answer", [True, False])
def test_a_norm_that_is_not_finite_leaves_the_gradients_alone(answer: bool) -> None:
    ours = _params(1.0, torch.float32)
    ours[1].grad[3] = float("nan")  # type: ignore[index]
    before = [p.grad.clone() for p in ours]  # type: ignore[union-attr]
    scaled = Shards(list(ours)).clip_grad_norm_([0, 1, 2], 1.0, answer=answer)
    for p, b in zip(ours, before):
        assert torch.equal(p.grad.nan_to_num(), b.nan_to_num())  # type: ignore[union-attr]
    assert scaled is (False if answer else None)
