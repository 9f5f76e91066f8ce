"""An offloaded model evaluated under ``torch.inference_mode()`` before (or between) training forwards.

FSDP2 makes each unit's unsharded weights (its ``all_gather_outputs``) the first time the unit unshards, and reuses
them for every later pass. Under ``inference_mode`` they would be made as inference tensors: at world size 1 torch
2.13 raises "Inference tensors do not track version counter" at once (``FSDPParamGroup.wait_for_unshard`` wraps
its copy in ``_unsafe_preserve_version_counter``), and over more ranks the next training forward raises "Inplace
update to inference tensor outside InferenceMode". Plain ``fully_shard`` fails both ways; ``no_grad`` does not,
nor does ``inference_mode`` once a training forward has made them. That is an evaluation or ``generate`` before
the first step (a baseline at step 0, Lightning's sanity check, which it runs under ``inference_mode`` unless the
backend is exactly ``"gloo"``) and an inference-only run.

``unshard_outside_inference_mode`` runs every unit's ``wait_for_unshard`` (with the copy made ahead,
offload/prefetch.py, inside it) under ``inference_mode(False)``: the weights are made as normal tensors, which
serve evaluation and training alike. The bytes copied are the same, so the outputs and the training after them
are bitwise those without offload (tests/unit/offload/test_offload_params.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["unshard_outside_inference_mode"]


def unshard_outside_inference_mode(units: list[nn.Module]) -> None:
    """Wrap each FSDP2 unit's ``wait_for_unshard`` to run outside inference_mode. Call after every other wrap of
    it (offload/prefetch.py's), so that what those make is outside it too."""
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        if group is not None:
            group.wait_for_unshard = _outside(group.wait_for_unshard)


def _outside(original: Any) -> Any:
    def wait_for_unshard() -> None:
        with torch.inference_mode(False):
            original()

    return wait_for_unshard
