"""TieredOptimizer as a drop-in for torch.optim.AdamW where users leave the beaten path: gradients that are
views, parameters given by name, on the meta device, frozen or thawed, and state dicts loaded around them.
Each is the regression test of a defect found where the drop-in once differed from torch."""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
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


def train(model, opt, seeds):
    for s in seeds:
        backward(model, s)
        opt.step()
        opt.zero_grad()


def test_state_for_a_frozen_parameter_loads_and_trains_once_thawed_as_torch_does(tmp_path):
    """A run resumed in a stage where a layer is frozen: torch keeps that layer's state for when it thaws."""
    ref = mlp()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    train(ref, torch_opt, range(3))
    sd = copy.deepcopy(torch_opt.state_dict())
    model = copy.deepcopy(ref)
    ref[0].weight.requires_grad_(False)
    model[0].weight.requires_grad_(False)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    with TieredOptimizer(list(model.parameters()), tmp_path, **KW) as opt:
        bad = copy.deepcopy(sd)
        bad["state"][0]["exp_avg"] = torch.zeros(3, 3)
        with pytest.raises(ValueError, match=r"exp_avg of 'group0.param0' is shape \(3, 3\); the parameter has "
                                             r"shape \(16, 8\)"):  # fmt: skip
            opt.load_state_dict(bad)
        opt.load_state_dict(copy.deepcopy(sd))
        assert torch.equal(opt.state[model[0].weight]["exp_avg"], sd["state"][0]["exp_avg"])
        assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]
        train(model, opt, range(3, 5))  # frozen: its state waits
        train(ref, torch_opt, range(3, 5))
        model[0].weight.requires_grad_(True)
        ref[0].weight.requires_grad_(True)
        train(model, opt, range(5, 8))
        train(ref, torch_opt, range(5, 8))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        assert opt.step_counts == [6, 8, 8, 8]


@pytest.mark.parametrize("split_masters", [False, True])
def test_a_bf16_load_state_dict_leaves_the_weights_and_keeps_the_masters_behind_them(tmp_path, split_masters):
    """torch's load_state_dict never writes the parameters. The masters it loads stand behind the weights where
    those are their rounding; elsewhere the weights (a write, the user's) win, as a write between steps does."""
    kw = dict(KW, split_masters=split_masters)
    model = mlp(torch.bfloat16)
    with TieredOptimizer(model, tmp_path / "a", **kw) as opt:
        train(model, opt, range(3))
        sd = opt.state_dict()
        weights = copy.deepcopy(model.state_dict())
        train(model, opt, range(3, 6))  # the run as it went on, not interrupted
    # Split masters keep only the low halves: a write of other weights after the load drops their low halves (as
    # between steps: ChunkUpdater.forget_low_halves), so there the weights must be loaded first.
    for order in ("model first",) if split_masters else ("model first", "optimizer first"):
        resumed = mlp(torch.bfloat16)  # fresh weights
        with TieredOptimizer(resumed, tmp_path / order, **kw) as opt:
            if order == "model first":
                resumed.load_state_dict(weights)
            fresh = copy.deepcopy(resumed.state_dict())
            opt.load_state_dict(sd)
            assert all(torch.equal(resumed.state_dict()[k], v) for k, v in fresh.items()), "the weights were written"
            if order == "optimizer first":
                resumed.load_state_dict(weights)
            train(resumed, opt, range(3, 6))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters())), order
    # New weights under the old state: each master stays where the weight is its rounding, else is the weight.
    new = mlp(torch.bfloat16)
    with torch.no_grad():
        new[0].weight[:8] = sd["state"][0]["master"][:8].bfloat16()  # half the rows: the masters' rounding
    with TieredOptimizer(new, tmp_path / "b", **kw) as opt:
        before = copy.deepcopy(new.state_dict())
        opt.load_state_dict(sd)
        assert all(torch.equal(new.state_dict()[k], v) for k, v in before.items())
        for i, p in enumerate(new.parameters()):
            master = sd["state"][i]["master"]
            expect = torch.where(master.bfloat16() == p, master, p.float())
            assert torch.equal(opt.state_dict()["state"][i]["master"], expect), i
        assert torch.equal(opt.state_dict()["state"][0]["master"][:8], sd["state"][0]["master"][:8])


def test_a_module_parameter_thawed_after_build_is_said_once_not_silently_left_untrained(tmp_path):
    model = mlp()
    model[0].weight.requires_grad_(False)
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(model, opt, range(2))
        model[0].weight.requires_grad_(True)
        backward(model, 2)
        with pytest.warns(UserWarning, match=r"'0.weight' of the model now have gradients.*list\(model.parameters"):
            opt.step()
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once
            train(model, opt, range(3, 5))


