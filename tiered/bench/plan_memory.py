"""The memory model of `tiered-bench plan`: the bytes each engine needs where, for N parameters.

tiered (``state_split``: where the state goes under one host_budget, ``plan_budget`` in closed form; the host
and GPU budgets it recommends; its GPU bytes), tiered with the parameters offloaded (tiered.offload_model:
the bf16 weights and gradients in pinned RAM, a window of blocks on the GPU), and DeepSpeed ZeRO-3's offloads.
docs/capacity.md explains each figure. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..layout.sizes import chunk_numel, pool, record_bytes, round_up
from ..shares import CHUNKS_IN_FLIGHT, KEEP_SHARE

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

__all__ = [
    "CAP", "largest_that",
    "Assumptions", "StateSplit", "device_scratch_bytes", "ds_gpu_bytes", "ds_infinity_host_bytes",
    "default_activations", "host_budget_max", "offload_gpu_bytes", "offload_host_budget", "offload_host_bytes",
    "recommend_gpu_budget", "recommend_host_budget", "state_split", "tiered_gpu_bytes", "DS_OFFLOAD_HOST",
    "DS_INFINITY_NVME", "DS_INFINITY_HOST", "DS_PARAMS", "ds_params_gpu_bytes", "OFFLOAD_HOST", "offload_hbm_params",
    "kept", "state_placement", "KiB", "MiB", "GiB",
]  # fmt: skip


@dataclass(frozen=True)
class Assumptions:
    """What the plan cannot know about the run; each is the user's to set (docs/capacity.md)."""

    activations: int = 8 * GiB  # GPU bytes for activations: batch, sequence, checkpointing decide it
    gpu_reserve: int = 2 * GiB  # CUDA context, library workspaces, the allocator's slack
    ram_reserve: int = 8 * GiB  # host RAM the OS and the training process need beside pinned memory
    chunk_bytes: int = 64 * MiB  # TieredOptimizer's chunk_bytes (its default)
    prefetch_depth: int = 8  # TieredOptimizer's prefetch_depth (its default)
    # DeepSpeed ZeRO-3 defaults (deepspeed/runtime/zero/config.py, offload_config.py):
    ds_reduce_bucket: int = 500_000_000  # reduce_bucket_size, elements: the bf16 gradient bucket on the GPU
    ds_sub_group: int = 1_000_000_000  # sub_group_size, elements: what ZeRO-Infinity swaps at once
    ds_buffer_count: int = 4  # offload_optimizer.buffer_count: pinned swap buffers of one sub-group each
    # With offload_param (the weights off the GPU too): stage3_max_live_parameters, the weights ZeRO-3 holds
    # gathered on the GPU at once, and offload_param's pinned NVMe buffers (buffer_count 5 x buffer_size 1e8).
    ds_max_live: int = 1_000_000_000
    ds_param_buffers: int = 5 * 100_000_000
    # Parameters offloaded (tiered.offload_model): the GPU bytes of the blocks FSDP2 holds unsharded at once:
    # the running decoder layer, the next one prefetched, one layer's gradients, and the root's embeddings and
    # head with their gradients. A 10B Llama (hidden 4096): 2.3 GB; a 30B one (hidden 6656): about 4 GB.
    offload_window: int = 4 * GiB

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{f.name} must be an integer >= 0, got {v!r}")
        if self.chunk_bytes < 4096:  # as TieredOptimizer (tiered/config.py): below a page, a typo
            raise ValueError(f"chunk_bytes must be at least 4 KiB (one page; the default is 64MiB), got "
                             f"{self.chunk_bytes} bytes")  # fmt: skip


