"""TieredOptimizer under torch.distributed, on CPU ranks over gloo: FSDP2 (fully_shard), DDP, ZeRO-1.

Each case runs the same training on every rank twice, once with TieredOptimizer and once with
torch.optim.AdamW under the same wrapper, and compares the full (gathered) weights. The model has a layer of
two rows, so at world size 3 one rank holds an empty shard of it. Gradients are large enough that
``max_grad_norm`` clips on every step, so the global norm over the ranks' shards is what is tested.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import signal

import pytest
import torch
from distributed_common import run_ranks
from helpers import flip_byte
from torch import nn

from tiered import TieredOptimizer, gather_stats
from tiered.checkpoint import CheckpointCorruptError

STEPS = 5
LR, CLIP = 1e-2, 0.5
# Small chunks and budget: several chunks a rank, streamed through NVMe files on every step.
KW = dict(lr=LR, weight_decay=0.1, chunk_bytes="12KiB", host_budget="96KiB", max_grad_norm=CLIP)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 2))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the step's global batch of 12 (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(12, 16, generator=g), torch.randn(12, 2, generator=g)
    per = 12 // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def loss_of(m: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = batch(step, rank, world)
    return 50 * nn.functional.mse_loss(m(x).float(), y)  # large gradients: max_grad_norm clips on every step


def fsdp(m: nn.Module, mixed: bool, device: str = "cpu") -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict = {"mesh": init_device_mesh(device, (torch.distributed.get_world_size(),))}
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    return fully_shard(m, **kw)


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


# ------------------------------------------------------------------------------------------------ FSDP2
def _fsdp2_parity(rank: int, world: int, root: str, mixed: bool) -> dict:
    ref, mine = fsdp(model(), mixed), fsdp(model(), mixed)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    opt = TieredOptimizer(mine, root, **KW)
    local_numel = sum(p.to_local().numel() for p in mine.parameters())
    for step in range(STEPS):
        loss_of(ref, step, rank, world).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(mine, step, rank, world).backward()
        opt.step()
        opt.zero_grad()
    diff = max((full(a) - full(b)).abs().max().item() for a, b in zip(ref.parameters(), mine.parameters()))
    moved = max((full(a) - full(b)).abs().max().item() for a, b in zip(ref.parameters(), model().parameters()))
    p, ref_p = next(mine.parameters()), next(ref.parameters())
    one = opt.state[p]["exp_avg"]  # opt.state[p] reads one parameter's state, sharded like p, as torch's does
    one_diff = (full(one) - full(ref_opt.state[ref_p]["exp_avg"])).abs().max().item()
    sd, ref_sd = copy.deepcopy(opt.state_dict()), ref_opt.state_dict()  # deepcopy: as frameworks keep a "best" state
    state_diff = max((full(sd["state"][i][k]) - full(ref_sd["state"][i][k])).abs().max().item()
                     for i in ref_sd["state"] for k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
    workdir, chunks = opt.workdir, len(opt.chunks)
    gathered = gather_stats(opt)
    stats = None if gathered is None else [(s["rank"], s["world_size"], s["steps"], s["state_bytes"]) for s in gathered]
    opt.close()
    return dict(diff=diff, moved=moved, state_diff=max(state_diff, one_diff), workdir=workdir, chunks=chunks,
                local_numel=local_numel, left=os.path.exists(workdir), stats=stats)  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-compute"])
def test_fsdp2_matches_fsdp2_with_adamw(tmp_path, world, mixed):
    results = run_ranks(_fsdp2_parity, world, str(tmp_path), mixed)
    for r in results:
        assert r["moved"] > 1e-3, "the weights did not train"
        assert r["diff"] < 1e-5, f"weights differ from FSDP2 + AdamW by {r['diff']}"
        assert r["state_diff"] < 1e-5, f"exp_avg/exp_avg_sq differ from FSDP2 + AdamW by {r['state_diff']}"
        assert not r["left"]
    # One private folder a rank under the shared root, named by the rank; all removed on close.
    names = [os.path.basename(r["workdir"]) for r in results]
    assert len(set(names)) == world and all(f"rank{k}-" in n for k, n in enumerate(names))
    assert all(os.path.dirname(r["workdir"]) == str(tmp_path) for r in results)
    # Every rank's stats, gathered on rank 0: each names its rank, and holds the state of its own shards.
    assert all(r["stats"] is None for r in results[1:])
    assert [s[:3] for s in results[0]["stats"]] == [(k, world, STEPS) for k in range(world)]
    assert [s[3] for s in results[0]["stats"]] == [12 * r["local_numel"] for r in results]
    if world == 3:  # the 2-row layer: rank 2 holds none of it, and still steps and clips with the others
        assert results[2]["local_numel"] < results[0]["local_numel"]


def _fsdp2_state_writes(rank: int, world: int, root: str) -> bool:
    """Writes through ``opt.state[p]`` (DTensors sharded like p) on one optimizer; the same changes through
    ``state_dict()`` and ``load_state_dict()`` on its twin."""
    a, b = fsdp(model(), False), fsdp(model(), False)
    opt_a, opt_b = TieredOptimizer(a, os.path.join(root, "a"), **KW), TieredOptimizer(b, os.path.join(root, "b"), **KW)
    _train(a, opt_a, range(2), rank, world)
    _train(b, opt_b, range(2), rank, world)
    pa = list(a.parameters())
    opt_a.state[pa[0]]["exp_avg"].zero_()  # in place, on the DTensor
    shard = opt_a.state[pa[1]]["exp_avg_sq"].to_local()  # its local shard, kept while others are read
    st = opt_a.state[pa[2]]
    st["exp_avg"] = st["exp_avg"] * -1  # replaced
    opt_a.state[pa[3]] = {**opt_a.state[pa[3]], "step": torch.tensor(7.0)}  # assigned
    del opt_a.state[pa[4]]
    shard.mul_(2)  # in place, after those reads
    sd = copy.deepcopy(opt_b.state_dict())
    for i, key, change in ((0, "exp_avg", 0.0), (1, "exp_avg_sq", 2.0), (2, "exp_avg", -1.0)):
        sd["state"][i][key] = sd["state"][i][key] * change
    sd["state"][3]["step"] = torch.tensor(7.0)
    del sd["state"][4]
    opt_b.load_state_dict(sd)
    _train(a, opt_a, range(2, 4), rank, world)
    _train(b, opt_b, range(2, 4), rank, world)
    same = all(torch.equal(x.to_local(), y.to_local()) for x, y in zip(a.parameters(), b.parameters()))
    same = same and opt_a.step_counts == opt_b.step_counts == [4, 4, 4, 9, 2, 4]
    opt_a.close()
    opt_b.close()
    return same


def test_fsdp2_writes_through_opt_state_take_effect_as_a_state_dict_load(tmp_path):
    assert run_ranks(_fsdp2_state_writes, 2, str(tmp_path)) == [True, True]


def _clip_norm_is_global(rank: int, world: int, root: str) -> dict:
    m = fsdp(model(), False)
    loss_of(m, 0, rank, world).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).full_tensor().item()
    # lr 0: the step only clips, in place, the gradients it was given.
    opt = TieredOptimizer(m, root, **{**KW, "max_grad_norm": norm / 4, "lr": 0.0, "weight_decay": 0.0})
    before = [p.grad.to_local().clone() for p in m.parameters()]
    opt.step()
    after = [p.grad.to_local() for p in m.parameters()]
    ratios = torch.cat([(a / b)[b != 0] for a, b in zip(after, before)])
    opt.close()
    return dict(ratios=ratios.tolist())


def test_clipping_uses_the_norm_over_all_ranks(tmp_path):
    # Clipping to a quarter of the global norm scales every rank's gradients by the same 1/4; a norm taken
    # over one rank's shard alone would scale them by a different factor on each rank.
    results = run_ranks(_clip_norm_is_global, 3, str(tmp_path))
    ratios = [x for r in results for x in r["ratios"]]
    assert len(ratios) > 100
    assert max(abs(x - 0.25) for x in ratios) < 1e-5


def _fsdp2_clip_bitwise(rank: int, world: int, root: str) -> dict:
    """FSDP2 + TieredOptimizer(max_grad_norm) against FSDP2 + AdamW(fused=True) + clip_grad_norm_, the same
    steps; one chunk a rank (torch's fused kernel over the same tensors, so the update is bitwise too)."""
    out = {}
    for kind in ("ref", "mine"):
        m = fsdp(model(), False)
        opt = (TieredOptimizer(m, root, lr=LR, weight_decay=0.1, max_grad_norm=CLIP) if kind == "mine" else
               torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1, fused=True))  # fmt: skip
        norms = []
        for step in range(STEPS):
            loss_of(m, step, rank, world).backward()
            if kind == "ref":
                norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP).full_tensor().item())
            opt.step()
            if kind == "mine":
                norms.append(opt.stats()["grad_norm"])
            opt.zero_grad()
        out[kind] = ([full(p) for p in m.parameters()], norms)
        if kind == "mine":
            opt.close()
    (ref, ref_norms), (mine, norms) = out["ref"], out["mine"]
    return dict(same=all(torch.equal(a, b) for a, b in zip(ref, mine)), norms=norms, ref_norms=ref_norms)


