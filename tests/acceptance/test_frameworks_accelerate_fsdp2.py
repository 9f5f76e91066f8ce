"""TieredOptimizer through accelerate's own FSDP2 path: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2))``, the optimizer built on the plain model and handed to ``prepare``, which shards the model and
writes the sharded parameters into the optimizer's ``param_groups``. Training, ``save_state`` halfway and a fresh
run resumed by ``load_state`` must equal the same two runs with ``torch.optim.AdamW``, to float rounding.

accelerate turns FSDP on only on accelerators: with ``cpu=True`` (or no GPU) it picks ``MULTI_CPU`` (DDP) and
ignores the plugin without a word. On CPU ranks the test therefore sets the distributed type that accelerate
would have chosen on GPUs (``DistributedType.FSDP``) right after building the ``Accelerator``; from there
``prepare``, ``save_state`` and ``load_state`` run accelerate's FSDP2 code unchanged, over gloo. The GPU test runs
it unforced, in one process on CUDA, as ``accelerate launch`` would start it.
"""

from __future__ import annotations

import os

import frameworks_common as fc  # first: it takes the HF libraries offline before they load

# isort: split
import pytest
import torch
from distributed_common import run_ranks

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
]

STEPS = 6
HALF = STEPS // 2


def _accelerator(force_fsdp: bool):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(True)  # accelerate's singletons: each run starts from scratch
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=force_fsdp, fsdp_plugin=plugin)
    if force_fsdp:  # what accelerate chooses on GPUs (see the module doc), where each AcceleratorState() reads it
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2, accelerator.distributed_type
    return accelerator


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in model.named_parameters()}  # fmt: skip


def _run(kind: str, root: str, state_dir: str, rank: int, world: int, force_fsdp: bool, resume: bool) -> dict:
    """One accelerate run: STEPS steps and ``save_state`` after HALF; or (``resume``) other initial weights,
    ``load_state`` and the last HALF steps. Returns the full weights at the end."""
    accelerator = _accelerator(force_fsdp)
    model = fc.tiny_llama(seed=1 if resume else 0)
    cls, kw = fc.optimizer_kwargs(kind, root)
    if kind == "tiered":  # a rank's shards hold half the state: less host memory, so that part lives on NVMe
        kw["host_budget"] = "128KiB"
    opt = cls(model.parameters() if kind == "adamw" else model, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / STEPS))
    model, popt, sched = accelerator.prepare(model, opt, sched)
    assert type(next(model.parameters())).__name__ == "DTensor"
    data = fc.tokens(STEPS * world * fc.BATCH).split(fc.BATCH)
    steps = range(HALF, STEPS) if resume else range(STEPS)
    if resume:
        accelerator.load_state(state_dir)
        assert fc.step_count(opt) == HALF
    device = next(model.parameters()).device
    for step in steps:
        batch = data[step * world + rank].to(device)
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        popt.step()
        sched.step()
        popt.zero_grad()
        if step + 1 == HALF and not resume:
            accelerator.save_state(state_dir)
    out = {"weights": _full(model), "steps": fc.step_count(opt)}
    if kind == "tiered":
        out["nvme_read_bytes"] = opt.stats()["total"]["nvme_read_bytes"]
    fc.close(opt)
    accelerator.wait_for_everyone()
    return out


def _pairs(rank: int, world: int, root: str, force_fsdp: bool) -> dict:
    out = {}
    for kind in fc.KINDS:
        state_dir = os.path.join(root, f"{kind}-state")
        out[kind] = _run(kind, os.path.join(root, "nvme"), state_dir, rank, world, force_fsdp, resume=False)
        out[f"{kind}-resumed"] = _run(kind, os.path.join(root, "nvme"), state_dir, rank, world, force_fsdp, resume=True)
    return out


def _check(results: dict, rtol: float = fc.RTOL, atol: float = fc.ATOL) -> None:
    before = fc.weights(fc.tiny_llama())
    fc.assert_trained(before, results["adamw"]["weights"])
    w = {k: r["weights"] for k, r in results.items()}
    fc.assert_same_weights(w["adamw"], w["adamw-resumed"], "AdamW: resumed vs uninterrupted (the test's control)",
                           rtol, atol)  # fmt: skip
    fc.assert_same_weights(w["adamw"], w["tiered"], "accelerate FSDP2: tiered vs AdamW", rtol, atol)
    fc.assert_same_weights(w["tiered"], w["tiered-resumed"], "accelerate FSDP2: tiered resumed vs uninterrupted",
                           rtol, atol)  # fmt: skip
    assert all(r["steps"] == STEPS for r in results.values()), {k: r["steps"] for k, r in results.items()}
    assert results["tiered"]["nvme_read_bytes"] > 0, "no state went through NVMe"


def test_accelerate_fsdp2_trains_and_resumes_as_adamw_on_cpu_ranks(tmp_path):
    results = run_ranks(_pairs, 2, str(tmp_path), True, timeout=600)
    for r in results:
        _check(r)


@pytest.mark.gpu
def test_accelerate_fsdp2_trains_and_resumes_as_adamw_on_cuda(tmp_path, monkeypatch):
    """One process, as ``accelerate launch --num_processes 1`` starts it (accelerate's FSDP2 needs a launched
    process: LOCAL_RANK set), unforced: accelerate itself picks FSDP2 on the GPU."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                     LOCAL_WORLD_SIZE="1").items():  # fmt: skip
        monkeypatch.setenv(k, v)
    try:
        # CUDA's matmuls may round differently from run to run: the looser tolerance of frameworks_common.
        _check(_pairs(0, 1, str(tmp_path), False), fc.FOREACH_RTOL, fc.FOREACH_ATOL)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
