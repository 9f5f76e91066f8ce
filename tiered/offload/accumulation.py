"""Gradient accumulation of an offloaded model, off backward's thread.

Under FSDP2's CPU offload a micro-batch's gradients for a block go to the host as backward makes them. On the
first micro-batch of a step the copy goes into pinned memory without waiting; on every later one FSDP2 copies
into new pageable memory, waits for that copy, and adds it to the gradient the host holds, on backward's own
thread (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, "we cannot run the add as a callback").
Backward stops for both at every block: the 10.0B's forward and backward took 9.7 s a micro-batch at two
micro-batches a step and 15.9 s at eight (bench/RESULTS.md, eighth and ninth sessions).

So each block's all-reduce hook (FSDP2 calls it once the block's gradients are reduced, before they are copied
to the host) takes the gradients the host already holds off the block's parameters. FSDP2 then copies the new
ones as on a first micro-batch. At the next block's hook (or backward's end), FSDP2 has set them: the job goes
to a worker thread, which waits for the copy (an event recorded behind it) and adds the held gradients into
the new ones (the same addition in the same dtype, so the same bits) while backward goes on. A callback at the
end of backward waits for the worker: when ``backward()`` returns, every ``.grad`` is the sum, as before. At
most ``MAX_PENDING`` blocks queue for the worker (besides the one it sums and the one backward reduces), so the
held gradients take a few blocks' worth of extra host memory, not a model's.

Where a parameter has a home (``homes``: a tensor of its gradient's exact size in a page-locked slab,
offload/pinning.py), its gradient is kept there rather than in the block FSDP2 copied it into, which torch's
pinned allocator rounds up to a power of two (a 10B Llama's MLP gradients take 128 MiB for 86). The worker copies
a first micro-batch's gradient into the home, adds a later one's into it (``home += new``: IEEE addition is
commutative, so these are the bits of FSDP2's ``new + held``), and sets ``.grad`` to it; FSDP2's block then goes
back to torch's cache for the next block's copy. So the host holds every gradient once, at its size, plus the few
blocks in flight.

On a GPU the addition itself runs there (``SUM_ON_DEVICE``): the hook copies the held gradients up on FSDP2's
reduce stream and adds them into the block's reduced gradients before FSDP2 copies those down, so the copy that
lands on the host is already the sum and the worker only moves it into the home. The host then touches each
gradient once a micro-batch (a copy) instead of adding in bf16 (about three times the CPU time an element): a
profiled 4.42B Llama had the worker busy 4.8 s a step on one GPU machine's host and 7.6 s on another's, where
backward then waited for it (bench/RESULTS.md, nineteenth session). PCIe carries each held gradient up once more a
micro-batch, beside the weights' copies up. It needs FSDP2's flat layout of the block's reduced gradients (every
parameter reduced, in the dtype of its gradient, which FSDP2 neither casts nor divides after the hook); a block
that falls outside it is summed on the worker as before.

Where ``tiered.optim.resident_grads`` is switched on (the default), the summed gradients FSDP2 reduced on the
GPU are also kept there (a block's all or none, as far as the GPU has room above what a backward takes:
offload/kept_sums.py) and offered beside their homes once the worker has written those: the optimizer's clip
then reads the last micro-batch's sums there instead of copying them up. The step gives back what its clip did
not take; the next forward (or a ``zero_grad``) drops what no step met. With ``SUM_FROM_KEPT`` the next forward
leaves them, and the next backward's hook adds each kept copy whose home is unchanged (resident_grads' version
check) instead of copying that home up: the same bits, without the link's busy direction. A block holds one
generation of copies: its hook takes the last backward's off resident_grads before it keeps its new ones.

A block whose parameters carry post-accumulate-grad hooks is left to FSDP2 (those hooks read the sum inside
backward). A parameter that got no gradient in this micro-batch gets its held one back.

A backward that raises part-way (out of memory, say) never reaches its end. Whatever it handed the worker is
summed into the tensors FSDP2 made, whatever happens to ``.grad`` meanwhile; the last block it reduced still
waits. ``settle()`` sums that one too (FSDP2 would have summed it already) and waits for the worker. It runs
before the model's next forward (a hook on the root), in the next backward, in ``model.zero_grad()`` and in
``TieredOptimizer.step()`` and ``zero_grad()``, so each sees what FSDP2's own accumulation would have left. Where
a parameter's gradient was set to None before that (another optimizer's ``zero_grad()``), its held gradient is
dropped, as FSDP2's sum would have been. (A ``zero_grad(set_to_none=False)`` of another optimizer right after
such a failure is the one case left: it zeroes the new gradients in place, and the held ones are added to them.)
A step or ``zero_grad`` settles only the models whose parameters it steps: another model's sums are not its to wait for.

Fork: the worker, and any thread of the parent inside the lock, do not exist in a forked child. There a fresh
optimizer's step over a fresh model touches none of the parent's models (they are not its own), and any call on a
model the parent offloaded (a forward, a backward, ``zero_grad``, a step over its parameters, ``stats``) raises at
once, by name (store/owner.py's ``OwnedLock``), rather than wait for ever; the child's exit leaves it alone.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..interrupts import deferred_sigint
from ..optim import resident_grads
from ..optim.shards import is_sharded, sharded_like
from ..store.owner import OwnedLock
from .device_sums import add_on_device, flat_views, keep_until_copied, local_shard, take_kept
from .failed_pass import Settings, forget_failed_pass, keep_failed_pass, settings
from .kept_sums import KeptSums

__all__ = ["MAX_PENDING", "SUM_ON_DEVICE", "SUM_FROM_KEPT", "HostAccumulation", "forget_failed_passes", "settle_all"]

# Blocks whose held gradients wait for the worker: two keep it busy while backward hands it the next, and bound
# the extra host memory to two blocks' gradients (about 0.8 GB on a 10B Llama).
MAX_PENDING = 2
# Where a later micro-batch's gradients are added to the held ones: None (the default) on the GPU where FSDP2
# reduces on one, on the worker otherwise; True: on the reduce's device even on the CPU (the tests' stand-in for
# the GPU, bitwise the worker's sums); False: always on the worker.
SUM_ON_DEVICE: bool | None = None
# Where those held gradients come from on the GPU: False (the default) copies each up from its home; True adds the
# copy the previous micro-batch's backward kept on the GPU (offload/kept_sums.py), so the kept blocks' sums stay
# there through the forward between and never cross PCIe upward again within a step. Off: on one GPU machine it
# took 4-7 % off a 4.42B Llama's forward and backward under a 12 GB cap, nothing under 24 GB, and a 13.01B under
# 16 GB ran out of memory, the copies held through the forward fragmenting the allocator; with expandable segments
# it trains, but gains nothing on a 5.16B under 16 GB at the auto budget (docs/offload.md).
SUM_FROM_KEPT = False

_live: weakref.WeakSet[HostAccumulation] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # A worker still waiting when the interpreter ends takes torch's threads down with it (the process aborts):
    # end each one first.
    for acc in list(_live):
        acc.stop()


def settle_all(params: Iterable[torch.Tensor]) -> None:
    """``settle()`` the accumulation of each offloaded model some of ``params`` belong to (what a step or an
    optimizer's ``zero_grad`` calls before it reads or drops them). In a forked child, one of the parent's raises."""
    params = list(params)
    for acc in list(_live):
        if acc.owns(params):
            acc.settle()


def forget_failed_passes(params: Iterable[torch.Tensor]) -> None:
    """``forget_failed_pass(params)`` of every offloaded model's accumulation (an optimizer's ``zero_grad``)."""
    params = list(params)
    for acc in list(_live):
        acc.forget_failed_pass(params)


@dataclass
class _Held:
    """A block's gradients from the micro-batches before this backward, taken off its parameters (None: the
    parameter had none, but has a home for the one to come)."""

    held: list[tuple[nn.Parameter, torch.Tensor | None]]
    stream: Any  # the CUDA stream FSDP2 copies the new gradients on; None on the CPU
    backward: int  # autograd's id of the backward that took them
    nbytes: int
    summed: bool = False  # added into FSDP2's reduced gradients on its device already: the copy down is the sum
    resident: dict[int, torch.Tensor] | None = None  # by id(param): its gradient on the GPU, kept (resident_grads)


@dataclass
class _Pair:
    """One parameter's work: its ``new`` gradient (the tensor FSDP2 made), the ``held`` one (or None) and its
    ``home`` (or None: the sum stays in ``new``, as FSDP2 would leave it)."""

    param: nn.Parameter
    new: torch.Tensor
    held: torch.Tensor | None
    home: torch.Tensor | None
    device: torch.Tensor | None = None  # the home's value on the GPU once written, to offer (resident_grads)


@dataclass
class _Job:
    """Work for the worker: a block's gradients to sum, or to move into their homes."""

    pairs: list[_Pair]
    event: Any  # after it, FSDP2's copies of the new gradients have landed; None on the CPU
    nbytes: int  # of the held gradients summed
    summed: bool  # on the device already (``new`` holds the sum): the worker only moves it into the home
    resident: dict[int, torch.Tensor] | None = None  # the pairs' ``device`` sums, chosen to keep (KeptSums)