def test_fsdp2_clip_is_bitwise_fsdp2_adamw_and_clip_grad_norm(tmp_path):
    for r in run_ranks(_fsdp2_clip_bitwise, 2, str(tmp_path)):
        assert min(r["norms"]) > CLIP, "the clip did not fire on every step"
        assert r["norms"] == r["ref_norms"], r
        assert r["same"], "weights differ from FSDP2 + AdamW + clip_grad_norm_"


def _clip_of_mixed_dtypes(rank: int, world: int, root: str) -> dict:
    # A bf16 layer among fp32 ones (torch takes the norms by dtype group), a 2-row layer (an empty shard at world
    # 3) and a layer that takes no gradient (left out of the norm, as torch's clip leaves a None grad out).
    def build() -> nn.Module:
        m = nn.Sequential(*model(), nn.Linear(2, 3))
        m[2].to(torch.bfloat16)
        return fsdp(m, False)

    def backward(m: nn.Module, step: int) -> None:
        x, y = batch(step, rank, world)
        for layer in list(m)[:-1]:  # the last layer is unused
            x = layer(x.to(layer.weight.dtype)) if isinstance(layer, nn.Linear) else layer(x)
        (50 * nn.functional.mse_loss(x.float(), y)).backward()

    ref, mine = build(), build()
    opt = TieredOptimizer(mine, root, lr=0.0, weight_decay=0.0, max_grad_norm=CLIP)  # lr 0: the step only clips
    same, norms = [], []
    for step in range(3):
        backward(ref, step)
        norms.append((torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).full_tensor().item(), None))
        backward(mine, step)
        opt.step()
        norms[-1] = (norms[-1][0], opt.stats()["grad_norm"])
        same.append(all(a.grad is None and b.grad is None or torch.equal(a.grad.to_local(), b.grad.to_local())
                        for a, b in zip(ref.parameters(), mine.parameters())))  # fmt: skip
        opt.zero_grad()
        ref.zero_grad()
    opt.close()
    return dict(same=same, norms=norms, empty=any(p.to_local().numel() == 0 for p in mine.parameters()))


