"""``opt.state`` as torch's ``optimizer.state`` (tiered/optim/state_view.py): a write into what ``opt.state[p]``
hands out, an assignment ``opt.state[p] = {...}`` and a ``del opt.state[p]`` take effect as they do on
torch.optim.AdamW's live dict, bitwise; a write that cannot (to a copy from before a step) is refused by name.

Once, ``opt.state[p]["exp_avg"].zero_()`` (ReLoRA-style restarts, pruning) changed a copy and nothing else, and
assigning raised, so torch's ZeroRedundancyOptimizer could not load its own state dict."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer
from tiered.optim import state_view
from tiered.store.workdir import EXPORT_PREFIX

# State on NVMe (a budget of three chunks' records), several chunks, parameters across chunk boundaries.
KW = dict(lr=1e-2, weight_decay=0.1, host_budget="36KiB", chunk_bytes="12KiB", prefetch_depth=2)


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dtype)


def backward(model: nn.Module, s: int) -> None:
    g = torch.Generator().manual_seed(100 + s)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(16, 32, generator=g).to(dtype), torch.randn(16, 8, generator=g)
    nn.functional.mse_loss(model(x).float(), y).backward()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        backward(model, s)
        opt.step()
        opt.zero_grad()


def assert_same(ref: nn.Module, ref_opt: torch.optim.Optimizer, model: nn.Module, opt: TieredOptimizer) -> None:
    """The weights and every parameter's state bitwise torch's."""
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for i, s in theirs.items():
        assert float(ours[i]["step"]) == float(s["step"]), i
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[i][key], s[key]), (i, key)


def pair(tmp_path, dtype: torch.dtype = torch.float32, **kw):
    ref, model = mlp(dtype), mlp(dtype)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return ref, ref_opt, model, TieredOptimizer(model, tmp_path, **{**KW, **kw})


def _zero_both(o, m):
    st = o.state[m[0].weight]
    st["exp_avg"].zero_()
    st["exp_avg_sq"].zero_()


def _temporary(o, m):  # neither the dict nor the tensor outlives the statement
    o.state[m[0].weight]["exp_avg"].mul_(-0.5)


def _replaced(o, m):
    st = o.state[m[2].weight]
    st["exp_avg"] = torch.full_like(st["exp_avg"], 1e-3)
    st["exp_avg_sq"] = st["exp_avg_sq"] * 4


def _step_count(o, m):
    o.state[m[0].bias]["step"].fill_(1.0)  # bias correction as on a first step


def _two_params(o, m):
    a, b = o.state[m[0].weight], o.state[m[2].bias]
    a["exp_avg"].zero_()
    b["exp_avg_sq"].mul_(3)


def _two_dicts_of_one_param(o, m):
    a, b = o.state[m[0].weight], o.state[m[0].weight]  # the second read sees nothing written yet
    a["exp_avg"].zero_()
    b["exp_avg_sq"].zero_()


def _two_handles_on_one_tensor(o, m):  # on torch's live tensor the writes compound: a quarter
    a = o.state[m[0].weight]["exp_avg"]
    b = o.state[m[0].weight]["exp_avg"]
    a.mul_(0.5)
    b.mul_(0.5)


def _two_dicts_one_entry(o, m):  # one live dict in torch: both writes count, neither wins over the other
    a, b = o.state[m[0].weight], o.state[m[0].weight]
    a["exp_avg"].mul_(0.5)
    b["exp_avg"].add_(1e-3)


def _held_then_written_through_a_new_read(o, m):  # the tensor held sees the write made through another read
    a = o.state[m[2].bias]["exp_avg_sq"]
    o.state[m[2].bias]["exp_avg_sq"].zero_()
    a.add_(1e-4)


def _replaced_then_read_again(o, m):  # the tensor put in the dict is the entry, read back as torch's
    st = o.state[m[2].weight]
    st["exp_avg"] = st["exp_avg"] * 2
    o.state[m[2].weight]["exp_avg"].add_(1e-3)


def _read_back(o, m):
    o.state[m[0].weight]["exp_avg"].fill_(0.25)
    st = o.state[m[0].weight]  # the write is seen by the next read, as on torch's live tensors
    assert bool((st["exp_avg"] == 0.25).all())
    st["exp_avg"].add_(1.0)


def _read_all(o, m):  # a logging loop: every parameter's state read, each dict dropped at once
    return {n: float(o.state[p]["exp_avg_sq"].sum()) for n, p in m.named_parameters()}


# Kept while other parameters' state is read (which lets go of the dicts nobody holds), written after.
def _kept_dict(o, m):
    st = o.state[m[0].weight]
    _read_all(o, m)
    st["exp_avg"].zero_()
    _read_all(o, m)


def _kept_tensor(o, m):
    t = o.state[m[0].weight]["exp_avg"]
    _read_all(o, m)
    t.mul_(0.5)


def _kept_view(o, m):
    row = o.state[m[0].weight]["exp_avg"][1]
    _read_all(o, m)
    row.fill_(0.1)


def _kept_detached(o, m):
    t = o.state[m[2].bias]["exp_avg_sq"].detach()
    _read_all(o, m)
    t.mul_(2)


def _kept_base(o, m):  # what the tensor handed out is a view of, where it is one (torch's is not: itself)
    t = o.state[m[0].weight]["exp_avg"]
    base = t if t._base is None else t._base
    del t
    _read_all(o, m)
    base.zero_()


WRITES = [_zero_both, _temporary, _replaced, _step_count, _two_params, _two_dicts_of_one_param,
          _two_handles_on_one_tensor, _two_dicts_one_entry, _held_then_written_through_a_new_read,
          _replaced_then_read_again, _read_back, _kept_dict, _kept_tensor, _kept_view, _kept_detached,
          _kept_base]  # fmt: skip


@pytest.mark.parametrize("write", WRITES, ids=[w.__name__.strip("_") for w in WRITES])
def test_a_write_into_what_opt_state_hands_out_takes_effect_as_in_torch(tmp_path, write):
    ref, ref_opt, model, opt = pair(tmp_path)
    with opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2))
            write(o, m)
        assert_same(ref, ref_opt, model, opt)  # a state_dict() sees it
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2, 5))
        assert_same(ref, ref_opt, model, opt)


@pytest.mark.parametrize(
    "dtype, kw",
    [(torch.bfloat16, dict(split_masters=False)), (torch.bfloat16, dict(split_masters=True)),
     (torch.float32, dict(moments_dtype="int8"))],
    ids=["bf16-masters", "split", "int8"],
)  # fmt: skip
def test_a_dict_read_again_while_held_is_the_same_dict_holding_the_state_now(tmp_path, dtype, kw):
    """torch's ``opt.state[p]`` is one live dict: while the one handed out is held, a read hands it out again,
    its tensors set to the state as it is now, as a fresh read shows it: a master after a write to the parameter,
    8-bit moments as their codes hold a value written."""
    model = mlp(dtype)
    with TieredOptimizer(model, tmp_path, **KW, **kw) as opt:
        train(model, opt, range(2))
        w = model[0].weight
        st = opt.state[w]
        tensors = dict(st)
        with torch.no_grad():
            w.mul_(-2)  # a write to the parameter: its master follows
        st["exp_avg"].mul_(0.3)  # in 8-bit moments: stored as the nearest codes
        assert opt.state[w] is st and all(st[k] is t for k, t in tensors.items())
        fresh = opt.state_dict()["state"][0]
        assert st.keys() == fresh.keys()
        assert all(torch.equal(st[k], fresh[k]) for k in fresh)
        train(model, opt, range(2, 3))


def _mapped_copies(folder) -> int:
    """Bytes of opt.state / state_dict() copies mapped now: files in the optimizer's folder (on the NVMe disk)."""
    with open("/proc/self/maps") as maps:
        spans = [line.split()[0].split("-") for line in maps if f"{os.path.realpath(folder)}/" in line
                 and EXPORT_PREFIX in line]  # fmt: skip
    return sum(int(z, 16) - int(a, 16) for a, z in spans)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings")