def test_a_module_parameter_thawed_inside_the_closure_is_said_at_that_step(tmp_path):
    model = mlp()
    model[0].weight.requires_grad_(False)

    def closure():
        opt.zero_grad()
        model[0].weight.requires_grad_(True)
        backward(model, 0)

    with TieredOptimizer(model, tmp_path, **KW) as opt:
        with pytest.warns(UserWarning, match=r"'0.weight' of the model now have gradients"):
            opt.step(closure)


def test_a_thawed_parameter_added_with_add_param_group_as_the_warning_says_is_not_warned_about(tmp_path):
    model = mlp()
    model[2].weight.requires_grad_(False)
    with TieredOptimizer(model, tmp_path, lr=1e-2, prefetch_depth=0) as opt:
        model[2].weight.requires_grad_(True)
        opt.add_param_group({"params": [model[2].weight]})  # the fix the warning names
        before = model[2].weight.detach().clone()
        backward(model, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # it is updated: nothing to say
            opt.step()
        assert not torch.equal(before, model[2].weight)


def test_a_backbone_added_after_its_head_is_laid_out_as_at_construction_and_trains_as_adamw(tmp_path):
    """torch's fine-tuning pattern: the new head trains alone, then the pre-trained backbone is unfrozen and added
    as a group of its own. An optimizer built over the head has records sized for it: the backbone was refused
    (a message about split bf16 masters, all parameters being fp32), then cut in chunks of the head's size; the
    state is now laid out again as over both groups at construction, the head's carried over."""
    built = []
    for _ in range(2):
        torch.manual_seed(0)
        backbone, head = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)), nn.Linear(16, 16)
        built.append((backbone.requires_grad_(False), head))
    (backbone, head), (ref_backbone, ref_head) = built
    torch_opt = torch.optim.AdamW(ref_head.parameters(), lr=1e-2, fused=True)
    with TieredOptimizer(head.parameters(), tmp_path, lr=1e-2) as opt:
        for step in range(5):
            if step == 2:
                for o, b in ((torch_opt, ref_backbone), (opt, backbone)):
                    o.add_param_group({"params": b.requires_grad_(True).parameters(), "lr": 1e-3})
                assert [c.group for c in opt.chunks] == [0, 1]  # one chunk each, as at construction
            for o, b, h in ((torch_opt, ref_backbone, ref_head), (opt, backbone, head)):
                h(b(torch.randn(4, 32, generator=torch.Generator().manual_seed(step)))).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        ours, theirs = opt.state_dict(), torch_opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip([*head.parameters(), *backbone.parameters()],
                                                 [*ref_head.parameters(), *ref_backbone.parameters()]))  # fmt: skip
    assert sorted(ours["state"]) == sorted(theirs["state"]) == list(range(6))
    for i, s in theirs["state"].items():
        assert float(ours["state"][i]["step"]) == float(s["step"]) and all(
            torch.equal(ours["state"][i][k], s[k]) for k in ("exp_avg", "exp_avg_sq")
        ), i


def test_unique_names_are_checked_in_linear_time():
    # 40,000 tensors (an MoE model's experts) took 11.8 s with the names checked against a list, 0.02 s with a set:
    # counted in comparisons, not timed, so that a loaded machine cannot fail it.
    from tiered import arguments

    class Names(list):
        compared = 0

        def __contains__(self, item):
            Names.compared += len(self)
            return super().__contains__(item)

    group = {"params": [torch.zeros(1) for _ in range(2000)]}
    arguments.group_names(group, 0, Names(f"x{i}" for i in range(100)))
    assert Names.compared <= 100 * 2, Names.compared  # the names already taken are read once, not per parameter


EXIT_AFTER_RELAYOUT = """
import logging, sys, tempfile, torch
from torch import nn
from tiered import TieredOptimizer
from tiered.store import TieredStore
logging.basicConfig(level=logging.WARNING)
flush = TieredStore.flush
def counted(self):
    before = self.stats()["nvme"]["bytes_written"]
    flush(self)
    print("flush at exit wrote", self.stats()["nvme"]["bytes_written"] - before, flush=True)
TieredStore.flush = counted
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
model[2].weight.requires_grad_(False)
opt = TieredOptimizer(list(model.parameters()), {root!r}, lr=1e-2, host_budget="1MiB", chunk_bytes="12KiB")
for step in range(4):
    model[2].weight.requires_grad_(step >= 2)  # thawed: the state is laid out again, over a new store
    model(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("exiting without close()", flush=True)
"""