def test_fsdp2_clip_takes_torch_s_norm_over_dtypes_empty_shards_and_unused_parameters(tmp_path):
    results = run_ranks(_clip_of_mixed_dtypes, 3, str(tmp_path))
    assert results[2]["empty"]
    for r in results:
        assert all(r["same"]), r
        assert all(t == m for t, m in r["norms"]), r["norms"]


def _inf_on_one_rank(rank: int, world: int, root: str) -> dict:
    m = fsdp(model(), False)
    opt = TieredOptimizer(m, root, **KW)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    out = {}
    for step in range(2):
        before = [p.to_local().clone() for p in m.parameters()]
        scaler.scale(loss_of(m, step, rank, world)).backward()
        if step == 0 and rank == 0:  # one element of one rank's shard overflows; the others are finite
            next(m.parameters()).grad.to_local()[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out[step] = (all(torch.equal(a, p.to_local()) for a, p in zip(before, m.parameters())), scaler.get_scale())
    out["steps"] = opt.global_step
    opt.close()
    return out


def test_grad_scaler_skips_on_every_rank_or_none(tmp_path):
    # An overflow in one rank's shard skips the step on every rank (and halves the scale everywhere), so the
    # shards never drift apart; the next finite step runs on all.
    for r in run_ranks(_inf_on_one_rank, 2, str(tmp_path)):
        assert r[0] == (True, 128.0) and r[1] == (False, 128.0) and r["steps"] == 1, r


def _built_differently(rank: int, world: int, root: str, case: str) -> str:
    m = fsdp(model(), False)
    params = list(m.parameters())
    kw = {**KW, "max_grad_norm": None if case == "clip" and rank == 1 else CLIP}  # e.g. a setting one node lacks
    if case == "params" and rank == 1:
        params = params[:-1]  # e.g. a rank leaving out a parameter its shard of is small or empty
    try:
        opt = TieredOptimizer(params, os.path.join(root, str(rank)), **kw)
    except ValueError as e:
        return str(e)
    try:  # built: the ranks part at the step's clip, one waiting in its all-reduce (until the process group's timeout)
        loss_of(m, 0, rank, world).backward()
        opt.step()
    finally:
        opt.close()
    return "stepped"


@pytest.mark.parametrize("case", ["clip", "params"])
def test_ranks_that_build_the_optimizer_differently_are_refused_on_every_rank(tmp_path, case):
    # The step's clip is a collective every rank must join alike, so the constructor compares the ranks' optimizers.
    expected = {"clip": "max_grad_norm is set on rank 0 and None on rank 1",
                "params": "groups of [6] parameters on rank 0; groups of [5] parameters on rank 1"}[case]  # fmt: skip
    for message in run_ranks(_built_differently, 2, str(tmp_path), case, timeout=90):
        assert message.startswith("the ranks built TieredOptimizer differently") and expected in message, message


# -------------------------------------------------------------------------------------- DDP and ZeRO-1
def _ddp_and_zero(rank: int, world: int, root: str) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    kw = {k: v for k, v in KW.items() if k != "max_grad_norm"}  # ZeRO-1 ranks hold different parameters
    for kind in ("ddp", "zero1"):
        ref, mine = DDP(model()), DDP(copy.deepcopy(model()))
        if kind == "ddp":
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
            opt = TieredOptimizer(mine.module, root, **kw)
        else:
            ref_opt = ZeroRedundancyOptimizer(ref.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                              weight_decay=0.1)  # fmt: skip
            opt = ZeroRedundancyOptimizer(mine.parameters(), optimizer_class=TieredOptimizer, nvme_path=root, **kw)
        for step in range(STEPS):
            for m, o in ((ref, ref_opt), (mine, opt)):
                loss_of(m, step, rank, world).backward()
                o.step()
                o.zero_grad()
        out[kind] = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), mine.parameters()))
        if kind == "zero1":
            opt.consolidate_state_dict(to=0)
            out["consolidated"] = sorted(opt.state_dict()["state"]) if rank == 0 else None
    return out


def test_ddp_and_zero1_match_adamw(tmp_path):
    results = run_ranks(_ddp_and_zero, 2, str(tmp_path))
    for r in results:
        assert r["ddp"] < 1e-6 and r["zero1"] < 1e-6, r
    assert results[0]["consolidated"] == list(range(6))  # every parameter's state, gathered on rank 0
    assert os.listdir(tmp_path) == []


