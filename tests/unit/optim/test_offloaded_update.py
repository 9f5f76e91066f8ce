"""Where an offloaded model's update runs: parameters that FSDP2's CPU offload keeps in host memory over a CUDA
mesh update on that GPU ("auto" is "device", split masters on); the same shards over a CPU mesh (the CPU
stand-in) are plain CPU parameters and update on the host. The copies across devices themselves run on the
GPU machine (tests/gpu/test_offload_params_cuda.py: bitwise the run on the GPU)."""

from __future__ import annotations

import pytest
import torch

from tiered.config import TierConfig


def test_auto_updates_offloaded_parameters_on_their_gpu() -> None:
    offloaded = TierConfig().resolve(cuda=False, offloaded=True)
    assert offloaded.update_on == "device"
    assert offloaded.split_masters is True
    assert offloaded.update_in_backward is False  # hooks on host gradients are not where it pays
    assert TierConfig().resolve(cuda=False).update_on == "host"
    assert TierConfig(update_on="host").resolve(cuda=False, offloaded=True).update_on == "host"  # asked for


def test_update_in_backward_is_refused_for_offloaded_parameters() -> None:
    with pytest.raises(ValueError, match="update_in_backward=True needs .* parameters on the GPU"):
        TierConfig(update_in_backward=True).resolve(cuda=False, offloaded=True)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_shards_over_a_cpu_mesh_have_no_other_compute_device() -> None:
    import tiered.offload
    from tiered.optim.shards import Shards

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert Shards(list(model.parameters())).compute_device is None  # plain parameters
    try:
        tiered.offload.offload_model(model, device="cpu", blocks=list(model))
        assert Shards(list(model.parameters())).compute_device is None  # the mesh is the CPU's: no GPU to use
    finally:
        tiered.offload.close()
