"""The optimizer's own clip (``max_grad_norm``): asked whether it scaled (the update under backward must know) or
not (the host then does not wait for the GPU), the gradients come out with torch's bits: those of
``torch.nn.utils.clip_grad_norm_`` where it scales, untouched where it would multiply by 1, and untouched when the
norm is not finite in both forms. Deferred (an offloaded model's), the gradients stay as they are and the
coefficient left for the update gives torch's bits when applied as the update applies it."""

from __future__ import annotations

import pytest
import torch

from tiered.optim.shards import Shards, total_norm_on


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


def _mixed() -> list[torch.nn.Parameter]:
    """Gradients of three dtypes, interleaved: torch groups them by dtype for the norm and the scale."""
    g = torch.Generator().manual_seed(1)
    out = []
    for n, dtype in ((9, torch.bfloat16), (40, torch.float32), (17, torch.float16), (5, torch.bfloat16)):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = (torch.randn(n, generator=g) * 3).to(dtype)
        out.append(p)
    return out


@pytest.mark.parametrize("make", [lambda: _params(10.0, torch.bfloat16), lambda: _params(10.0, torch.float32), _mixed],
                         ids=["bf16", "fp32", "mixed"])  # fmt: skip
@pytest.mark.parametrize("answer", [True, False])
def test_a_deferred_clip_leaves_the_gradients_and_its_scale_gives_torchs_bits(make, answer: bool) -> None:
    ours, ref = make(), make()
    before = [p.grad.clone() for p in ours]  # type: ignore[union-attr]
    shards = Shards(list(ours))
    scaled = shards.clip_grad_norm_(list(range(len(ours))), 1.0, answer=answer, defer=True)
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert scaled is (True if answer else None)
    scale = shards.deferred_scale
    assert scale is not None
    for p, r, b in zip(ours, ref, before):
        assert torch.equal(p.grad, b)  # type: ignore[arg-type]  # left for the update
        applied = p.grad * scale  # type: ignore[operator]  # what transfer.py's reads do
        assert applied.dtype == r.grad.dtype  # type: ignore[union-attr]
        assert torch.equal(applied, r.grad)  # type: ignore[arg-type]
        assert not torch.equal(applied, b)


def test_a_deferred_clip_below_the_norm_leaves_no_scale_when_asked() -> None:
    shards = Shards(_params(1e-3, torch.float32))
    assert shards.clip_grad_norm_([0, 1, 2], 1.0, answer=True, defer=True) is False
    assert shards.deferred_scale is None
    shards.clip_grad_norm_([0, 1, 2], 1.0, answer=False, defer=True)  # unasked: a factor of exactly 1
    assert shards.deferred_scale is not None and float(shards.deferred_scale) == 1.0


def test_the_norm_copied_one_tensor_at_a_time_is_torchs_bitwise() -> None:
    grads = [p.grad for p in _mixed()]
    ref = torch.nn.utils.get_total_norm(grads)  # type: ignore[arg-type]
    ours = total_norm_on(grads, torch.device("cpu"))  # type: ignore[arg-type]
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)


def _with_an_empty_gradient(seed: int) -> list[torch.nn.Parameter]:
    """fp32 gradients, one of them of a zero-size parameter (torch's AdamW trains those, and its clip counts them)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1056, 1600, 0, 1024, 1056, 1024, 1360, 1056)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 10
    return params


@pytest.mark.parametrize(("answer", "defer"), [(True, False), (False, False), (True, True)])
def test_a_zero_size_gradient_counts_in_the_norm_as_in_torchs(answer: bool, defer: bool) -> None:
    """torch stacks one norm a gradient, a zero-size one's 0 included, and the norm of that stack rounds otherwise
    with one term fewer: left out, the norm was an ulp off on about one draw in ten, and every clipped gradient
    with it."""
    for seed in range(10):
        ours, ref = _with_an_empty_gradient(seed), _with_an_empty_gradient(seed)
        shards = Shards(list(ours))
        shards.clip_grad_norm_(list(range(len(ours))), 0.5, answer=answer, defer=defer)
        norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        assert torch.equal(shards.last_norm, norm), seed  # type: ignore[arg-type]
        scale = shards.deferred_scale if defer else 1
        assert all(torch.equal(p.grad * scale, r.grad) for p, r in zip(ours, ref)), seed  # type: ignore[operator]
    grads = [p.grad for p in _with_an_empty_gradient(2)]
    assert torch.equal(total_norm_on(grads, torch.device("cpu")), torch.nn.utils.get_total_norm(grads))  # type: ignore[arg-type]


def test_an_optimizer_with_a_zero_size_parameter_clips_and_steps_as_torch(tmp_path) -> None:
    from tiered import TieredOptimizer

    ours, ref = _with_an_empty_gradient(0), _with_an_empty_gradient(0)
    torch_opt = torch.optim.AdamW(ref, lr=0.01, fused=True)
    g = torch.Generator().manual_seed(0)
    with TieredOptimizer(ours, tmp_path, lr=0.01, max_grad_norm=0.5) as opt:
        for step in range(10):
            for p, r in zip(ours, ref):
                p.grad = torch.randn(p.shape, generator=g) * 10
                r.grad = p.grad.clone()
            norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
            opt.step()
            torch_opt.step()
            assert opt.stats()["grad_norm"] == norm.item(), step
            assert all(torch.equal(p, r) for p, r in zip(ours, ref)), step


def _layers() -> torch.nn.ParameterList:
    """Tensors of many sizes and gradient scales, so that summing their norms in another order rounds otherwise."""
    torch.manual_seed(0)
    sizes = (3000, 7, 1500, 33, 900, 2, 4000, 11, 600)
    return torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n)) for n in sizes)


def _grads(m: torch.nn.ParameterList, step: int) -> None:
    """The step's gradients, the same for both models, of norms that differ tensor to tensor."""
    g = torch.Generator().manual_seed(step)
    for p in m:
        p.grad = torch.randn(p.shape, generator=g) * (1 + p.numel() % 7)


