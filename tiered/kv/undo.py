"""PassUndo: what one forward pass appended, so that a pass that breaks off part-way can be taken back.

A forward appends its tokens layer by layer. One that raises at layer k (a page load hits a full disk or a damaged
file; the model raises between layers) has appended them to layers ``0 .. k-1`` only. The errors say "fix the
cause, then retry", and the retried forward must then find each sequence as it was before the broken one, as
``DynamicCache`` would (its ``update`` raises before its ``cat``, and a retry appends once): else the layers before k
hold the tokens twice, and the logits are silently wrong.

What taking back needs. Each row's length when the pass began (every layer of a sequence is that long between
passes), and, for a slot whose partial last page filled during the pass, that page's device tensor: it was the
slot's tail, whose first tokens are the old tail's. Pages are never written again, so nothing else is kept: the
pages the pass filled are deleted, the tokens it wrote into the tail are zeroed (a tail has defined bytes past its
tokens, as ``append`` makes it), and a sequence the pass made is forgotten.

Call order: ``PassUndo(lengths, created)`` when a pass begins; ``note`` after each append; ``take_back`` after the
window has settled (no load or write in flight reads the pages it deletes); dropped when the pass ends.
"""

from __future__ import annotations

import contextlib

import torch

from ..store import TieredStore
from .layout import KVLayout
from .pages import Page, Slot

__all__ = ["PassUndo", "stopped_short"]


class PassUndo:
    def __init__(self, lengths: dict[int, int], created: set[int]) -> None:
        self.lengths = lengths  # each row's tokens when the pass began
        self.created = created  # rows the pass made (new ids): forgotten when it is taken back
        self._tails: dict[tuple[int, int], torch.Tensor] = {}  # (seq, layer): the old tail, as a filled page

    def note(self, slot: Slot, layout: KVLayout, pages: list[Page]) -> None:
        """``append`` filled ``pages`` of ``slot``: keep the first one's tensor if it began as the old tail."""
        base = self.lengths.get(slot.seq, 0)
        if pages and base % layout.page_tokens and pages[0].index == base // layout.page_tokens:
            assert pages[0].fresh is not None  # a page just filled is its device bytes
            self._tails[(slot.seq, slot.layer)] = pages[0].fresh

    def take_back(self, slots: dict[int, list[Slot]], layout: KVLayout, store: TieredStore,
                  device: torch.device | None) -> list[Page]:  # fmt: skip
        """Every row's slots back to their lengths at the pass's start; returns the pages dropped (deleted from
        the store; the window forgets them). Idempotent: a slot already back is left alone."""
        dropped: list[Page] = []
        for seq, base in self.lengths.items():
            for slot in slots.get(seq, []):
                if slot.length != base:
                    dropped += self._truncate(slot, layout, store, device, base)
            if seq in self.created and seq in slots:
                del slots[seq]  # made by this pass: the retry makes it again
        return dropped

    def _truncate(self, slot: Slot, layout: KVLayout, store: TieredStore, device: torch.device | None,
                  base: int) -> list[Page]:  # fmt: skip
        p = layout.page_tokens
        keep, off = base // p, base % p
        drop = slot.pages[keep:]
        tail = slot.tail
        if drop and off:  # the old tail filled in this pass: its tokens are the page's first ones
            tail = self._tails.get((slot.seq, slot.layer))
            if tail is None:  # not noted (append itself raised after filling it): its bytes where they are
                tail = drop[0].fresh if drop[0].fresh is not None else store.get(drop[0].key).to(device)
        for page in drop:
            page.release()
            with contextlib.suppress(KeyError):
                store.delete(page.key)
        del slot.pages[keep:]
        slot.length = base
        slot.dev_n = min(slot.dev_n, keep)
        if off:
            assert tail is not None  # a slot with tokens past its pages has a tail
            tail[:, :, off:].zero_()
        slot.tail = tail if off else None
        return drop


def stopped_short(at: int, layers: int, again: bool) -> ValueError:
    """The error of a forward pass that stopped after ``at`` of ``layers`` layers with no error in the cache (taken
    back): the model raised part-way, or it has ``at`` layers (``again``: the pass before stopped there too, so
    that is the likelier cause). ``at == layers``: it was refused past them, and stopped as it was taken back."""
    if at >= layers:  # the pass ran every layer, then the model updated one more: refused (passes.py, ``beyond``)
        return ValueError(f"the last forward pass, refused for updating a layer past the {layers} this cache's config "
                          f"has, was stopped before its tokens were taken back out of layers 0..{layers - 1}; they "
                          "are now: run this forward again (and, for that model, build a TieredCache from its own "
                          "config, TieredCache(model.config, ...))")  # fmt: skip
    fix = (f"build this TieredCache from the model's own config, TieredCache(model.config, ...): the config has "
           f"{layers} layers (config.num_hidden_layers)")  # fmt: skip
    if again:
        return ValueError(f"forward passes keep stopping after {at} of the {layers} layers this cache was built for, "
                          f"with no error in the cache: the model has {at} layers; {fix}. (If instead each of them "
                          f"raised in the model at layer {at}, their tokens were taken back: run this forward again "
                          "now.)")  # fmt: skip
    twice = (" If this forward updates layer 0 twice (an encoder-decoder model's cross-attention), give it "
             "EncoderDecoderCache(TieredCache(...), DynamicCache())") if at == 1 else ""  # fmt: skip
    return ValueError(f"the last forward pass stopped after {at} of the {layers} layers this cache was built for, "
                      f"with no error in the cache; its tokens were taken back out of layers 0..{at - 1}. If that "
                      f"forward raised part-way (in the model), run it again now. If the model has {at} layers, "
                      f"{fix}.{twice}")  # fmt: skip