def test_a_loop_reading_every_parameters_state_holds_about_one_copy(tmp_path):
    """Once every dict handed out was kept until the next step: a second state, on the disk."""
    model = mlp(torch.bfloat16)  # a master too
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        train(model, opt, range(2))
        for _ in range(2):
            _read_all(opt, model)
            largest = max(p.numel() for p in model.parameters())
            assert _mapped_copies(tmp_path) <= 3 * (4 * largest + 4096)  # the last one read at most (whole pages)
            assert len(opt.state._handed) <= 1
            opt.state_dict()  # lets go of that one too
            assert opt.state._handed == []
        train(model, opt, range(2, 3))


def test_get_pop_and_in_answer_as_torchs_dict(tmp_path):
    """torch's state is a defaultdict(dict): ``get`` and ``pop(p, default)`` give the default where ``p`` has no
    state (once, ``pop(p, None)`` raised KeyError and ``get(p)`` gave {}); ``pop`` takes the state away."""
    ref, ref_opt, model, opt = pair(tmp_path)
    with opt:
        foreign = nn.Parameter(torch.zeros(1))
        for m, o in ((ref, ref_opt), (model, opt)):
            w = m[0].weight
            assert (w in o.state, o.state.get(w), o.state.get(w, 7), o.state.pop(w, None)) == (False, None, 7, None)
            assert (o.state.get(foreign), o.state.pop(foreign, 3), foreign in o.state) == (None, 3, False)
            with pytest.raises(KeyError):
                o.state.pop(w)
            train(m, o, range(2))
        popped = [o.state.pop(m[2].weight) for m, o in ((ref, ref_opt), (model, opt))]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(popped[0][key], popped[1][key]), key
        for m, o in ((ref, ref_opt), (model, opt)):
            assert m[2].weight not in o.state and o.state.get(m[2].weight) is None
            assert torch.equal(o.state.get(m[0].weight)["exp_avg"], ref_opt.state[ref[0].weight]["exp_avg"])
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2, 4))  # the popped parameter starts afresh, as torch's
        assert_same(ref, ref_opt, model, opt)