def _zero1_resume(rank: int, world: int, root: str) -> dict:
    """ZeRO-1 saved as docs/distributed.md says (consolidated on rank 0), then resumed on a new optimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = {k: v for k, v in KW.items() if k != "max_grad_norm"}
    out = {}
    for kind in ("adamw", "tiered"):
        if kind == "adamw":
            zero = functools.partial(ZeroRedundancyOptimizer, optimizer_class=torch.optim.AdamW, lr=LR,
                                     weight_decay=0.1, fused=True)  # fmt: skip
        else:
            zero = functools.partial(ZeroRedundancyOptimizer, optimizer_class=TieredOptimizer, nvme_path=root, **kw)
        m = DDP(model())
        opt = zero(m.parameters())
        _train(m, opt, range(2), rank, world)
        opt.consolidate_state_dict(to=0)
        path = os.path.join(root, f"{kind}.pt")
        if rank == 0:
            torch.save({"model": m.module.state_dict(), "optim": opt.state_dict()}, path)
        torch.distributed.barrier()
        _train(m, opt, range(2, 4), rank, world)
        saved = torch.load(path, weights_only=True)
        again = model()
        again.load_state_dict(saved["model"])
        resumed = DDP(again)
        opt_again = zero(resumed.parameters())
        opt_again.load_state_dict(saved["optim"])
        _train(resumed, opt_again, range(2, 4), rank, world)
        out[kind] = ([p.detach().clone() for p in m.parameters()], [p.detach().clone() for p in resumed.parameters()])
        for o in (opt, opt_again):
            if kind == "tiered":
                o.optim.close()
        torch.distributed.barrier()
    return out


def test_zero1_resumes_from_its_consolidated_state_dict_as_with_adamw(tmp_path):
    """torch's ZeroRedundancyOptimizer.load_state_dict assigns each parameter's state (``optim.state[p] =
    {...}``): once refused, so a ZeRO-1 run could save its state and never load it."""
    for r in run_ranks(_zero1_resume, 2, str(tmp_path)):
        (adamw, adamw_resumed), (tiered, tiered_resumed) = r["adamw"], r["tiered"]
        assert all(torch.equal(a, b) for a, b in zip(adamw, adamw_resumed))
        assert all(torch.equal(a, b) for a, b in zip(tiered, tiered_resumed)), "the resumed run differs"
        assert all(torch.equal(a, b) for a, b in zip(tiered_resumed, adamw_resumed)), "differs from AdamW's"


# ------------------------------------------------------------------------ torch.distributed.checkpoint
def _train(m: nn.Module, opt: TieredOptimizer, steps: range, rank: int, world: int) -> None:
    for step in steps:
        loss_of(m, step, rank, world).backward()
        opt.step()
        opt.zero_grad()


def _node_root(roots: str | list[str], rank: int, world: int) -> str:
    """A rank's nvme_path: the one root, or with one root per node, its node's (ranks split evenly)."""
    return roots if isinstance(roots, str) else roots[rank * len(roots) // world]


def _dcp_save_then_continue(rank: int, world: int, root: str | list[str], ckpt: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = fsdp(model(), False)
    opt = TieredOptimizer(m, _node_root(root, rank, world), **KW)
    _train(m, opt, range(3), rank, world)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    _train(m, opt, range(3, STEPS), rank, world)
    return [full(p) for p in m.parameters()]


def _dcp_load_then_continue(rank: int, world: int, root: str, ckpt: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(123)
    m = fsdp(nn.Sequential(*[copy.deepcopy(layer) for layer in model()]), False)
    for p in m.parameters():  # nothing of the saved run survives but what the checkpoint brings
        p.data.normal_()
    opt = TieredOptimizer(m, root, **KW)
    msd, osd = get_state_dict(m, opt)  # templates, sharded for this world size
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert opt.step_counts == [3] * len(opt.params)
    _train(m, opt, range(3, STEPS), rank, world)
    return [full(p) for p in m.parameters()]


@pytest.mark.parametrize("saved_at, loaded_at", [(2, 3), (2, 1), (1, 2)])
def test_dcp_round_trip_reshards(tmp_path, saved_at, loaded_at):
    # Saved with torch.distributed.checkpoint at one world size, loaded at another: training goes on as if
    # uninterrupted (the global batch is the same at every world size).
    ckpt = str(tmp_path / "ckpt")
    continued = run_ranks(_dcp_save_then_continue, saved_at, str(tmp_path / "a"), ckpt)[0]
    resumed = run_ranks(_dcp_load_then_continue, loaded_at, str(tmp_path / "b"), ckpt)[0]
    diff = max((a - b).abs().max().item() for a, b in zip(continued, resumed))
    assert diff < 1e-5, f"resumed training differs by {diff}"


def _dcp_adamw_bf16_into_tiered(rank: int, world: int, root: str, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tiered import TieredLoadPlanner

    def train(m: nn.Module, o: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            x, y = batch(step, rank, world)
            (50 * nn.functional.mse_loss(m(x.to(torch.bfloat16)).float(), y)).backward()
            o.step()
            o.zero_grad()

    src = fsdp(model().to(torch.bfloat16), False)
    adamw = torch.optim.AdamW(src.parameters(), lr=LR, weight_decay=0.1)
    train(src, adamw, range(2))
    msd, osd = get_state_dict(src, adamw)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    out = {}
    for split in (False, True):
        for how in ("load_state_dict", "dcp"):
            m = fsdp(model().to(torch.bfloat16), False)
            with TieredOptimizer(m, os.path.join(root, f"{how}-{split}"), **KW, split_masters=split) as opt:
                if how == "load_state_dict":
                    m.load_state_dict(src.state_dict())
                    opt.load_state_dict(adamw.state_dict())
                else:
                    msd, osd = get_state_dict(m, opt)
                    state = {"model": msd, "optim": osd}
                    dcp.load(state, checkpoint_id=ckpt, planner=TieredLoadPlanner())
                    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                train(m, opt, range(2, 4))
            out[how, split] = [full(p) for p in m.parameters()]
    return out


def test_dcp_checkpoint_of_adamw_over_bf16_resumes_tiered_under_fsdp2(tmp_path):
    """AdamW's DCP checkpoint of bf16 parameters has no fp32 masters: DCP's default planner refuses it for a
    TieredOptimizer's template, TieredLoadPlanner loads it with the masters started from the loaded weights.
    The resumed run is bitwise the same hand-over through ``load_state_dict``, with and without split masters."""
    r = run_ranks(_dcp_adamw_bf16_into_tiered, 2, str(tmp_path / "nvme"), str(tmp_path / "ckpt"))[0]
    for split in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(r["load_state_dict", split], r["dcp", split])), split


def _writes_between_steps(rank: int, world: int, root: str) -> dict:
    """bf16 FSDP2 runs, with and without split masters, that halve every weight between steps: by a
    ``load_state_dict`` or by ``p.mul_`` under no_grad (ops on the DTensors, which move their own version counters,
    not their local tensors'). Per run: whether the masters were then the written weights, and the weights after."""
    out = {}
    for split in (False, True):
        for how in ("load_state_dict", "in place"):
            m = fsdp(model().to(torch.bfloat16), False)
            with TieredOptimizer(m, os.path.join(root, f"{how}-{split}"), **KW, split_masters=split) as opt:
                for step in range(4):
                    if step == 2:
                        if how == "load_state_dict":
                            m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})
                        else:
                            with torch.no_grad():
                                for p in m.parameters():
                                    p.mul_(0.5)
                        state = opt.state_dict()["state"]
                        written = all(torch.equal(full(state[i]["master"]), full(p).float())
                                      for i, p in enumerate(m.parameters()))  # fmt: skip
                    x, y = batch(step, rank, world)
                    (50 * nn.functional.mse_loss(m(x.to(torch.bfloat16)).float(), y)).backward()
                    opt.step()
                    opt.zero_grad()
            out[how, split] = written, [full(p) for p in m.parameters()]
    return out


