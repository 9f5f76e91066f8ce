"""Whether chunks update under backward: always (``update_in_backward=True``), or, for ``"auto"`` (the default
for CUDA parameters updated on the GPU), where this run's own steps show that it pays.

The update under backward (optim/under_backward/overlap.py) pays where backward lasts at least as long as the step's own
update: the state's PCIe round trip then runs beside backward's kernels instead of after them (0.94B Llama,
state in DDR: 0.68 -> 0.52 s a step at 32 x 1024 tokens). Where backward is shorter (8 x 1024: 0.34 -> 0.35 s)
it only adds its copies into spare buffers and the check at ``step()``; where most early updates are redone
(DDP, whose all-reduce runs after the hooks; a clip that fires every step), the work is wasted.

So "auto" measures before it decides. Its first ``MEASURED`` steps run without early updates; each times the
window backward leaves (from the first gradient made final to backward's end) and the step's own time (from
backward's end to the step's), both by CUDA events on the stream backward runs on: the host queues backward
ahead of the GPU, so its clocks would count part of backward as the step's. After the last of them it turns
early updates on if the window is at least the step's time, the first step (warm-up) left out. Once on, two
steps in a row that redo more than they keep turn them off for good. ``stats()`` says what was decided, and
on what figures.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["UnderBackwardSwitch"]

MEASURED = 3  # steps timed before "auto" decides; the first is warm-up (allocator, kernels compiled)
WASTED = 2  # steps in a row that redo more early updates than they keep, after which "auto" turns them off


class UnderBackwardSwitch:
    """``engaged``: whether backward's hooks start updates now. ``setting``: True or "auto"."""

    def __init__(self, setting: bool | str, *, cuda: bool) -> None:
        if setting not in (True, "auto"):
            raise ValueError(f"UnderBackwardSwitch needs True or 'auto', got {setting!r}")
        self.setting, self.cuda = setting, cuda
        self.engaged = setting is True
        self.decided = "always (update_in_backward=True)" if setting is True else ""
        self._start: Any = None  # when this backward made its first gradient final
        self._end: Any = None  # when it ended
        self._step: Any = None  # when the step began
        self._measured: list[tuple[float, float]] = []  # (window, step) of the steps timed
        self._wasted = 0

    # ------------------------------------------------------------------- on autograd's thread (lock held)
    def backward_began(self) -> None:
        if not self.decided:
            self._start, self._end = self._stamp(), None

    def backward_ended(self) -> None:
        if not self.decided and self._start is not None:
            self._end = self._stamp()

    def _stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the stream backward runs on (autograd's thread makes it current)
        return event

    # ---------------------------------------------------------------------------------- from step()
    def step_began(self) -> None:
        if not self.decided:
            self._step = self._stamp()

    def step_ended(self) -> None:
        """The step's work is done (the host has waited for it); the last backward timed was its own."""
        if self.decided or self._step is None:
            return
        end = self._stamp()
        step = self._seconds(self._step, end)
        window = 0.0 if self._start is None or self._end is None else self._seconds(self._start, self._end)
        self._start = self._end = self._step = None
        self._measured.append((window, step))
        if len(self._measured) < MEASURED:
            return
        timed = self._measured[1:]  # the first step warms up
        window = min(w for w, _ in timed)
        step = max(s for _, s in timed)
        self.engaged = window >= step
        verb, cmp = ("on", ">=") if self.engaged else ("off", "<")
        self.decided = f"{verb}: backward's window {window:.3f} s {cmp} the step's {step:.3f} s"

    def _seconds(self, a: Any, b: Any) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def judged(self, kept: int, redone: int) -> None:
        """``step()`` kept ``kept`` early updates and redid ``redone``."""
        if self.setting is True or not self.engaged:
            return
        self._wasted = self._wasted + 1 if redone > kept else 0
        if self._wasted >= WASTED:
            self.engaged = False
            self.decided = f"off: {WASTED} steps in a row redid more early updates than they kept"

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"setting": self.setting, "engaged": self.engaged, "decided": self.decided or "measuring"}
        if self._measured:
            out["measured"] = [{"window_s": round(w, 4), "step_s": round(s, 4)} for w, s in self._measured]
        return out