def default_activations(gpu: int) -> int:
    """The activations the plan assumes on a GPU of ``gpu`` bytes where the user gives none: a quarter of it, at
    most ``Assumptions().activations`` (8 GiB). Smaller cards run smaller micro-batches: under 12 and 16 GB caps
    the project's runs took 2 x 2048 and 4 x 2048 tokens a micro-batch, with checkpointing, and their predictions'
    3 GiB held (bench/RESULTS.md); 8 GiB on a 12 GB card would leave no room for any model."""
    return min(Assumptions().activations, gpu // 4)


# B/param of pinned host RAM with the parameters offloaded: bf16 weights (2) and gradients (2), each in a
# page-locked slab of its exact size (tiered/offload/pinning.py). (FSDP2's own pinning went through torch's
# allocator, which rounds each tensor up to a power of two: 1.25-1.35x for Llama shapes; the 10.0B's run
# peaked at 115.3 GiB of host memory that way.) The few blocks FSDP2 copies gradients into on their way to
# their slab come out of the RAM reserve.
OFFLOAD_HOST = 4
DS_OFFLOAD_HOST = 18  # B/param of host RAM: fp32 master, exp_avg, exp_avg_sq (12), fp32 grads (4), bf16 grads (2)
DS_INFINITY_NVME = 16  # B/param on NVMe: fp32 master, exp_avg, exp_avg_sq (12) and the fp32 grads swapped out (4)
DS_INFINITY_HOST = 2  # B/param of host RAM: the bf16 gradient partitions, pinned
DS_PARAMS = 2  # B/param with offload_param: the bf16 weights' partitions, pinned in RAM (cpu) or on NVMe (nvme)


def host_budget_max(ram: int, ram_reserve: int) -> int:
    """The largest host_budget: under 90 % of RAM (TierConfig refuses more) and leaving ``ram_reserve`` to the
    OS and the process, rounded down to whole MiB; 0 when the reserve leaves nothing."""
    return max(0, min(ram * 9 // 10, ram - ram_reserve)) // MiB * MiB


@dataclass(frozen=True)
class StateSplit:
    """Where tiered's state goes under one host_budget (tiered.optim.budget.plan_budget's answer)."""

    chunks: int
    state_bytes: int  # every chunk, as host buffers (whole pages)
    resident_bytes: int  # the chunks that stay in DDR for good
    stream_reserve: int  # the rest of host_budget: room for the chunks in flight
    nvme_bytes: int  # the chunks that live on NVMe (what the free-space check counts)
    prefetch_depth: int


def state_split(params: int, fmt: str, host_budget: int, a: Assumptions = Assumptions()) -> StateSplit | None:
    """``plan_budget`` for one param group of ``params`` parameters in record format ``fmt``, the update on
    the GPU (no staging): None where host_budget cannot hold one chunk (the optimizer refuses to start).

    The chunks are ``params // n`` full ones and a last partial one. The scan policy keeps the most leading
    chunks resident that leave room for ``prefetch_depth + CHUNKS_IN_FLIGHT`` chunks in flight (the read-ahead and
    the device update's window; never more than stream):
    plan_residency's loop, solved instead of walked."""
    n = chunk_numel(fmt, a.chunk_bytes)
    full, rem = divmod(params, n)
    count = full + (1 if rem else 0)
    if count == 0:
        return StateSplit(0, 0, 0, host_budget, 0, 0)
    s, s_last = pool(record_bytes(fmt, n)), (pool(record_bytes(fmt, rem)) if rem else 0)
    total = full * s + s_last
    largest_raw = record_bytes(fmt, n if full else rem)
    largest = s if full else s_last
    if host_budget < largest_raw:
        return None
    depth = min(a.prefetch_depth, max(0, host_budget // largest_raw - CHUNKS_IN_FLIGHT))
    flight = depth + (CHUNKS_IN_FLIGHT if depth else 2)  # no read-ahead: the serial twin, plan_budget's two chunks

    def prefix(r: int) -> int:
        return r * s if r <= full else total

    def fits(r: int) -> bool:
        return prefix(r) + min(flight, count - r) * largest <= host_budget

    resident = next((r for r in range(count, max(count - flight, 0) - 1, -1) if fits(r)), None)
    if resident is None:  # below count - flight every streamed chunk set needs `flight` chunks of room
        resident = max(0, min(count - flight - 1, (host_budget - flight * largest) // s))
    held = prefix(resident)
    return StateSplit(count, total, held, host_budget - held, total - held, depth)


def recommend_host_budget(params: int, fmt: str, ram: int, a: Assumptions = Assumptions(), *,
                          spare: bool = False, gpu_budget: int = 0) -> int:  # fmt: skip
    """The host_budget for ``params`` parameters on a host with ``ram`` bytes: the whole state where it fits
    under ``host_budget_max`` (rounded up to whole MiB, or GiB from 16 GiB on), else that maximum. ``spare``:
    room for a second copy of the state too, as far as the maximum allows, for the update under backward's
    spare buffers (pinned only once it turns on). ``gpu_budget``: the whole chunks it holds stay in HBM."""
    whole = state_split(params, fmt, 1 << 62, a)
    assert whole is not None
    cap = host_budget_max(ram, a.ram_reserve)
    chunk = record_bytes(fmt, chunk_numel(fmt, a.chunk_bytes))
    in_hbm = min(whole.state_bytes, gpu_budget // chunk * chunk)
    want = (whole.state_bytes - in_hbm) * (2 if spare else 1)
    unit = GiB if want >= 16 * GiB else MiB
    return min(cap, max(round_up(want, unit), MiB))


def state_placement(params: int, fmt: str, gpu: int, ram: int, a: Assumptions = Assumptions(), *, offload: bool,
                    keep: bool = True) -> tuple[int, int, StateSplit | None]:  # fmt: skip
    """tiered's state for ``params`` parameters on a box of ``gpu`` and ``ram`` bytes: the parameters whose state
    the GPU keeps (``offload``: ``offload_hbm_params``, else 0), the host_budget the plan recommends for the rest,
    and where the state goes under it (None: that budget cannot hold one chunk). One computation for the figures a
    fit prints and the constraint that judges them (plan.py). ``keep``: as ``offload_hbm_params``'s."""
    if offload:
        in_hbm = offload_hbm_params(params, gpu, fmt, a, keep=keep)
        budget = recommend_host_budget(params - in_hbm, fmt, max(0, ram - offload_host_bytes(params)), a)
    else:
        in_hbm, budget = 0, recommend_host_budget(params, fmt, ram, a)
    return in_hbm, budget, state_split(params - in_hbm, fmt, budget, a)


def tiered_gpu_bytes(params: int, fmt: str, a: Assumptions = Assumptions()) -> int:
    """GPU bytes: bf16 weights and gradients (4 B/param), activations, the reserve, and the optimizer's
    scratch (``device_scratch_bytes``)."""
    return 4 * params + a.activations + a.gpu_reserve + device_scratch_bytes(params, fmt, a)


def device_scratch_bytes(params: int, fmt: str, a: Assumptions = Assumptions(), *, offloaded: bool = False) -> int:
    """The optimizer's GPU scratch with the update on the GPU: DeviceUpdate's device records (``CHUNKS_IN_FLIGHT``, 3),
    its fp32 gradient row and two bf16 rows (``offloaded``: as many more as records, the host gradients' staging
    rows), and ChunkUpdater's rows (split: joined fp32 masters and an int32 row; bf16 or 8-bit moments: two fp32
    rows; the 8-bit codes' kernels, codec_kernels.py, take no row of their own)."""
    n = min(params, chunk_numel(fmt, a.chunk_bytes))
    scratch = CHUNKS_IN_FLIGHT * record_bytes(fmt, n) + (4 + 2 + 2 + (2 * CHUNKS_IN_FLIGHT if offloaded else 0)) * n
    return scratch + {"split": 8 * n, "packed": 8 * n, "full": 0, "int8": 8 * n, "split-int8": 16 * n}[fmt]


def recommend_gpu_budget(peak: int, allowed: int, params: int, fmt: str, a: Assumptions = Assumptions()) -> int:
    """The gpu_budget that keeps state in the HBM a training step leaves spare: ``allowed`` (the bytes the
    process may use) less ``peak`` (``torch.cuda.max_memory_reserved`` after a forward and backward of one
    micro-batch: weights, gradients, activations, the allocator's slack), the optimizer's scratch, the
    reserve, and a twentieth of ``allowed`` (the room below which the update under backward keeps new weights
    in host memory rather than in GPU rows, device_update.py); whole GiB, at most the whole state, 0 where
    nothing is spare."""
    whole = state_split(params, fmt, 1 << 62, a)
    assert whole is not None
    spare = allowed - peak - device_scratch_bytes(params, fmt, a) - a.gpu_reserve - allowed // 20
    return max(0, min(round_up(whole.state_bytes, MiB), spare // GiB * GiB))


def offload_gpu_bytes(params: int, fmt: str, a: Assumptions = Assumptions(), *, gpu: int = 0) -> int:
    """GPU bytes with the parameters offloaded: the window, the activations, the reserve and the optimizer's
    scratch (``device_scratch_bytes``, offloaded: three chunk records and the rows, which DeviceUpdate allocates
    whatever else the GPU holds; it grows with ``chunk_bytes``), nothing that grows with the model's depth. Given
    the ``gpu`` bytes, the model's weights where they are kept from forward to backward instead (``kept``)."""
    held = 2 * params if gpu and kept(params, gpu, fmt, a) else window_bytes(params, a)
    return held + a.activations + a.gpu_reserve + device_scratch_bytes(params, fmt, a, offloaded=True)


def kept(params: int, gpu: int, fmt: str, a: Assumptions = Assumptions()) -> bool:
    """Whether an offloaded model's bf16 weights stay on the GPU from forward to backward: where they take at
    most ``KEEP_SHARE`` of it (tiered.offload's ``keep_for_backward="auto"``) and, kept, fit beside the
    activations, the reserve and the optimizer's scratch (the plan does not count a run the GPU cannot hold)."""
    weights = 2 * params
    rest = a.activations + a.gpu_reserve + device_scratch_bytes(params, fmt, a, offloaded=True)
    return 0 < weights <= KEEP_SHARE * gpu and max(weights, window_bytes(params, a)) + rest <= gpu


def window_bytes(params: int, a: Assumptions = Assumptions()) -> int:
    """The GPU bytes of an offloaded model's window: ``offload_window``, at most the bf16 weights and gradients of
    the whole model (4 B/param), all that its blocks can hold; a default window (4 GiB) over a small model's
    whole weights would have it need more GPU offloaded than with its weights on the GPU."""
    return min(a.offload_window, 4 * params)


def offload_hbm_params(params: int, gpu: int, fmt: str, a: Assumptions = Assumptions(), *, keep: bool = True) -> int:
    """With the parameters offloaded, the parameters whose state the GPU keeps (``gpu_budget``), in whole chunks:
    what ``offload_gpu_bytes`` (the window or the weights ``kept``, the activations, the reserve and the scratch)
    leaves of ``gpu`` bytes. ``keep=False``: the weights never kept, as with ``keep_for_backward=False``: no jump
    where the keep rule stops, so that the bytes left to DDR and NVMe grow with ``params``, as the search for the
    largest model needs; the most room where the weights are larger than the window (kept weights smaller than it
    leave more). Those chunks
    update where they lie, off PCIe and off the disk (examples/big_model.py measures the spare room)."""
    n = chunk_numel(fmt, a.chunk_bytes)
    spare = gpu - offload_gpu_bytes(params, fmt, a, gpu=gpu if keep else 0)
    return min(params, max(0, spare) // record_bytes(fmt, n) * n)


def offload_host_budget(params: int, ram: int, a: Assumptions = Assumptions()) -> int:
    """The largest host_budget with the parameters offloaded: ``host_budget_max`` of the RAM that the pinned
    bf16 weights and gradients (``OFFLOAD_HOST`` B/param) leave."""
    return host_budget_max(max(0, ram - offload_host_bytes(params)), a.ram_reserve)


def offload_host_bytes(params: int) -> int:
    """Pinned host bytes of the bf16 weights and gradients of ``params`` offloaded parameters."""
    return int(OFFLOAD_HOST * params)


def ds_gpu_bytes(params: int, a: Assumptions = Assumptions()) -> int:
    """GPU bytes under ZeRO-3 with the optimizer offloaded: bf16 weights (2 B/param) and one bf16 gradient
    bucket (reduce_bucket_size), since gradients leave for the host as they are reduced; activations, reserve."""
    return 2 * params + 2 * a.ds_reduce_bucket + a.activations + a.gpu_reserve


def ds_params_gpu_bytes(params: int, a: Assumptions = Assumptions()) -> int:
    """GPU bytes under ZeRO-3 with the weights offloaded too (offload_param): the weights gathered at once (at
    most ``ds_max_live``), the bf16 gradient bucket, activations, reserve."""
    return 2 * min(params, a.ds_max_live) + 2 * a.ds_reduce_bucket + a.activations + a.gpu_reserve


def ds_infinity_host_bytes(params: int, a: Assumptions = Assumptions()) -> int:
    """Pinned host RAM under ZeRO-Infinity: the bf16 gradient partitions (2 B/param), ``buffer_count`` swap
    buffers of one fp32 sub-group each, and the fp32 gradient buffer of one sub-group."""
    sub = min(params, a.ds_sub_group)
    return DS_INFINITY_HOST * params + (a.ds_buffer_count + 1) * 4 * sub


# The search the plan runs over these needs (plan.py: a model size, not a byte count).
CAP = 1 << 50  # parameters: a constraint that allows this many is no limit


def largest_that(ok: Callable[[int], bool]) -> int | None:
    """The largest N >= 0 with ok(N) (ok is monotone: true up to a point), or None past CAP."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > CAP:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
