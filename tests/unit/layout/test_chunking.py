"""How parameters are cut into chunks (``plan_chunks``), and why it matters: torch's fused AdamW rounds a tensor's
last elements otherwise than the rest, so a parameter cut at an odd element drifts from AdamW over the whole
parameter. Cuts fall on ``CUT_ALIGN`` elements from the parameter's start, and the optimizer is then AdamW(fused=True)
bit for bit whatever the sizes before it; a checkpoint saved with cuts anywhere loads into the aligned layout."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer
from tiered.layout import chunking
from tiered.layout.chunking import CUT_ALIGN, plan_chunks


# ------------------------------------------------------------------------------------------------- the plan
def check_plan(group_numels, chunk_numel, align):
    chunks = plan_chunks(group_numels, chunk_numel, align=align)
    covered = {}
    for chunk in chunks:
        assert 0 < chunk.numel <= chunk_numel
        assert [pc.chunk_start for pc in chunk.pieces] == [0, *[pc.chunk_start + pc.numel for pc in chunk.pieces][:-1]]
        assert sum(pc.numel for pc in chunk.pieces) == chunk.numel
        for pc in chunk.pieces:
            covered.setdefault(pc.param, []).append((pc.param_start, pc.numel))
    for g, params in enumerate(group_numels):
        group_chunks = [c for c in chunks if c.group == g]
        for c in group_chunks[:-1]:  # only a group's last chunk ends for want of parameters
            assert c.numel > chunk_numel - align
        for index, numel in params:
            spans = covered.get(index, [])
            assert [s for s, _ in spans] == [0, *[s + n for s, n in spans][:-1]]  # the pieces tile it in order
            assert sum(n for _, n in spans) == numel
            assert all(s % align == 0 for s, _ in spans)  # every cut where the kernel's work units begin
            assert all(n % align == 0 for _, n in spans[:-1])  # so only the last piece holds the tail
    return chunks


def test_cuts_fall_on_whole_units_of_the_parameter_and_chunks_end_short_by_less_than_one():
    """Linear(10, 3) -> Linear(3, 700) in 1024-element chunks: the weight starting at element 33 takes 960 of the
    991 elements left in the first chunk (15 units of 64), not all 991."""
    chunks = check_plan([[(0, 30), (1, 3), (2, 2100), (3, 700)]], 1024, CUT_ALIGN)
    assert [(c.numel, [(pc.param, pc.param_start, pc.chunk_start, pc.numel) for pc in c.pieces]) for c in chunks] == [
        (993, [(0, 0, 0, 30), (1, 0, 30, 3), (2, 0, 33, 960)]),
        (1024, [(2, 960, 0, 1024)]),
        (816, [(2, 1984, 0, 116), (3, 0, 116, 700)]),
    ]


def test_a_chunk_with_less_than_a_unit_of_room_left_ends_there():
    chunks = check_plan([[(0, 1000), (1, 5000)]], 1024, CUT_ALIGN)
    assert [c.numel for c in chunks] == [1000, 1024, 1024, 1024, 1024, 904]
    assert chunks[1].pieces[0].param_start == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_groups_are_cut_on_whole_units(seed):
    rng = random.Random(seed)
    chunk_numel = rng.choice([64, 100, 1024, 3072, 4096])
    groups, index = [], 0
    for _ in range(rng.randint(1, 3)):
        sizes = [rng.choice([0, 1, 3, 15, 17, 63, 64, 65, 700, 1023, 1025]) or rng.randint(1, 5 * chunk_numel)
                 for _ in range(rng.randint(1, 8))]  # fmt: skip
        groups.append([(index + i, n) for i, n in enumerate(sizes)])
        index += len(sizes)
    check_plan(groups, chunk_numel, CUT_ALIGN)


def test_align_one_cuts_every_chunk_numel_as_before():
    chunks = check_plan([[(0, 3), (1, 2100)]], 1024, 1)
    assert [c.numel for c in chunks] == [1024, 1024, 55]


def test_a_chunk_narrower_than_the_alignment_cuts_at_its_own_width():
    chunks = plan_chunks([[(0, 100)]], 32, align=64)
    assert [c.numel for c in chunks] == [32, 32, 32, 4]
    with pytest.raises(ValueError, match="align"):
        plan_chunks([[(0, 100)]], 32, align=0)


# ------------------------------------------------------------------------------------------- the optimizer
def train(model, opt_kw, steps, seed=0):
    """``steps`` AdamW steps of ``model`` under TieredOptimizer and of an fp32 copy (bf16 parameters' masters) under
    torch's fused AdamW, on the same random gradients; checks every weight, master and moment bit for bit. Returns
    the pieces that continue a parameter (cut from its earlier pieces)."""
    ref = copy.deepcopy(model).float()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(seed)
    with TieredOptimizer(model, lr=1e-2, weight_decay=0.01, **opt_kw) as opt:
        for _ in range(steps):
            for p, q in zip(model.parameters(), ref.parameters()):
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
                q.grad = p.grad.float()
            opt.step()
            torch_opt.step()
        state = opt.state_dict()["state"]
        for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
            assert torch.equal(p, q.to(p.dtype)), f"param {i}: {(p != q.to(p.dtype)).sum()} weights differ"
            want = {"master": q.detach(), **torch_opt.state[q]}
            for key in ("master", "exp_avg", "exp_avg_sq") if p.dtype != torch.float32 else ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[i][key], want[key]), f"param {i} {key}: {(state[i][key] != want[key]).sum()}"
        return [pc for c in opt.chunks for pc in c.pieces if pc.param_start]


def test_a_parameter_cut_after_a_bias_of_three_steps_as_fused_adamw_bit_for_bit(tmp_path):
    """Linear(10, 3) -> Linear(3, 700) in 12 KiB chunks: the second weight starts at element 33 and is cut across
    chunks. Cut where the chunk filled (element 991 of it), 7 of its exp_avg_sq and a weight drifted from torch's in
    20 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 3), nn.Linear(3, 700))
    cut = train(model, dict(nvme_path=tmp_path, chunk_bytes="12KiB"), steps=20)
    assert [pc.param for pc in cut] == [2, 2]  # the weight is cut, twice


