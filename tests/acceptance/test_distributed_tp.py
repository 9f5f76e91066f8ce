"""TieredOptimizer under FSDP2 + tensor parallel, torchtitan's 2-D layout, on four CPU ranks over gloo.

One (dp=2, tp=2) DeviceMesh: ``parallelize_module`` over ``mesh["tp"]``, then ``fully_shard`` over ``mesh["dp"]``.
"mlp" (ColwiseParallel up, RowwiseParallel down) splits the parameters every way a 2-D mesh splits them: the up
weight and bias ``(_StridedShard(0), Shard(0))``, the down weight ``(Shard(0), Shard(1))``, the down bias
``(Shard(0), Replicate())``; "colwise" (two ColwiseParallel layers side by side) gives every parameter the first
of those. Against FSDP2 + TP + ``AdamW(fused=True)`` + ``clip_grad_norm_`` over the same steps.
"""

from __future__ import annotations

import os

import pytest
import torch
from distributed_common import run_ranks
from torch import nn

from tiered import TieredOptimizer

STEPS, LR, CLIP = 3, 1e-2, 0.5

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class SideBySide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], -1)  # this tp rank's columns of each


def _parallel(mesh, layout: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if layout == "mlp":
        m: nn.Module = MLP()
        parallelize_module(m, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    else:
        m = SideBySide()
        parallelize_module(m, mesh["tp"], {"a": ColwiseParallel(), "b": ColwiseParallel()})
    return fully_shard(m, mesh=mesh["dp"])


def _tp_clip(rank: int, world: int, root: str, layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for kind in ("ref", "mine"):
        m = _parallel(mesh, layout)
        opt = (TieredOptimizer(m, root, lr=LR, weight_decay=0.1, max_grad_norm=CLIP) if kind == "mine" else
               torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1, fused=True))  # fmt: skip
        norms = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step + 10 * mesh.get_local_rank("dp"))  # the tp ranks share a batch
            (100 * m(torch.randn(4, 16, generator=g)).pow(2).mean()).backward()
            if kind == "ref":
                norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP).full_tensor().item())
            opt.step()
            if kind == "mine":
                norms.append(opt.stats()["grad_norm"])
            opt.zero_grad()
        out[kind] = ([p.full_tensor() for p in m.parameters()], norms)
        if kind == "mine":
            sd = opt.state_dict()["state"]  # DTensors placed as their parameters, as AdamW's
            out["placed"] = all(sd[i]["exp_avg"].placements == p.placements for i, p in enumerate(m.parameters()))
            opt.close()
    (ref, ref_norms), (mine, norms) = out["ref"], out["mine"]
    return dict(same=all(torch.equal(a, b) for a, b in zip(ref, mine)), norms=norms, ref_norms=ref_norms,
                placed=out["placed"], placements=[str(p.placements) for p in m.parameters()])  # fmt: skip


@pytest.mark.parametrize("layout", ["mlp", "colwise"])
def test_fsdp2_with_tensor_parallel_clips_by_torch_s_norm_bitwise(tmp_path, layout):
    # Each mesh dimension that splits a parameter joins the norm: FSDP2's _StridedShard over dp as well as
    # tensor parallel's Shard over tp. A norm over tp alone would differ between the dp halves, and from torch's.
    results = run_ranks(_tp_clip, 4, str(tmp_path), layout)
    assert "_StridedShard" in results[0]["placements"][0]
    assert layout != "mlp" or "Replicate" in results[0]["placements"][3]
    for r in results:
        assert min(r["norms"]) > CLIP, "the clip did not fire on every step"
        assert r["norms"] == r["ref_norms"], r
        assert r["same"], "weights differ from FSDP2 + TP + AdamW + clip_grad_norm_"
        assert r["placed"]


def _two_meshes(rank: int, world: int, root: str) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = nn.Sequential(MLP(), nn.Linear(16, 4))
    parallelize_module(m[0], mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})  # the 2-D mesh's
    fully_shard(m[1], mesh=mesh["dp"])  # and a layer sharded over dp alone: its parameters are on mesh["dp"]
    fully_shard(m, mesh=mesh["dp"])
    out = []
    for clip in (None, CLIP):
        opt = TieredOptimizer(m, os.path.join(root, str(clip)), lr=LR, max_grad_norm=clip)
        m(torch.randn(4, 16)).sum().backward()
        try:
            opt.step()
            out.append("stepped")
        except ValueError as e:
            out.append(str(e))
        finally:
            opt.close()
            opt.zero_grad()
    return out


def test_parameters_on_two_meshes_train_but_are_refused_a_clip_by_name(tmp_path):
    # torch's clip_grad_norm_ cannot take their norm either (its stack refuses DTensors of two meshes).
    for unclipped, clipped in run_ranks(_two_meshes, 4, str(tmp_path)):
        assert unclipped == "stepped"
        assert "different device meshes" in clipped and "max_grad_norm" in clipped, clipped
