"""TieredOptimizer where code written for torch.optim.AdamW meets it: GradScaler, writes to the parameters,
add_param_group, AdamW's keyword arguments, opt.state, state-dict hooks, torch.compile, default folders,
host budgets larger than the state, and state dicts of state larger than the host budget."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch
from helpers import run_script
from torch import nn

import tiered.store.workdir
from tiered import TieredOptimizer

KW = dict(lr=1e-2, host_budget="60KiB", chunk_bytes="12KiB", prefetch_depth=2)


def mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dtype)


def backward(model: nn.Module, seed: int, scaler: torch.amp.GradScaler | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 32, generator=g).to(next(model.parameters()).dtype)
    loss = model(x).float().pow(2).mean()
    (loss if scaler is None else scaler.scale(loss)).backward()


def assert_same_weights(a: nn.Module, b: nn.Module, **tol) -> None:
    torch.testing.assert_close(list(a.parameters()), list(b.parameters()), **tol)


# ---------------------------------------------------------------------------------------- GradScaler
def test_grad_scaler_after_a_plain_step_and_skipped_overflows_match_adamw(tmp_path):
    # Before: GradScaler.step crashed after a plain step (grad_scale None), and overflows were invisible to
    # frameworks because the optimizer claimed _step_supports_amp_scaling.
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        assert not getattr(opt, "_step_supports_amp_scaling", False)
        for m, o in ((ref, ref_opt), (model, opt)):
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            backward(m, 0)
            o.step()  # a plain step first (warm-up without AMP)
            o.zero_grad()
            for s in range(1, 5):
                backward(m, s, scaler)
                if s == 2:  # an overflow: the scaler must skip the step and halve its scale
                    next(m.parameters()).grad[0, 0] = float("inf")
                scaler.step(o)
                scaler.update()
                o.zero_grad()
            assert scaler.get_scale() == 1024.0 / 2
        assert opt.global_step == 4  # one plain step and three of the four scaled ones
        assert_same_weights(ref, model, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------- writes to the parameters
def test_weights_loaded_after_the_optimizer_is_built_are_trained_not_reverted(tmp_path):
    pretrained = mlp()
    with torch.no_grad():
        for p in pretrained.parameters():
            p.mul_(3).add_(0.5)
    ref, model = mlp(), mlp()
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        model.load_state_dict(pretrained.state_dict())  # after building: "build the optimizer, then load"
        ref.load_state_dict(pretrained.state_dict())
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for s in range(3):
            for m, o in ((ref, ref_opt), (model, opt)):
                backward(m, s)
                o.step()
                o.zero_grad()
            for m in (ref, model):  # in-place writes between steps, also through .data (EMA swaps, clipping)
                m[0].weight.data.mul_(0.5)
                with torch.no_grad():
                    m[2].bias.clamp_(-0.01, 0.01)
        assert_same_weights(ref, model, rtol=1e-6, atol=1e-7)


def test_a_write_to_a_bf16_parameter_reaches_its_master(tmp_path):
    for split in (False, True):
        model = mlp(torch.bfloat16)
        with TieredOptimizer(model, tmp_path, **KW, update_on="device", split_masters=split) as opt:
            backward(model, 0)
            opt.step()
            opt.zero_grad()
            w = model[0].weight
            with torch.no_grad():
                w[:3].fill_(0.25)  # a partial write: other elements keep their masters' extra precision
            i = next(i for i, p in enumerate(opt.params) if p is w)
            master = opt.state_dict()["state"][i]["master"]
            assert torch.equal(master[:3], torch.full_like(master[:3], 0.25))
            assert torch.equal(master.to(torch.bfloat16), w.detach())
            # Full masters keep the low bits of untouched elements; split ones take the parameter as it is.
            assert torch.equal(master[3:], w.detach()[3:].float()) == split
            backward(model, 1)
            opt.step()  # trains on from the written value
            assert (w.detach()[:3] != 0.25).float().mean() > 0.9


# --------------------------------------------------------------------------- torch.optim's surface
def test_add_param_group_trains_the_new_parameters_as_adamw_does(tmp_path):
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.AdamW(ref[0].parameters(), lr=1e-2)
    with TieredOptimizer(list(model[0].parameters()), tmp_path, **KW) as opt:
        for step in range(4):
            if step == 2:  # e.g. a fine-tuning callback unfreezing the head
                ref_opt.add_param_group({"params": list(ref[2].parameters()), "lr": 5e-3})
                opt.add_param_group({"params": list(model[2].parameters()), "lr": 5e-3})
                assert opt.param_groups[1]["lr"] == 5e-3 and opt.param_groups[1]["betas"] == (0.9, 0.999)
            for m, o in ((ref, ref_opt), (model, opt)):
                backward(m, step)
                o.step()
                o.zero_grad()
        assert_same_weights(ref, model, rtol=1e-6, atol=1e-7)
        with pytest.raises(ValueError, match="more than one parameter group"):
            opt.add_param_group({"params": [model[0].weight]})
        with pytest.raises(ValueError, match="amsgrad"):
            opt.add_param_group({"params": [nn.Parameter(torch.ones(3))], "amsgrad": True})
        assert len(opt.param_groups) == 2 and len(opt.params) == 4


def test_adamw_keyword_arguments_are_accepted_or_refused_by_name(tmp_path):
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, maximize=True, foreach=False)
    kw = dict(amsgrad=False, maximize=True, foreach=False, fused=None, capturable=False, differentiable=False)
    with TieredOptimizer(model, tmp_path, **KW, **kw) as opt:
        for s in range(3):
            for m, o in ((ref, ref_opt), (model, opt)):
                backward(m, s)
                o.step()
                o.zero_grad()
        assert_same_weights(ref, model, rtol=1e-6, atol=1e-7)
        with pytest.raises(ValueError, match="amsgrad"):
            opt.load_state_dict(torch.optim.AdamW(mlp().parameters(), amsgrad=True).state_dict())
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        TieredOptimizer(mlp(), tmp_path, amsgrad=True)
    with pytest.raises(ValueError, match="differentiable"):
        TieredOptimizer(mlp(), tmp_path, differentiable=True)
    with pytest.raises(ValueError, match="lr must be a finite number"):
        TieredOptimizer(mlp(), tmp_path, lr=float("inf"))
    with pytest.raises(TypeError, match="pass lr=... by keyword"):
        TieredOptimizer(mlp().parameters(), 1e-3)


def test_param_groups_have_adamw_s_keys_and_refuse_coupled_weight_decay(tmp_path):
    adamw = torch.optim.AdamW(mlp().parameters())
    with TieredOptimizer(mlp(), tmp_path, **KW) as opt:
        assert opt.param_groups[0].keys() == adamw.param_groups[0].keys()  # decoupled_weight_decay on torch >= 2.6
        assert opt.state_dict()["param_groups"][0].keys() == adamw.state_dict()["param_groups"][0].keys()
        assert {k: v for k, v in opt.defaults.items() if k != "lr"} == {k: v for k, v in adamw.defaults.items()
                                                                          if k != "lr"}  # fmt: skip
        old = opt.state_dict()  # a state dict saved before the key existed still loads
        for g in old["param_groups"]:
            g.pop("decoupled_weight_decay", None)
        opt.load_state_dict(old)
        with pytest.raises(ValueError, match="decoupled_weight_decay=False"):  # torch.optim.Adam's L2 weight decay
            opt.load_state_dict(torch.optim.Adam(mlp().parameters(), weight_decay=0.1).state_dict())
        opt.load_state_dict(torch.optim.Adam(mlp().parameters()).state_dict())  # no weight decay: the same update
        with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
            opt.add_param_group({"params": [nn.Parameter(torch.ones(3))], "decoupled_weight_decay": False})
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        TieredOptimizer([{"params": mlp().parameters(), "decoupled_weight_decay": False}], tmp_path)


def _dcp_train(model: nn.Module, opt, steps: range) -> None:
    for s in steps:
        backward(model, s)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("saved_by", ["tiered", "adamw"])
def test_dcp_checkpoints_move_between_tiered_and_adamw(tmp_path, saved_by):
    # torch.distributed.checkpoint (as accelerate's FSDP2 save_state uses it) without a process group: DCP needs
    # every key of the loading optimizer's state dict in the checkpoint, param groups' keys included.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        m = mlp()
        if kind == "tiered":
            return m, TieredOptimizer(m, tmp_path / f"nvme-{len(os.listdir(tmp_path))}", **KW, weight_decay=0.1)
        return m, torch.optim.AdamW(m.parameters(), lr=KW["lr"], weight_decay=0.1, fused=True)

    loaded_by = "adamw" if saved_by == "tiered" else "tiered"
    src, src_opt = make(saved_by)
    _dcp_train(src, src_opt, range(2))
    # What the load must give: the same hand-over through a plain state dict (the two differ in the last bit
    # between steps, where torch's fused kernel rounds a chunk's tail: README).
    straight, straight_opt = make(loaded_by)
    straight.load_state_dict(src.state_dict())
    straight_opt.load_state_dict(src_opt.state_dict())
    _dcp_train(straight, straight_opt, range(2, 4))
    msd, osd = get_state_dict(src, src_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    dst, dst_opt = make(loaded_by)
    _dcp_train(dst, dst_opt, range(1))  # state exists, as after any step: DCP loads into it
    msd, osd = get_state_dict(dst, dst_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(dst, dst_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _dcp_train(dst, dst_opt, range(2, 4))
    assert_same_weights(straight, dst, rtol=0, atol=0)
    for o in (straight_opt, src_opt, dst_opt):
        if isinstance(o, TieredOptimizer):
            o.close()


def test_dcp_recipe_resumes_split_masters_exactly_and_a_real_write_still_wins(tmp_path):
    """docs/distributed.md's recipe in one process: ``dcp.load`` fills the model's own tensors, then
    ``set_state_dict`` loads the optimizer and then the model, writing the very weights again (their version
    counters move). Split masters keep their low halves through that rewrite: the run resumes bitwise. Weights
    that differ, written after the same load, still replace their masters, as any write does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    kw = dict(KW, split_masters=True)  # chunks of 12 KiB: each weight spans two
    src = mlp(torch.bfloat16)
    with TieredOptimizer(src, tmp_path / "a", **kw) as opt:
        _dcp_train(src, opt, range(3))
        msd, osd = get_state_dict(src, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
        saved = {i: s["master"].clone() for i, s in opt.state_dict()["state"].items()}
        _dcp_train(src, opt, range(3, 6))  # the run that never stopped

    def resume(root, write=None):
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(torch.bfloat16)  # other weights
        opt = TieredOptimizer(model, root, **kw)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if write is not None:
            with torch.no_grad():
                write(model)
        return model, opt

    model, opt = resume(tmp_path / "b")
    with opt:
        assert all(torch.equal(s["master"], saved[i]) for i, s in opt.state_dict()["state"].items())
        _dcp_train(model, opt, range(3, 6))
    assert_same_weights(src, model, rtol=0, atol=0)

    step = torch.finfo(torch.bfloat16).eps  # one bf16 step of a weight near 1: a weight differs by its rounding

    def rewrite(m):
        m[0].weight.copy_(m[0].weight.clone())  # the same values again
        m[2].weight.add_(m[2].weight.abs().clamp_min(1e-3) * step * 2)  # other values

    model, opt = resume(tmp_path / "c", rewrite)
    with opt:
        masters = {i: s["master"] for i, s in opt.state_dict()["state"].items()}
        assert torch.equal(masters[0], saved[0])  # rewritten as it was: the low halves kept
        assert torch.equal(masters[2], model[2].weight.float().reshape(masters[2].shape))  # the write wins
        assert not torch.equal(masters[2], saved[2])


@pytest.mark.parametrize("split", [False, True], ids=["masters", "split-masters"])
def test_dcp_checkpoint_of_adamw_over_bf16_loads_with_the_planner_as_through_load_state_dict(tmp_path, split):
    """torch's AdamW over bf16 parameters keeps no fp32 masters, so its DCP checkpoint lacks the ``master`` keys of
    a TieredOptimizer's template, which DCP's default planner requires ("Missing key in checkpoint state_dict:
    optim.state.0.weight.master"). With ``TieredLoadPlanner`` it loads, the masters started from the loaded
    weights: bitwise the hand-over through ``load_state_dict``, into a fresh optimizer or one that has stepped
    (its own masters from before the load do not stand), in either optimizer state-dict layout. The planner
    still refuses any other missing key, and still loads a TieredOptimizer's own masters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from tiered import TieredLoadPlanner

    kw = dict(KW, split_masters=split, weight_decay=0.1)  # chunks of 12 KiB: each weight spans two
    src = mlp(torch.bfloat16)
    adamw = torch.optim.AdamW(src.parameters(), lr=KW["lr"], weight_decay=0.1)
    _dcp_train(src, adamw, range(2))
    for flat in (False, True):  # the optimizer state dict nested as torch's, or flattened (torchtitan's)
        msd, osd = get_state_dict(src, adamw, options=StateDictOptions(flatten_optimizer_state_dict=flat))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / f"adamw-{flat}"))

    def load(model: nn.Module, opt: TieredOptimizer, ckpt: str, flat: bool = False) -> None:
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        msd, osd = get_state_dict(model, opt, options=options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(tmp_path / ckpt), planner=TieredLoadPlanner())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)

    def resume(how: str, stepped: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = mlp(torch.bfloat16)
        with TieredOptimizer(model, tmp_path / f"{how}-{stepped}", **kw) as opt:
            if stepped:
                _dcp_train(model, opt, range(5, 7))  # masters of its own, finer than the weights
            if how == "load_state_dict":
                model.load_state_dict(src.state_dict())
                opt.load_state_dict(adamw.state_dict())
            else:
                load(model, opt, f"adamw-{how == 'dcp-flat'}", flat=how == "dcp-flat")
            masters = [s["master"].clone() for s in opt.state_dict()["state"].values()]
            assert all(torch.equal(m, p.float()) for m, p in zip(masters, model.parameters()))
            _dcp_train(model, opt, range(2, 4))
        return masters, [p.detach().clone() for p in model.parameters()]

    expected = resume("load_state_dict", False)
    for how, stepped in (("dcp", False), ("dcp", True), ("dcp-flat", True)):
        got = resume(how, stepped)
        for a, b in zip(expected[0] + expected[1], got[0] + got[1]):
            assert torch.equal(a, b), (how, stepped)

    model = mlp(torch.bfloat16)
    with TieredOptimizer(model, tmp_path / "strict", **kw) as opt:
        msd, osd = get_state_dict(model, opt)
        msd["head.weight"] = torch.zeros(2)  # a key the checkpoint lacks that is not a master
        with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: model.head.weight"):
            dcp.load(
                {"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "adamw-False"), planner=TieredLoadPlanner()
            )
        _dcp_train(model, opt, range(3))
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "tiered"))
        saved = [s["master"].clone() for s in opt.state_dict()["state"].values()]
        assert not all(torch.equal(m, p.float()) for m, p in zip(saved, model.parameters()))  # finer than those
    model = mlp(torch.bfloat16)
    with TieredOptimizer(model, tmp_path / "own", **kw) as opt:
        load(model, opt, "tiered")
        assert all(torch.equal(s["master"], m) for s, m in zip(opt.state_dict()["state"].values(), saved))


def test_state_of_a_parameter_reads_lazily_in_torch_layout(tmp_path):
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        p = model[0].weight
        assert p not in opt.state and opt.state[p] == {}
        for m, o in ((ref, ref_opt), (model, opt)):
            backward(m, 0)
            o.step()
        s, r = opt.state[p], ref_opt.state[ref[0].weight]
        assert p in opt.state and float(s["step"]) == 1.0
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(s[k], r[k], rtol=1e-6, atol=1e-9)
        assert list(opt.state) == [] and len(opt.state) == 0  # nothing walks (and pulls in) the whole state


def test_state_dict_hooks_run_as_for_any_optimizer(tmp_path):
    model = mlp()
    calls = []
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
        opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre"))
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
        sd = opt.state_dict()
        assert sd["extra"] == 1
        opt.load_state_dict(sd)
    assert calls == ["pre", "load-pre", "load-post"]


def test_torch_compile_of_step_runs_it_eagerly(tmp_path):
    ref, model = mlp(), mlp()
    with TieredOptimizer(ref, tmp_path / "a", **KW) as a, TieredOptimizer(model, tmp_path / "b", **KW) as b:
        compiled = torch.compile(b.step)
        for s in range(2):
            backward(ref, s)
            a.step()
            backward(model, s)
            compiled()
            a.zero_grad()
            b.zero_grad()
        assert_same_weights(ref, model, rtol=0, atol=0)


def _train_compiled_or_not(compiled: list[bool], root, steps: int = 2) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps per entry of ``compiled``, each leg on a fresh model and optimizer (compiled or not)
    that resumes from the last leg's checkpoint; returns the weights at the end."""
    weights = None
    for leg, comp in enumerate(compiled):
        model = mlp()
        if weights is not None:
            model.load_state_dict(weights)
        run = torch.compile(model, backend="eager") if comp else model
        with TieredOptimizer(run, root / f"nvme{leg}", **KW) as opt:
            assert opt.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]  # the model's own names
            if leg:
                opt.load_checkpoint(root / f"ckpt{leg - 1}")
            for s in range(leg * steps, (leg + 1) * steps):
                backward(run, s)
                opt.step()
                opt.zero_grad()
            opt.save_checkpoint(root / f"ckpt{leg}")
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights


