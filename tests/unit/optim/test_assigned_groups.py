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


# ------------------------------------------------------------------------------- the same tensors, reordered
def square(seed: int = 0) -> nn.Module:
    """Hidden layers of one shape: a tensor given another's state by position goes on without an error (it only
    trains wrong)."""
    torch.manual_seed(seed)
    hidden = [layer for _ in range(4) for layer in (nn.Linear(48, 48), nn.Tanh())]
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), *hidden, nn.Linear(48, 2))


def layer_groups(m: nn.Module, named: bool = False) -> list[dict]:
    """Three groups at their own lr: two of two hidden layers each, one of the first and the last layer."""

    def params(layers: list[int]) -> list:
        return [(f"{i}.{n}", p) if named else p for i in layers for n, p in m[i].named_parameters()]

    return [{"params": params(ls), "lr": lr} for ls, lr in (([2, 4], 1e-2), ([6, 8], 3e-3), ([0, 10], 5e-3))]


def swapped(groups: list[dict]) -> list[dict]:
    """The first two groups in the other order (one shape at each place)."""
    return [groups[1], groups[0], *groups[2:]]


def layers_swapped(groups: list[dict]) -> list[dict]:
    """The first group's two layers in the other order (one shape at each place), and its ``param_names``."""
    first = {
        **groups[0],
        **{k: [*groups[0][k][2:], *groups[0][k][:2]] for k in ("params", "param_names") if k in groups[0]},
    }
    return [first, *groups[1:]]


def reversed_within(groups: list[dict]) -> list[dict]:
    """Each group's tensors in reverse order (and its ``param_names``, where torch keeps them)."""
    return [{**g, **{k: g[k][::-1] for k in ("params", "param_names") if k in g}} for g in groups]


def regrouped(groups: list[dict]) -> list[dict]:
    """The first group's last tensor moved to the end of the second (it trains at that group's lr from then)."""
    first, second = groups[:2]
    moved = [{**first, "params": first["params"][:-1]}, {**second, "params": [*second["params"], first["params"][-1]]}]
    return [*moved, *groups[2:]]


@pytest.mark.parametrize("reorder", [swapped, layers_swapped, reversed_within, regrouped])
def test_the_same_tensors_in_other_places_keep_their_state(tmp_path, reorder):
    """Groups reordered (a framework restoring them in its saved order), tensors reordered within a group or moved
    to another: torch keys the state by tensor, so that changes nothing there; each tensor keeps its own state
    here too (they took each other's, position by position)."""

    def run(kind, m, make):
        opt = make(layer_groups(m))
        train(m, opt, range(3))
        opt.param_groups = reorder(opt.param_groups)
        train(m, opt, range(3, 6))

    both(tmp_path, run, make_model=square)


