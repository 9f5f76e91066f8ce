"""The shares of a GPU budget that the automatic choices give weights, gradients and state, and the optimizer's
chunks in flight on the GPU (its scratch). Torch-free, so that
`tiered-bench plan` (tiered/bench/plan_memory.py) counts by the rules the runtime applies (tiered.auto_budget,
tiered.offload)."""

from __future__ import annotations

__all__ = ["GPU_SHARE", "KEEP_SHARE", "CHUNKS_IN_FLIGHT"]

# The share of the GPU weights, gradients and state kept there may take; the rest is for activations, the
# optimizer's scratch and the allocator's slack (also what offload_model(enabled="auto") allows a model).
GPU_SHARE = 0.6
# The share of the GPU budget an offloaded model's weights may take and be kept from forward to backward
# (keep_for_backward="auto"), as DeepSpeed ZeRO-Offload keeps its bf16 weights on the GPU: on a 24 GB cap the
# 4.4B's 8.2 GiB (37 %) are kept, the 10B's 18.6 GiB (83 %) are streamed again for backward.
KEEP_SHARE = 0.45
# Device records (and, for parameters in host memory, gradient staging rows) the update on the GPU cycles through,
# and the chunks the step's pipeline keeps open at once (tiered/optim/device_update.py). Three: with the records'
# downloads on a stream of their own, chunk i+2's upload then need not wait for chunk i's update, so a record takes
# the longest of its trip up, its trip down and its update, not the sum of two: on an H100 the step alone of 1.0B
# bf16 parameters went from 1.09x to 1.00x its link floor (fp32 moments) and from 1.29x to 1.05x (8-bit), for one
# more 64 MiB record on the GPU (bench/RESULTS.md, fortieth session; with the download on the work stream, 2 and 3
# records had given the offloaded 4.42B's optimizer the same 1.43 s, eighteenth session).
CHUNKS_IN_FLIGHT = 3