def test_assignment_and_del_load_one_parameter_as_torch_does(tmp_path):
    ref, ref_opt, model, opt = pair(tmp_path)
    other = mlp()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2, fused=True)
    train(other, other_opt, range(7, 10))  # another run's state for the first layer
    with opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2))
            o.state[m[0].weight] = copy.deepcopy(other_opt.state[other[0].weight])
            del o.state[m[0].bias]  # torch's next step starts it afresh
            o.state[m[2].weight] = {}  # the same
            with pytest.raises(KeyError):
                del o.state[m[0].bias]  # no state left to delete
            del o.state[m[2].bias]
            o.state[m[2].bias].update(copy.deepcopy(other_opt.state[other[2].bias]))  # the empty dict, filled
        assert model[0].bias not in opt.state and opt.state[model[0].bias] == {}
        assert torch.equal(opt.state[model[0].weight]["exp_avg"], other_opt.state[other[0].weight]["exp_avg"])
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2, 5))
        assert_same(ref, ref_opt, model, opt)
        assert opt.step_counts == [6, 3, 3, 6]  # the other run's 3 steps and 3 more; 3 afresh


def test_assignment_is_checked_as_load_state_dict_checks_an_entry(tmp_path):
    model = mlp()
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        train(model, opt, range(2))
        w = model[0].weight
        good = {k: v.clone() for k, v in opt.state[w].items()}
        before = copy.deepcopy(opt.state_dict())
        bad = [
            ({**good, "exp_avg": torch.zeros(3, 3)}, ValueError, r"exp_avg of '0.weight' is shape \(3, 3\)"),
            ({**good, "exp_avg_sq": torch.zeros(64, 32, dtype=torch.int32)}, ValueError, "of dtype torch.int32"),
            ({"step": good["step"], "exp_avg": good["exp_avg"]}, ValueError, "has no 'exp_avg_sq'"),
            ({**good, "step": torch.tensor(-1.0)}, ValueError, "whole number >= 0"),
            ({**good, "max_exp_avg_sq": good["exp_avg_sq"]}, ValueError, "amsgrad"),
            (good["exp_avg"], TypeError, "a parameter's state is a dict"),
        ]
        for value, error, match in bad:
            with pytest.raises(error, match=match):
                opt.state[w] = value
        with pytest.raises(ValueError, match="not a parameter of this TieredOptimizer"):
            opt.state[nn.Parameter(torch.zeros(3))] = good
        after = opt.state_dict()
        for i, s in before["state"].items():  # nothing changed
            assert all(torch.equal(v, after["state"][i][k]) for k, v in s.items())
        opt.state[w] = good  # and a good one loads