def test_a_write_between_steps_is_kept_by_split_masters_under_fsdp2(tmp_path):
    """A write into the weights between steps is kept as torch's AdamW keeps it: the masters become the written
    weights, split or not, and the runs with and without split masters stay bitwise the same."""
    r = run_ranks(_writes_between_steps, 1, str(tmp_path))[0]
    for how in ("load_state_dict", "in place"):
        assert r[how, False][0] and r[how, True][0], how
        assert all(torch.equal(a, b) for a, b in zip(r[how, False][1], r[how, True][1])), how


# ------------------------------------------------------------------------------------------------- GPU
def _fsdp2_cuda(rank: int, world: int, root: str, mixed: bool) -> dict:
    def train(m: nn.Module, o: torch.optim.Optimizer) -> None:
        for step in range(STEPS):
            x, y = (t.cuda() for t in batch(step, rank, world))
            # fp32 loss: under bf16 compute the output is bf16, and CUDA's mse_loss backward refuses mixed dtypes
            (50 * nn.functional.mse_loss(m(x).float(), y)).backward()
            if isinstance(o, torch.optim.AdamW):
                torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            o.step()
            o.zero_grad()

    ref = fsdp(model().cuda(), mixed, "cuda")
    train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, fused=True))  # the kernel ours runs
    out = {}
    for early in (False, True):
        mine = fsdp(model().cuda(), mixed, "cuda")
        opt = TieredOptimizer(mine, os.path.join(root, str(early)), update_in_backward=early, **KW)
        train(mine, opt)
        out[early] = ([full(p) for p in mine.parameters()], opt.update_on, opt.stats()["under_backward"])
        opt.close()
    (plain, update_on, _), (early_w, _, stats) = out[False], out[True]
    diff = max((full(a) - b).abs().max().item() for a, b in zip(ref.parameters(), plain))
    return dict(diff=diff, update_on=update_on, same=all(torch.equal(a, b) for a, b in zip(plain, early_w)),
                started=stats["started"])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-compute"])
def test_fsdp2_on_cuda_matches_adamw(tmp_path, mixed):
    """fp32: within float rounding of FSDP2 + fused AdamW. bf16 compute rounds every weight to bf16 for the
    forward, so a one-ulp difference in an fp32 master can flip a rounding and grow through the steps: there
    the tolerance is bf16's. With the update under backward the weights are bitwise the plain step's."""
    world = min(torch.cuda.device_count(), 2)
    for r in run_ranks(_fsdp2_cuda, world, str(tmp_path), mixed, backend="cuda:nccl,cpu:gloo"):
        assert r["update_on"] == "device" and r["diff"] < (1e-3 if mixed else 1e-5), r
        assert r["same"] and r["started"] > 0, r


def test_two_nodes_with_local_nvme_and_a_shared_checkpoint_folder(tmp_path):
    # The multi-node shape on one machine: 4 ranks as two "nodes" of two, each node with its own nvme_path,
    # the checkpoint in one folder all of them see; then resumed on one node of 2 ranks.
    nodes = [str(tmp_path / "node0-nvme"), str(tmp_path / "node1-nvme")]
    ckpt = str(tmp_path / "shared" / "ckpt")
    continued = run_ranks(_dcp_save_then_continue, 4, nodes, ckpt)[0]
    resumed = run_ranks(_dcp_load_then_continue, 2, str(tmp_path / "b"), ckpt)[0]
    assert max((a - b).abs().max().item() for a, b in zip(continued, resumed)) < 1e-5
    assert all(os.listdir(n) == [] for n in nodes)  # each node's private folders were its own, and are gone


