"""TieredOptimizer's contract with its users: torch.optim behaviour, clear errors, resources freed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from io_engine import parse_size
from tiered import TieredOptimizer
from tiered.config import TierConfig


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def one_step(model, opt):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_is_a_torch_optimizer_and_context_manager(tmp_path):
    model = small()
    with TieredOptimizer(model, tmp_path / "state") as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == 1e-2
        one_step(model, opt)
        assert os.path.exists(tmp_path / "state")
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    opt.close()  # idempotent


def test_zero_grad_set_to_none(tmp_path):
    model = small()
    with TieredOptimizer(model, tmp_path) as opt:
        model(torch.randn(2, 8)).sum().backward()
        opt.zero_grad(set_to_none=False)
        assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())


def test_closure_returns_loss(tmp_path):
    model = small()
    with TieredOptimizer(model, tmp_path) as opt:
        x = torch.randn(4, 8)

        def closure():
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        assert isinstance(opt.step(closure), torch.Tensor)


def test_a_parameter_thawed_inside_the_closure_is_updated_at_that_step_as_by_adamw(tmp_path):
    """torch's AdamW looks at the gradients after the closure has run: a layer frozen when the optimizer was built
    and thawed inside the closure is updated at that step, bitwise as by AdamW(fused=True). It was once skipped at
    that step, the parameters checked before the closure ran, and the weights differed from then on."""
    ours, ref = small(), small()
    for m in (ours, ref):
        m[0].requires_grad_(False)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def closure_for(m, opt, thaw):
        def closure():
            opt.zero_grad()
            if thaw:
                m[0].requires_grad_(True)
            loss = m(x).pow(2).mean()
            loss.backward()
            return loss

        return closure

    with TieredOptimizer(list(ours.parameters()), tmp_path, lr=1e-2) as opt:  # a list: frozen ones are followed
        for step in range(3):
            opt.step(closure_for(ours, opt, step == 1))
            torch_opt.step(closure_for(ref, torch_opt, step == 1))
            assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters())), step
        assert opt.step_counts == [2, 2, 3, 3]


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("amsgrad", True, "amsgrad=True is not supported"),
        ("decoupled_weight_decay", False, "decoupled_weight_decay=False .* is not supported"),
        ("differentiable", True, "differentiable=True is not supported"),
    ],
)
def test_a_refused_option_set_in_param_groups_after_build_is_refused_at_step(tmp_path, key, value, match):
    """torch's AdamW reads its flags from the param groups at every step. Those TieredOptimizer refuses by name at
    construction, in add_param_group and in loaded state dicts are refused at step() too, when set since, nothing
    changed: they were once ignored, plain AdamW run and the weights no longer torch's. Set back, it steps as
    torch's AdamW."""
    ours, ref = (nn.Parameter(torch.linspace(-1, 1, 16)) for _ in range(2))
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True)
    with TieredOptimizer([ours], tmp_path, lr=1e-2, weight_decay=0.1) as opt:
        opt.param_groups[0][key] = value
        ours.grad = torch.ones(16)
        with pytest.raises(ValueError, match=rf"param_groups\[0\]: {match}"):
            opt.step()
        assert opt.step_counts == [0] and torch.equal(ours, ref)
        opt.param_groups[0][key] = not value
        for s in range(3):
            g = torch.randn(16, generator=torch.Generator().manual_seed(s))
            ours.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            torch_opt.step()
        assert torch.equal(ours, ref)


BAD_HYPERPARAMETERS = {  # how a group goes wrong -> the error torch.optim.AdamW raises too, and what ours says
    "a key left out": (lambda g: g.pop("betas"), KeyError, "'betas' is missing"),
    "weight_decay left out": (lambda g: g.pop("weight_decay"), KeyError, "'weight_decay' is missing"),
    "betas a number": (lambda g: g.update(betas=0.9), TypeError, "'betas' must be two numbers, got 0.9"),
    "one beta": (lambda g: g.update(betas=(0.9,)), ValueError, "'betas' must be two numbers"),
    "three betas": (lambda g: g.update(betas=(0.9, 0.99, 0.5)), ValueError, "'betas' must be two numbers"),
    "a beta None": (lambda g: g.update(betas=(None, 0.999)), TypeError, "'betas' must be two numbers"),
    "lr None": (lambda g: g.update(lr=None), TypeError, "'lr' must be a number, got None"),
    "lr a string": (lambda g: g.update(lr="1e-3"), TypeError, "'lr' must be a number"),
    "eps None": (lambda g: g.update(eps=None), TypeError, "'eps' must be a number"),
    "lr of two elements": (lambda g: g.update(lr=torch.ones(2)), ValueError, "'lr' must be a number"),
}