@pytest.mark.parametrize(
    "dtype, kw",
    [
        (torch.float32, {}),
        (torch.bfloat16, dict(split_masters=True)),
        (torch.bfloat16, dict(split_masters=False)),
        (torch.float32, dict(moments_dtype="int8")),
        (torch.float32, dict(moments_dtype=torch.bfloat16)),
    ],
    ids=["fp32", "split", "bf16-masters", "int8", "bf16-moments"],
)
def test_one_parameter_loads_as_a_whole_state_dict_with_that_entry_would(tmp_path, dtype, kw):
    """In every record format: the parameters sharing the loaded one's chunks keep their state (and 8-bit
    moments their codes), as a load of the whole state dict with that entry replaced keeps them."""
    a, b = mlp(dtype), mlp(dtype)
    opt_a, opt_b = (TieredOptimizer(m, tmp_path / n, **KW, **kw) for m, n in ((a, "a"), (b, "b")))
    with opt_a, opt_b:
        train(a, opt_a, range(3))
        train(b, opt_b, range(3))
        entry = {k: v.clone() for k, v in opt_a.state[a[0].bias].items()}
        entry["exp_avg"] = torch.linspace(-1e-2, 1e-2, 64)
        if "master" in entry:
            entry["master"] += 1e-4
        opt_a.state[a[0].bias] = entry
        sd = copy.deepcopy(opt_b.state_dict())
        sd["state"][1] = entry
        opt_b.load_state_dict(sd)
        for _ in range(2):
            for m, o in ((a, opt_a), (b, opt_b)):
                train(m, o, range(3, 5))
            assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
            sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
            assert all(torch.equal(v, sb[i][k]) for i, s in sa.items() for k, v in s.items())


def test_a_one_parameter_load_keeps_a_write_to_a_neighbour_spanning_more_chunks(tmp_path):
    """Split masters: a weight written, then ``opt.state[bias] = ...`` for a bias sharing one of that weight's
    chunks. The weight's master is exactly the weight written, in every chunk, and training goes on as without the
    load (once the load took the whole weight as in line with its masters: outside the shared chunk they kept
    their stale low halves)."""

    def deep() -> nn.Module:  # 2.weight spans five chunks, the first shared with 0.bias
        torch.manual_seed(0)
        layers = (nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
        return nn.Sequential(*layers).to(torch.bfloat16)

    a, b = deep(), deep()
    opt_a, opt_b = (TieredOptimizer(m, tmp_path / n, **KW, split_masters=True) for m, n in ((a, "a"), (b, "b")))
    with opt_a, opt_b:
        bias_chunks = [c for c in opt_a.chunked_state.chunks if any(pc.param == 1 for pc in c.pieces)]
        weight_chunks = [c for c in opt_a.chunked_state.chunks if any(pc.param == 2 for pc in c.pieces)]
        assert len(bias_chunks) == 1 and bias_chunks[0] in weight_chunks and len(weight_chunks) > 2
        for m, o in ((a, opt_a), (b, opt_b)):
            train(m, o, range(3))
            with torch.no_grad():
                m[2].weight.mul_(1.5)  # a write: the master becomes exactly the weight
        opt_a.state[a[0].bias] = dict(opt_a.state[a[0].bias])  # the bias's own state, loaded again
        assert torch.equal(opt_a.state[a[2].weight]["master"], a[2].weight.float())
        for m, o in ((a, opt_a), (b, opt_b)):
            train(m, o, range(3, 5))
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
        assert torch.equal(opt_a.state[a[2].weight]["master"], opt_b.state[b[2].weight]["master"])


def test_a_write_after_a_step_to_a_copy_from_before_it_is_refused_by_name(tmp_path):
    ref, ref_opt, model, opt = pair(tmp_path)
    with opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2))
        kept = opt.state[model[0].weight]
        train(model, opt, range(2, 3))
        train(ref, ref_opt, range(2, 3))
        kept["exp_avg"].zero_()  # torch's would be the live tensor; this is a copy from before the step
        backward(model, 3)
        with pytest.raises(RuntimeError, match=r"exp_avg of '0.weight', read from opt.state\[p\] before the last "):
            opt.step()
        opt.step()  # said once; the write was not applied
        backward(ref, 3)
        ref_opt.step()
        assert_same(ref, ref_opt, model, opt)