def test_checkpoints_move_between_a_compiled_model_and_the_same_model_uncompiled(tmp_path):
    # torch.compile wraps the model in an OptimizedModule whose parameter names start with "_orig_mod.": the
    # state is keyed by the model's own names, so a run resumes compiled or not whichever way it was saved.
    straight = _train_compiled_or_not([False, False, False], tmp_path / "straight")
    for legs in ([True, False, True], [False, True, True]):
        got = _train_compiled_or_not(legs, tmp_path / "-".join(map(str, legs)))
        assert all(torch.equal(got[n], straight[n]) for n in straight), legs
    # (name, parameter) pairs of a compiled model, and of a model holding a compiled block, name them alike.
    model = mlp()
    model[0] = torch.compile(model[0], backend="eager")
    with TieredOptimizer(model.named_parameters(), tmp_path / "pairs", **KW) as opt:
        assert opt.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert opt.param_groups[0]["param_names"][0] == "0._orig_mod.weight"  # as given, as torch keeps them
    with TieredOptimizer(torch.compile(mlp(), backend="eager").named_parameters(), tmp_path / "c", **KW) as opt:
        assert opt.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_nvme_path_defaults_to_a_documented_folder(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("TIERED_NVME_PATH", str(tmp_path / "default"))
    monkeypatch.setattr("tiered.store.workdir._said_default", False)
    with caplog.at_level(logging.WARNING, logger="tiered"):
        with TieredOptimizer(mlp().parameters(), lr=1e-3) as opt:
            assert os.path.dirname(opt.workdir) == str(tmp_path / "default")
    assert "no nvme_path given" in caplog.text and str(tmp_path / "default") in caplog.text
    # it names where the folder came from, and does not ask for the variable the user did set
    assert "from $TIERED_NVME_PATH" in caplog.text and "or $TIERED_NVME_PATH" not in caplog.text
    caplog.clear()
    monkeypatch.delenv("TIERED_NVME_PATH")
    monkeypatch.setattr("tiered.store.workdir._said_default", False)
    with caplog.at_level(logging.WARNING, logger="tiered"):
        root = tiered.store.workdir.default_root()  # the same words as the optimizer's and the KV cache's
    assert root == os.path.join(tempfile.gettempdir(), "tiered")
    assert f"go under {root} (set nvme_path= or $TIERED_NVME_PATH" in caplog.text


def test_a_budget_larger_than_a_few_chunks_keeps_them_all_in_memory(tmp_path):
    # Before: 114 MiB of state in two chunks and budgets of 256-512 MiB still wrote it all every step (the
    # read-ahead reserve took the whole budget). Scaled down: two chunks, a budget that holds both.
    model = nn.Linear(1024, 600)  # 615k params: 7.4 MB of state, in two 4 MiB chunks
    with TieredOptimizer(model, tmp_path, chunk_bytes="4MiB", host_budget="12MiB") as opt:
        assert len(opt.chunks) == 2
        for _ in range(3):
            model(torch.randn(4, 1024)).sum().backward()
            opt.step()
        assert opt.stats()["total"]["nvme_write_bytes"] == 0 and opt.stats()["total"]["nvme_read_bytes"] == 0


# ------------------------------------------------------------------------ state larger than the budget
MEMORY_SCRIPT = """
import gc, os, threading, time, torch
from tiered import TieredOptimizer

def anon():  # anonymous memory: what a state dict in RAM would take (file-backed pages are page cache)
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

peak = [0]
def watch():
    while True:
        peak[0] = max(peak[0], anon()); time.sleep(0.002)

torch.manual_seed(0)
model = torch.nn.Linear(4096, 6144)          # 25.2 M params: 302 MB of fp32 state
opt = TieredOptimizer(model, os.environ["NVME"], host_budget="32MiB", chunk_bytes="4MiB")
model(torch.randn(2, 4096)).sum().backward(); opt.step()
ref = {k: v.clone() for k, v in opt.state[model.bias].items()}
gc.collect(); base = anon(); peak[0] = base
threading.Thread(target=watch, daemon=True).start()
sd = opt.state_dict()
torch.save(sd, os.environ["SD"]); del sd; gc.collect()
opt.load_state_dict(torch.load(os.environ["SD"], mmap=True, weights_only=True))
time.sleep(0.05)
got = opt.state[model.bias]
assert all(torch.equal(got[k], ref[k]) for k in ref)
print((peak[0] - base) / 2**20, opt.state_bytes / 2**20)
"""


def test_state_dict_round_trip_of_state_ten_times_the_budget_stays_within_the_budget(tmp_path):
    out = run_script(MEMORY_SCRIPT, timeout=600, env={"NVME": str(tmp_path / "nvme"), "SD": str(tmp_path / "sd.pt")})
    assert out.returncode == 0, out.stderr
    grew, state = (float(x) for x in out.stdout.split())
    assert state > 280
    # Budget 32 MiB, plus a stated constant of 48 MiB (chunk-sized scratch, torch.save's zip bookkeeping):
    # before, state_dict alone took the whole 302 MB.
    assert grew < 32 + 48, f"anonymous memory grew by {grew:.0f} MiB for {state:.0f} MiB of state"


def test_one_optimizer_per_parameter_stepped_during_backward(tmp_path):
    """torchtune's optimizer_in_bwd: one optimizer per parameter, stepped from a post-accumulate-grad hook,
    every one of them under the same nvme_path root."""

    def attach(model, make):
        opts = {p: make(p) for p in model.parameters()}

        def step(p):
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
        return opts

    ref, model = mlp(), mlp()
    ref_opts = attach(ref, lambda p: torch.optim.AdamW([p], lr=1e-2))
    opts = attach(model, lambda p: TieredOptimizer([p], tmp_path, lr=1e-2, host_budget="64KiB"))
    assert len({o.workdir for o in opts.values()}) == len(opts) == 4
    for s in range(3):
        backward(ref, s)
        backward(model, s)
    assert_same_weights(ref, model, rtol=1e-6, atol=1e-7)
    assert all(o.global_step == 3 for o in opts.values()) and len(ref_opts) == 4
    for o in opts.values():
        o.close()
    assert os.listdir(tmp_path) == []