def state_of(opt):
    """(param, key) -> a copy of each tensor of opt.state_dict()'s state: tiered's are mapped from files that close()
    deletes, and a failing assert's report would read them after it."""
    return {(i, k): v.clone() for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


@pytest.mark.parametrize("how", [*BAD_HYPERPARAMETERS, "a group assigned without its hyperparameters"])
def test_a_missing_or_malformed_hyperparameter_is_refused_at_step_and_the_run_goes_on_once_fixed(tmp_path, how):
    """A param group's lr, betas, eps or weight_decay left out (a list assigned to opt.param_groups with only
    "params" and "lr"), mistyped (betas=0.9) or None (a scheduler's bug) raised a bare KeyError or TypeError from
    inside the step, after the step counts had moved: the optimizer was then broken for good, even once the group
    was fixed. Each is refused before the step changes anything, naming the group and the key, as torch's AdamW
    raises; fixed, the run goes on as torch's AdamW's that never took the step."""
    model, ref = small(), small()

    def groups(m):
        return [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 5e-3, "betas": (0.8, 0.99)}]

    torch_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1, fused=True)

    def grads(m, s):
        m(torch.randn(4, 8, generator=torch.Generator().manual_seed(s))).pow(2).mean().backward()

    # Not "with": closed, its records are unmapped, and a failure's report that shows them (the update's arguments)
    # would crash pytest; a failing run leaves it to the collector instead.
    opt = TieredOptimizer(groups(model), tmp_path, lr=1e-2, weight_decay=0.1, chunk_bytes="4KiB")
    for s in range(2):
        for m, o in ((model, opt), (ref, torch_opt)):
            grads(m, s)
            o.step()
            o.zero_grad()
    before, weights, saved = state_of(opt), [p.clone() for p in model.parameters()], opt.param_groups
    if how in BAD_HYPERPARAMETERS:
        opt.param_groups = [dict(g) for g in saved]
        spoil, error, match = BAD_HYPERPARAMETERS[how]
        spoil(opt.param_groups[1])
    else:  # as Lightning's BaseFinetuning and user code assign them
        opt.param_groups = [saved[0], {"params": saved[1]["params"], "lr": 1e-3}]
        error, match = KeyError, "'betas' is missing"
    grads(model, 2)
    with pytest.raises(error, match=rf"param_groups\[1\]: {match}"):
        opt.step()
    assert opt.step_counts == [2, 2, 2, 2]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
    after = state_of(opt)
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), [
        k for k in before if not torch.equal(before[k], after[k])
    ]
    opt.param_groups = saved  # the user fixes the group and goes on
    opt.step()
    opt.zero_grad()
    grads(ref, 2)
    torch_opt.step()
    torch_opt.zero_grad()
    for s in range(3, 5):
        for m, o in ((model, opt), (ref, torch_opt)):
            grads(m, s)
            o.step()
            o.zero_grad()
    assert opt.step_counts == [5, 5, 5, 5]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    ours, theirs = state_of(opt), state_of(torch_opt)
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs), [
        k for k in theirs if not torch.equal(theirs[k], ours[k])
    ]
    opt.close()


def test_hyperparameters_torch_steps_with_are_not_refused_at_step(tmp_path):
    """No range is checked at step(): a negative lr, tensor betas, a numpy lr and a list of betas set in a group
    step as torch's AdamW steps them (the constructor's own checks are torch's, and stay)."""
    import numpy as np

    values = (
        {"lr": -1e-3},
        {"betas": (torch.tensor(0.8), torch.tensor(0.95))},
        {"lr": np.float32(3e-3)},
        {"betas": [0.7, 0.9]},
    )
    ours, ref = (nn.Parameter(torch.linspace(-1, 1, 16)) for _ in range(2))
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    with TieredOptimizer([ours], tmp_path, lr=1e-2) as opt:
        for s, value in enumerate(values):
            for o in (opt, torch_opt):
                o.param_groups[0].update(value)
            g = torch.randn(16, generator=torch.Generator().manual_seed(s))
            ours.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            torch_opt.step()
        assert torch.equal(ours, ref)


