"""Ctrl-C during an optimizer step (or a load: optim/whole_load.py): finish the step, then deliver the interrupt.

A ``KeyboardInterrupt`` raised at an arbitrary bytecode inside a step would leave some chunks updated and
others not, and could land inside the store's bookkeeping between two assignments. So while a step runs
on the main thread, SIGINT is only counted; when the step ends the original handler runs (by default:
``KeyboardInterrupt`` is raised right after ``step()`` completes, with the state whole). A second Ctrl-C
asks for the step to stop at the next chunk boundary (``pressed() >= 2``): the step is then abandoned and
the optimizer marks itself broken (see ``TieredOptimizer.step``).

Call order: ``with deferred_sigint() as sigint: ... if sigint.pressed() >= 2: raise KeyboardInterrupt``. The
interrupt is raised as the block ends, so bookkeeping the work needs done (``opt.state``'s, after a step or a
load) goes inside it. Short work that must not stop part-way holds it too, with no second-press stop: a close's
release, which runs once (optim/assembly.py, kv/cache.py, the store's), and a store load's hand-over to the I/O
threads (store/host_tier.py).
Off the main thread nothing changes (Python delivers signals to the main thread only), nor where SIGINT
is ignored (``nohup``, a shell's background job): there a Ctrl-C neither interrupts nor breaks a step.

Nested blocks: one opened while another holds SIGINT (a store load's hand-over inside a step) installs nothing and
yields the outer block's ``Sigint``: every press counts where the outermost block counts them, so a second Ctrl-C
during a load's hand-over still stops the step, and the hand-over costs no handler swap.

A wait that has committed nothing yet: ``deferred_sigint(lands=waiting_for_room)`` (the store's read hand-over, over
io_engine's wait for queue room, which a stalled disk can make last for ever) lets a press arriving while
``lands()`` is true through at once, as if nothing held it, once; the others are held. A nested block's ``lands``
is ignored: the outer block decides (a step holds a press there too).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["deferred_sigint", "Sigint", "reader_gone"]


class Sigint:
    """How many SIGINTs arrived while deferred."""

    def __init__(self, lands: Callable[[], bool] | None = None) -> None:
        self.count = 0
        self._lands = lands  # while it returns True a press is let through (see the module docstring)
        self._old: Any = signal.SIG_DFL  # the handler the block replaced

    def pressed(self) -> int:
        return self.count

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._lands is not None and self._lands():
            self._lands = None  # once: the interrupt that ends the wait is on its way, and must not be overtaken
            _deliver(self._old, frame)
            return
        self.count += 1


@contextmanager
def deferred_sigint(*, lands: Callable[[], bool] | None = None) -> Iterator[Sigint]:
    sigint = Sigint(lands)
    if threading.current_thread() is not threading.main_thread():
        yield sigint
        return
    current = signal.getsignal(signal.SIGINT)
    if current in (signal.SIG_IGN, None):
        # Ignored (nohup, a shell's background job) or owned by C code: a Ctrl-C must stay without effect.
        yield sigint
        return
    outer = getattr(current, "__self__", None)
    if isinstance(outer, Sigint):  # inside another block: it counts (handing on presses here would lose some)
        yield outer
        return
    try:
        sigint._old = old = signal.signal(signal.SIGINT, sigint._handler)
    except (ValueError, OSError):  # no signal support here (e.g. an embedded interpreter)
        yield sigint
        return
    try:
        yield sigint
    finally:
        signal.signal(signal.SIGINT, old)
    if sigint.count:  # the step completed: now the interrupt, as it would have come
        _deliver(old, None)


def _deliver(old: Any, frame: FrameType | None) -> None:
    """A Ctrl-C, as the handler ``old`` would have taken it."""
    if callable(old):
        old(signal.SIGINT, frame)
    elif old == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # from inside a block, whose handler is still installed
        signal.raise_signal(signal.SIGINT)


def reader_gone() -> int:
    """A command's answer to ``BrokenPipeError`` on stdout (``... | head`` after head has exited): nothing to say
    and not a failure, so no traceback; stdout goes to /dev/null, since the interpreter's flush at exit would
    raise again. Returns 141, the shell's status for a write to a closed pipe (128 + SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141