def test_a_load_overwrites_writes_made_before_it_and_a_refused_load_keeps_them(tmp_path):
    ref, ref_opt, model, opt = pair(tmp_path)
    with opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2))
        saved = (copy.deepcopy(ref_opt.state_dict()), copy.deepcopy(opt.state_dict()))
        for (m, o), sd in zip(((ref, ref_opt), (model, opt)), saved):
            o.state[m[0].weight]["exp_avg"].zero_()
            o.load_state_dict(sd)  # the write is overwritten
            kept = o.state[m[2].weight]
            kept["exp_avg_sq"].zero_()
            with pytest.raises(ValueError):
                o.load_state_dict({"state": {}, "param_groups": []})  # refused before anything changed
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2, 4))
        assert_same(ref, ref_opt, model, opt)


def test_reads_without_writes_load_nothing(tmp_path, monkeypatch):
    """Cheap where nothing is written: no parameter's state is loaded again, whatever was read. torch's
    ZeroRedundancyOptimizer puts each ``step`` back as ``step.cpu()``, the same values: nothing either."""
    loads = []
    monkeypatch.setattr(state_view, "load_param_state", lambda *a: loads.append(a))
    model = mlp()
    with TieredOptimizer(model, tmp_path, **KW) as opt:
        train(model, opt, range(2))
        held = [opt.state[p] for p in model.parameters()]
        for st in held:
            st["step"] = st["step"].cpu()
            st["exp_avg"] = st["exp_avg"].clone()
        opt.state_dict()
        train(model, opt, range(2, 4))
        assert loads == []


def test_a_write_between_backward_and_step_redoes_the_updates_backward_started(tmp_path):
    """The update under backward started this step's updates from the state before the write: they are
    dropped, and the step runs on the state written."""
    ref, ref_opt, model, opt = pair(tmp_path, update_on="device", update_in_backward=True, host_budget="8MiB")
    with opt:
        for s in range(4):
            for m, o in ((ref, ref_opt), (model, opt)):
                backward(m, s)
                if s == 2:
                    o.state[m[0].weight]["exp_avg"].zero_()
                o.step()
                o.zero_grad()
        assert opt.stats()["under_backward"]["kept"] > 0  # it did run under backward
        assert_same(ref, ref_opt, model, opt)


def _thaw_the_head(m: nn.Module, o: torch.optim.Optimizer) -> None:
    m[2].requires_grad_(True)
    o.state_dict()  # any call that reads the state: tiered's is laid out again, over the thawed layer


def _add_the_backbone(m: nn.Module, o: torch.optim.Optimizer) -> None:
    m[0].requires_grad_(True)
    o.add_param_group({"params": list(m[0].parameters())})  # too large for the head's buffers: all laid out again


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("relayout", [_thaw_the_head, _add_the_backbone], ids=["thaw", "add_param_group"])
def test_a_write_into_a_dict_handed_out_before_the_state_is_laid_out_again_takes_effect(tmp_path, relayout, when):
    """A layer thawed between steps, or a param group added, lays tiered's state out again (param_set.follow). The
    dicts opt.state[p] had handed out before were then no longer looked at: a write to one after it, such as
    ``st["exp_avg"].zero_()``, was dropped without a word, where on torch's live dict it takes effect. They stay
    watched across the new layout now, and the write is taken in, before or after it, bitwise torch's."""
    ref, model = mlp(), mlp()
    opts = []
    for m in (ref, model):
        if relayout is _thaw_the_head:
            m[2].requires_grad_(False)
            groups = [{"params": list(m.parameters())}]  # a list: the optimizer follows freezes and thaws
        else:
            m[0].requires_grad_(False)
            groups = [{"params": list(m[2].parameters())}]  # the head trains first, the backbone is added later
        opts.append(torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=True) if m is ref
                    else TieredOptimizer(groups, tmp_path, **KW))  # fmt: skip
    ref_opt, opt = opts
    with opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2))
            laid_out = getattr(o, "chunked_state", None)
            st = o.state[m[0].weight if relayout is _thaw_the_head else m[2].weight]  # it has state from the start
            if when == "before":
                st["exp_avg"].zero_()
            relayout(m, o)
            assert o is ref_opt or o.chunked_state is not laid_out  # laid out again
            if when == "after":
                st["exp_avg"].zero_()
                st["exp_avg_sq"].mul_(2)
        del st
        assert_same(ref, ref_opt, model, opt)  # a state_dict() sees it
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2, 5))
        assert_same(ref, ref_opt, model, opt)