def test_frozen_and_tied_parameters(tmp_path):
    model = small()
    model[0].weight.requires_grad_(False)
    model[2].bias = model[2].bias  # plain
    tied = nn.Linear(4, 4, bias=False)
    model.append(tied)
    model.tied_again = tied  # the same module twice: its weight is one parameter
    with TieredOptimizer(model, tmp_path) as opt:
        names = opt.param_names
        assert "0.weight" not in names
        assert len(names) == len(set(names)) == 4
        before = model[0].weight.clone()
        one_step(model, opt)
        assert torch.equal(model[0].weight, before)


def test_explicit_bad_params(tmp_path):
    w = torch.zeros(3, requires_grad=True)
    TieredOptimizer([torch.zeros(3)], tmp_path).close()  # frozen: accepted, as by AdamW (test_param_set.py)
    with pytest.raises(ValueError, match="appears twice"):
        TieredOptimizer([w, w], tmp_path)
    with pytest.raises(ValueError, match="empty"):
        TieredOptimizer([], tmp_path)
    with pytest.raises(TypeError, match="single tensor"):
        TieredOptimizer(w, tmp_path)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(host_budget="lots"), "cannot parse host_budget"),
        (dict(chunk_bytes="12 parsecs"), "cannot parse chunk_bytes"),
        (dict(lr=-1.0), "lr must be"),
        (dict(betas=(0.9, 1.5)), "betas"),
        (dict(prefetch_depth=-1), "prefetch_depth"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(max_grad_norm="1"), "max_grad_norm must be a number > 0 or None, got '1'"),
        (dict(max_grad_norm=True), "max_grad_norm must be a number"),
        (dict(host_budget="1KiB"), "cannot hold one state chunk"),
        (dict(host_budget="1000TiB"), "of RAM"),
        (dict(host_budget=10**400), "host_budget .* is beyond any machine"),  # was an OverflowError
        (dict(chunk_bytes="1" + "0" * 310 + "GB"), "chunk_bytes .* is beyond any machine"),
        (dict(update_on="gpu"), "update_on must be 'auto', 'host' or 'device'"),
    ],
)
def test_bad_arguments_name_the_fix(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        TieredOptimizer(small(), tmp_path, **kw)


@pytest.mark.parametrize("chunk_bytes", ["4KiB", "12KiB"])  # 12 KiB of 8-bit state is still 1024 parameters a chunk
def test_a_host_budget_under_the_smallest_chunk_asks_only_for_more_host_budget(tmp_path, chunk_bytes):
    """host_budget="4KiB" under 8-bit moments, whose smallest chunk (1024 parameters) is an 8 KiB record, was told
    "raise host_budget or lower chunk_bytes": lowering chunk_bytes gave the same error. Where the chunks are already
    the smallest, the refusal names only host_budget, with the size it needs, and that size is taken."""
    p = [nn.Parameter(torch.randn(5000))]
    with pytest.raises(ValueError) as e:
        TieredOptimizer(p, tmp_path / "a", moments_dtype="int8", chunk_bytes=chunk_bytes, host_budget="4KiB")
    msg = str(e.value)
    assert "raise host_budget to at least 8KiB" in msg and "lower chunk_bytes" not in msg, msg
    with TieredOptimizer(p, tmp_path / "b", moments_dtype="int8", chunk_bytes=chunk_bytes, host_budget="8KiB"):
        pass
    # Larger chunks than the smallest: lowering chunk_bytes helps, and the refusal still says so.
    with pytest.raises(ValueError, match="raise host_budget or lower chunk_bytes"):
        TieredOptimizer(p, tmp_path / "c", moments_dtype="int8", chunk_bytes="64KiB", host_budget="8KiB")


def test_the_advised_host_budget_holds_the_chunk_in_whole_pages(tmp_path):
    """A 700-parameter fp32 model's one chunk is 8400 bytes, which the store keeps in 12 KiB of whole pages. The
    refusal advised "at least 9KiB" (the raw bytes), construction took it, and the first step failed inside the
    store ("larger than host_budget"). The advice counts whole pages; the advised size builds and steps."""
    p = nn.Parameter(torch.randn(700))
    with pytest.raises(ValueError) as e:
        TieredOptimizer([p], tmp_path / "a", host_budget="1KiB")
    advised = re.search(r"raise host_budget to at least (\d+)KiB", str(e.value))
    assert advised is not None and advised[1] == "12", str(e.value)
    with TieredOptimizer([p], tmp_path / "b", host_budget=f"{advised[1]}KiB") as opt:
        p.grad = torch.randn(700)
        opt.step()
    with pytest.raises(ValueError, match="at least 12KiB"):  # a budget under the pages is refused up front
        TieredOptimizer([p], tmp_path / "c", host_budget="9KiB")


def test_a_gpu_budget_ignored_on_cpu_parameters_does_not_refuse_split_masters(tmp_path):
    # On CPU parameters gpu_budget is warned as ignored: no chunk lives in HBM keeping full masters, so it rules
    # out split masters only where it applies (CUDA parameters updated on the host), not in a CPU debug run
    # sharing the GPU run's knobs.
    model = nn.Linear(64, 64).to(torch.bfloat16)
    kw = dict(host_budget="256KiB", chunk_bytes="12KiB", gpu_budget="1MiB", update_on="host", split_masters=True)
    with pytest.warns(RuntimeWarning, match="gpu_budget is ignored"):
        opt = TieredOptimizer(model, tmp_path, **kw)
    with opt:
        assert opt.stats()["split_chunks"] > 0
        model(torch.randn(2, 64, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    with pytest.raises(ValueError, match="split_masters=True cannot apply: gpu_budget is set with update_on='host'"):
        TierConfig(**kw).resolve(cuda=True)  # where its chunks would be in HBM: still refused


def test_budget_between_one_and_two_chunks_runs_serially(tmp_path):
    model = nn.Linear(64, 64)  # 4160 parameters: 5 chunks of 1024
    with TieredOptimizer(model, tmp_path, chunk_bytes="12KiB", host_budget="16KiB") as opt:
        assert opt.prefetch_depth == 0
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        assert opt.stats()["last_step"]["nvme_read_bytes"] > 0


def test_unwritable_nvme_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot be written"):
        TieredOptimizer(small(), blocker / "state")


def test_an_empty_nvme_path_is_refused_not_taken_for_the_current_folder(tmp_path, monkeypatch):
    """``""`` (an unset variable) named the current folder: the working folder went there, and the dead runs' folders
    in it were reclaimed. None means the default root; ``""`` is refused by name."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^nvme_path is empty: pass a folder, e.g. /mnt/nvme"):
        TieredOptimizer(small(), "")
    assert os.listdir(tmp_path) == []


def test_disk_too_small_is_caught_up_front(tmp_path):
    """The check counts what lives on disk: state beyond the host budget. What stays in DDR needs no disk."""
    from helpers import small_tmpfs

    big = nn.Linear(256, 256)  # 66k params: 790 KB of state
    with small_tmpfs("64k") as mnt:
        root = os.path.join(mnt, "state")
        with pytest.raises(OSError, match="needs") as e:
            TieredOptimizer(big, root, host_budget="256KiB", chunk_bytes="64KiB")
        assert "free" in str(e.value)
        assert os.listdir(root) == []  # the refused optimizer's private folder is gone
        # The error names the smallest host_budget that leaves the disk enough, and that budget works.
        suggested = re.search(r"raise host_budget to (\S+ \S+) or more", str(e.value)).group(1)
        with TieredOptimizer(big, root, host_budget=suggested.replace(" ", ""), chunk_bytes="64KiB") as opt:
            big(torch.randn(2, 256)).sum().backward()
            opt.step()
        with pytest.raises(OSError, match="needs"):  # one chunk less would not do
            less = parse_size(suggested.replace(" ", "")) - 64 * 1024
            TieredOptimizer(big, root, host_budget=less, chunk_bytes="64KiB")
        with TieredOptimizer(big, root, host_budget="4MiB") as opt:  # all of it in host memory
            big(torch.randn(2, 256)).sum().backward()
            opt.step()
            assert opt.stats()["store"]["nvme"]["bytes_written"] == 0


def test_optimizers_share_one_nvme_path_root(tmp_path):
    """nvme_path is a root: each live optimizer, in this process or another, works in a private folder."""
    with TieredOptimizer(small(), tmp_path) as a, TieredOptimizer(small(), tmp_path) as b:
        assert a.workdir != b.workdir and os.path.dirname(a.workdir) == str(tmp_path)
        assert oct(os.stat(a.workdir).st_mode & 0o777) == "0o700"
        code = (
            "import torch; from tiered import TieredOptimizer\n"
            "m = torch.nn.Linear(2, 2)\n"
            f"with TieredOptimizer(m, {str(tmp_path)!r}) as o:\n"
            "    m(torch.ones(1, 2)).sum().backward(); o.step(); print(len(__import__('os').listdir(o.nvme_path)))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "3"  # a, b and its own
    assert os.listdir(tmp_path) == []  # closing removes each private folder


def test_close_deletes_state_files(tmp_path):
    model = small()
    opt = TieredOptimizer(model, tmp_path, host_budget="12KiB", chunk_bytes="12KiB")
    one_step(model, opt)
    opt.close()
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".bin")]
    assert leftovers == []


def test_grad_scaler_skips_inf_steps_and_unscales(tmp_path):
    model = small()
    ref = small()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with TieredOptimizer(model, tmp_path, lr=1e-2) as opt:
        scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)]
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            for m, o, s in ((ref, torch_opt, scalers[0]), (model, opt, scalers[1])):
                s.scale(m(x).pow(2).mean()).backward()
                if step == 1:
                    m[0].weight.grad[0, 0] = float("inf")
                s.step(o)
                s.update()
                o.zero_grad()
        assert scalers[1].get_scale() == scalers[0].get_scale() < 1024.0
        assert opt.state_dict()["state"][0]["step"] == 3  # the inf step was skipped
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale, growth, unscale", [(1024.0, 2.0, False), (1000.0, 3.0, True)],
                         ids=["powers-of-two", "any-scale-after-unscale_"])  # fmt: skip
def test_grad_scaler_is_bitwise_torch_s_fused_adamw_with_powers_of_two_or_after_unscale(tmp_path, scale, growth,
                                                                                         unscale):  # fmt: skip
    """torch's fused AdamW takes GradScaler's scale into its kernel (grad / scale); TieredOptimizer lets the scaler
    unscale the gradients (grad * (1 / scale)), which is the same bit for bit where the scale is a power of two
    (GradScaler's default growth and backoff keep it one) or the gradients were unscaled already (``unscale_()``,
    as before clipping); other scales differ by rounding, as the README says. Growth and an inf step included."""
    model, ref = small(), small()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with TieredOptimizer(model, tmp_path, lr=1e-2) as opt:
        scalers = [torch.amp.GradScaler("cpu", init_scale=scale, growth_factor=growth, growth_interval=2)
                   for _ in range(2)]  # fmt: skip
        for step in range(6):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            for m, o, s in ((ref, torch_opt, scalers[0]), (model, opt, scalers[1])):
                s.scale(m(x).pow(2).mean()).backward()
                if step == 3:
                    m[0].weight.grad[0, 0] = float("inf")
                if unscale:
                    s.unscale_(o)
                s.step(o)
                s.update()
                o.zero_grad()
            assert scalers[1].get_scale() == scalers[0].get_scale()
            for a, b in zip(ref.parameters(), model.parameters()):
                assert torch.equal(a, b), step
        assert scalers[0].get_scale() != scale  # it grew and backed off
        ours, theirs = opt.state_dict()["state"], torch_opt.state_dict()["state"]
        for i, s in theirs.items():
            assert float(ours[i]["step"]) == float(s["step"]) == 5  # the inf step skipped
            assert torch.equal(ours[i]["exp_avg"], s["exp_avg"]) and torch.equal(ours[i]["exp_avg_sq"], s["exp_avg_sq"])


def test_stats_keys(tmp_path):
    model = small()
    with TieredOptimizer(model, tmp_path) as opt:
        one_step(model, opt)
        st = opt.stats()
    assert {"steps", "chunks", "chunk_bytes", "state_bytes", "last_step", "total", "store", "under_backward"} <= set(st)
    assert set(st["last_step"]) == {
        "step_s", "clip_s", "read_wait_s", "grad_d2h_s", "update_s", "h2d_s", "write_wait_s", "drain_s", "settle_s",
        "nvme_read_bytes", "nvme_write_bytes", "host_hit_bytes", "under_backward_bytes", "link_up_bytes",
        "link_down_bytes",
    }  # fmt: skip
    assert st["last_step"]["step_s"] > 0
    # A model on the CPU updates where it is: nothing crosses a link (tests/gpu/test_gpu.py counts a GPU's bytes).
    assert st["last_step"]["link_up_bytes"] == st["last_step"]["link_down_bytes"] == 0


def test_stats_docstring_names_every_key_it_returns(tmp_path):
    """help(opt.stats) showed nothing: the method had no docstring. It names each top-level key, as
    docs/internals.md's ``opt.stats() = {...}`` does (``rank`` and ``world_size`` appear under torch.distributed)."""
    model = small()
    with TieredOptimizer(model, tmp_path) as opt:
        one_step(model, opt)
        keys = set(opt.stats()) | {"rank", "world_size"}
    doc = TieredOptimizer.stats.__doc__ or ""
    assert [k for k in sorted(keys) if f"``{k}``" not in doc] == []


def test_import_does_not_initialise_cuda():
    code = "import torch, tiered, io_engine, tiered.optimizer, tiered.store; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


FORK_AFTER_IMPORT = """
import multiprocessing as mp, torch
torch.set_num_threads(2)  # a parallel op forks OpenMP's pool only with two threads or more
import tiered, tiered.checkpoint, tiered.kv, tiered.optimizer, io_engine

def child():
    torch.randn(1 << 20).sum()  # parallel in torch: hangs where the parent started OpenMP's pool

if __name__ == "__main__":
    p = mp.get_context("fork").Process(target=child)
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
    print(torch.get_num_threads(), "hung" if p.exitcode is None or p.exitcode < 0 else p.exitcode)
"""


def test_a_process_forked_after_import_runs_parallel_torch_ops():
    """Importing the packages does no parallel torch work: GNU OpenMP does not survive fork, so a child forked
    after the parent started its pool (multiprocessing's fork, Lightning's ddp_fork) hangs in its first
    parallel torch op."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", FORK_AFTER_IMPORT], capture_output=True, text=True, timeout=120,
                         env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "0"], out.stdout  # two intra-op threads, and the child ran to its end


def test_checkpoints_of_bf16_moments_resume_exactly(tmp_path):
    """A checkpoint holds fp32 rows whatever the record format; bf16 moments go out and come back exactly."""
    model, other = small(), small()
    kw = dict(moments_dtype=torch.bfloat16, chunk_bytes="4KiB", host_budget="64KiB")
    with TieredOptimizer(model, tmp_path / "s", **kw) as opt, TieredOptimizer(other, tmp_path / "s", **kw) as opt2:
        one_step(model, opt)
        opt.save_checkpoint(tmp_path / "ckpt")
        assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
        opt2.load_checkpoint(tmp_path / "ckpt")
        for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
            assert all(torch.equal(a[k], b[k]) for k in a)
        torch.manual_seed(5)
        one_step(model, opt)
        torch.manual_seed(5)
        one_step(other, opt2)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
    with pytest.raises(ValueError, match="moments_dtype"):
        TieredOptimizer(small(), tmp_path / "t", moments_dtype=torch.float16)


def test_a_disk_too_small_for_any_budget_this_ram_allows_says_how_much_more_disk(tmp_path):
    from tiered.arguments import check_free_space

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OSError, match=r"use a disk with 1\.00 TiB more free .*RAM allows a host_budget of at most"):
        check_free_space(str(tmp_path), free + 2**40, "the optimizer state", lambda free: 2**60)


def test_import_tiered_gives_its_submodules_as_attributes_on_first_use():
    """docs/offload.md sets ``tiered.offload.GPU_SHARE`` and calls ``tiered.offload.close()`` after a plain
    ``import tiered``; the package stays cheap to import (nothing of torch until a name is used)."""
    code = (
        "import sys, tiered; cheap = 'torch' not in sys.modules; "
        "tiered.offload.GPU_SHARE; tiered.offload.close; tiered.checkpoint.save_checkpoint; "
        "print(cheap, hasattr(tiered, 'no_such_module'))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "False"]