def test_exit_after_the_state_was_laid_out_again_closes_the_optimizer_first(tmp_path):
    """The optimizer closes before its store at exit: its store then writes nothing (the state fits the host
    budget), and releasing it fails nowhere. Its store of a new layout once closed first, flushing it all."""
    from helpers import run_script

    out = run_script(EXIT_AFTER_RELAYOUT.format(root=str(tmp_path)), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "exiting without close()" in out.stdout
    assert "failed" not in out.stdout + out.stderr, out.stderr
    assert "flush at exit wrote" not in out.stdout or "flush at exit wrote 0" in out.stdout, out.stdout
    assert not any(tmp_path.iterdir())


def test_a_tensor_lr_that_a_scheduler_fills_trains_as_torch_s_fused_adamw(tmp_path):
    """torch's recipe for compiled optimizer steps: ``lr=torch.tensor(...)``, which the scheduler then fill_()s in
    place. It was refused ("tensor lr is not supported"); each step now reads its value, as torch's fused kernel
    reads a CPU lr, so the weights are torch's bit for bit, the lr stays the user's tensor, and state dicts carry
    it both ways."""
    ref, model = mlp(), mlp()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(1e-2), fused=True)
    lr = torch.tensor(1e-2)
    with TieredOptimizer(model, tmp_path, **{**KW, "lr": lr}) as opt:
        assert opt.param_groups[0]["lr"] is lr
        scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=12) for o in (torch_opt, opt)]
        for m, o, sched in zip((ref, model), (torch_opt, opt), scheds):
            for s in range(4):
                train(m, o, [s])
                sched.step()
        assert opt.param_groups[0]["lr"] is lr and torch.equal(lr, torch_opt.param_groups[0]["lr"])
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        opt.load_state_dict(torch_opt.state_dict())  # a tensor lr in a loaded state dict
        assert isinstance(opt.state_dict()["param_groups"][0]["lr"], torch.Tensor)
        lr = opt.param_groups[0]["lr"]
        for o in (torch_opt, opt):
            o.param_groups[0]["lr"].fill_(3e-3)  # by hand, in place
        train(model, opt, range(4, 6))
        train(ref, torch_opt, range(4, 6))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        with pytest.raises(ValueError, match="a tensor lr must have one element"):
            opt.add_param_group({"params": [nn.Parameter(torch.ones(2))], "lr": torch.ones(2)})
    with pytest.raises(ValueError, match="a tensor lr must be on the CPU"):
        TieredOptimizer(mlp(), tmp_path, lr=torch.tensor(1e-2, device="meta"))


def test_a_loaded_tensor_lr_is_the_optimizer_s_own_copy_as_torch_s_load_makes_it(tmp_path):
    """load_state_dict took the dict's lr tensor itself: after loading torch_opt.state_dict(), torch_opt's scheduler
    or fill_() drove tiered's lr too (and one dict loaded into two optimizers tied their lrs). torch's load
    deep-copies the param groups' settings, and so does this one now."""
    betas = (torch.tensor(0.9), torch.tensor(0.999))
    torch_opt = torch.optim.AdamW(mlp().parameters(), lr=torch.tensor(1e-2), betas=betas)
    sd = torch_opt.state_dict()
    theirs = torch_opt.param_groups[0]
    with TieredOptimizer(mlp(), tmp_path / "a", **KW) as opt, TieredOptimizer(mlp(), tmp_path / "b", **KW) as other:
        for o in (opt, other):
            o.load_state_dict(sd)
        ours = opt.param_groups[0]
        assert torch.equal(ours["lr"], theirs["lr"]) and ours["lr"] is not theirs["lr"]
        assert ours["lr"] is not other.param_groups[0]["lr"] and ours["betas"][0] is not theirs["betas"][0]
        theirs["lr"].fill_(123.0)
        theirs["betas"][0].fill_(0.5)
        assert float(ours["lr"]) == float(torch.tensor(1e-2)) and float(ours["betas"][0]) == float(torch.tensor(0.9))


