"""A list assigned to ``opt.param_groups`` is the one the optimizer goes on with, as torch.optim's: Lightning's
``BaseFinetuning`` restores its saved groups so on resume (new dicts over the same tensors, one group more where a
layer was thawed before the checkpoint), and accelerate's ``AcceleratedOptimizer`` passes such an assignment
through. The step reads the hyperparameters (an LR schedule) from the new dicts, a group appended is laid out as
``add_param_group`` lays one out, and loads and ``add_param_group`` after the assignment act on the new list.

Every case runs the same steps with ``torch.optim.AdamW(fused=True)`` (the arithmetic TieredOptimizer performs)
and compares the weights bitwise.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer

KW = dict(lr=1e-2, weight_decay=0.1)
# Several chunks, part of them on NVMe: the steps stream through the disk.
TIERED_KW = dict(**KW, chunk_bytes="12KiB", host_budget="24KiB")


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 2))


def backbone_frozen(seed: int = 0) -> nn.Module:
    """The model with its first layer frozen, as BaseFinetuning's ``freeze_before_training`` leaves it."""
    m = model(seed)
    m[0].requires_grad_(False)
    return m


def trainable(m: nn.Module) -> list[nn.Parameter]:
    return [p for p in m.parameters() if p.requires_grad]


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: range, sched=None) -> None:
    """``steps`` steps; ``sched.step()`` after each (an LR scheduler, or ``Halve``)."""
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(12, 16, generator=g), torch.randn(12, 2, generator=g)
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


class Halve:
    """Halves every group's lr at each ``step()``, in the groups ``opt.param_groups`` holds then (torch's
    schedulers refuse a group added after them)."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt

    def step(self) -> None:
        for g in self.opt.param_groups:
            g["lr"] /= 2


def new_dicts(groups: list[dict]) -> list[dict]:
    """The groups as new dicts over the same tensors (what BaseFinetuning's ``on_fit_start`` assigns)."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])} for g in groups]


def thawed_group(opt: torch.optim.Optimizer, m: nn.Module) -> dict:
    """The first layer thawed, as a group of its own with the first group's settings and a lower lr (the shape of
    the group ``BaseFinetuning.unfreeze_and_add_param_group`` adds, as its saved groups restore it)."""
    m[0].requires_grad_(True)
    first = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    return {**first, "params": list(m[0].parameters()), "lr": first["lr"] / 10}


def both(tmp_path, run: Callable[[str, nn.Module, Callable], None], make_model=model, **tiered_kw) -> None:
    """``run(kind, model, make_optimizer)`` with AdamW, then with TieredOptimizer; the weights bitwise equal."""
    weights = {}
    made: list[torch.optim.Optimizer] = []

    def make(params) -> torch.optim.Optimizer:
        if kind == "adamw":
            made.append(torch.optim.AdamW(params, **KW, fused=True))
        else:
            made.append(TieredOptimizer(params, tmp_path, **{**TIERED_KW, **tiered_kw}))
        return made[-1]

    for kind in ("adamw", "tiered"):
        m = make_model()
        run(kind, m, make)
        weights[kind] = [p.detach().clone() for p in m.parameters()]
    for o in made:
        if isinstance(o, TieredOptimizer):
            assert o.stats()["total"]["nvme_read_bytes"] > 0, "the steps did not stream through NVMe"
            o.close()
    before = [p.detach() for p in make_model().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, weights["adamw"])), "nothing trained"
    for i, (a, t) in enumerate(zip(weights["adamw"], weights["tiered"])):
        assert torch.equal(a, t), f"parameter {i}: tiered differs from AdamW by {(a - t).abs().max().item()}"


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_new_dicts_over_the_same_tensors_take_the_lr_schedule(tmp_path, update_on):
    """``opt.param_groups = [new dicts]`` before a LambdaLR that divides the lr by 10 a step: the step reads the lr
    from the new dicts (it went on at the first lr before), and ``state_dict()`` shows it."""

    def run(kind, m, make):
        opt = make(m.parameters())
        opt.param_groups = new_dicts(opt.param_groups)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1**s)
        train(m, opt, range(4), sched)
        assert opt.state_dict()["param_groups"][0]["lr"] == pytest.approx(1e-2 * 0.1**4)

    both(tmp_path, run, update_on=update_on)


def test_an_appended_group_is_laid_out_and_trains(tmp_path):
    """After steps, the first layer thawed and the groups assigned anew with a group for it appended: the new
    group trains from fresh state at its own lr, the old one keeps its state and follows the schedule."""

    def run(kind, m, make):
        opt = make(trainable(m))
        sched = Halve(opt)
        train(m, opt, range(2), sched)
        opt.param_groups = [*new_dicts(opt.param_groups), thawed_group(opt, m)]
        train(m, opt, range(2, 5), sched)
        assert [len(g["params"]) for g in opt.state_dict()["param_groups"]] == [4, 2]

    both(tmp_path, run, make_model=backbone_frozen)


