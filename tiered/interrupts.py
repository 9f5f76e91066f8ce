"""Ctrl-C during an optimizer step (or a load: optim/whole_load.py): finish the step, then deliver the interrupt.
The Python handlers of the signals that ask for a checkpoint or an exit (SIGTERM, SIGUSR1, SIGUSR2, SIGHUP) are
held the same way.

A ``KeyboardInterrupt`` raised at an arbitrary bytecode inside a step would leave some chunks updated and
others not, and could land inside the store's bookkeeping between two assignments. So while a step runs
on the main thread, SIGINT is only counted; when the step ends the original handler runs (by default:
``KeyboardInterrupt`` is raised right after ``step()`` completes, with the state whole). A second Ctrl-C
asks for the step to stop at the next chunk boundary (``pressed() >= 2``): the step is then abandoned and
the optimizer marks itself broken (see ``TieredOptimizer.step``).

Other signals: a preemption handler (k8s or SLURM's SIGTERM, SLURM's ``--signal=USR1``) typically saves
(``opt.state_dict()``, ``save_checkpoint``) and exits or goes on. Run between two chunks, on the thread that holds
the step's re-entrant lock, its save would read a torn state. So each of ``HELD`` that has a Python handler installed
is held too: its arrival is noted, and when the block ends its handler runs, once, after the original handlers are
back. Held signals run in the order they first came (a Ctrl-C's ``KeyboardInterrupt`` among them), each even where
one before it raised (``sys.exit`` in a SIGTERM handler; the last exception propagates). A signal that comes again
while held runs once, as the kernel merges a blocked signal's arrivals; nothing but a Ctrl-C stops the block early
(SIGKILL always ends the process). Signals left at SIG_DFL or SIG_IGN, or handled in C (faulthandler), are left
alone: nothing is installed for them. SIGALRM and the rest are never held (timeouts and watchdogs use them to break a
hang). A block that ends by an exception still runs the held handlers (never lost), though not a Ctrl-C's: the
exception is on its way already.

Call order: ``with deferred_sigint() as sigint: ... if sigint.pressed() >= 2: raise KeyboardInterrupt``. The
interrupt is raised as the block ends, so bookkeeping the work needs done (``opt.state``'s, after a step or a
load) goes inside it. Short work that must not stop part-way holds it too, with no second-press stop: a close's
release, which runs once (optim/assembly.py, kv/cache.py, the store's), and a store load's hand-over to the I/O
threads (store/host_tier.py).
Off the main thread nothing changes (Python delivers signals to the main thread only), nor where SIGINT
is ignored (``nohup``, a shell's background job): there a Ctrl-C neither interrupts nor breaks a step.

Nested blocks: one opened while another holds signals (a store load's hand-over inside a step) installs nothing and
yields the outer block's ``Sigint``: every press counts where the outermost block counts them, so a second Ctrl-C
during a load's hand-over still stops the step, and the hand-over costs no handler swap.

A wait that has committed nothing yet: ``deferred_sigint(lands=waiting_for_room)`` (the store's read hand-over, over
io_engine's wait for queue room, which a stalled disk can make last for ever) lets a press arriving while
``lands()`` is true through at once, as if nothing held it, once; the others are held. A nested block's ``lands``
is ignored: the outer block decides (a step holds a press there too). The held signals' handlers run there at once
too, each time one comes: a preemption handler that saves and exits must not wait for a disk that may never
answer, and the hand-over has changed nothing it could read.

A release in a ``finally`` (a pin's end, after a body that runs user code; a flush's after writes that may stall):
a hold opened there comes too late, as Python raises a press already pending at the first call of the ``finally``,
before that hold is in place, and the release never runs (a record pinned for good). So such a block is one
``deferred_sigint(lets_through=True)``, opened before the ``try``: ``sigint.through = True`` where signals must come
through (the body, the waits), as if nothing held them, and ``sigint.through = False`` first thing in the ``finally``,
a plain assignment that no signal can overtake, so that the release runs held and a press is raised after it. Nested
in a block that holds, such a block holds nothing of its own (the outer one decides, its ``through`` no effect); one
opened where another lets signals through installs its own. While it lets them through its handlers stay installed
(``signal.getsignal`` in a pin block names the block's), each passing a signal on at once. A release on a thread
other than the one that opened the block (a pin taken on a worker) holds nothing of the opener's: ``undo_whole``
runs it, keeping a press raised at its start for after it. A block whose release is another function's (the
``__exit__`` of a pin block, store/gpu_tier.py: its body is the caller's ``with``) names its owner
(weakly) in ``sigint.exit_of``: a press pending as that ``__exit__`` begins, before its first line turns ``through``
off, is held like one after it (Python raises such a press at a function's start, and the release would never run).

A handler installed inside a block (by a hook, or a library) stays installed when the block ends; the block restores
only the handlers it replaced where its own is still in place, on top or under other blocks' (blocks that let signals
through may end out of order: a save's writer under its pins), from where it is unlinked. Limit: ``signal.signal``
replaces a C-level handler chained in front of a Python one (``faulthandler.register(SIGUSR1, chain=True)`` after
``signal.signal(SIGUSR1, ...)``), so the first block drops such a registration; register faulthandler on a signal
without a Python handler (``faulthandler.register`` alone leaves it at SIG_DFL for Python, and nothing is held), or
after the first step.
"""

