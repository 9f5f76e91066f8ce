"""TieredOptimizer as a drop-in for torch.optim.AdamW where users leave the beaten path: gradients that are
views, parameters given by name, on the meta device, frozen or thawed, and state dicts loaded around them.
Each is the regression test of a defect found where the drop-in once differed from torch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer

KW = dict(lr=1e-2, host_budget="60KiB", chunk_bytes="12KiB", prefetch_depth=2)


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(dtype)


def backward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g).to(next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()


@pytest.mark.parametrize(
    "grad_of_step",
    [
        lambda s: torch.randn(128, generator=torch.Generator().manual_seed(s))[::2],  # a view into a flat buffer
        lambda s: torch.randn(1, generator=torch.Generator().manual_seed(s)).expand(64),  # a broadcast gradient
    ],
    ids=["strided", "expanded"],
)
def test_a_strided_or_expanded_grad_updates_as_its_values_say(tmp_path, grad_of_step):
    """torch's fused CPU kernel reads a gradient's memory as if it were dense: the update must read the values."""
    ours, ref = (nn.Parameter(torch.linspace(-1, 1, 64)) for _ in range(2))
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    with TieredOptimizer([ours], tmp_path, **KW) as opt:
        for s in range(3):
            ours.grad = grad_of_step(s)
            assert not ours.grad.is_contiguous()
            ref.grad = grad_of_step(s).contiguous()
            opt.step()
            torch_opt.step()
            assert torch.equal(ours, ref), s


def test_a_meta_parameter_is_refused_by_name_with_the_fix(tmp_path):
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"parameter 'weight' is on the meta device.*to_empty"):
        TieredOptimizer(model, tmp_path)
    assert not any(tmp_path.iterdir())  # its folder is gone again


def test_named_parameters_are_taken_as_torch_takes_them_and_their_names_key_the_state(tmp_path):
    model, ref = mlp(), mlp()
    torch_opt = torch.optim.AdamW(ref.named_parameters(), lr=1e-2, fused=True)
    with TieredOptimizer(model.named_parameters(), tmp_path / "a", **KW) as opt:
        names = [n for n, _ in model.named_parameters()]
        assert opt.param_names == names and opt.param_groups[0]["param_names"] == names
        for s in range(3):
            backward(model, s), backward(ref, s)
            opt.step(), torch_opt.step()
            opt.zero_grad(), torch_opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        sd = opt.state_dict()
        assert sd["param_groups"][0]["param_names"] == torch_opt.state_dict()["param_groups"][0]["param_names"]
        torch.optim.AdamW(copy.deepcopy(ref).named_parameters(), lr=1e-2).load_state_dict(sd)
        ck = opt.save_checkpoint(tmp_path / "ck")
    # Names key the state: a checkpoint of named parameters loads into an optimizer built from the module.
    twin = mlp()
    with TieredOptimizer(twin, tmp_path / "b", **KW) as opt:
        opt.load_checkpoint(ck)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
        assert opt.step_counts == [3] * 4
    # Named param groups, and one added later.
    first, second = mlp(), mlp()
    groups = [{"params": list(first.named_parameters()), "lr": 1e-3}]
    with TieredOptimizer(groups, tmp_path / "c", **KW) as opt:
        opt.add_param_group({"params": [(f"second.{n}", p) for n, p in second.named_parameters()]})
        assert opt.param_names == names + [f"second.{n}" for n in names]
        with pytest.raises(ValueError, match="two parameters are named '0.weight'"):
            opt.add_param_group({"params": [("0.weight", nn.Parameter(torch.zeros(2)))]})
        assert len(opt.param_groups) == 2 and len(opt.param_names) == 8  # the failed group left nothing behind


def test_named_parameters_given_wrong_are_refused_by_name(tmp_path):
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="two parameters are named 'w'"):
        TieredOptimizer([("w", a), ("w", b)], tmp_path)
    with pytest.raises(TypeError, match=r"mixes \(name, tensor\) pairs with a Parameter"):
        TieredOptimizer([("w", a), b], tmp_path)
    with pytest.raises(ValueError, match="name all of them"):
        TieredOptimizer([{"params": [("w", a)]}, {"params": [b]}], tmp_path)
    assert not any(tmp_path.iterdir())