@pytest.mark.parametrize("pair", [torch.tensor, np.array], ids=["tensor", "ndarray"])
def test_betas_as_one_tensor_or_array_of_two_are_taken_where_torch_takes_them(tmp_path, pair):
    """torch's AdamW takes betas as one tensor (or numpy array) of two in its constructor, add_param_group and
    load_state_dict, and so did tiered's step once set in a group; tiered's constructor, add_param_group and
    load_state_dict refused them ("betas must be two floats in [0, 1)"). Taken now, the group's value as given,
    and the weights are torch's fused AdamW's bit for bit; out of range or not two, still refused."""
    ref, model = mlp(), mlp()
    torch_opt = torch.optim.AdamW(ref[0].parameters(), lr=1e-2, betas=pair([0.8, 0.95]), fused=True)
    torch_opt.add_param_group({"params": list(ref[2].parameters()), "betas": pair([0.7, 0.9])})
    betas = pair([0.8, 0.95])
    with TieredOptimizer(model[0].parameters(), tmp_path, **KW, betas=betas) as opt:
        assert opt.param_groups[0]["betas"] is betas
        opt.add_param_group({"params": list(model[2].parameters()), "betas": pair([0.7, 0.9])})
        train(model, opt, range(3))
        train(ref, torch_opt, range(3))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        sd = torch_opt.state_dict()
        assert isinstance(sd["param_groups"][1]["betas"], (torch.Tensor, np.ndarray))  # as add_param_group kept it
        for g in torch_opt.param_groups:
            g["betas"] = pair([0.6, 0.99])
        opt.load_state_dict(sd)
        torch_opt.load_state_dict(sd)
        train(model, opt, range(3, 5))
        train(ref, torch_opt, range(3, 5))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        for bad in ([0.9, 1.0], [0.9, 0.99, 0.5], [[0.9, 0.99]]):
            with pytest.raises(ValueError, match="betas must be two floats in"):
                opt.add_param_group({"params": [nn.Parameter(torch.ones(2))], "betas": pair(bad)})
    with pytest.raises(ValueError, match="betas must be two floats in"):
        TieredOptimizer(mlp(), tmp_path / "b", **KW, betas=pair([-0.1, 0.9]))


def test_complex_and_channels_last_parameters_are_refused_as_unsupported_here_with_the_fix(tmp_path):
    """torch's AdamW steps both; the refusal said complex ones were AdamW's limit ("AdamW needs floating-point
    parameters") and named no layout."""
    with pytest.raises(TypeError, match=r"'group0.param0' is torch.complex64: TieredOptimizer does not support "
                                        r"complex parameters.*view_as_real"):  # fmt: skip
        TieredOptimizer([nn.Parameter(torch.randn(4, dtype=torch.complex64))], tmp_path)
    conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"'weight' is not contiguous \(channels_last\): TieredOptimizer does not "
                                         r"support.*torch.contiguous_format"):  # fmt: skip
        TieredOptimizer(conv, tmp_path)
    assert not any(tmp_path.iterdir())
    TieredOptimizer(conv.to(memory_format=torch.contiguous_format), tmp_path).close()  # the fix it names


def test_a_transposed_parameter_is_refused_with_a_fix_that_makes_it_contiguous(tmp_path):
    """The refusal of any non-contiguous parameter named model.to(memory_format=torch.contiguous_format), which
    converts only 4-D and 5-D tensors: a transposed weight stayed as it was, and the next build failed the same."""
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match=r"'w' is not contiguous: .*p\.data = p\.data\.contiguous\(\)") as e:
        TieredOptimizer(model, tmp_path)
    assert "memory_format" not in str(e.value)
    model.w.data = model.w.data.contiguous()  # the fix it names
    TieredOptimizer(model, tmp_path).close()


def test_a_set_of_parameters_is_refused_as_torch_refuses_one(tmp_path):
    """A set has no order from run to run, and state goes by position (checkpoint names, state dict indices): torch
    refuses one in a param group, and TieredOptimizer took it. Refused there now; a set as the whole ``params`` is
    taken, as torch takes it."""
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(4))
    with pytest.raises(TypeError, match="ordered collections"):
        torch.optim.AdamW([{"params": {a, b}}])
    torch.optim.AdamW({a, b})
    for params in ([{"params": {a, b}}], [{"params": [a]}, {"params": {b}, "lr": 0.1}]):
        with pytest.raises(TypeError, match="ordered collections"):
            TieredOptimizer(params, tmp_path)
    assert not any(tmp_path.iterdir())
    TieredOptimizer({a, b}, tmp_path).close()
    with TieredOptimizer([a], tmp_path) as opt:
        with pytest.raises(TypeError, match="ordered collections"):
            opt.add_param_group({"params": {b}})
        opt.param_groups.append({"params": {b}})  # as add_param_group adds it, at the next call
        a.grad = torch.ones(3)
        with pytest.raises(TypeError, match="ordered collections"):
            opt.step()
        opt.param_groups.pop()
        opt.step()
        assert opt.step_counts == [1]


