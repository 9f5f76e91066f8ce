"""The tensors an optimizer steps are those in its ``param_groups``, as with torch.optim.AdamW: tensors swapped in
after the optimizer was built are followed (accelerate's FSDP2 ``prepare`` and HF Trainer with FSDP do it);
parameters that do not require grad are accepted and keep no state until they get gradients (peft); and an
optimizer refuses to pickle, naming what saves its state instead.

Every training case runs twice from the same seed, with ``torch.optim.AdamW`` (torch's fused kernel, the
arithmetic TieredOptimizer performs) and with ``TieredOptimizer``, and compares the weights to float rounding.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer

STEPS = 6
KW = dict(lr=1e-2, weight_decay=0.1)
# Several chunks, part of them on NVMe: a rebuilt layout streams through the disk as the first one did.
TIERED_KW = dict(**KW, chunk_bytes="12KiB", host_budget="40KiB")  # 52 KiB of state in 5 chunks
RTOL, ATOL = 1e-6, 1e-7


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 2))


def loss_of(m: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(12, 16, generator=g), torch.randn(12, 2, generator=g)
    return nn.functional.mse_loss(m(x), y)


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        loss_of(m, step).backward()
        opt.step()
        opt.zero_grad()


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **KW, fused=True)


def assert_same(expected: nn.Module, actual: nn.Module, what: str) -> None:
    for (name, e), a in zip(expected.named_parameters(), actual.parameters()):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{what}: {name}: {m}")


def moved(m: nn.Module, seed: int = 0) -> float:
    return max((a - b).abs().max().item() for a, b in zip(m.parameters(), model(seed).parameters()))


def swap_in(opt: torch.optim.Optimizer, new: nn.Module) -> None:
    """What accelerate's FSDP2 ``prepare`` does to an optimizer built before it: each entry of
    ``param_groups[i]["params"]`` replaced by the new tensor of the same parameter."""
    new_params = list(new.parameters())
    for g in opt.param_groups:
        g["params"] = [new_params.pop(0) for _ in g["params"]]


# ----------------------------------------------------------------------------------- a swapped param set
def test_tensors_swapped_in_before_the_first_step_are_trained(tmp_path):
    """The optimizer is built on one model's tensors, which are then replaced in ``param_groups`` by another
    model's (the same values, new tensors): the new ones train exactly as AdamW trains them."""
    ref = model()
    ref_opt = adamw(model().parameters())
    swap_in(ref_opt, ref)
    train(ref, ref_opt, range(STEPS))

    mine = model()
    with TieredOptimizer(model().parameters(), tmp_path, **TIERED_KW) as opt:
        swap_in(opt, mine)
        train(mine, opt, range(STEPS))
        assert opt.stats()["total"]["nvme_read_bytes"] > 0, "the rebuilt layout did not stream through NVMe"
        assert opt.state[next(mine.parameters())]["step"] == STEPS
    assert moved(ref) > 1e-3
    assert_same(ref, mine, "swapped before the first step")