def test_a_resume_that_assigns_the_thawed_group_before_the_load(tmp_path):
    """BaseFinetuning's resume after the thaw: a new optimizer over the trainable parameters (the first layer
    frozen again), the saved groups assigned (two), the state dict loaded, the layer thawed, more steps."""

    def run(kind, m, make):
        opt = make(trainable(m))
        train(m, opt, range(2))
        opt.add_param_group(thawed_group(opt, m))
        train(m, opt, range(2, 4))
        sd, saved = opt.state_dict(), new_dicts(opt.param_groups)
        m[0].requires_grad_(False)
        resumed = make(trainable(m))
        resumed.param_groups = saved
        resumed.load_state_dict(sd)
        m[0].requires_grad_(True)
        train(m, resumed, range(4, 6))

    both(tmp_path, run, make_model=backbone_frozen)


def test_add_param_group_after_an_assignment_and_a_load(tmp_path):
    """BaseFinetuning's resume before the thaw: the groups assigned anew (the same tensors), the state dict
    loaded, then the thaw's ``add_param_group`` (it raised IndexError: the group went to a list nobody read)."""

    def run(kind, m, make):
        opt = make(trainable(m))
        train(m, opt, range(2))
        sd = opt.state_dict()
        resumed = make(trainable(m))
        resumed.param_groups = new_dicts(resumed.param_groups)
        resumed.load_state_dict(sd)
        resumed.add_param_group(thawed_group(resumed, m))
        train(m, resumed, range(2, 5))
        assert [len(g["params"]) for g in resumed.param_groups] == [4, 2]

    both(tmp_path, run, make_model=backbone_frozen)


def test_a_group_dropped_or_grown_by_assignment_is_refused_by_name_and_nothing_changes(tmp_path):
    m = model()
    with TieredOptimizer([{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}], tmp_path,
                         **TIERED_KW) as opt:  # fmt: skip
        train(m, opt, range(1))
        groups = opt.param_groups
        opt.param_groups = groups[:1]
        with pytest.raises(ValueError, match=r"holds 1 groups.*laid out over 2.*requires_grad_\(False\)"):
            opt.step()
        assert len(opt.param_groups) == 1
        opt.param_groups = [groups[0], {**groups[1], "params": [*groups[1]["params"], *m[4].parameters()]}]
        with pytest.raises(ValueError, match=r"param_groups\[1\] holds 4 parameters.*over 2 there.*add_param_group"):
            opt.step()
        opt.param_groups = groups
        train(m, opt, range(1, 2))


def test_an_appended_group_torch_refuses_stays_in_the_list_and_is_refused_again(tmp_path):
    """A group appended with a parameter another group holds: torch's ``add_param_group`` check refuses it at each
    call, the list stays as assigned; once it is put right the group is laid out."""
    m = model()
    with TieredOptimizer(list(m[0].parameters()), tmp_path, **TIERED_KW) as opt:
        bad = {"params": [m[0].weight, *m[2].parameters()]}
        opt.param_groups = [*opt.param_groups, bad]
        for _ in range(2):
            with pytest.raises(ValueError, match="more than one parameter group"):
                opt.step()
            assert opt.param_groups[1] is bad
        bad["params"] = list(m[2].parameters())
        train(m, opt, range(1))
        assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
        assert opt.state[m[2].weight]["step"] == 1


# ------------------------------------------------------------------------------------------------------ FSDP2
def _fsdp2_assigned(rank: int, world: int, root: str) -> list[bool]:
    from torch.distributed.fsdp import fully_shard

    runs = {}
    for kind in ("adamw", "tiered"):
        m = model()
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
        if kind == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(m.parameters(), **KW, fused=True)
        else:
            opt = TieredOptimizer(m.parameters(), root, **TIERED_KW)
        opt.param_groups = new_dicts(opt.param_groups)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1**s)
        for step in range(4):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(12, 16, generator=g), torch.randn(12, 2, generator=g)
            nn.functional.mse_loss(m(x[rank::world]), y[rank::world]).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        runs[kind] = [p.full_tensor() for p in m.parameters()]
        if isinstance(opt, TieredOptimizer):
            opt.close()
    return [torch.equal(a, t) for a, t in zip(runs["adamw"], runs["tiered"])]


def test_new_dicts_over_the_same_tensors_under_fsdp2(tmp_path):
    """The same, over DTensor parameters on a 2-rank gloo mesh: the step reads the schedule's lr there too."""
    from distributed_common import run_ranks

    for rank, same in enumerate(run_ranks(_fsdp2_assigned, 2, str(tmp_path))):
        assert all(same), f"rank {rank}: parameters {[i for i, s in enumerate(same) if not s]} differ from AdamW"
