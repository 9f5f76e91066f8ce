"""TieredOptimizer: torch.optim.AdamW whose fp32 state (master weights, exp_avg, exp_avg_sq) lives in a
TieredStore (pinned host memory up to ``host_budget``, the rest in files on NVMe). This module is the
torch.optim contract; the work is below it:

    config.py            TierConfig: every knob parsed, checked and resolved once
    layout/              parameters -> chunks; the record formats (bf16 or 8-bit moments, split masters)
    optim/               what a step runs on: the shards the state is laid out on (FSDP2), param_groups followed
                         where a framework swaps or assigns them (one list read by all: groups.py), the build
                         (assembly.py), one step's work in order (step.py) and its stream of chunks (pipeline.py),
                         update_on="host" or "device", AdamW on one record (update.py), the update under backward
                         (under_backward/), the state as one object (state_chunks.py), state dicts, stats (reports.py)
    store/, checkpoint/  TieredStore, the tiers the state lives in; checkpoints, through their own protocol

Call order: ``opt = TieredOptimizer(model, nvme_path=...)``; per step ``loss.backward(); opt.step(); opt.zero_grad()``;
``opt.close()`` (or ``with``, or none: collection or exit closes it). ``prefetch_depth=0`` is the serial twin.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, cast

import torch

from io_engine import IOConfig
from io_engine.shutdown import close_at_exit, forget

from .arguments import adamw_only_defaults, check_group, check_nvme_path, check_unchanged, param_groups, settle_groups
from .checkpoint import save_checkpoint
from .checkpoint.sharded import save_sharded
from .checkpoint.validate import checkpoint_path
from .config import TierConfig
from .interrupts import deferred_sigint
from .offload import take_writes
from .offload.accumulation import forget_failed_passes
from .offload.accumulation import settle_all as settle_accumulation
from .optim import clip_order, param_set
from .optim.assembly import Planned, build, plan_layout, release, write_initial_state
from .optim.groups import Groups, GroupsAttribute
from .optim.left_out import LeftOut
from .optim.reports import Reports
from .optim.shards import Shards
from .optim.state_chunks import StateChunks
from .optim.state_dicts import StateDictFileError as StateDictFileError  # state_dict()'s error, public here
from .optim.state_dicts import export_state_dict, load_state, load_with_hooks, with_hooks
from .optim.state_view import LazyState, StateAttribute
from .optim.step import check_groups, run_step
from .optim.step_stats import StepTimes
from .optim.under_backward.overlap import UnderBackward, hook_backward
from .optim.whole_load import LoadGuard, OptimizerBrokenError, torn, whole_load
from .store.owner import OwnedFinalizer, OwnedLock
from .store.workdir import default_root, folder_tag, make_workdir
from .telemetry import Wear


class TieredOptimizer(Reports, torch.optim.Optimizer):
    """AdamW with its state tiered across pinned host memory and NVMe. Numerically torch's AdamW.

    Args:
        params: an ``nn.Module`` (parameter names key the state; frozen parameters are left out), or an
            iterable of parameters, (name, parameter) pairs or param-group dicts, as for torch's AdamW (frozen
            ones among them keep no state until they take gradients). The tensors stepped are those in ``param_groups``
            at each step: replaced ones (accelerate's FSDP2 ``prepare``) are followed (param_set.py).
        nvme_path: root of the NVMe tier, created if missing; the optimizer works in a private folder
            under it (``workdir``), removed on close. None: ``$TIERED_NVME_PATH``, else ``<tempdir>/tiered``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; ``lr`` a float or a one-element CPU tensor (which
            a scheduler ``fill_()``s: each step reads its value); ``betas`` also one tensor or numpy array of two.
        host_budget: pinned host bytes for state and staging buffers (a hard limit), e.g. "8GiB".
        gpu_budget: HBM bytes for state chunks, which then update where they lie: no PCIe, no disk (0: none).
            The first chunks that fit stay there; ``host_budget`` and the disk hold the rest.
        chunk_bytes: state bytes per chunk (master + exp_avg + exp_avg_sq, as moments_dtype keeps them); whole
            multiples of 1024 elements (rounded down, at least 1024) so that every row is page-aligned for O_DIRECT.
        prefetch_depth: chunks read ahead (0: the serial twin). Deeper fills the disk's queue, shrinks the resident set.
        max_grad_norm: clip the global gradient norm as ``torch.nn.utils.clip_grad_norm_`` does (a NaN norm: none).
        io: an ``IOConfig`` (default: ``IOConfig.from_env()``).
        verify: check every chunk read back from NVMe against its checksum.
        moments_dtype: ``torch.float32`` (default: exact AdamW), ``torch.bfloat16`` (the moments kept in bf16
            between steps, updated in fp32: 8 state bytes a parameter) or ``"int8"`` (also ``torch.int8``: one
            byte a parameter and an fp32 scale a block of 256, moments_codec.py; 6 bytes a parameter, 4.2 with
            split masters). Neither is exact (their effect on the loss: bench/RESULTS.md). Checkpoints and
            ``state_dict()`` hold the moments' fp32 values, which load back into the same codes.
        split_masters: for chunks of bf16 parameters, keep only the low 16 bits of each fp32 master (and a
            tie bit), the parameter being the high half: exact, 10 state bytes a parameter instead of 12, for a
            join and a split around each update (master_split.py). None (default): on where the update runs on
            the device and the moments are fp32 or 8-bit; off on the host, where the join and split cost more
            CPU than the disk time they save (bench/RESULTS.md). A write to such a parameter between steps
            changes the high half of its master.
        update_on: "host" runs torch's fused AdamW on the CPU over the pinned chunk (gradients come down
            and weights go up over PCIe); "device" uploads each chunk's state to the parameters' device
            and updates it there, with one more chunk record of device memory, so the CPU does nothing
            but I/O and checksums. Both are exact AdamW. "auto" (default): "device" for CUDA parameters,
            else "host". On a CPU model "device" is the host (an extra copy of each chunk: it exists so
            that the same code runs, and is tested, without a GPU).
        update_in_backward: move the state to the GPU while backward runs, where it has room, update it there at
            ``step()`` and write it back under the next forward (exact, clipped or not); a chunk without room
            starts its update under backward into spare host memory, kept at ``step()`` where still exact, if
            backward's window outlasts the step (optim/under_backward/). Needs update_on="device". "auto"
            (default; off for CPU parameters) stages from the second step and times the first three.
        tbw, run_steps, wear_share: SSD wear. A run of ``run_steps`` projected to write more than ``wear_share``
            (default a tenth) of the drive's rated ``tbw`` (terabytes written) is warned about once, in the
            "tiered" logger. ``stats()["telemetry"]["wear"]`` reports the bytes either way.
    """

    def __init__(
        self,
        params: torch.nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        nvme_path: str | os.PathLike | None = None,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] | torch.Tensor = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        host_budget: int | str = "2GiB",
        gpu_budget: int | str = 0,
        chunk_bytes: int | str = "64MiB",
        prefetch_depth: int = 8,
        max_grad_norm: float | None = None,
        io: IOConfig | None = None,
        verify: bool = True,
        moments_dtype: torch.dtype | str = torch.float32,
        split_masters: bool | None = None,
        update_on: str = "auto",
        update_in_backward: bool | str = "auto",
        tbw: float | None = None,
        run_steps: int | None = None,
        wear_share: float = 0.1,
    ):
        root = default_root() if nvme_path is None else check_nvme_path(nvme_path)
        config = TierConfig(host_budget=host_budget, gpu_budget=gpu_budget, chunk_bytes=chunk_bytes,
                            prefetch_depth=prefetch_depth, max_grad_norm=max_grad_norm, io=io, verify=verify,
                            moments_dtype=moments_dtype, split_masters=split_masters, update_on=update_on,
                            update_in_backward=update_in_backward, tbw=tbw, run_steps=run_steps,
                            wear_share=wear_share)  # fmt: skip
        groups, self.param_names = param_groups(params)
        self._left_out, self._clip_order = LeftOut(params), clip_order.ClipOrder(params)  # what a module tells
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        **adamw_only_defaults())  # fmt: skip
        check_group(defaults, "TieredOptimizer", given=True)
        self._built = False  # until then add_param_group is torch's (Optimizer.__init__ calls it per group)
        super().__init__(groups, defaults)
        settle_groups(self.param_groups)  # checked, their fused flag recorded
        self._host_auto = host_budget == "auto"  # a budget too small then says what "auto" read
        self._group_sizes = [len(g["params"]) for g in self.param_groups]
        # The state is laid out on plain tensors: the parameters, or under FSDP2 this rank's shards of them.
        shards = Shards(param_set.flat(self.param_groups))
        planned = plan_layout(self.param_names, shards, self.param_groups, config, agree=True)  # the ranks alike
        self._asked = config.settled(planned.config)  # a layout over other tensors (param_set.py) resolves it again
        if planned.config.gpu_budget and not planned.hbm:
            warnings.warn("gpu_budget is ignored: the parameters are not on a GPU, nor streamed to one by FSDP2's "
                          "CPU offload with the update there", RuntimeWarning, stacklevel=2)  # fmt: skip
        self.nvme_path = root
        self._lock = OwnedLock("TieredOptimizer")  # one step, save or load at a time; refused in a forked child
        self._broken: str | None = None  # why the state is torn, after a step or load failed part-way
        self.workdir, self._folder_lock = make_workdir(root, folder_tag())  # locked until removed: assembly.py
        self._resources: list[Any] = []  # what the finalizer releases, last made first
        # Releases only in this process: a forked child must not delete the live folder (store/owner.py).
        self._finalizer = OwnedFinalizer(self, release, self._resources, self._folder_lock)
        # One for every layout: what it handed out stays watched when the state is laid out again (state_view.py).
        self._state_view = LazyState(self._usable_state, self._current_state, self._loading_state, self._whole_load)
        try:
            self._assemble(shards, planned)
        except BaseException:
            self._finalizer()
            raise
        self._built = True

    # ----------------------------------------------------------------------------------------- layout
    def _assemble(self, shards: Shards, planned: Planned) -> StateChunks:
        """Build the machinery a step runs on, over ``shards``, and write the first records (fresh state)."""
        config, cuda = planned.config, planned.cuda
        self._layout, self._layout_plan, self.chunks = planned.layout, planned.rule, planned.chunks
        self._shards, self._params = shards, shards.locals
        self.config = config
        budgets = (cast(int, b) for b in (config.host_budget, config.gpu_budget, config.chunk_bytes))  # bytes by now
        self.host_budget, self.gpu_budget, self.chunk_bytes = budgets
        self.max_grad_norm, self.verify, self.moments_dtype = config.max_grad_norm, config.verify, config.moments_dtype
        self.update_on, self.split_masters = config.update_on, config.split_masters
        self.state_bytes = sum(c.nbytes for c in self.chunks)
        parts = build(self._params, self._groups, self.chunks, config, self._folder_lock, self._resources,
                      cuda=cuda, hbm=planned.hbm, device=planned.device, host_auto=self._host_auto)  # fmt: skip
        self.store, self._strategy = parts.store, parts.strategy
        self._pipeline, self.prefetch_depth = parts.pipeline, parts.prefetch_depth
        self._chunk_numel = parts.chunk_numel
        previous = getattr(self, "_chunked", None)  # a layout before: the global step goes on
        self._chunked = StateChunks(
            shards=shards, param_names=self.param_names, groups=self._groups, chunks=self.chunks,
            store=self.store, strategy=parts.strategy, updater=parts.updater, prefetch_depth=self.prefetch_depth,
            chunk_bytes=self.chunk_bytes, host_budget=self.host_budget, workdir=self.workdir,
            global_step=0 if previous is None else previous.step_count, status=self._status,
        )  # fmt: skip
        before = getattr(self, "_times", None)
        wear = Wear(config.tbw, config.run_steps, config.wear_share, config.moments_dtype, hbm=planned.hbm)
        self._times = StepTimes(parts.disk_rate, wear, self.update_on, planned.device.type)
        if before is not None:  # the sums over all steps go on across layouts
            self._times.total = before.total
        write_initial_state(self.store, self._strategy, self.chunks)
        self._chunked.versions_as_now()  # after the initial state set them
        self._under_backward = hook_backward(self._chunked, config.update_in_backward, self._resources)
        # An offloaded model's clip leaves its gradients in host memory as they are: its norm is taken on the GPU
        # and the update scales them as they go up (Shards.clip_grad_norm_'s defer).
        self._defer_clip = shards.compute_device is not None
        # Closed at exit before this layout's store, which would flush the whole state just before the folder goes.
        forget(self)
        close_at_exit(self, early=True)
        return self._chunked

    def _follow_param_set(self) -> None:
        """Follow the groups ``param_groups`` holds now: other tensors in them or in other places, frozen ones thawed
        (the state laid out again), groups appended to a list assigned to it (as add_param_group): follow_assigned."""
        param_set.follow_assigned(self._chunked, self._group_sizes, self._lay_out_again, self._add_group)

    def _lay_out_again(self, undo: Callable[[], None] | None = None,
                       order: tuple[list[int], list[str]] | None = None) -> None:  # fmt: skip
        """Lay the state out again over the tensors in param_groups (param_set.follow: ``undo``, ``order``)."""
        self._drop_started("layout")  # first: the export below may need its host room (UnderBackward.give_room)
        param_set.follow(self._chunked, self._asked, self._broken is None, self._resources, self._assemble,
                         self._finalizer, undo=undo, order=order)  # fmt: skip
        if order is not None:  # what opt.state[p] handed out follows its tensor
            self._state_view.moved(order[0])

    state = StateAttribute()  # opt.state: _state_view; = {} resets it (state_view.py)
    param_groups = GroupsAttribute()  # _groups.now; = [...] points it at the new list (groups.py)
    _groups: Groups  # the list of now, for every part, whatever list was last assigned (optim/groups.py)

    # ------------------------------------------------------------------------------------------ state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add parameters, as torch.optim does: their state starts fresh (masters from the parameters)."""
        if not getattr(self, "_built", False):  # torch's Optimizer.__init__, one call per group
            super().add_param_group(param_group)
            return
        with self._lock:
            self._check_usable()  # follows a param set changed since (param_set.py) before adding to it
            self._add_group(param_group)

    def _add_group(self, param_group: dict[str, Any]) -> None:
        gi, first = len(self.param_groups), len(self._params)
        super().add_param_group(param_group)  # torch's checks: no parameter in two groups; defaults filled
        chunks = param_set.add_group(self._chunked, self._layout, self._layout_plan, self._group_sizes,
                                     self._chunk_numel, gi, first, self._lay_out_again)  # fmt: skip
        self.state_bytes += sum(c.nbytes for c in chunks)  # [] where it laid all out again (_assemble counts)
        if self._under_backward is not None:  # hook the new parameters too
            self._under_backward.close()
            self._under_backward = hook_backward(self._chunked, self.config.update_in_backward, self._resources)

    # ------------------------------------------------------------------------------------------- step
    @torch._disable_dynamo  # torch.compile(opt.step) runs it eagerly: the step is I/O, not graphs
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One AdamW step over all parameters that have a gradient.

        All or nothing: a Ctrl-C during the step is delivered once the step has completed (a second one
        stops it at the next chunk). If the step fails part-way (an I/O error, a corrupt record, a second
        Ctrl-C), some chunks are updated and others not: the optimizer is then broken, and ``step``,
        ``state_dict`` and ``save_checkpoint`` raise ``OptimizerBrokenError`` until ``load_checkpoint`` or
        ``load_state_dict`` restores a whole state. A failure before any chunk changes (a bad gradient, a
        parameter changed under the optimizer, a group's lr None) raises and leaves the optimizer as it was.
        """
        with self._lock:
            self._check_usable(reads=False)  # before the closure too: no backward spent on a closed or broken one
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
                # What the closure may change (torch reads it after): parameters thawed, swapped, state written.
                self._check_usable(reads=False)
            self._left_out.check(self.param_groups)
            check_groups(self.param_groups)  # torch reads flags and hyperparameters at each step: ones set since too
            # An offloaded model's gradient sums (after a backward that raised part-way): only the stepped models'.
            settle_accumulation(param_set.flat(self.param_groups))
            with self._shards.grads(), deferred_sigint() as sigint:
                check_unchanged(self.param_names, self._params, self._layout)
                self._torn = False  # run_step says when; a torn step before a restoring load must not count here
                try:
                    run_step(self._chunked, self._pipeline, self._times, self._under_backward, self.max_grad_norm,
                             self._defer_clip, sigint, self._tearing, self._clip_order)  # fmt: skip
                except BaseException as e:
                    if self._torn:
                        self._broken = torn("step()", e)
                    raise
                # Inside the block: a Ctrl-C held for the step is raised as the block ends, and the step it let
                # finish must leave what opt.state[p] handed out before it stale, as any step does.
                self._state_view.stepped()  # what opt.state[p] handed out is a copy from before this step
        return loss

    _torn = False  # a step is part-way through its chunks

    def _tearing(self, now: bool) -> None:  # run_step says when a failure would leave the state torn, and when not
        self._torn = now

    _under_backward: UnderBackward | None = None

    def _drop_started(self, why: str, landed: bool = True) -> None:
        if self._under_backward is not None:
            self._under_backward.drop_all(why, landed=landed)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; what backward started or staged is dropped first (the last step's downloads may go on under
        the next forward), and an offloaded model's gradient sums are settled (offload/accumulation.py)."""
        self._lock.check()  # takes no lock, but drops what backward staged: refused in a forked child too
        self._drop_started("zero_grad", landed=False)
        params = param_set.flat(self.param_groups)
        settle_accumulation(params)
        # An offloaded model whose backward raised part-way: drop that pass (its parameters as the user gave them).
        forget_failed_passes(params)
        super().zero_grad(set_to_none)

    # ----------------------------------------------------------------------------- torch state dicts
    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's layout: ``state[i] = {step, exp_avg, exp_avg_sq}`` shaped like parameter i.

        For parameters kept in a lower precision, ``master`` (their fp32 master weights) is added, so a
        round trip through this dict loses nothing. The tensors live in a file on the NVMe tier, memory-
        mapped, not in RAM (state_dicts.py), so frameworks that checkpoint through ``state_dict`` and
        ``torch.save`` work at any state size. torch's state-dict hooks run as for any optimizer.
        """
        with self._lock:
            self._check_usable()
            return with_hooks(self, lambda: self._shards.to_global(export_state_dict(self._chunked)))

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from ``state_dict()`` here or from ``torch.optim.AdamW`` on the same parameters, which, as
        torch's load, it leaves as they are (state_dicts.scatter_state). Everything is checked before anything
        changes; then the state streams in chunk by chunk, all or nothing as a step is (optim/whole_load.py). A
        broken optimizer is whole again afterwards."""
        with self._whole_load("load_state_dict()") as guard:
            load_with_hooks(self, state_dict, lambda sd: self._load_state_dict(sd, guard))

    def _load_state_dict(self, state_dict: dict[str, Any], guard: LoadGuard) -> None:
        sd = self._shards.to_local(state_dict)
        if param_set.lay_out_loaded(self._chunked, sd, self._asked, self._resources, self._assemble, self._finalizer):
            guard.torn = True  # state for a frozen parameter: laid out afresh, the state before is gone
            self._chunked.guard = guard
        load_state(self._chunked, sd)
        guard.torn, self._broken = False, None
        # Here, not after whole_load: a Ctrl-C it held is raised as it ends; the load it let finish still forgets.
        self._state_view.forget()

    # ------------------------------------ checkpoints: tiered.checkpoint's options by name (a typo: TypeError, at once)
    def save_checkpoint(self, path: str | os.PathLike, *, extra: dict[str, Any] | None = None, scheduler: Any = None,
                        keep_last: int | None = None, io: IOConfig | None = None) -> str:  # fmt: skip
        """Write an NVMe-tier checkpoint (tiered/checkpoint). Waits for a step running in another thread."""
        path = checkpoint_path(path)  # first: "" (an unset variable) is refused, not taken for the current folder
        kw = dict(extra=extra, scheduler=scheduler, keep_last=keep_last, io=io)
        with self._lock:
            self._check_usable()
            if self._shards.distributed:  # collective: each rank saves its shards (checkpoint/sharded.py)
                return save_sharded(self._chunked, path, self._shards.layout(self.param_names), **kw)
            return save_checkpoint(self._chunked, path, **kw)

    def load_checkpoint(self, path: str | os.PathLike, *, scheduler: Any = None,
                        hparams: Literal["checkpoint", "keep"] = "checkpoint",
                        verify: Literal["stream", "first"] = "stream", weights_only: bool = True,
                        io: IOConfig | None = None) -> dict[str, Any]:  # fmt: skip
        """Load a checkpoint (every check before anything changes), all or nothing as ``load_state_dict``; state it
        holds for a frozen parameter is laid out first, as there (param_set.load_checkpoint_into)."""
        path = checkpoint_path(path)  # before anything runs, as save_checkpoint
        kw = dict(scheduler=scheduler, hparams=hparams, verify=verify, weights_only=weights_only, io=io)
        with self._whole_load("load_checkpoint()", collective=True) as guard:
            out = param_set.load_checkpoint_into(self._chunked, path, kw, self._asked, self._resources, self._assemble,
                                                 self._finalizer, guard)  # fmt: skip
            self._state_view.forget()  # in the block, as in _load_state_dict
        return out

    @contextlib.contextmanager
    def _whole_load(self, what: str, collective: bool = False) -> Iterator[LoadGuard]:
        """A whole state's load, all or nothing (whole_load.py; ``collective``: by all ranks at once where sharded)."""
        with self._lock:
            self._check_open()
            self._drop_started("load")  # before a layout again reads the state (_lay_out_again)
            self._follow_param_set()
            collective = collective and self._shards.distributed  # the layout of now, followed just above
            with whole_load(what, self._current_state, self._mark_broken, collective=collective) as guard:
                yield guard
                guard.torn, self._broken = False, None

    # --------------------------------------------------- condition (stats, summary: optim/reports.py)
    def _mark_broken(self, why: str) -> None:  # a load failed part-way (whole_load)
        self._broken = why

    def _status(self) -> tuple[bool, str | None]:
        return self.closed, self._broken

    def _current_state(self) -> StateChunks:
        return self._chunked

    @contextlib.contextmanager
    def _usable_state(self) -> Iterator[StateChunks]:
        """The state, held still and checked usable for the block (``opt.state[p]`` reads through this)."""
        with self._lock:
            self._check_usable()
            yield self._chunked

    @contextlib.contextmanager
    def _loading_state(self) -> Iterator[StateChunks]:
        """As ``_usable_state``, for a load of one parameter's state (``opt.state[p] = ...``), all or nothing."""
        with self._lock:
            self._check_usable()
            self._drop_started("load")
            with whole_load("opt.state[p] = ...", self._current_state, self._mark_broken):
                yield self._chunked

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this TieredOptimizer is closed; build a new one (or load a checkpoint into one)")
        take_writes(self)  # an offloaded model's `p.data = t` since its last forward: saved, exported or loaded over
        self._chunked.landed()  # the records the last step updated in HBM are back in host memory (staged.py)

    def _check_usable(self, reads: bool = True) -> None:
        """Open, whole, and laid out over the tensors ``param_groups`` holds now (followed here: every call that
        reads or steps the state comes through this, ``opt.state[p]`` included)."""
        self._check_open()
        if self._broken is not None:
            raise OptimizerBrokenError(self._broken)
        self._state_view.flush()  # writes to what opt.state[p] handed out (optim/state_view.py)
        self._follow_param_set()
        if reads and self._under_backward is not None:  # all but step(): a read may need its room (give_room)
            self._under_backward.give_room("the state was read")

    def __getstate__(self) -> dict[str, Any]:  # a pickled optimizer would need its folder, which closes with it
        raise TypeError("a TieredOptimizer cannot be pickled or deep-copied: its state lives in its private folder on "
                        "NVMe. Save opt.state_dict() (torch.save pickles it; load it with load_state_dict()) or use "
                        "opt.save_checkpoint(path) and load_checkpoint(path)")  # fmt: skip

    def close(self) -> None:
        """Release pinned memory, I/O threads and the folder lock; delete the private folder. Idempotent. One
        never closed is closed when collected or, at the latest, at interpreter exit (frameworks never call it).
        In a process forked after it was made, this copy only reads closed from then on: the memory, threads,
        lock and folder are the parent's, which goes on training (store/owner.py)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:  # in a child without the lock: a thread of the parent may have held it at the fork
            with self._lock if finalizer.here else contextlib.nullcontext():
                finalizer()

    def __enter__(self) -> TieredOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
