"""One forward at a time per offloaded model: a second thread's call while another thread's runs is refused by name.

FSDP2 gathers and frees each unit's weights in state it keeps per module (the training state, the unsharded
parameters, the order of the forward), and no lock guards it. Two threads running ``generate`` (or any forward) of
one offloaded model at once freed the weights under each other: "aten.mm.default got mixed torch.Tensor and
DTensor", setStorage errors, or wrong numbers. So the root's forward is claimed by the thread that enters it, and a
call from another thread while it is claimed raises ``RuntimeError`` before any other hook of the model runs (the
refusal is the first pre-hook), naming the fix: one forward at a time (a lock around ``generate`` in a server), or
a model per thread. Refusing rather than queueing behind a lock: the forward is not the unit of work that must be
alone (a forward with grad leaves state for its backward, which no hook brackets), and a lock held by a forward
that waits on the caller's other threads would deadlock them; the caller knows its unit of work.

The claim is released by a forward hook with ``always_call=True``, which torch runs after a forward that raised an
``Exception``, not after a ``KeyboardInterrupt`` (a Ctrl-C in a notebook's ``generate``). So the claim also holds
the frame of the torch call that made it: a claim whose frame is no longer on its thread's stack is stale (its
forward ended, however) and is taken over. Looking costs nothing while one thread calls the model.

A backward of the model running on another thread is not detected: FSDP2 marks a backward that is running and one
that raised part-way alike (offload/failed_pass.py ends the latter at the next forward), docs/offload.md.

In a forked child the claim's lock refuses (store/owner.py's ``OwnedLock``): a forward of a model the parent
offloaded raises there at once, by name, rather than wait for a lock a thread of the parent held at the fork.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

from torch import nn

from ..store.owner import OwnedLock

__all__ = ["one_forward_at_a_time"]


def one_forward_at_a_time(model: nn.Module) -> None:
    """Refuse a call of ``model`` from a thread while another thread's call of it runs. Register after every other
    forward hook of the model: the refusal is then the first pre-hook, and the release the last hook."""
    _Claim(model)


def _on_stack(frame: FrameType, top: FrameType | None) -> bool:
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


class _Claim:
    def __init__(self, model: nn.Module) -> None:
        self._lock = OwnedLock("offloaded model")  # held only to look at and set the claim: never across a forward
        self._thread: int | None = None
        self._name = ""
        self._frame: FrameType | None = None  # torch's frame that runs the claiming call's hooks
        model.register_forward_pre_hook(self._enter, prepend=True)
        model.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: nn.Module, args: Any) -> None:
        caller = sys._getframe(1)  # torch's frame of this call: on this thread's stack while the call runs
        me = threading.get_ident()
        with self._lock:
            if self._frame is not None and self._thread != me:
                if _on_stack(self._frame, sys._current_frames().get(self._thread)):  # type: ignore[arg-type]
                    raise RuntimeError(
                        "tiered: the offloaded model was called from thread "
                        f"{threading.current_thread().name!r} while thread {self._name!r} runs a forward of it: "
                        "FSDP2 gathers and frees an offloaded model's weights in per-module state that is not "
                        "thread-safe, so an offloaded model runs one forward at a time. Serve it from one thread at a "
                        "time (a threading.Lock held around each generate() or forward call), or give each thread "
                        "its own model (docs/offload.md, 'Threads')"
                    )
            elif self._frame is not None and _on_stack(self._frame, caller):
                return  # a call of the model inside its own forward, on the same thread: the outer call keeps it
            self._thread, self._name, self._frame = me, threading.current_thread().name, caller

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._lock.here:
            return  # a forked child: its _enter refused, so nothing was claimed
        caller = sys._getframe(1)
        with self._lock:
            # The frame that claimed: this call's (the normal return), or one already gone (a forward that raised:
            # torch runs this hook from the frame outside it); not an outer call's still running.
            if self._thread == threading.get_ident() and self._frame is not None and (
                self._frame is caller or not _on_stack(self._frame, caller)
            ):  # fmt: skip
                self._thread, self._name, self._frame = None, "", None