def test_a_write_after_a_step_to_a_copy_from_before_a_new_layout_is_refused_by_name(tmp_path):
    """A dict handed out before the state was laid out again, written after the next step: dropped without a word,
    where a copy from before a step is refused. It is refused now, as any stale copy."""
    model = mlp()
    model[2].requires_grad_(False)
    with TieredOptimizer([{"params": list(model.parameters())}], tmp_path, **KW) as opt:
        train(model, opt, range(2))
        kept = opt.state[model[0].weight]
        _thaw_the_head(model, opt)
        train(model, opt, range(2, 3))
        kept["exp_avg"].zero_()  # torch's would be the live tensor; this is a copy from before the step
        backward(model, 3)
        with pytest.raises(RuntimeError, match=r"exp_avg of 'group0.param0', read from opt.state\[p\] before the last"):
            opt.step()
        opt.step()  # said once


# A master written through opt.state, on the reference's fp32 master as on tiered's: values whose bf16 rounding
# differs from the weight's in most elements, and in low bits alone in others (1e-3 is below a bf16 step there).
def _master_in_place(st, master):
    for t in (st["master"], master):
        t.mul_(-0.75).add_(1e-3)


def _master_replaced(st, master):
    st["master"] = st["master"] * -0.75 + 1e-3
    master.mul_(-0.75).add_(1e-3)


def _master_row(st, master):  # through a view: a part of the master
    for t in (st["master"][1], master[1]):
        t.fill_(0.123456)


MASTER_WRITES = [_master_in_place, _master_replaced, _master_row]


@pytest.mark.parametrize("write", MASTER_WRITES, ids=[w.__name__.strip("_") for w in MASTER_WRITES])
@pytest.mark.parametrize(
    "kw",
    [dict(split_masters=False), dict(split_masters=True),
     dict(update_on="device", update_in_backward=True, host_budget="8MiB")],
    ids=["bf16-masters", "split", "under-backward"],
)  # fmt: skip
def test_a_write_to_a_master_through_opt_state_moves_its_weight_as_on_adamw_over_fp32_masters(tmp_path, kw, write):
    """The reference is torch's fused AdamW over fp32 masters, whose bf16 weights are the masters' rounding: a
    write to a master there moves its weight. Here the write was taken in and then undone (the unchanged weight
    won, as after a load), so a read back before the next step already showed the old master. Now the weight
    becomes the master's rounding, the master keeps every bit written, and training goes on bitwise the
    reference's; under the update in backward the write between backward and step redoes what backward began."""
    model = mlp(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    w, master = model[0].weight, masters[0]

    def same() -> None:
        for p, m in zip(model.parameters(), masters):
            assert torch.equal(p, m.detach().to(torch.bfloat16))
        ours = opt.state_dict()["state"]
        for i, m in enumerate(masters):
            assert torch.equal(ours[i]["master"], m.detach()), i
            assert torch.equal(ours[i]["exp_avg_sq"], ref_opt.state[m]["exp_avg_sq"]), i

    with TieredOptimizer(model, tmp_path, **{**KW, **kw}) as opt:
        for s in range(5):
            backward(model, s)
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.float()
            if s == 2:  # between backward and step: what the update under backward began is redone
                with torch.no_grad():
                    write(opt.state[w], master.detach())
                assert torch.equal(opt.state[w]["master"], master.detach())  # read back before the step
                assert torch.equal(w, master.detach().to(torch.bfloat16))
            ref_opt.step()
            opt.step()
            opt.zero_grad()
            same()
        if kw.get("update_in_backward"):
            assert opt.stats()["under_backward"]["redone"].get("load", 0) > 0