def _full_state_dict_round_trip(rank: int, world: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    m = fsdp(model(), False)
    opt = TieredOptimizer(m, os.path.join(root, "a"), **KW)
    _train(m, opt, range(2), rank, world)
    # The whole state gathered on rank 0 (as HF accelerate saves under FSDP), then broadcast into a new optimizer.
    osd = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    m2 = fsdp(model(), False)
    opt2 = TieredOptimizer(m2, os.path.join(root, "b"), **KW)
    set_optimizer_state_dict(m2, opt2, osd if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))  # fmt: skip
    a, b = opt.state_dict(), opt2.state_dict()
    diff = max((full(a["state"][i][k]) - full(b["state"][i][k])).abs().max().item()
               for i in a["state"] for k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
    return dict(on_rank0=len(osd["state"]) if rank == 0 else None, diff=diff, steps=opt2.step_counts)


def test_full_state_dict_gathered_on_rank0_and_broadcast(tmp_path):
    results = run_ranks(_full_state_dict_round_trip, 2, str(tmp_path))
    assert results[0]["on_rank0"] == 6  # every parameter's full state, on rank 0 only
    for r in results:
        assert r["diff"] == 0.0 and r["steps"] == [2] * 6, r


# ------------------------------------------------------------------------------ NVMe-tier checkpoints
def _nvme_save_then_continue(rank: int, world: int, root: str, ckpt: str) -> dict:
    m = fsdp(model(), False)
    opt = TieredOptimizer(m, root, **KW)
    _train(m, opt, range(3), rank, world)
    saved = opt.save_checkpoint(ckpt, extra={"epoch": 7})  # collective: every rank its shards
    _train(m, opt, range(3, STEPS), rank, world)
    return dict(saved=saved, weights=[full(p) for p in m.parameters()])


def _nvme_load_then_continue(rank: int, world: int, root: str, ckpt: str) -> dict:
    m = fsdp(nn.Sequential(*[copy.deepcopy(layer) for layer in model()]), False)
    for p in m.parameters():  # nothing of the saved run survives but what the checkpoint brings
        p.data.normal_()
    opt = TieredOptimizer(m, root, **KW)
    info = opt.load_checkpoint(ckpt)
    steps = opt.step_counts
    _train(m, opt, range(3, STEPS), rank, world)
    return dict(extra=info["extra"], step=info["step"], steps=steps, weights=[full(p) for p in m.parameters()])


@pytest.mark.parametrize("saved_at, loaded_at", [(2, 2), (2, 3), (2, 1), (1, 2)])
def test_nvme_checkpoint_reshards(tmp_path, saved_at, loaded_at):
    # opt.save_checkpoint under FSDP2 is collective; the checkpoint loads at another world size (each rank
    # rebuilds its shards from the saved ones) and training goes on as if uninterrupted: bitwise at the
    # same layout, to float rounding of the gradients' reduction across another number of ranks otherwise.
    ckpt = str(tmp_path / "ckpt" / "step-3")
    before = run_ranks(_nvme_save_then_continue, saved_at, str(tmp_path / "a"), ckpt)
    assert all(r["saved"] == ckpt for r in before)
    assert sorted(os.listdir(ckpt)) == sorted(["shards.json", *(f"rank-{k:05d}" for k in range(saved_at))])
    after = run_ranks(_nvme_load_then_continue, loaded_at, str(tmp_path / "b"), ckpt)
    for r in after:
        assert r["extra"] == {"epoch": 7} and r["step"] == 3 and r["steps"] == [3] * 6
    diff = max((a - b).abs().max().item() for a, b in zip(before[0]["weights"], after[0]["weights"]))
    assert diff == 0.0 if saved_at == loaded_at else diff < 1e-5, diff
    if (saved_at, loaded_at) == (2, 2):  # the CLI checks every rank's part, every byte
        from tiered.checkpoint import inspect_checkpoint, verify_checkpoint

        ok = verify_checkpoint(ckpt)
        assert ok["ok"] and ok["ranks"] == 2 and ok["step"] == 3
        summary = inspect_checkpoint(ckpt)
        assert summary["ranks"] == 2 and not summary["problems"]
        assert [p["shape"] for p in summary["params"]] == [list(p.shape) for p in model().parameters()]
        with open(os.path.join(ckpt, "rank-00001", "exp_avg.bin"), "r+b") as f:
            f.seek(40)
            f.write(b"\xff\xff\xff\xff")  # one damaged part: verify must say which
        with pytest.raises(CheckpointCorruptError, match="rank-00001"):
            verify_checkpoint(ckpt)


def _save_killed_part_way(rank: int, world: int, root: str, ckpt: str) -> str:
    m = fsdp(model(), False)
    opt = TieredOptimizer(m, root, **KW)
    _train(m, opt, range(3), rank, world)
    opt.save_checkpoint(ckpt)  # the previous checkpoint
    _train(m, opt, range(3, STEPS), rank, world)
    if rank == 1:  # SIGKILL once its first chunk is written, before its checkpoint is whole
        os.environ["TIERED_CHECKPOINT_TEST_HOOK"] = "kill:chunk:1"
    try:
        opt.save_checkpoint(ckpt)
    except Exception as e:  # noqa: BLE001 - what the surviving rank sees is the result
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_rank_killed_during_a_collective_save_leaves_the_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_ranks(_save_killed_part_way, 2, str(tmp_path / "a"), ckpt, allow_missing=True)
    assert results[1] is None  # killed
    assert results[0] != "saved"  # the survivor's collective failed, in bounded time, and it committed nothing
    after = run_ranks(_nvme_load_then_continue, 2, str(tmp_path / "b"), ckpt)
    assert all(r["step"] == 3 and r["steps"] == [3] * 6 for r in after)


def _save_whose_peer_dies(rank: int, world: int, root: str, ckpt: str) -> dict | str:
    m = fsdp(model(), False)
    opt = TieredOptimizer(m, root, **KW)
    _train(m, opt, range(2), rank, world)
    if rank == 1:  # SIGKILL once its part is whole in rank 0's temp folder, before the ranks exchange outcomes
        os.environ["TIERED_CHECKPOINT_TEST_HOOK"] = "kill:done:1"
    try:
        opt.save_checkpoint(ckpt)
    except Exception as e:  # noqa: BLE001 - what the surviving rank sees is the result
        cause = e.__cause__
        left = sorted(os.listdir(os.path.dirname(ckpt)))
        return dict(runtime=isinstance(e, RuntimeError), text=str(e), cause=type(cause).__name__, left=left)
    return "saved"


def test_a_collective_save_whose_peer_dies_leaves_no_temp_folder_and_names_the_path(tmp_path):
    # The survivor got gloo's bare "Connection closed by peer" and kept the hidden temp folder with every part
    # written, for good: its own later saves never swept a name of its own process.
    ckpt = str(tmp_path / "ckpts" / "step-2")
    results = run_ranks(_save_whose_peer_dies, 2, str(tmp_path / "a"), ckpt, allow_missing=True)
    assert results[1] is None  # killed
    survivor = results[0]
    assert survivor != "saved" and survivor["left"] == [], survivor
    assert survivor["runtime"] and survivor["cause"] != "NoneType", survivor  # what an except caught before
    assert f"the collective save to {ckpt} failed, nothing was committed" in survivor["text"], survivor


def _save_whose_rank0_dies_first(rank: int, world: int, root: str, ckpt: str) -> dict | str:
    m = fsdp(model(), False)
    opt = TieredOptimizer(m, root, **KW)
    _train(m, opt, range(2), rank, world)
    if rank == 0:  # gone before the save's first collective (rank 0's temp folder and save id)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        opt.save_checkpoint(ckpt)
    except Exception as e:  # noqa: BLE001 - what the surviving rank sees is the result
        return dict(
            runtime=isinstance(e, RuntimeError), text=f"{type(e).__name__}: {e}", cause=type(e.__cause__).__name__
        )
    return "saved"


def test_a_collective_save_whose_rank0_dies_before_the_first_collective_names_the_path(tmp_path):
    # Rank 1 got a TypeError ('NoneType' object is not subscriptable) from the error handler of the first
    # exchange, which neither named the checkpoint nor was caught by an `except RuntimeError`.
    ckpt = str(tmp_path / "ckpts" / "step-2")
    results = run_ranks(_save_whose_rank0_dies_first, 2, str(tmp_path / "a"), ckpt, allow_missing=True)
    assert results[0] is None  # killed
    survivor = results[1]
    assert survivor != "saved" and survivor["runtime"] and survivor["cause"] != "NoneType", survivor
    assert f"the collective save to {ckpt} failed, nothing was committed" in survivor["text"], survivor


def _save_a_series(rank: int, world: int, root: str, series: str) -> list:
    m = fsdp(model(), False)
    opt = TieredOptimizer(m, root, **KW)
    for step in range(1, 4):
        _train(m, opt, range(step - 1, step), rank, world)
        opt.save_checkpoint(os.path.join(series, f"step-{step}"), keep_last=2)
    return sorted(os.listdir(series))


def test_sharded_checkpoints_are_pruned_and_found_as_a_series(tmp_path):
    from tiered.checkpoint import latest_checkpoint

    series = str(tmp_path / "ckpt")
    results = run_ranks(_save_a_series, 2, str(tmp_path / "nvme"), series)
    assert results == [["step-2", "step-3"]] * 2
    assert latest_checkpoint(series) == os.path.join(series, "step-3")


# A first layer of 384 x 16 elements, so that each rank's part holds several records. Saved at 2 ranks with
# 1024-element chunks, each part's row files hold four records (CRC segments), by element: [0, 1024),
# [1024, 2048), [2048, 3072) (the first weight's 192 rows of 16) and [3072, 3456) (the second's one row).
# Loaded at 3 ranks (128 rows each of the first weight; rows 0, 1 and none of the second), each rank needs:
WIDE_READS = [
    {"rank-00000": [(0, 1024), (1024, 1024), (3072, 384)]},
    {"rank-00000": [(2048, 1024)], "rank-00001": [(0, 1024), (3072, 384)]},
    {"rank-00001": [(1024, 1024), (2048, 1024)]},
]
ROWS = ("master.bin", "exp_avg.bin", "exp_avg_sq.bin")


def wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 384, bias=False), nn.Tanh(), nn.Linear(384, 2, bias=False))