@pytest.mark.parametrize("reorder", [swapped, reversed_within])
def test_8bit_moments_keep_their_codes_where_whole_groups_are_reordered(tmp_path, reorder):
    """With ``moments_dtype="int8"`` the state is carried over as fp32 values and quantized again in the new
    layout's blocks (the README says so): whole groups reordered land in blocks of the same elements, so the codes,
    and the steps after, are bitwise those of the optimizer left in its order; tensors moved within a group are
    quantized again in other blocks, each moment within its quantization error."""
    runs = []
    for i, reorder_now in enumerate((False, True)):
        m = square()
        with TieredOptimizer(layer_groups(m), tmp_path / str(i), **TIERED_KW, moments_dtype="int8") as opt:
            train(m, opt, range(3))
            if reorder_now:
                opt.param_groups = reorder(opt.param_groups)
            state = [{k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()]
            train(m, opt, range(3, 5))
            runs.append((state, [p.detach().clone() for p in m.parameters()]))
    (kept, kept_weights), (moved, moved_weights) = runs
    for a, b in zip(kept, moved):
        for key in ("exp_avg", "exp_avg_sq"):
            if reorder is swapped:
                assert torch.equal(a[key], b[key]), key
            else:
                assert torch.allclose(a[key], b[key], rtol=0, atol=0.05 * a[key].abs().max().item()), key
    if reorder is swapped:
        assert all(torch.equal(a, b) for a, b in zip(kept_weights, moved_weights))


@pytest.mark.parametrize("named", [False, True], ids=["numbered", "named"])
@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
@pytest.mark.parametrize("after", [0, 2])
def test_a_save_after_a_reorder_loads_into_an_optimizer_built_in_the_new_order(tmp_path, named, how, after):
    """Names follow the tensors (a named parameter's, as state_dict()'s param_names and checkpoints key it), and
    a number of a place (``group0.param1``) numbers the new place, as a new optimizer over the new order numbers
    it: a state dict or checkpoint saved after a reorder (``after`` steps) loads into one and goes on as AdamW."""

    def reorder(groups: list[dict]) -> list[dict]:
        return layers_swapped(swapped(groups))

    def run(kind, m, make):
        opt = make(layer_groups(m, named))
        train(m, opt, range(after))
        opt.param_groups = reorder(opt.param_groups)
        train(m, opt, range(after, 3))
        if kind == "tiered":
            names = [f"{i}.{n}" for i in (8, 6, 2, 4, 0, 10) for n in ("weight", "bias")]
            numbered = [f"group{g}.param{i}" for g in range(3) for i in range(4)]
            assert opt.param_names == (names if named else numbered)
            saved = [g.get("param_names") for g in opt.state_dict()["param_groups"]]
            assert saved == ([names[:4], names[4:8], names[8:]] if named else [None] * 3)
        again = reorder(layer_groups(m, named))
        if kind == "tiered" and how == "checkpoint":
            path = opt.save_checkpoint(tmp_path / "ck")
            opt.close()
            resumed = make(again)
            resumed.load_checkpoint(path)
        else:
            sd = opt.state_dict()
            resumed = make(again)
            resumed.load_state_dict(sd)
        train(m, resumed, range(3, 6))

    both(tmp_path, run, make_model=square)


def test_a_new_tensor_in_a_place_and_a_moved_one(tmp_path):
    """A tensor replaced in its place by a copy (a model moved or reloaded) takes the state laid out there, while
    two others swap places and keep theirs: as AdamW over the tensors it had, each with its own state."""

    def run(kind, m, make):
        opt = make(layer_groups(m))
        train(m, opt, range(3))
        first, second = (g["params"] for g in opt.param_groups[:2])
        first[1], first[3] = first[3], first[1]  # the two layers' biases, of one shape
        if kind == "tiered":  # AdamW's state is keyed by the tensor: a new one starts afresh there
            m[8].weight = nn.Parameter(m[8].weight.detach().clone())
            second[2] = m[8].weight
        train(m, opt, range(3, 6))

    both(tmp_path, run, make_model=square)


def test_a_state_dict_handed_out_before_a_reorder_stays_its_tensors(tmp_path):
    """``opt.state[p]`` read before the groups are reordered, written after the optimizer followed the reorder:
    the write goes to ``p``'s state, as into torch's live dict."""

    def run(kind, m, make):
        opt = make(layer_groups(m))
        train(m, opt, range(3))
        held = opt.state[m[2].weight]
        opt.param_groups = swapped(opt.param_groups)
        opt.state_dict()  # follows the reorder
        held["exp_avg"].zero_()
        train(m, opt, range(3, 6))

    both(tmp_path, run, make_model=square)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("reorder", [swapped, layers_swapped])
def test_a_write_to_a_handed_dict_not_yet_taken_in_at_a_reorder_stays_its_tensors(tmp_path, when, reorder):
    """``opt.state[p]`` written in place just before or just after the groups are reordered, nothing in between
    (a moment rescaled, then a framework restoring its groups): the next step takes the write in for ``p``, as
    torch's live dict has it, not for the tensor now in ``p``'s old place."""

    def run(kind, m, make):
        opt = make(layer_groups(m))
        train(m, opt, range(3))
        held = opt.state[m[2].weight]
        if when == "before":
            held["exp_avg"].mul_(0.5)
        opt.param_groups = reorder(opt.param_groups)
        if when == "after":
            held["exp_avg"].mul_(0.5)
        train(m, opt, range(3, 6))

    both(tmp_path, run, make_model=square)


def test_opt_state_answers_for_each_tensor_after_a_reorder_and_for_an_appended_group(tmp_path):
    """``p in opt.state`` before anything followed the reorder: the tensor's own answer (it read another's), and
    False, not IndexError, for a tensor of a group appended but not yet laid out."""
    m = square()
    m[0].requires_grad_(False)
    with TieredOptimizer(layer_groups(m), tmp_path, **TIERED_KW) as opt:
        train(m, opt, range(1))
        opt.param_groups = [opt.param_groups[2], *opt.param_groups[:2]]
        assert m[2].weight in opt.state and m[0].weight not in opt.state
        new = nn.Parameter(torch.zeros(3))
        opt.param_groups = [*opt.param_groups, {"params": [new]}]
        assert new not in opt.state
        assert opt.state[new] == {}
        assert m[2].weight in opt.state and m[0].weight not in opt.state


def test_a_new_tensor_in_the_place_of_one_still_there_is_refused_by_name_and_nothing_changes(tmp_path):
    """A new tensor where a tensor laid out was, that one now elsewhere: whose state it should take is unknown.
    A tensor in two places is refused too. Put right, the optimizer trains as before."""
    m = square()
    with TieredOptimizer(layer_groups(m, named=True), tmp_path, **TIERED_KW) as opt:
        train(m, opt, range(1))
        first = opt.param_groups[0]["params"]
        kept = list(first)
        first[0], first[2] = nn.Parameter(torch.zeros(48, 48)), first[0]
        with pytest.raises(
            ValueError, match=r"param_groups\[0\]\[0\].*place of '2.weight'.*now at param_groups\[0\]\[2\]"
        ):
            opt.step()
        first[:] = [kept[0], kept[0], *kept[2:]]
        with pytest.raises(ValueError, match=r"'2.weight' is in param_groups twice"):
            opt.step()
        first[:] = kept
        assert opt.param_names[:2] == ["2.weight", "2.bias"]
        train(m, opt, range(1, 2))
        assert opt.state[kept[0]]["step"] == 2


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
