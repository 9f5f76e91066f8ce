"""ForwardPasses: a TieredCache's forward passes, the one under way and what the ones before it showed.

A pass starts at layer 0 and updates each layer once, in order; ``at`` is the next layer of the pass under way
(None between passes) and ``undo`` what it appended (undo.py). A pass that breaks off is taken back: one that raised
in the cache at once (``take_back_after``), one that raised in the model, out of the cache's sight, by the next
pass's layer 0 (``broken_off``), which then says so where it matters, from what the passes before showed
(``whole_seen``: one ran every layer; ``short_at``: where the last to stop short stopped; ``unsaid``: the rows the
passes that stopped short before any whole one gave back, not yet refused). A pass is whole once its last layer is
updated: one that raised in the model after that (lm_head) keeps its tokens, as DynamicCache does, for its run again
comes as the next pass would (positions from the lengths) and cannot be told from it. Unless the model goes on to a
layer past the config's (it has more): that update is refused, and the pass taken back (``beyond``), from ``last``,
``at`` the config's layer count until it is (a take-back that raised, a Ctrl-C included, is the next pass's).
A pass whose layer update raised stays under way (``at`` past that layer, the last one's too) until it is taken
back; ``raised`` names that layer, so that the next pass, if it has to take it back, says it raised in the cache.

This module exists so that cache.py keeps the sequences, the public calls and each layer's update, and this one
the passes' own bookkeeping and their taking back, each read in one sitting.

Call order (TieredCache, under its lock): ``ForwardPasses(store, layout, window, slots)`` once; at layer 0 of a
pass, ``broken_off(rows, closed)`` if ``at`` is not None, then ``begin(undo)`` as the pass begins; ``at`` advanced
per layer, and at the last layer ``whole()``; ``take_back_after(error, closed, layer)`` where a layer update raised,
``beyond(refused, closed)`` (returns the error to raise) where the model updated a layer the config lacks; a freed
sequence leaves ``unsaid``; a swap_out leaves ``last`` (``swapped``: its tails are stored and checksummed, the
user's now).
"""

from __future__ import annotations

import warnings

from ..store import TieredStore
from .layout import KVLayout
from .pages import Slot
from .undo import PassUndo, stopped_short
from .window import Window

__all__ = ["ForwardPasses"]