def test_tensors_swapped_in_after_steps_carry_their_state(tmp_path):
    """Three steps on one set of tensors, a swap to copies of them, three more: as AdamW's six steps (its
    state is keyed by position in ``param_groups`` too)."""
    ref = model()
    ref_opt = adamw(ref.parameters())
    train(ref, ref_opt, range(STEPS))

    first = model()
    with TieredOptimizer(first.parameters(), tmp_path, **TIERED_KW) as opt:
        train(first, opt, range(STEPS // 2))
        second = copy.deepcopy(first)
        swap_in(opt, second)
        train(second, opt, range(STEPS // 2, STEPS))
        sd = opt.state_dict()
    assert_same(ref, second, "swapped after three steps")
    ref_sd = ref_opt.state_dict()
    for i, s in ref_sd["state"].items():
        assert float(sd["state"][i]["step"]) == float(s["step"]) == STEPS
        torch.testing.assert_close(sd["state"][i]["exp_avg_sq"], s["exp_avg_sq"], rtol=RTOL, atol=ATOL)


def test_a_swap_to_other_shapes_after_steps_is_refused_by_name(tmp_path):
    first = model()
    with TieredOptimizer(first.parameters(), tmp_path, **TIERED_KW) as opt:
        train(first, opt, range(2))
        before = [p.detach().clone() for p in first.parameters()]
        opt.param_groups[0]["params"][2] = nn.Parameter(torch.zeros(7, 64))
        with pytest.raises(ValueError, match=r"group0\.param2.*shape \(7, 64\).*\(48, 64\)"):
            opt.step()
        # Nothing changed: putting the tensor back makes the optimizer usable again.
        opt.param_groups[0]["params"][2] = list(first.parameters())[2]
        assert all(torch.equal(a, b) for a, b in zip(before, first.parameters()))
        train(first, opt, range(2, 3))


def test_parameters_added_to_param_groups_by_hand_are_refused(tmp_path):
    m = model()
    with TieredOptimizer(m.parameters(), tmp_path, **TIERED_KW) as opt:
        opt.param_groups[0]["params"].append(nn.Parameter(torch.zeros(3)))
        with pytest.raises(ValueError, match="add_param_group"):
            opt.step()


def test_state_dict_follows_a_swap(tmp_path):
    """``load_state_dict`` and ``state_dict`` after a swap see the new tensors (accelerate loads and saves
    through them), and ``opt.state`` is keyed by them."""
    ref = model()
    ref_opt = adamw(ref.parameters())
    train(ref, ref_opt, range(STEPS))
    first, second = model(), copy.deepcopy(ref)
    with TieredOptimizer(first.parameters(), tmp_path, **TIERED_KW) as opt:
        swap_in(opt, second)
        opt.load_state_dict(ref_opt.state_dict())
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        for i, s in ref_sd["state"].items():
            assert float(sd["state"][i]["step"]) == STEPS
            torch.testing.assert_close(sd["state"][i]["exp_avg"], s["exp_avg"], rtol=0, atol=0)
        assert torch.equal(opt.state[second[4].weight]["exp_avg"], ref_opt.state[ref[4].weight]["exp_avg"])
        train(second, opt, range(STEPS, STEPS + 2))
        train(ref, ref_opt, range(STEPS, STEPS + 2))
    assert_same(ref, second, "resumed from AdamW's state dict after a swap")


# --------------------------------------------------------------------------------- frozen parameters
def frozen_model(seed: int = 0) -> nn.Module:
    m = model(seed)
    m[0].weight.requires_grad_(False)
    m[2].requires_grad_(False)
    return m


def test_frozen_parameters_in_a_list_are_skipped_as_by_adamw(tmp_path):
    """``model.parameters()`` with frozen ones among them, as AdamW takes it: they keep no state (so no
    chunk holds them) and do not move; the rest train as with AdamW, and the state dict numbers them alike."""
    ref = frozen_model()
    ref_opt = adamw(ref.parameters())
    train(ref, ref_opt, range(STEPS))
    mine = frozen_model()
    with TieredOptimizer(mine.parameters(), tmp_path, **TIERED_KW) as opt:
        frozen_elems = sum(p.numel() for p in mine.parameters() if not p.requires_grad)
        state_elems = sum(c.numel for c in opt.chunks)
        assert state_elems == sum(p.numel() for p in mine.parameters()) - frozen_elems
        train(mine, opt, range(STEPS))
        sd = opt.state_dict()
        assert mine[0].weight not in opt.state
    assert_same(ref, mine, "frozen parameters")
    assert torch.equal(mine[0].weight, model()[0].weight)
    ref_sd = ref_opt.state_dict()
    assert sorted(sd["state"]) == sorted(ref_sd["state"]) == [1, 4, 5]
    assert sd["param_groups"][0]["params"] == ref_sd["param_groups"][0]["params"]


def test_a_frozen_parameter_that_is_thawed_later_trains(tmp_path):
    """Progressive unfreezing: three steps with a layer frozen, then it is thawed; its state starts then, as
    AdamW's does, and the other parameters keep theirs."""
    runs = {}
    for kind in ("adamw", "tiered"):
        m = frozen_model()
        opt = adamw(m.parameters()) if kind == "adamw" else TieredOptimizer(m.parameters(), tmp_path, **TIERED_KW)
        train(m, opt, range(STEPS // 2))
        m[2].requires_grad_(True)
        train(m, opt, range(STEPS // 2, STEPS))
        runs[kind] = (m, opt.state_dict())
        if kind == "tiered":
            opt.close()
    assert_same(runs["adamw"][0], runs["tiered"][0], "thawed after three steps")
    steps = {k: {i: float(s["step"]) for i, s in sd["state"].items()} for k, (_, sd) in runs.items()}
    assert steps["tiered"] == steps["adamw"] == {1: 6.0, 2: 3.0, 3: 3.0, 4: 6.0, 5: 6.0}


def test_a_parameter_frozen_after_steps_keeps_its_state_across_a_new_layout(tmp_path):
    """A layer frozen after steps keeps its state, as with AdamW, also when another one thaws meanwhile (which
    lays the state out again); unfrozen, it resumes from that state."""
    runs = {}
    for kind in ("adamw", "tiered"):
        m = frozen_model()
        opt = adamw(m.parameters()) if kind == "adamw" else TieredOptimizer(m.parameters(), tmp_path, **TIERED_KW)
        train(m, opt, range(2))
        m[4].requires_grad_(False)
        m[2].requires_grad_(True)
        train(m, opt, range(2, 4))
        m[4].requires_grad_(True)
        train(m, opt, range(4, STEPS))
        runs[kind] = (m, {i: float(s["step"]) for i, s in opt.state_dict()["state"].items()})
        if kind == "tiered":
            opt.close()
    assert_same(runs["adamw"][0], runs["tiered"][0], "frozen after steps, then unfrozen")
    assert runs["tiered"][1] == runs["adamw"][1] == {1: 6.0, 2: 4.0, 3: 4.0, 4: 4.0, 5: 4.0}


def test_only_frozen_parameters(tmp_path):
    m = model()
    m.requires_grad_(False)
    with TieredOptimizer(m.parameters(), tmp_path, **TIERED_KW) as opt:
        assert opt.chunks == []
        opt.step()
        assert opt.state_dict()["state"] == {}


def test_frozen_parameters_of_any_dtype_are_accepted(tmp_path):
    """AdamW does not look at a frozen parameter's dtype (a quantized base weight, a float64 table)."""
    m = model()
    table = nn.Parameter(torch.zeros(4, dtype=torch.float64), requires_grad=False)
    codes = nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False)
    with TieredOptimizer([*m.parameters(), table, codes], tmp_path, **TIERED_KW) as opt:
        train(m, opt, range(1))
        table.requires_grad_(True)
        loss_of(m, 1).backward()
        table.grad = torch.ones_like(table)
        with pytest.raises(TypeError, match=r"group0\.param6.*float64"):
            opt.step()


def test_update_in_backward_with_frozen_parameters(tmp_path):
    """The update under backward hooks only parameters that take gradients (a frozen one cannot be hooked)."""
    ref = frozen_model()
    ref_opt = adamw(ref.parameters())
    train(ref, ref_opt, range(STEPS))
    mine = frozen_model()
    with TieredOptimizer(mine.parameters(), tmp_path, **TIERED_KW, update_on="device", update_in_backward=True) as opt:
        train(mine, opt, range(STEPS))
    assert_same(ref, mine, "frozen parameters, update under backward")


# ------------------------------------------------------------------------------------------------ add_param_group
def test_a_new_group_of_more_elements_than_split_records_hold_is_laid_out_as_at_construction_and_trains_as_adamw(
    tmp_path,
):
    """A bf16 model's split records are padded to 4 KiB: a new fp32 group's chunk has fewer bytes but more
    elements than the optimizer's scratch rows. Its first records failed to write (a tensor size error), the
    group stayed in param_groups and never trained; the state is now laid out again over both groups."""
    a = nn.Parameter(torch.randn(16).bfloat16())  # one 16-element split chunk (update_on="device" splits)
    c, ref = (nn.Parameter(torch.linspace(-1, 1, 100)) for _ in range(2))
    ref_opt = torch.optim.AdamW([ref], **KW, fused=True)
    with TieredOptimizer([a], tmp_path, **KW, update_on="device") as opt:
        assert opt.chunks[0].split
        opt.add_param_group({"params": [c]})
        assert len(opt.param_groups) == 2 and opt.step_counts == [0, 0]
        assert [(ch.group, ch.numel, ch.split) for ch in opt.chunks] == [(0, 16, True), (1, 100, False)]
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            a.grad, c.grad = torch.randn(16, generator=g).bfloat16(), torch.randn(100, generator=g)
            ref.grad = c.grad.clone()
            opt.step(), ref_opt.step()
        assert torch.equal(c, ref) and opt.step_counts == [3, 3]
        mine, theirs = opt.state_dict()["state"][1], ref_opt.state_dict()["state"][0]
        assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_a_large_group_added_after_a_small_one_takes_the_chunks_it_takes_at_construction(tmp_path):
    """torch's fine-tuning pattern: built over a head, then the backbone added. Its chunks were cut to the head's
    record size, thousands of tiny records for a real backbone, each streamed every step (25-80x slower steps);
    the state is now laid out again as the constructor lays out both groups, the head's state carried over."""

    def build(m):
        return list(m[4].parameters()), [*m[0].parameters(), *m[2].parameters()]

    m, ref = model(), model()
    head, backbone = build(m)
    ref_head, ref_backbone = build(ref)
    kw = dict(**KW, chunk_bytes="64KiB")  # the backbone (4,208 elements, 50 KiB of state) fits one chunk
    with TieredOptimizer([{"params": ref_head}, {"params": ref_backbone, "lr": 1e-3}], tmp_path, **kw) as built:
        expected = [(c.group, c.numel) for c in built.chunks]
    ref_opt = adamw(ref_head)
    with TieredOptimizer(head, tmp_path, **kw) as opt:
        for p in backbone + ref_backbone:
            p.requires_grad_(False)
        train(m, opt, range(2)), train(ref, ref_opt, range(2))
        for p in backbone + ref_backbone:
            p.requires_grad_(True)
        opt.add_param_group({"params": backbone, "lr": 1e-3})
        ref_opt.add_param_group({"params": ref_backbone, "lr": 1e-3})
        assert [(c.group, c.numel) for c in opt.chunks] == expected
        assert opt.step_counts == [2, 2, 0, 0, 0, 0]
        train(m, opt, range(2, 4)), train(ref, ref_opt, range(2, 4))
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
        mine, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        assert all(torch.equal(mine[i][k], theirs[i][k]) for i in theirs for k in ("exp_avg", "exp_avg_sq"))


def test_a_failed_layout_again_for_a_new_group_leaves_the_optimizer_as_it_was(tmp_path, monkeypatch):
    """A failure while the state is laid out again for a large new group (a disk error, a Ctrl-C) takes the group
    back out and lays the state before back out: the optimizer trains on as torch's AdamW, and the same group can
    be added again."""
    from tiered.optim import param_set

    m, ref = model(), model()
    head, ref_head = list(m[4].parameters()), list(ref[4].parameters())
    backbone = [*m[0].parameters(), *m[2].parameters()]
    ref_opt = adamw(ref_head)
    m[0].requires_grad_(False), m[2].requires_grad_(False), ref[0].requires_grad_(False), ref[2].requires_grad_(False)
    with TieredOptimizer(head, tmp_path, **KW) as opt:
        train(m, opt, range(2)), train(ref, ref_opt, range(2))
        restore, calls = param_set.restore, []

        def restore_fails_once(*args, **kw):
            calls.append(1)
            if len(calls) == 1:
                raise OSError(5, "Input/output error")
            restore(*args, **kw)

        monkeypatch.setattr(param_set, "restore", restore_fails_once)
        m[0].requires_grad_(True), m[2].requires_grad_(True)
        with pytest.raises(OSError, match="Input/output error"):
            opt.add_param_group({"params": backbone, "lr": 1e-3})
        monkeypatch.undo()
        assert len(calls) == 2 and not opt.closed  # laid back out, its state restored
        assert len(opt.param_groups) == 1 and len(opt.params) == 2 and opt.step_counts == [2, 2]
        assert all(c.group == 0 for c in opt.chunks)
        m[0].requires_grad_(False), m[2].requires_grad_(False)
        train(m, opt, range(2, 3)), train(ref, ref_opt, range(2, 3))
        assert all(torch.equal(a, b) for a, b in zip(head, ref_head))
        m[0].requires_grad_(True), m[2].requires_grad_(True)
        opt.add_param_group({"params": backbone, "lr": 1e-3})
        before = [p.detach().clone() for p in backbone]
        train(m, opt, range(3, 4))
        assert all(not torch.equal(p, q) for p, q in zip(backbone, before))
        assert opt.step_counts == [4, 4, 1, 1, 1, 1]


def test_bf16_parameters_added_where_no_chunk_is_split_keep_full_masters_and_train_as_adamw(tmp_path):
    """split_masters is on with update_on="device", but an fp32 model's optimizer has no scratch for split chunks:
    a bf16 group added to it was refused; its chunks now keep full fp32 masters, as in a group of mixed dtypes."""
    w = nn.Parameter(torch.linspace(-1, 1, 64))
    b, ref = nn.Parameter(torch.linspace(-2, 2, 48).bfloat16()), nn.Parameter(torch.linspace(-2, 2, 48).bfloat16())
    ref_master = nn.Parameter(ref.detach().float())
    ref_opt = torch.optim.AdamW([ref_master], **KW, fused=True)
    with TieredOptimizer([w], tmp_path, **KW, update_on="device", split_masters=True) as opt:
        opt.add_param_group({"params": [b]})
        assert not any(ch.split for ch in opt.chunks)
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            w.grad, b.grad = torch.randn(64, generator=g), torch.randn(48, generator=g).bfloat16()
            ref_master.grad = b.grad.float()
            opt.step(), ref_opt.step()
        assert torch.equal(opt.state_dict()["state"][1]["master"], ref_master)
        assert torch.equal(b, ref_master.bfloat16())


def test_a_group_whose_first_records_fail_to_write_is_taken_back_out(tmp_path, monkeypatch):
    """A failure while the new chunks' first records are written (a disk error, a Ctrl-C) left the group in
    param_groups, counted in step_counts and state_dict() but never updated. It is now taken back out, its
    records deleted, and the same group can be added again."""
    m = model()
    new = list(m[2].requires_grad_(False).parameters())  # 3120 elements: four chunks
    with TieredOptimizer([*m[0].parameters(), *m[4].parameters()], tmp_path, **TIERED_KW) as opt:
        train(m, opt, range(1))
        keys, put = set(opt.store.keys()), opt.store.put
        written = []

        def put_once(key, *args, **kw):
            if written:
                raise OSError(5, "Input/output error")
            written.append(key)
            put(key, *args, **kw)

        monkeypatch.setattr(opt.store, "put", put_once)
        m[2].requires_grad_(True)
        with pytest.raises(OSError, match="Input/output error"):
            opt.add_param_group({"params": new, "lr": 1e-3})
        monkeypatch.undo()
        assert written and set(opt.store.keys()) == keys  # the record it wrote is gone again
        assert len(opt.param_groups) == 1 and len(opt.params) == 4 and len(opt.step_counts) == 4
        train(m, opt, range(1, 2))
        assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]
        opt.add_param_group({"params": new, "lr": 1e-3})
        before = [p.detach().clone() for p in new]
        train(m, opt, range(2, 3))
        assert all(not torch.equal(p, q) for p, q in zip(new, before))
        assert opt.step_counts == [3, 3, 3, 3, 1, 1]


def test_add_param_group_to_an_optimizer_without_state_lays_the_group_out(tmp_path):
    """An optimizer built over frozen parameters only has no records to size a new group by: it was refused; the
    state is now laid out again over both groups, as at construction."""
    m = model()
    m.requires_grad_(False)
    with TieredOptimizer(m[0].parameters(), tmp_path, **TIERED_KW) as opt:
        added = list(m[2].requires_grad_(True).parameters())
        opt.add_param_group({"params": added})
        assert len(opt.param_groups) == 2 and len(opt.params) == 4 and {c.group for c in opt.chunks} == {1}
        before = [p.detach().clone() for p in added]
        train(m, opt, range(1))
        assert all(not torch.equal(p, q) for p, q in zip(added, before))


# ------------------------------------------------------------------------------------------------ pickle
def test_pickling_is_refused_with_what_to_use(tmp_path):
    with TieredOptimizer(model().parameters(), tmp_path, **TIERED_KW) as opt:
        for dump in (pickle.dumps, copy.deepcopy, lambda o: torch.save(o, tmp_path / "opt.pt")):
            with pytest.raises(TypeError, match=r"state_dict\(\).*save_checkpoint"):
                dump(opt)
        pickle.dumps(opt.state_dict())  # what the message offers works


def test_peft_lora_with_model_parameters_trains_as_adamw(tmp_path):
    """peft's LoRA on a tiny Llama, the optimizer given ``model.parameters()`` (frozen base weights among them),
    as with AdamW: the adapters train alike, the base weights keep no state and do not move."""
    pytest.importorskip("peft")
    import frameworks_common as fc  # takes the HF libraries offline before they load
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    runs, opts = {}, {}
    for kind in fc.KINDS:
        m = get_peft_model(fc.tiny_llama(), config)
        cls, kw = fc.optimizer_kwargs(kind, tmp_path / "nvme")
        opt = cls(m.parameters(), **{**kw, "host_budget": "24KiB", "chunk_bytes": "12KiB"} if kind == "tiered" else kw)
        for batch in fc.tokens(STEPS * fc.BATCH).split(fc.BATCH):
            m(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
        runs[kind], opts[kind] = fc.weights(m), opt
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert sum(c.numel for c in opts["tiered"].chunks) == trainable < sum(p.numel() for p in m.parameters()) / 4
    base = fc.weights(fc.tiny_llama())
    lora = [n for n in runs["tiered"] if "lora_" in n]
    assert lora and all(runs["tiered"][n].abs().max() > 0 for n in lora)  # lora_B starts at zero
    name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(runs["tiered"][name], base["model.layers.0.self_attn.q_proj.weight"])
    fc.assert_same_weights(runs["adamw"], runs["tiered"], "peft LoRA: tiered vs AdamW")
    assert sorted(opts["tiered"].state_dict()["state"]) == sorted(opts["adamw"].state_dict()["state"])
    assert opts["tiered"].stats()["total"]["nvme_read_bytes"] > 0
    opts["tiered"].close()


def test_checkpoint_with_frozen_parameters_resumes(tmp_path):
    """An NVMe-tier checkpoint of an optimizer with frozen parameters loads into a new one over the same list:
    the frozen ones are empty in it, and the rest resume as if never interrupted."""
    ref = frozen_model()
    ref_opt = adamw(ref.parameters())
    train(ref, ref_opt, range(STEPS))
    mine = frozen_model()
    with TieredOptimizer(mine.parameters(), tmp_path / "nvme", **TIERED_KW) as opt:
        train(mine, opt, range(STEPS // 2))
        opt.save_checkpoint(tmp_path / "ckpt")
    resumed = frozen_model(seed=1)
    resumed[0].weight.data.copy_(mine[0].weight)  # frozen weights come from the model (the base), not the state
    resumed[2].load_state_dict(mine[2].state_dict())
    with TieredOptimizer(resumed.parameters(), tmp_path / "nvme", **TIERED_KW) as opt:
        opt.load_checkpoint(tmp_path / "ckpt")
        train(resumed, opt, range(STEPS // 2, STEPS))
    assert_same(ref, resumed, "resumed from a checkpoint with frozen parameters")


def _fsdp2_frozen(rank: int, world: int, root: str) -> float:
    from torch.distributed.fsdp import fully_shard

    runs = {}
    for kind in ("adamw", "tiered"):
        m = frozen_model()
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
        opt = adamw(m.parameters()) if kind == "adamw" else TieredOptimizer(m.parameters(), root, **TIERED_KW)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(12, 16, generator=g), torch.randn(12, 2, generator=g)
            nn.functional.mse_loss(m(x[rank::world]), y[rank::world]).backward()
            opt.step()
            opt.zero_grad()
        runs[kind] = [p.full_tensor() for p in m.parameters()]
        if kind == "tiered":
            opt.close()
    return max((a - b).abs().max().item() for a, b in zip(runs["adamw"], runs["tiered"]))


def test_frozen_parameters_under_fsdp2(tmp_path):
    """Frozen DTensor parameters (FSDP2 over a partly frozen model) keep no state on any rank."""
    from distributed_common import run_ranks

    assert max(run_ranks(_fsdp2_frozen, 2, str(tmp_path))) < 1e-6