def test_a_state_dict_says_fused_and_torch_s_fused_adamw_resumes_it_bitwise(tmp_path):
    """The groups said 'fused': None (the argument left out), though the update is always torch's fused kernel:
    torch.optim.AdamW(fused=True).load_state_dict() took that None and ran its for-loop kernel from then on, so a
    run moved from TieredOptimizer to torch's fused AdamW was no longer the run continued. A group with
    foreach=True keeps fused None (torch refuses both True); fused=False as given; a loaded None is fused too."""
    model, twin = mlp(), mlp()
    with TieredOptimizer(model, tmp_path / "a", **KW) as opt, TieredOptimizer(twin, tmp_path / "b", **KW) as other:
        for s in range(2):
            for m, o in ((model, opt), (twin, other)):
                backward(m, s)
                o.step()
                o.zero_grad()
        sd = other.state_dict()
        assert [g["fused"] for g in sd["param_groups"]] == [True]
        torch_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
        torch_opt.load_state_dict(sd)
        assert torch_opt.param_groups[0]["fused"] is True
        for s in range(2, 4):
            for m, o in ((model, opt), (twin, torch_opt)):
                backward(m, s)
                o.step()
                o.zero_grad()
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b)
        opt.load_state_dict({"state": sd["state"], "param_groups": [{**sd["param_groups"][0], "fused": None}]})
        assert opt.param_groups[0]["fused"] is True
    head, body = mlp()[2].parameters(), mlp()[0].parameters()
    with TieredOptimizer([{"params": head, "foreach": True}, {"params": body, "fused": False}], tmp_path / "c",
                         **KW) as opt:  # fmt: skip
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3))], "fused": None})
        assert [g["fused"] for g in opt.param_groups] == [None, False, True]


def test_fused_and_foreach_both_true_are_refused_by_name_as_torch_refuses_them(tmp_path):
    """torch.optim.AdamW(foreach=True, fused=True) raises; TieredOptimizer took it and silently rewrote the fused=True
    asked for to None. Both given True are refused by name, in the arguments, a group or an added group; a flag set in
    a group since, or loaded, is not (torch's AdamW runs those)."""
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        torch.optim.AdamW(mlp().parameters(), foreach=True, fused=True)
    for args, group in (({"foreach": True, "fused": True}, {}), ({"fused": True}, {"foreach": True}),
                        ({}, {"foreach": True, "fused": True})):  # fmt: skip
        where = "TieredOptimizer" if len(args) == 2 else "param group 0"
        with pytest.raises(RuntimeError, match=f"{where}: fused=True and foreach=True cannot both be set"):
            TieredOptimizer([{"params": mlp().parameters(), **group}], tmp_path / "a", **KW, **args)
        assert not os.path.exists(tmp_path / "a") or os.listdir(tmp_path / "a") == []
    model = mlp()
    with TieredOptimizer(model, tmp_path / "b", **KW, fused=True) as opt:
        with pytest.raises(RuntimeError, match="param group 1: fused=True and foreach=True cannot both be set"):
            opt.add_param_group({"params": [nn.Parameter(torch.ones(3))], "foreach": True})
        assert len(opt.param_groups) == 1 and opt.param_groups[0]["fused"] is True
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3))], "foreach": True, "fused": False})
        opt.param_groups[0]["foreach"] = True  # set since: steps, as torch's AdamW does
        backward(model, 0)
        opt.step()
        assert opt.step_counts[0] == 1


def test_fused_is_none_in_a_state_dict_beside_a_foreach_set_since_or_loaded(tmp_path):
    """foreach=True set in a group after construction (fused recorded True then), or loaded from a dict of an older
    torch that has no 'fused' key: the dict said fused=True beside foreach=True, and torch's AdamW loading it ran
    fused where the user asked for foreach. Now fused is None there, as torch sets it."""
    model = mlp()
    with TieredOptimizer(model, tmp_path / "a", **KW) as opt:
        backward(model, 0)
        opt.step()
        opt.param_groups[0]["foreach"] = True
        sd = opt.state_dict()
        assert sd["param_groups"][0]["fused"] is None and sd["param_groups"][0]["foreach"] is True
        old = {"state": sd["state"], "param_groups": [{k: v for k, v in sd["param_groups"][0].items() if k != "fused"}]}
        opt.param_groups[0]["foreach"] = None
        opt.load_state_dict(old)
        assert opt.param_groups[0]["fused"] is None and opt.param_groups[0]["foreach"] is True