@pytest.mark.parametrize(
    ("sizes", "chunk_bytes"),
    [
        ([3, 2100, 5, 4097], "12KiB"),
        ([1, 17, 1000, 63, 3001], "24KiB"),
        ([10, 7, 9000, 130], "36KiB"),
        ([65, 1023, 1025, 2047, 1], "12KiB"),
    ],
)
@pytest.mark.parametrize(
    "dtype, kw",
    [(torch.float32, {}), (torch.bfloat16, dict(split_masters=True)), (torch.bfloat16, dict(update_on="device"))],
    ids=["fp32", "bf16-split", "bf16-split-device"],
)
def test_odd_sizes_cut_anywhere_step_as_fused_adamw_bit_for_bit(tmp_path, sizes, chunk_bytes, dtype, kw):
    """Parameters of odd sizes, so every cut falls at an odd offset of the group, under small budgets (NVMe); bf16
    parameters' split masters are AdamW's fp32 masters (``update_on="device"``: the GPU path's CPU stand-in)."""
    torch.manual_seed(sum(sizes))
    model = nn.ParameterList(nn.Parameter(torch.randn(n).to(dtype)) for n in sizes)
    kw = dict(nvme_path=tmp_path, chunk_bytes=chunk_bytes, host_budget="64KiB", prefetch_depth=1, **kw)
    assert train(model, kw, steps=6, seed=len(sizes))


def test_a_checkpoint_saved_with_cuts_anywhere_loads_into_the_aligned_layout(tmp_path, monkeypatch):
    """Checkpoints keep each parameter's rows whole, so one saved by a layout that cut at any element (as tiered
    did before cuts were aligned) loads exactly into today's chunks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 3), nn.Linear(3, 700))
    kw = dict(lr=1e-2, chunk_bytes="12KiB")
    g = torch.Generator().manual_seed(0)
    with monkeypatch.context() as m:
        m.setattr(chunking, "CUT_ALIGN", 1)
        with TieredOptimizer(model, tmp_path / "a", **kw) as old:
            assert old.chunks[0].numel == 1024  # the weight cut at its element 991
            for _ in range(3):
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=g)
                old.step()
            path = old.save_checkpoint(tmp_path / "ckpt")
            saved = old.state_dict()
    with TieredOptimizer(model, tmp_path / "b", **kw) as new:
        assert new.chunks[0].numel == 993
        new.load_checkpoint(path)
        loaded = new.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    for i, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded["state"][i][key], value), (i, key)