from __future__ import annotations

import _signal
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["deferred_sigint", "flagged", "undo_whole", "Sigint", "reader_gone", "HELD"]

# signal's C functions, without its wrappers' conversion of every number to an enum (thirteen a block, most of its
# cost: a block guards each pin and get of the store outside a step, KV page loads among them); they take back
# and return the same objects, and a module attribute each, so that tests can count the swaps.
_get, _swap = _signal.getsignal, _signal.signal

# Held beside SIGINT where a Python handler is installed: the signals that ask a training run to save or stop.
HELD: tuple[int, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP") if hasattr(signal, name)
)


class Sigint:
    """How many SIGINTs arrived while deferred, and which held signals came, in order."""

    ended = False  # the block is over: a handler of it still installed passes each signal on (see _release)
    through = False  # signals pass as if nothing held them, for now (``deferred_sigint(lets_through=True)``)
    # A weak reference to the object whose ``__exit__`` ends the block, where another function releases it: weak, as
    # the handler stays installed (letting presses through) when that ``__exit__`` is never called, and the object
    # must still be dropped then, its ``__del__`` releasing (store/gpu_tier.py)
    exit_of: Callable[[], object] | None = None

    def __init__(self, lands: Callable[[], bool] | None = None) -> None:
        self.count = 0
        self._lands = lands  # while it returns True a press is let through (see the module docstring)
        self._old: Any = signal.SIG_DFL  # the SIGINT handler the block replaced
        self._others: dict[int, Any] = {}  # the handlers it replaced, SIGINT's too: restored as it ends
        self._came: list[int] = []  # each held signal once, in the order they first came (SIGINT too)

    def pressed(self) -> int:
        return self.count

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Down the chain of blocks' handlers in a loop, not by calling each: a KV cache keeps a pin block open for
        # each page it holds (hundreds a request), and two frames a block ran a press into the recursion limit
        # (RecursionError in place of KeyboardInterrupt).
        block = self
        while block._passes(signum, frame):
            below = block._old if signum == signal.SIGINT else block._others[signum]
            under = getattr(below, "__self__", None)
            if not isinstance(under, Sigint):  # the first handler of no block: the user's, a hook's, the default
                if signum == signal.SIGINT:
                    _deliver(below, frame)
                else:
                    below(signum, frame)
                return
            block = under
        if signum == signal.SIGINT:
            block.count += 1
        if signum not in block._came:
            block._came.append(signum)

    def _passes(self, signum: int, frame: FrameType | None) -> bool:
        """Whether the block passes the signal on, as if nothing held it: where it lets signals through, in a wait
        that has committed nothing yet (a stalled disk), or left installed by a block whose end was cut short."""
        if self.through and not self._exiting(frame) or self.ended:
            return True
        if self._lands is not None and self._lands():
            if signum == signal.SIGINT:
                self._lands = None  # once: the interrupt that ends the wait is on its way, and must not be overtaken
            return True
        return False

    def _exiting(self, frame: FrameType | None) -> bool:
        """The block's ``__exit__`` (``exit_of``'s) has begun, under ``frame`` or as it: the block has ended, and its
        ``through`` is about to go off. Up the stack, for a profiler or tracer's function run as it begins."""
        owner = None if self.exit_of is None else self.exit_of()
        exit_code = getattr(getattr(type(owner), "__exit__", None), "__code__", None)
        while exit_code is not None and frame is not None:
            if frame.f_code is exit_code and frame.f_locals.get("self") is owner:
                return True
            frame = frame.f_back
        return False

    def _hold(self) -> None:
        """Install the handler for SIGINT (unless ignored), then each of HELD with a Python handler. SIGINT's first: a
        press while the others are swapped is counted. Python runs the handlers of signals already pending as each
        swap begins: one that raises stops the hold part-way, and the block's end puts back what it swapped."""
        current = _get(signal.SIGINT)
        if current not in (signal.SIG_IGN, None):  # ignored (nohup) or owned by C code: a Ctrl-C stays without effect
            self._old = _swap(signal.SIGINT, self._handler)
            self._others[signal.SIGINT] = self._old
        for signum in HELD:
            if callable(_get(signum)):
                self._others[signum] = _swap(signum, self._handler)

    def _release(self) -> None:
        """Put back the handlers the block replaced, SIGINT's last: until then a press is counted, where one raised
        between two swaps (SIGINT's handler back first) left the block's handler on the others for good, a SIGTERM
        swallowed and every later block taking itself for a nested one. One put back may still raise before the rest
        are (a SIGTERM's exit): what is left passes signals on once ``ended``, and the next block puts it back. One
        under another block's handler (blocks letting signals through need not end in the order they began: a save's
        pins) is unlinked from under it, or each such end would leave one handler more for good (_unlink)."""
        for signum in reversed(self._others):
            _unlink(signum, self)

    def _resend_held(self, completed: bool) -> None:
        """The held signals, sent again to the main thread (a block ended on another one): each then runs there."""
        for signum in self._came:
            if completed or signum != signal.SIGINT:
                signal.pthread_kill(threading.main_thread().ident, signum)  # type: ignore[arg-type]

    def _run_held(self, completed: bool) -> None:
        """The held signals, as their handlers would have taken them; each runs even where one before it raised."""
        came = [s for s in self._came if completed or s != signal.SIGINT]  # an exception is on its way already

        def run(i: int) -> None:
            if i < len(came):
                try:
                    if came[i] == signal.SIGINT:
                        _deliver(self._old, None)
                    else:
                        self._others[came[i]](came[i], None)
                finally:
                    run(i + 1)

        run(0)