def _full_state(m: nn.Module, opt: TieredOptimizer) -> list:
    sd = opt.state_dict()["state"]
    return [full(p) for p in m.parameters()] + [full(sd[i][k]) for i in sorted(sd) for k in ("exp_avg", "exp_avg_sq")]


def _wide_save(rank: int, world: int, root: str, ckpt: str) -> list:
    m = fsdp(wide_model(), False)
    opt = TieredOptimizer(m, root, **KW)
    _train(m, opt, range(2), rank, world)
    opt.save_checkpoint(ckpt)
    return _full_state(m, opt)


def _wide_load(rank: int, world: int, root: str, ckpt: str) -> dict:
    from unittest import mock

    from io_engine.engine import IOEngine
    from tiered.checkpoint import CheckpointError

    reads = []  # (part, row file, first element, elements) of each read of the checkpoint's row files
    pread = IOEngine.pread

    def logged(self, buffer, path, offset=0, *, nbytes=None):
        if os.fspath(path).startswith(ckpt + os.sep):
            part, name = os.path.relpath(path, ckpt).split(os.sep)
            reads.append((part, name, offset // 4, (buffer.nbytes if nbytes is None else nbytes) // 4))
        return pread(self, buffer, path, offset, nbytes=nbytes)

    m = fsdp(wide_model(), False)
    for p in m.parameters():  # nothing of the saved run survives but what the checkpoint brings
        p.data.normal_()
    opt = TieredOptimizer(m, root, **KW)
    with mock.patch.object(IOEngine, "pread", logged):
        try:
            opt.load_checkpoint(ckpt)
        except CheckpointError as e:
            return dict(reads=reads, error=(type(e).__name__, str(e)))
    return dict(reads=reads, error=None, state=_full_state(m, opt))


def _expected_reads(rank: int) -> list:
    return sorted((part, f, first, n) for part, recs in WIDE_READS[rank].items() for f in ROWS for first, n in recs)


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory) -> tuple[str, list]:
    tmp = tmp_path_factory.mktemp("wide")
    ckpt = str(tmp / "ckpt")
    saved = run_ranks(_wide_save, 2, str(tmp / "nvme"), ckpt)[0]
    return ckpt, saved


def test_a_resharding_load_reads_only_the_records_it_needs(tmp_path, wide_ckpt):
    ckpt, saved = wide_ckpt
    results = run_ranks(_wide_load, 3, str(tmp_path), ckpt)
    for rank, r in enumerate(results):
        assert r["error"] is None, r["error"]
        # Each record it needs read once, whole (checked); the part's other records never read.
        assert sorted(r["reads"]) == _expected_reads(rank), rank
    state = results[0]["state"]  # weights and moments, exactly as saved
    assert len(state) == len(saved) == 6 and all(torch.equal(a, b) for a, b in zip(saved, state))


def test_a_damaged_record_is_reported_by_the_rank_that_needs_it_on_every_rank(tmp_path, wide_ckpt):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(wide_ckpt[0], ckpt)
    with open(os.path.join(ckpt, "rank-00000", "exp_avg.bin"), "r+b") as f:
        f.seek(4 * 2048 + 40)  # in rank-00000's third record, which only rank 1 (of 3) needs
        f.write(b"\xff\xff\xff\xff")
    results = run_ranks(_wide_load, 3, str(tmp_path / "nvme"), ckpt)
    damaged = "rank-00000/exp_avg.bin: bytes 8192..12288 do not match their crc32"
    kind, message = results[1]["error"]
    assert kind == "CheckpointCorruptError" and damaged in message, message
    for rank in (0, 2):  # they never read it: they checked their own rows, installed none, and raise rank 1's failure
        assert sorted(results[rank]["reads"]) == _expected_reads(rank)
        kind, message = results[rank]["error"]
        assert kind == "CheckpointCorruptError" and "rank 1: CheckpointCorruptError" in message and damaged in message


def test_a_resharding_load_refuses_a_part_whose_objects_are_damaged_on_every_rank(tmp_path, wide_ckpt):
    # At another world size only rank 0's objects.pt was read: rank-00001's, damaged, loaded without a word at 3
    # ranks, where a load at the saved 2 refused it. Now each part's is checked by a rank that opens it.
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(wide_ckpt[0], ckpt)
    objects = os.path.join(ckpt, "rank-00001", "objects.pt")
    flip_byte(objects, os.path.getsize(objects) // 2)
    results = run_ranks(_wide_load, 3, str(tmp_path / "nvme"), ckpt)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} loaded a checkpoint with a damaged part"
        kind, message = r["error"]
        assert kind == "CheckpointCorruptError" and "rank-00001/objects.pt" in message, message
    assert "rank 1: CheckpointCorruptError" in results[0]["error"][1]  # rank 0 reads nothing of that part


def _load_whose_peer_dies(rank: int, world: int, root: str, ckpt: str, point: str) -> dict | str:
    """A collective load at 3 ranks of a 2-rank checkpoint; rank 1 SIGKILLs itself as it gathers its rows (before
    the ranks agree) or as it installs them (after). What a survivor raised, and its optimizer after, is the
    result."""
    from unittest import mock

    from tiered.checkpoint import reshard, sharded

    m = fsdp(wide_model(), False)
    opt = TieredOptimizer(m, root, **KW)
    before = [p.to_local().clone() for p in m.parameters()] + [list(opt.step_counts)]
    die = mock.Mock(side_effect=lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
    target = (sharded, "gather_parts") if point == "gather" else (reshard.Gathered, "install")
    with mock.patch.object(*target, die if rank == 1 else getattr(*target)):
        try:
            opt.load_checkpoint(ckpt)
        except Exception as e:  # noqa: BLE001 - what the surviving ranks see is the result
            after = [p.to_local().clone() for p in m.parameters()] + [list(opt.step_counts)]
            try:
                opt.step()
                stepped = "stepped"
            except Exception as s:  # noqa: BLE001 - as above
                stepped = type(s).__name__
            return dict(text=f"{type(e).__name__}: {e}", runtime=isinstance(e, RuntimeError),
                        cause=type(e.__cause__).__name__, partial=getattr(e, "partial_load", None),
                        unchanged=all(torch.equal(a, b) if torch.is_tensor(a) else a == b
                                      for a, b in zip(before, after)),
                        stepped=stepped)  # fmt: skip
    return "loaded"


@pytest.mark.parametrize("point", ["gather", "install"])
def test_a_collective_load_whose_peer_dies_names_the_path_and_says_what_it_changed(tmp_path, wide_ckpt, point):
    # The survivors raised gloo's bare "Connection closed by peer", naming neither the load nor the checkpoint; and
    # where the peer died as the ranks installed, their optimizers were broken while the error had no partial_load.
    ckpt = wide_ckpt[0]
    results = run_ranks(_load_whose_peer_dies, 3, str(tmp_path / "nvme"), ckpt, point, allow_missing=True)
    assert results[1] is None  # killed
    for survivor in (results[0], results[2]):
        assert survivor != "loaded" and survivor["runtime"] and survivor["cause"] != "NoneType", survivor
        assert f"the collective load of {ckpt} failed" in survivor["text"], survivor
        assert "a rank left the load" in survivor["text"], survivor
        if point == "gather":  # before the agreement: nothing changed, and the error says so
            assert not survivor["partial"] and survivor["unchanged"], survivor
            assert "this rank's optimizer was not changed" in survivor["text"], survivor
        else:  # after it: the survivors installed, the job as a whole is torn
            assert survivor["partial"] is True and survivor["stepped"] == "OptimizerBrokenError", survivor
            assert "load an intact checkpoint on every rank" in survivor["text"], survivor