def _thaw_and_add(m: torch.nn.ParameterList, o: torch.optim.Optimizer) -> None:
    """The first layers, frozen when the optimizer was built, thawed and added: in the groups after the rest."""
    for p in list(m)[:5]:
        p.requires_grad_(True)
    o.add_param_group({"params": list(m)[:5]})


def _reorder_groups(m: torch.nn.ParameterList, o: torch.optim.Optimizer) -> None:
    """As above, then each group's tensors reversed (tiered's state follows them: groups.placed)."""
    _thaw_and_add(m, o)
    for g in o.param_groups:
        g["params"].reverse()


@pytest.mark.parametrize("change", [_thaw_and_add, _reorder_groups], ids=["add_param_group", "reordered"])
@pytest.mark.parametrize("kw", [{}, dict(update_on="device", update_in_backward=True)], ids=["host", "device"])
def test_the_clip_of_an_optimizer_built_from_a_model_sums_in_the_models_order(tmp_path, change, kw) -> None:
    """Users clip with ``clip_grad_norm_(model.parameters())``, whose norm rounds by the order of the tensors. A
    model whose first layers are thawed and added later lists them last in ``param_groups``: the clip summed in
    that order, an ulp off torch's norm, and the weights drifted from the first clipped step. Built from the
    model, the optimizer takes its order, and every step is bitwise torch's."""
    from tiered import TieredOptimizer

    ref, ours = _layers(), _layers()
    for m in (ref, ours):
        for p in list(m)[:5]:
            p.requires_grad_(False)
    torch_opt = torch.optim.AdamW(list(ref)[5:], lr=1e-2, fused=True)
    with TieredOptimizer(ours, tmp_path, lr=1e-2, max_grad_norm=0.1, **kw) as opt:
        for m, o in ((ref, torch_opt), (ours, opt)):
            change(m, o)
        for step in range(12):
            for m, o in ((ref, torch_opt), (ours, opt)):
                _grads(m, step)
                if o is torch_opt:
                    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
                o.step()
            assert opt.stats()["grad_norm"] == norm.item(), step
            assert all(torch.equal(p, r) for p, r in zip(ours, ref)), step


def test_the_clip_of_an_optimizer_built_from_a_list_sums_in_group_order(tmp_path) -> None:
    """Built from groups (HF Trainer's decay and no-decay groups), the optimizer knows no model: its clip is
    ``clip_grad_norm_`` over the tensors in ``param_groups`` order, bitwise, as the README says."""
    from tiered import TieredOptimizer

    ref, ours = _layers(), _layers()
    groups = [[m[i] for i in (8, 1, 6, 3)] for m in (ref, ours)], [[m[i] for i in (4, 5, 2, 7, 0)] for m in (ref, ours)]
    torch_opt = torch.optim.AdamW([{"params": groups[0][0]}, {"params": groups[1][0]}], lr=1e-2, fused=True)
    with TieredOptimizer([{"params": groups[0][1]}, {"params": groups[1][1]}], tmp_path, lr=1e-2,
                         max_grad_norm=0.1) as opt:  # fmt: skip
        for step in range(6):
            for m, o in ((ref, torch_opt), (ours, opt)):
                _grads(m, step)
                if o is torch_opt:
                    torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], 0.1)
                o.step()
            assert all(torch.equal(p, r) for p, r in zip(ours, ref)), step