class ForwardPasses:
    def __init__(self, store: TieredStore, layout: KVLayout, win: Window, slots: dict[int, list[Slot]]) -> None:
        """``slots``: the cache's sequences, shared (a take-back truncates them, and forgets those a pass made)."""
        self._store, self._layout, self._win, self._slots = store, layout, win, slots
        self.at: int | None = None  # the next layer of the forward pass under way; None between passes
        self.undo: PassUndo | None = None  # what the pass under way appended (undo.py)
        self.short_at: int | None = None  # where the last pass that stopped short stopped, unexplained
        self.whole_seen = False  # whether a pass ever ran every layer (then none stops short for want of layers)
        self.unsaid: set[int] = set()  # rows passes that stopped short, before any whole one, gave back unsaid
        self.last: PassUndo | None = None  # the pass that just ran the config's last layer: the lengths before it
        self.kept: set[int] = set()  # rows of ``last`` swapped out since: its tokens stay in them
        self.raised: int | None = None  # the layer whose update raised, while its pass is not yet taken back

    def begin(self, undo: PassUndo) -> None:
        self.undo, self.last, self.raised = undo, None, None
        self.kept.clear()

    def swapped(self, seq: int) -> None:
        """``seq`` was swapped out between passes: its stored tails and checksums hold the tokens of ``last`` now,
        so a take-back of ``last`` leaves it (the other rows it still takes back) and says so."""
        if self.last is not None and seq in self.last.lengths:
            del self.last.lengths[seq]
            self.last.created.discard(seq)
            self.kept.add(seq)

    def whole(self) -> None:
        """The pass updated the config's last layer: whole, unless the model updates another (``beyond``). Kept of
        it until then: its rows' lengths and the sequences it made, not the old tails, device memory the window
        does not count (a take-back reads them back out of the pages they filled)."""
        if self.undo is not None:
            self.last = PassUndo(self.undo.lengths, self.undo.created)
        self.undo, self.short_at, self.whole_seen, self.at = None, None, True, None

    def beyond(self, refused: str, closed: bool) -> ValueError:
        """The model updated a layer past the config's last, refused (``refused``, the error's message, returned):
        the layers before had stored its tokens, which a retry would store again. Take back the pass, the one under
        way or the one just whole, but for its rows swapped out since (``kept``), which the error names."""
        if self.at is None:
            self.undo = self.last
            if self.undo is not None:  # under way until taken back: a Ctrl-C in the take-back's wait leaves it to
                self.at = self._layout.layers  # the next pass's layer 0, as for a layer update that raised
            if self.kept:
                seqs = sorted(self.kept)
                refused += (f". This forward's tokens stay in sequences {seqs}, swapped out after it stored them: "
                            f"free() each and recompute it (the other rows' were taken back)")  # fmt: skip
        error = ValueError(refused)
        self.take_back_after(error, closed)
        return error

    def take_back(self, closed: bool) -> list[int]:
        """Take the tokens of the pass that broke off back out of the layers it appended them to (undo.py), once
        nothing in flight reads its pages; returns the rows that held some. ``closed``: the cache is closed."""
        undo = self.undo
        if undo is not None and not closed:
            self._win.settle(check=False)  # its errors are for the forward that meets them, not this one
            rows = [s for s, n in undo.lengths.items() if s in self._slots and self._slots[s][0].length != n]
            self._win.writes.forget(undo.take_back(self._slots, self._layout, self._store, self._win.device))
        else:
            rows = []
        self.undo, self.at, self.last, self.raised = None, None, None, None
        self.kept.clear()
        return rows

    def take_back_after(self, error: BaseException, closed: bool, layer: int | None = None) -> None:
        """A layer update raised (``layer``'s; None: ``beyond``'s refusal): the forward stops here, and the caller
        may fix the cause and run it again."""
        self.raised = layer
        try:
            self.take_back(closed)
        except Exception as e:  # the pass stays under way: the next forward's layer 0 tries again
            note = (f"TieredCache: taking this forward's tokens back out of the cache failed too ({e!r}); free() its "
                    "sequences and recompute them")  # fmt: skip
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(note)
            else:  # pragma: no cover - Python 3.10
                warnings.warn(note, RuntimeWarning, stacklevel=4)

    def broken_off(self, now: set[int], closed: bool) -> None:
        """Layer 0, while the last pass is still under way: it stopped with no error in the cache. Either the
        model raised part-way (the tokens it computed from the cache's lengths, which then held the broken pass's
        tokens, are wrong), or the model has fewer layers than the config: take the pass back, and say so where
        this pass runs rows that one changed (a server that moved on to other sequences goes on: their lengths
        are right). Before any pass ran whole, the model may have fewer layers, and then the passes that stopped
        short returned with no error, their tokens taken back unsaid: a pass over any of their rows is refused
        too, once, naming the layer count where the last two stopped at one layer (or that they raised there). A
        pass over other rows goes on: two requests that raised at one layer say nothing of a third. ``now``: this
        pass's rows, taken before the take-back forgets the sequences the broken pass made."""
        at, raised = self.at or 0, self.raised
        rows = set(self.take_back(closed))
        if not rows:
            return  # its rows were freed: nothing of it is left
        if raised is not None:  # it raised in the cache, not in the model: it says nothing of the layer count
            if now & rows:
                raise ValueError(f"the last forward pass raised in its update of layer {raised} and was stopped "
                                 f"before its tokens were taken back out of layers 0..{raised}; they are now: run "
                                 "this forward again")  # fmt: skip
            return
        if self.whole_seen:  # a pass ran every layer: the model has them all, so this one raised in the model
            if now & rows:
                raise stopped_short(at, self._layout.layers, False)
            return
        again, self.short_at = self.short_at == at, at
        self.unsaid |= rows
        told = now & self.unsaid
        if told:
            self.unsaid -= told
            raise stopped_short(at, self._layout.layers, again)