def _unlink(signum: int, gone: Sigint | None = None) -> Any:
    """Take out of ``signum``'s chain of block handlers (each passing on to the one it replaced) ``gone``'s and every
    ended block's: such a handler only passes signals on, so the one below it takes its place, on top by a swap,
    under a live block in that block's record. All of them, down to the first handler of no block: a chain that
    kept any would grow with every out-of-order end, until a press ran into Python's recursion limit. A hook's
    handler (not a block's) ends the walk: what it passes on to is its own. Returns the handler on top."""
    above: Sigint | None = None  # the nearest live block over the handler looked at, or None where it is on top
    top = handler = _get(signum)
    while isinstance(block := getattr(handler, "__self__", None), Sigint) and signum in block._others:
        below = block._others[signum]
        if block.ended or block is gone:
            if above is None:
                _swap(signum, below)
                top = below
            else:
                above._others[signum] = below
                if signum == signal.SIGINT:
                    above._old = below
        else:
            above = block
        handler = below
    return top


def _outer_block() -> Sigint | None:
    """The block holding signals now, if any (not one letting them through); handlers left by ones that have ended
    (``Sigint._release``) are taken out of the chain on the way (_unlink)."""
    for signum in (signal.SIGINT, *HELD):
        outer = getattr(_unlink(signum), "__self__", None)
        if isinstance(outer, Sigint) and not outer.ended and not outer.through:
            return outer
    return None


@contextmanager
def deferred_sigint(*, lands: Callable[[], bool] | None = None, lets_through: bool = False) -> Iterator[Sigint]:
    """``lets_through``: the block turns ``sigint.through`` on and off (the module docstring)."""
    sigint = Sigint(lands)
    if threading.current_thread() is not threading.main_thread():
        yield sigint
        return
    outer = _outer_block()
    if outer is not None:  # inside another block: it counts (handing on presses here would lose some)
        yield sigint if lets_through else outer  # one whose ``through`` changes nothing of the outer's
        return
    completed = False
    try:
        try:
            sigint._hold()
        except (ValueError, OSError):  # no signal support here (e.g. an embedded interpreter): nothing held
            sigint._release()
        yield sigint
        completed = True  # the step completed: now the interrupt, as it would have come
    finally:
        if threading.current_thread() is not threading.main_thread():  # a pin ended on another thread: no swap
            sigint.ended = True  # here; the handlers pass signals on, and the main thread's next block puts them back
            sigint._resend_held(completed)
        else:
            try:
                sigint._release()  # also of a hold stopped part-way
            finally:
                sigint.ended = True  # whatever cut the release short, what it left installed passes signals on
                sigint._run_held(completed)


@contextmanager
def flagged(flag: list[bool]) -> Iterator[None]:
    """``flag[0]`` True while the block runs: a wait in a held block, which its ``lands=`` reads to let a press
    through there (nothing is taken during such a wait, and it may last for ever)."""
    flag[0] = True
    try:
        yield
    finally:
        flag[0] = False


def undo_whole(undo: Callable[..., object], *args: Any) -> None:
    """``undo(*args)`` run to its end with Ctrl-C held, in a ``finally`` whose block may have been opened on another
    thread (a pin taken on a worker, released on the main thread), so that no ``lets_through`` block of this thread
    holds it: the hold opened here comes only as the ``finally`` began, and a press pending then raised before it
    was in place. Such an interrupt (a ``KeyboardInterrupt``, a held handler's ``SystemExit``) is kept, the undo
    runs, and then it is raised; a press during the undo is held and raised after it. Inside a block that holds (the
    ``finally`` of a ``lets_through`` block, a step) it opens nothing. Limit: Python looks for signals as each
    function begins, so one that arrives in the instant before this function's own first line still skips it."""
    interrupt: BaseException | None = None
    while True:
        began = False
        try:
            with deferred_sigint():
                began = True
                undo(*args)
            break
        except BaseException as e:
            if began or isinstance(e, Exception):  # the undo's own error, or its held press raised as it ended
                raise
            interrupt = e  # before the hold was in place: nothing undone yet, so again
    if interrupt is not None:
        raise interrupt


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
