"""The machinery an optimizer steps with, built from its resolved config and its chunks, and released again.

What is built, bottom up: the budget plan (how much of ``host_budget`` the staging buffers, the read-ahead
and the resident chunks get: budget.py); the staging pool (pinned buffers for gradients and weights
crossing PCIe, update_on="host" with CUDA parameters only); the ``TieredStore`` in the private folder;
the update strategy (an ``UpdateStrategy``, strategy.py: host_update.py or device_update.py) around the
AdamW kernel (update.py); the step pipeline over both (pipeline.py); and, where part of the state lives on
disk, the disk's calibrated bandwidth for the step telemetry (telemetry.py).

The private folder is handed in with its lock (``folder``: workdir.make_workdir's ``FolderLock``), which the
optimizer holds from the folder's making to its removal: the store is given it (``folder_lock``) rather than
locking the folder itself, so the folder stays locked while the disk is measured before the store is opened,
and between the stores of two layouts (param_set.follow: the old parts released, the new ones built); a
sibling starting on the same root never takes it for a dead run's then, and a run killed then leaves a folder
the next one reclaims.

Call order: ``resources = []``; ``parts = build(..., folder, resources)`` appends each resource as it is made, so
that a failure part-way, like the optimizer's close, is handled by ``release(resources, folder)``; a layout built
again calls ``release_parts(resources)`` and ``build`` with the same ``folder``, still locked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import torch

from io_engine import PinnedBufferPool, pool_bytes

from ..arguments import check_free_space, check_param
from ..auto_budget import auto_host_too_small
from ..config import TierConfig
from ..interrupts import deferred_sigint
from ..layout.chunking import Chunk, Layout
from ..layout.sizes import ROW_ALIGN
from ..progress import progress
from ..store import TieredStore
from ..store.lock import FolderLock
from ..store.workdir import remove_workdir
from ..telemetry import DiskRate, disk_rate
from .budget import budget_for_disk, in_hbm, least_host_budget, plan_budget
from .device_update import DeviceUpdate
from .groups import Groups
from .host_update import HostUpdate, staging_sizes
from .pipeline import StepPipeline
from .rank_agreement import check_ranks_agree
from .shards import Shards
from .strategy import UpdateStrategy
from .update import ChunkUpdater

__all__ = ["Machinery", "Planned", "plan_layout", "build", "release", "release_parts", "write_initial_state"]


@dataclass
class Planned:
    """A layout over some tensors, checked and planned, nothing built yet."""

    config: TierConfig  # resolved for these tensors
    layout: list[tuple[Any, Any, Any]]  # each local tensor's shape, dtype, device: changes are refused at step()
    rule: Layout  # how chunks are cut (add_param_group cuts its own by it)
    chunks: list[Chunk]
    cuda: bool  # the parameters are on CUDA
    device: torch.device  # where a streamed chunk updates with update_on="device": the parameters', or their GPU

    @property
    def hbm(self) -> bool:
        """Whether state chunks can live in HBM (``gpu_budget``): the update runs on a GPU, the parameters' or,
        for parameters FSDP2's CPU offload keeps in host memory, the one they are streamed to. An offloaded
        model leaves most of the GPU idle (a layer's weights and the activations), and the state kept there
        never crosses PCIe or touches the disk."""
        return self.cuda or (self.device.type == "cuda" and self.config.update_on == "device")


def plan_layout(names: list[str], shards: Shards, param_groups: list[dict[str, Any]], asked: TierConfig,
                agree: bool = False) -> Planned:  # fmt: skip
    """Check the tensors the state is laid out on and plan the chunks over them. A frozen parameter (an empty
    placeholder: shards.py) is checked once it thaws, as AdamW ignores it until then; nor does it decide the
    chunk size. ``agree`` (the constructor's): first compare this optimizer with the other ranks' (collective,
    under FSDP2: rank_agreement.py), before any check that one rank alone could fail."""
    if agree:
        check_ranks_agree(shards, names, param_groups, asked.max_grad_norm)
    for name, p, frozen in zip(names, shards.locals, shards.frozen):
        if not frozen:
            check_param(name, p)
    cuda = any(p.is_cuda for p in shards.locals)
    gpu = shards.compute_device  # parameters offloaded to the host by FSDP2, computed on this GPU
    device = gpu or (shards.locals[0].device if shards.locals else torch.device("cpu"))
    config = asked.resolve(cuda=cuda, offloaded=gpu is not None, device=device)  # gpu_budget="auto" read there
    all_bf16 = all(p.dtype == torch.bfloat16 for p, f in zip(shards.locals, shards.frozen) if not f)
    # TierConfig parsed the sizes and the moments' dtype; resolve() decided split_masters.
    chunk_bytes, moments_dtype = cast(int, config.chunk_bytes), cast(torch.dtype, config.moments_dtype)
    rule = Layout(chunk_bytes, moments_dtype, cast(bool, config.split_masters), all_bf16)
    layout = [(p.shape, p.dtype, p.device) for p in shards.locals]
    return Planned(config, layout, rule, rule.plan(shards.grouped(param_groups)), cuda, device)


@dataclass
class Machinery:
    store: TieredStore
    updater: ChunkUpdater
    strategy: UpdateStrategy
    pipeline: StepPipeline
    prefetch_depth: int  # as the budget allows: at most the config's
    chunk_numel: int  # the largest chunk's elements: every scratch row is this long
    disk_rate: DiskRate | None  # the disk's calibrated bandwidth, where part of the state lives there


def build(params: list[torch.Tensor], groups: Groups, chunks: list[Chunk], config: TierConfig, folder: FolderLock,
          resources: list[Any], *, cuda: bool, hbm: bool, device: torch.device,
          host_auto: bool = False) -> Machinery:  # fmt: skip
    """The machinery over ``chunks`` in the private folder ``folder`` (its lock; see the module doc).
    ``host_auto``: the host budget is what ``host_budget="auto"`` took, which a refusal says."""
    workdir = folder.folder
    on_device = config.update_on == "device"
    any_split = any(c.split for c in chunks)
    chunk_numel = max((c.numel for c in chunks), default=ROW_ALIGN)
    staging_slots = config.prefetch_depth + 1
    host_cuda = cuda and not on_device  # gradients and weights cross PCIe through pinned staging buffers
    staging = pool_bytes(staging_sizes(chunk_numel, staging_slots, any_split)) if host_cuda else 0
    # TierConfig parsed the sizes and the moments' dtype.
    host_budget, moments_dtype = cast(int, config.host_budget), cast(torch.dtype, config.moments_dtype)
    gpu_budget = cast(int, config.gpu_budget) if hbm else 0
    kept = in_hbm([c.nbytes for c in chunks], gpu_budget)
    sizes = [c.nbytes for c, h in zip(chunks, kept) if not h]  # what host memory and the disk hold
    if host_auto and host_budget < least_host_budget(sizes, staging):
        raise auto_host_too_small(host_budget, least_host_budget(sizes, staging))
    # Chunks of ROW_ALIGN elements are the smallest: a refusal then asks for no smaller chunk_bytes. The room
    # streaming takes is the read-ahead beside the chunks the strategy keeps open (its window).
    window = DeviceUpdate.window() if on_device else HostUpdate.in_flight
    plan = plan_budget(sizes, host_budget, staging, config.prefetch_depth, smallest=chunk_numel <= ROW_ALIGN,
                       in_flight=window)  # fmt: skip
    check_free_space(workdir, plan.disk_bytes, "the optimizer state",
                     lambda free: budget_for_disk(sizes, staging, config.prefetch_depth, free, window))  # fmt: skip
    rate = disk_rate(workdir, config.io) if plan.disk_bytes else None  # before the store fills the disk
    staging_pool = PinnedBufferPool(staging) if staging else None
    if staging_pool is not None:
        resources.append(staging_pool)
    store = TieredStore(workdir, host_budget=host_budget - staging, gpu_budget=gpu_budget,
                        io=config.io, policy="scan", verify=config.verify,
                        stream_reserve=plan.stream_reserve, folder_lock=folder)  # fmt: skip
    resources.append(store)
    # Streamed chunks update on the device (the parameters', or the GPU offloaded ones are streamed to) or the
    # host; their scratch rows live there.
    where = device if on_device else torch.device("cpu")
    updater = ChunkUpdater(params, moments_dtype, chunk_numel, any_split=any_split, where=where)
    strategy: UpdateStrategy
    if on_device:
        strategy = DeviceUpdate(params, groups, updater, chunk_numel,
                                record_bytes=max((c.nbytes for c in chunks), default=0), device=device)  # fmt: skip
    else:
        strategy = HostUpdate(params, groups, updater, chunk_numel, staging_slots, staging_pool, split=any_split)
    resources.append(strategy)
    pipeline = StepPipeline(store, strategy, plan.prefetch_depth)
    return Machinery(store, updater, strategy, pipeline, plan.prefetch_depth, chunk_numel, rate)


def write_initial_state(store: TieredStore, strategy: UpdateStrategy, chunks: list[Chunk]) -> None:
    """The chunks' first records: masters the parameters' values, moments zero; written chunk by chunk.

    A split chunk's masters are its bf16 parameters exactly, so their low halves and tie bits are zero and
    its first record depends on its size alone: it is packed once (with 8-bit moments that saves encoding
    every chunk's zeros on the CPU, which took longer than the disk for a 30B model). Where that record is all
    zero bytes, one the store places on NVMe is allocated there, not written (``put(..., zeros=True)``)."""
    if not chunks:
        return
    rows = torch.empty(3, max(c.numel for c in chunks), dtype=torch.float32)  # as wide as the widest chunk
    # Split chunks' first records, by format and size, and whether each is all zero bytes.
    blank: dict[tuple[str, int], tuple[torch.Tensor, bool]] = {}
    with progress(sum(c.nbytes for c in chunks), "tiered: writing the initial state") as bar:
        for c in chunks:
            t = rows[:, : c.numel]
            zeros = False
            if c.split:
                if (c.fmt.name, c.numel) not in blank:
                    packed = c.fmt.pack(t.zero_())
                    blank[(c.fmt.name, c.numel)] = (packed, not packed.reshape(-1).view(torch.uint8).any())
                record, zeros = blank[(c.fmt.name, c.numel)]
            else:
                t.zero_()
                strategy.gather_params(c, t[0])
                record = c.fmt.pack(t)
            store.put(c.key, record, zeros=zeros)  # put copies, so one scratch buffer serves every chunk
            bar.update(c.nbytes)
    # No flush: the tier is a cache of the training state; durability is the checkpoint's job.


def release(resources: list[Any], folder: FolderLock) -> None:
    """Close what an optimizer holds (``release_parts``), then remove its folder and release the folder's lock
    (``remove_workdir``: emptied under it, so no sibling reclaims it meanwhile). The optimizer's finalizer: it
    holds the resources, never the optimizer, so a wrapper or subclass instance being collected closes nothing.

    It runs once (the optimizer reads closed from its start, and neither a second ``close()`` nor the exit hook
    runs it again), so nothing may stop it part-way: a Ctrl-C is held until all is released (interrupts.py), and
    any other interrupt (a SIGTERM handler's ``SystemExit``) is raised once the rest and the folder are gone."""
    with deferred_sigint():
        try:
            release_parts(resources)
        finally:
            remove_workdir(folder.folder, folder)


def release_parts(resources: list[Any]) -> None:
    """Close ``resources``, last made first: the update strategy, the store (records deleted, not flushed: the
    tier is a working area), the staging pool; the list is left empty, so that a layout built again over other
    tensors (the optimizer's param set followed) appends its own to the same list the finalizer holds. A failure
    is logged and the rest released; an interrupt (not an ``Exception``) is raised after the rest is released."""
    stopped: BaseException | None = None
    for r in reversed(resources):
        try:
            if isinstance(r, TieredStore):
                _empty(r)
            r.close()
        except Exception as e:  # noqa: BLE001 - the rest must still be released; the folder is removed after
            _failed(r, e)
        except BaseException as e:  # noqa: BLE001 - raised below, once nothing is left half released
            stopped = stopped or e
    resources.clear()
    if stopped is not None:
        raise stopped


def _empty(store: TieredStore) -> None:
    """Delete every record of ``store``. Stopped part-way, it closes the store with ``discard``, then raises: its
    threads still go (the folder lock is the optimizer's, released with the folder), and the records left are not
    written (the tier is a working area, and on a full disk that write's error would replace what stopped the
    deletes)."""
    try:
        for key in store.keys():
            store.delete(key)
    except BaseException:
        try:
            store.close(discard=True)
        except Exception as e:  # noqa: BLE001 - what stopped the deletes is the one to raise
            _failed(store, e)
        raise


def _failed(r: Any, e: Exception) -> None:
    logging.getLogger("tiered").warning("TieredOptimizer.close: releasing %s failed: %s", type(r).__name__, e)