def _fits(home: torch.Tensor, new: torch.Tensor, held: torch.Tensor | None) -> bool:
    """Whether ``new`` can be kept in ``home``: its size and dtype, and the held gradient (if any) is the home."""
    local = local_shard(new)
    if home.shape != local.shape or home.dtype != local.dtype:
        return False
    return held is None or local_shard(held).data_ptr() == home.data_ptr()


class HostAccumulation:
    """Sums an offloaded model's gradients across micro-batches on a worker thread. ``units``: each FSDP2
    module with the parameters it manages (its own, not a nested unit's); ``root``: the model."""

    def __init__(self, root: nn.Module, units: Iterable[tuple[nn.Module, list[nn.Parameter]]],
                 homes: dict[int, torch.Tensor] | None = None) -> None:  # fmt: skip
        """``homes``: by ``id(param)``, where each parameter's gradient is kept (its local shape and dtype)."""
        self._homes = homes if homes is not None else {}  # the caller's dict: a cast lays them out again
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=MAX_PENDING)
        self._pending: _Held | None = None  # the block last reduced: FSDP2 sets its new gradients after its hook
        self._error: BaseException | None = None
        self.kept = KeptSums(self)  # which sums backward keeps on the GPU for the clip (resident_grads)
        self.backward_end_hooks: list[Callable[[], None]] = []  # called once at each backward's end, after the sums
        self._ended: int | None = None  # autograd's id of the last backward whose end called them
        self._lock = OwnedLock("offloaded model")  # every call refuses in a forked child: the worker is the parent's
        self._counts = {
            "blocks_summed": 0,
            "bytes_summed": 0,
            "bytes_summed_on_device": 0,
            "bytes_summed_from_kept": 0,
            "bytes_held_up": 0,
            "bytes_reduced": 0,
            "bytes_homed": 0,
            "worker_s": 0.0,
            "end_wait_s": 0.0,
        }
        self._worker = threading.Thread(target=self._run, name="tiered-grad-sum", daemon=True)
        self._worker.start()
        _live.add(self)
        self._root = weakref.ref(root)
        self._pass_settings: Settings | None = None  # FSDP2's settings as the last forward began (failed_pass.settings)
        self._unended: str | None = None  # why a failed pass's end raised part-way: refused until zero_grad
        self._param_ids: set[int] = set()
        for module, params in units:
            module.set_all_reduce_hook(self._hook_for(module, params))  # type: ignore[operator]
            self._param_ids.update(id(p) for p in params)
        # Before FSDP2's own hooks (prepend): a pass that failed part-way is put behind before FSDP2 starts anew.
        root.register_forward_pre_hook(lambda *_: self._before_forward(), prepend=True)
        zero_grad = root.zero_grad

        def settled_zero_grad(set_to_none: bool = True) -> None:
            self.settle()
            forget_failed_pass(root)
            self._unended = None  # the batch skipped: what could not be ended is dropped with it
            resident_grads.drop(self)  # new gradients come next: the copies of the last ones on the GPU go
            zero_grad(set_to_none)

        root.zero_grad = settled_zero_grad  # type: ignore[method-assign]

    def settle(self) -> None:
        """Sum what a backward that raised part-way left (nothing otherwise) and wait for the worker: every
        ``.grad`` is then what FSDP2's own accumulation would have left. Raises the worker's failure, if any."""
        self._hand_over(finished=False)
        self._wait()

    def forget_failed_pass(self, params: Iterable[torch.Tensor]) -> None:
        """An optimizer's ``zero_grad`` over ``params``: if some are this model's and its last pass failed part-way,
        FSDP2's bookkeeping of that pass is reset and its gradients on gathered weights dropped
        (offload/failed_pass.py)."""
        root = self._root()
        if root is not None and self.owns(params):
            self._lock.check()  # a parent's model in a forked child
            forget_failed_pass(root)
            self._unended = None

    def owns(self, params: Iterable[torch.Tensor] | None) -> bool:
        """Whether the model is alive and some of ``params`` (None: any) are its own."""
        return self._root() is not None and (params is None or any(id(p) in self._param_ids for p in params))

    @property
    def here(self) -> bool:
        """This process made it (not a forked child): its worker lives here."""
        return self._lock.here

    def keep_failed_pass(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Before the model's next forward, or any optimizer's step over ``params`` (None: any) if some are this
        model's: if its last pass failed part-way, its backward is ended where it stopped, the gradients it made that
        no reduction took summed in as plain ``.grad`` holds them (offload/failed_pass.py)."""
        if torch._C._current_graph_task_id() != -1:
            return  # inside a backward (a step in a post-accumulate-grad hook): that pass runs, it did not fail
        root = self._root()
        if root is None or not self.owns(params):
            return  # another model's step: its sums are not this one's to wait for (nor, in a forked child, to hang on)
        self._lock.check()  # a parent's model in a forked child: refused before anything
        if self._unended is not None:
            raise RuntimeError(f"tiered: the offloaded model's failed pass could not be ended ({self._unended}): some "
                               "of its gradients are lost, so no step or forward may use them; call model.zero_grad() "
                               "(or a TieredOptimizer's zero_grad()) to skip the batch, then run it again")  # fmt: skip
        self.settle()  # first the block a failed backward reduced last: the sums in backward's order
        # All or nothing: a Ctrl-C is held while the end runs (raised after it); an error part-way (out of memory
        # in its reduce) leaves sums taken but never handed back, refused above until zero_grad.
        with deferred_sigint():
            try:
                keep_failed_pass(root, self._pass_settings, at_step=params is not None)  # waits for the sums
            except BaseException as e:
                self._unended = f"{type(e).__name__}: {e}"
                raise

    def _before_forward(self) -> None:
        # The next forward makes new gradients: the copies of the last ones on the GPU go, unless the next
        # backward adds them into its own (SUM_FROM_KEPT). A pass that failed part-way is ended first, its
        # gradients on gathered weights summed in, as plain .grad would keep them.
        self.keep_failed_pass()
        root = self._root()
        self._pass_settings = settings(root) if root is not None else None
        if not SUM_FROM_KEPT:
            resident_grads.drop(self)

    def stop(self) -> None:
        """End the worker once it has summed what it was handed (the model is gone, or done with). Idempotent. In a
        forked child (its exit, a collection), nothing: the worker and the copies on the GPU are the parent's."""
        if not self.here:
            return
        resident_grads.drop(self)
        if self._worker.is_alive():
            self._jobs.put(None)
            if threading.current_thread() is not self._worker:
                self._worker.join(timeout=60)

    def stats(self) -> dict[str, float]:
        """Blocks and bytes summed (``bytes_summed_on_device``: of those, added on the reduce's device;
        ``bytes_summed_from_kept``: of those, added from the copies kept there, ``SUM_FROM_KEPT``), bytes of first
        gradients the worker moved into their homes, its busy seconds, and the seconds backward's end waited for
        it. The link's traffic: ``bytes_reduced``, the blocks' reduced gradients FSDP2 copies down (as its hook sees
        them, padding included), and ``bytes_held_up``, the held sums copied up to be added on the device."""
        with self._lock:
            return dict(self._counts)

    def _hook_for(self, module: nn.Module, params: list[nn.Parameter]) -> Callable[[torch.Tensor], None]:
        def hook(reduce_output: torch.Tensor) -> None:
            self._hook(module, params, reduce_output)

        return hook

    def _hook(self, module: nn.Module, params: list[nn.Parameter], reduce_output: torch.Tensor) -> None:
        # Runs on backward's thread, inside FSDP2's reduce of this block, before it copies the block's gradients.
        self._lock.check()  # a backward in a forked child of a forward the parent ran: refused before anything
        keep_until_copied(reduce_output)
        with self._lock:
            self._counts["bytes_reduced"] += reduce_output.nbytes
        backward = torch._C._current_graph_task_id()
        pending = self._pending
        # The previous block's copies are queued by now; one left by a backward that raised is summed likewise.
        self._hand_over(finished=pending is None or pending.backward == backward)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)  # type: ignore[attr-defined]
        if any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params):
            return
        held = [(p, p.grad) for p in params if p.grad is not None or id(p) in self._homes]
        if not held:
            return
        for p, _ in held:
            p.grad = None  # FSDP2 now copies this micro-batch's gradient as a first one: pinned, not waiting
        stream = torch.cuda.current_stream(reduce_output.device) if reduce_output.is_cuda else None
        nbytes = sum(g.numel() * g.element_size() for _, g in held if g is not None)
        views = flat_views(module, reduce_output) if _sums_on(reduce_output) else None
        kept = take_kept(held, reduce_output) if SUM_FROM_KEPT else {}
        summed = views is not None and add_on_device(views, reduce_output, held, kept)
        if summed and any(g is not None for _, g in held):
            self.kept.note_adding()
            from_kept = sum(c.nbytes for c in kept.values())
            with self._lock:
                self._counts["bytes_summed_from_kept"] += from_kept
                self._counts["bytes_held_up"] += nbytes - from_kept
        resident = None
        if summed and views is not None:  # only sums made on the device can stay there
            resident = self.kept.choose(views, [id(p) for p, _ in held if id(p) in self._homes], reduce_output)
        with self._lock:
            self._pending = _Held(held, stream, backward, nbytes, summed, resident)  # type: ignore[arg-type]

    def _hand_over(self, *, finished: bool) -> None:
        """The block last reduced to the worker: each new gradient FSDP2 made, with the held one to add in.
        A parameter without a new one gets its held gradient back, unless ``finished`` is False (its backward
        raised, and a None since may be a zero_grad: the held one is dropped)."""
        with self._lock:
            held, self._pending = self._pending, None
        if held is None:
            return
        pairs = []
        for p, old in held.held:
            new = p.grad
            if new is not None:
                home = self._homes.get(id(p))
                if home is not None and not _fits(home, new, old):
                    home = None  # another tensor stands in .grad (set by hand): sum as FSDP2 would
                if old is not None or home is not None:
                    device = held.resident.get(id(p)) if held.resident and home is not None else None
                    pairs.append(_Pair(p, new, old, home, device))
            elif finished and old is not None:  # no gradient this micro-batch: FSDP2 would have left the held one
                p.grad = old
        if not pairs:
            self.kept.let_go(held.resident)
            return
        event = held.stream.record_event() if held.stream is not None else None
        job = _Job(pairs, event, held.nbytes, held.summed, held.resident)
        if self._worker.is_alive():
            self._jobs.put(job)  # waits while MAX_PENDING are queued: what bounds the held memory
        else:  # stopped (the interpreter is ending): sum here rather than queue for no one
            self._sum(job)

    def _end_of_backward(self) -> None:
        # Queued by every hook; the first to run waits for all, the others find nothing left.
        self._hand_over(finished=True)
        t0 = time.perf_counter()
        self._wait()
        with self._lock:
            self._counts["end_wait_s"] += time.perf_counter() - t0
        self.kept.end_of_backward()
        backward = torch._C._current_graph_task_id()
        if backward != self._ended:
            self._ended = backward
            for hook in self.backward_end_hooks:
                hook()

    def _wait(self) -> None:
        self._jobs.join()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"tiered: summing an offloaded model's gradients failed: {error!r}") from error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            t0 = time.perf_counter()
            try:
                self._sum(job)
            except BaseException as e:  # kept for backward's end, which raises it; the worker goes on
                self._error = self._error or e
            finally:
                with self._lock:
                    self._counts["worker_s"] += time.perf_counter() - t0
                self._jobs.task_done()

    def _sum(self, job: _Job) -> None:
        try:
            self._sum_pairs(job)
        finally:
            self.kept.let_go(job.resident)

    def _sum_pairs(self, job: _Job) -> None:
        if job.event is not None:
            job.event.synchronize()
        homed = 0
        with torch.no_grad():
            for pair in job.pairs:
                new = local_shard(pair.new)
                if pair.home is None:
                    if not job.summed:  # a pair without a home holds a sum
                        new.add_(local_shard(pair.held))  # type: ignore[arg-type]
                elif pair.held is None:
                    pair.home.copy_(new)
                    pair.param.grad = sharded_like(pair.home, pair.new) if is_sharded(pair.new) else pair.home
                    homed += new.numel() * new.element_size()
                else:  # the held gradient is the home's: home += new, the bits of new + held
                    if job.summed:  # the addition ran on the device: new is the sum
                        pair.home.copy_(new)
                    else:
                        pair.home.add_(new)
                    pair.param.grad = pair.held
                if pair.device is not None and pair.home is not None:  # the home now holds what the GPU does
                    resident_grads.offer(self, pair.home, pair.device)
        with self._lock:
            self._counts["blocks_summed"] += any(p.held is not None for p in job.pairs)
            self._counts["bytes_summed"] += job.nbytes
            self._counts["bytes_summed_on_device"] += job.nbytes if job.summed else 0
            self._counts["bytes_homed"] += homed


def _sums_on(reduce_output: torch.Tensor) -> bool:
    """Whether ``SUM_ON_DEVICE`` asks for the sums on the device ``reduce_output`` lies on."""
    return SUM_ON_DEVICE is True or (SUM_ON_DEVICE is None and reduce_output.is_cuda)
