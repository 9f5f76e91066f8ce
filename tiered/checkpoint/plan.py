"""What a checkpoint sees of a chunked optimizer state, and where each of its elements goes in the row files.

The checkpoint code never imports the optimizer (imports point down: tiered.optimizer -> tiered.checkpoint
-> tiered.store.scan / tiered.store). It sees ``ChunkedState``: the few members that ``save_checkpoint`` and
``load_checkpoint`` use, which ``TieredOptimizer`` offers as ``opt.chunked_state`` (tiered/optim/state_chunks.py:
the one object that state dicts and the update under backward see too). A test fake or another chunked optimizer
may provide them too. ``check_chunked_state`` is the structural check at the
public boundary: a torch optimizer, say, is refused by name with the way out.

The layout (save and load plan it the same way, so they agree by construction):

    optimizer_params(state)        the parameters in the state's order, laid end to end: one ParamEntry each
                                   (name, shape, dtype, first row-file element, numel, group, step count)
    chunk_runs(chunk, first_of)    a chunk's pieces as maximal runs contiguous in the chunk and in the row
                                   files: one pwrite (save) or pread (load) per run and row

Row file elements are keyed by parameter, not by chunk, so a checkpoint loads into any chunk size.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..layout.chunking import Chunk
from ..store.records import Tier
from .manifest import ParamEntry, dtype_name

__all__ = [
    "ChunkStore",
    "ChunkedState",
    "Run",
    "check_chunked_state",
    "own_load",
    "own_save",
    "chunk_runs",
    "optimizer_params",
    "mismatches",
    "mismatch_fix",
    "is_positional",
]


class ChunkStore(Protocol):
    """What a pass over the chunks asks of their store: ``tiered.store.scan``'s read-ahead, then pin and retire.

    Call order per pass: ``is_resident`` (once per key, by the read-ahead), ``prefetch``; per chunk
    ``with pin(key) as record: ...`` and ``info(key).tier`` (``tiered.store.scan.pinned_in_host``), then
    ``retire(key)``. ``tiered.TieredStore`` is one.
    """

    def is_resident(self, key: str) -> bool: ...

    def info(self, key: str) -> Any: ...

    def prefetch(self, keys: Iterable[str]) -> object: ...

    def pin(self, key: str, tier: Tier | None = None) -> AbstractContextManager[torch.Tensor]: ...

    def retire(self, key: str) -> object: ...


class ChunkedState(Protocol):
    """An optimizer's state as fp32 chunks in a ``ChunkStore``: exactly what save and load use.

    Read by both: ``closed``, ``param_names`` / ``params`` (the flat parameter order, names key the
    checkpoint), ``param_groups`` (the torch list of dicts; a load updates its hyperparameters in place),
    ``step_counts``, ``chunks`` and ``prefetch_depth``. Save also reads ``global_step``, ``chunk_bytes``,
    ``host_budget``, ``store`` and each pinned record through ``chunk_state_rows``; load writes through
    ``install_chunk_rows`` and ``set_step_counts``. The caller holds the state still (no step runs) throughout.
    """

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def closed(self) -> bool: ...

    @property
    def param_names(self) -> Sequence[str]: ...

    @property
    def params(self) -> Sequence[torch.Tensor]: ...

    @property
    def step_counts(self) -> Sequence[int]: ...

    @property
    def global_step(self) -> int: ...

    @property
    def chunks(self) -> Sequence[Chunk]: ...

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def host_budget(self) -> int: ...

    @property
    def prefetch_depth(self) -> int: ...

    @property
    def store(self) -> ChunkStore: ...

    def set_step_counts(self, counts: list[int], global_step: int) -> None:
        """Restore the per-parameter step counts (``params`` order) and the global step."""

    def chunk_state_rows(self, chunk: Chunk, record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of a chunk whose ``record`` is pinned in host memory, each fp32
        ``[chunk.numel]``; kept alive and unchanged by the caller until their writes have landed."""
        ...

    def install_chunk_rows(self, chunk: Chunk, rows: torch.Tensor) -> Any:
        """Replace a chunk's state with fp32 ``rows`` (3, numel) and set its parameters from the masters.
        Returns a CUDA event after which ``rows`` may be reused, or None (reusable now)."""
        ...


def _members(protocol: type) -> tuple[str, ...]:
    """A protocol's public members (its annotations, properties and methods), in definition order."""
    names = [*getattr(protocol, "__annotations__", {}), *vars(protocol)]
    return tuple(dict.fromkeys(n for n in names if not n.startswith("_")))


STATE_MEMBERS = _members(ChunkedState)
_POSITIONAL = re.compile(r"^group\d+\.param\d+$")
_MISSING = object()


def check_chunked_state(opt: object) -> ChunkedState:
    """``opt``'s state if it has every member of ``ChunkedState`` and is open, else a TypeError / RuntimeError
    that says what to do. ``opt`` is such a state, or offers one as ``opt.chunked_state`` (a TieredOptimizer
    does). Members are looked up statically: no property runs, so checking changes nothing."""
    if inspect.getattr_static(opt, "chunked_state", _MISSING) is not _MISSING:
        opt = getattr(opt, "chunked_state")  # noqa: B009  # a property: the optimizer's state of now
    missing = [n for n in STATE_MEMBERS if inspect.getattr_static(opt, n, _MISSING) is _MISSING]
    if missing:
        lacks = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise TypeError(
            f"expected a tiered.TieredOptimizer, got {type(opt).__name__} (it lacks {lacks} of the members of "
            "tiered.checkpoint.plan.ChunkedState); for torch optimizers use tiered.checkpoint.import_torch_state_dict"
        )
    state: ChunkedState = opt  # type: ignore[assignment]  # checked member by member just above
    if state.closed:
        raise RuntimeError("this TieredOptimizer is closed; checkpoints are saved from (and loaded into) an open one")
    return state


def own_load(opt: object) -> Callable[..., dict[str, Any]] | None:
    """``opt.load_checkpoint`` where ``opt`` offers its state as ``chunked_state`` and loads checkpoints itself (a
    TieredOptimizer: under its lock, all or nothing, state for its frozen parameters laid out first), else None:
    ``opt`` is a state, which ``load_checkpoint`` loads into. The function form of a load goes through the optimizer's
    own, so there is one way to load into an optimizer."""
    return _own(opt, "load_checkpoint")


def own_save(opt: object) -> Callable[..., str] | None:
    """``opt.save_checkpoint`` where ``opt`` offers its state as ``chunked_state`` and saves checkpoints itself (a
    TieredOptimizer: under its lock, refused while broken, writes through ``opt.state[p]`` taken in, collectively
    under FSDP2), else None: ``opt`` is a state, which ``save_checkpoint`` saves. As ``own_load``: one way to save."""
    return _own(opt, "save_checkpoint")


def _own(opt: object, method: str) -> Callable[..., Any] | None:
    if inspect.getattr_static(opt, "chunked_state", _MISSING) is _MISSING:
        return None
    own = getattr(opt, method, None)
    return own if callable(own) else None


@dataclass(frozen=True)
class Run:
    """Elements ``[chunk_start, chunk_start + numel)`` of a chunk row are elements ``[first, first + numel)``
    of the row files."""

    chunk_start: int
    first: int
    numel: int

    @property
    def in_chunk(self) -> slice:
        """Its span of the chunk's row: ``row[run.in_chunk]``."""
        return slice(self.chunk_start, self.chunk_start + self.numel)


def optimizer_params(state: ChunkedState) -> list[ParamEntry]:
    """The state's parameters in its own order, laid end to end (how a checkpoint holds them)."""
    group_of = [gi for gi, g in enumerate(state.param_groups) for _ in g["params"]]
    steps = state.step_counts
    out, offset = [], 0
    for i, (name, p) in enumerate(zip(state.param_names, state.params)):
        out.append(ParamEntry(name, tuple(p.shape), dtype_name(p.dtype), offset, p.numel(), group_of[i], int(steps[i])))
        offset += p.numel()
    return out


def chunk_runs(chunk: Chunk, first_of_param: list[int], skip: list[bool] | None = None) -> list[Run]:
    """``chunk``'s pieces as maximal runs that are contiguous both in the chunk and in the row files.

    ``first_of_param[i]``: the row-file element where parameter ``i`` (in the state's order) starts; ``skip[i]``:
    parameter ``i`` is not in the row files (no state there), and has no run.
    """
    runs: list[Run] = []
    for pc in chunk.pieces:
        if skip is not None and skip[pc.param]:
            continue
        first = first_of_param[pc.param] + pc.param_start
        last = runs[-1] if runs else None
        if last and last.chunk_start + last.numel == pc.chunk_start and last.first + last.numel == first:
            runs[-1] = Run(last.chunk_start, last.first, last.numel + pc.numel)
        else:
            runs.append(Run(pc.chunk_start, first, pc.numel))
    return runs


def holds_no_state(saved: ParamEntry) -> bool:
    """A checkpoint's entry for a parameter frozen at the save (empty, never stepped): it loads into a parameter
    of any shape as no state, which starts fresh (master = the parameter, zero moments, step 0), as torch's AdamW
    starts a parameter its loaded state dict holds nothing for."""
    return saved.shape == (0,) and saved.step == 0


def loads_as_no_state(saved: ParamEntry, here: tuple[int, ...]) -> bool:
    """A checkpoint's entry that loads as no state into a parameter of shape ``here``: one that holds none
    (``holds_no_state``), or one never stepped (trainable when the state was laid out, frozen before any step) into
    a parameter that has no elements of state here (the stand-in of one frozen here, or a zero-size one). Nothing
    of it is installed (its rows are read for their CRCs alone), as load_state_dict installs nothing for an entry
    torch's AdamW never stepped, and a frozen parameter keeps its weights."""
    return holds_no_state(saved) or (saved.step == 0 and math.prod(here) == 0)


def mismatches(
    mine: list[ParamEntry], saved: dict[str, ParamEntry], saved_groups: int | None, groups_here: int
) -> list[str]:
    """Every difference between the optimizer's parameters and the checkpoint's, one line each.

    ``saved_groups``: the checkpoint's param-group count when groups must match too, else None; ``groups_here``:
    the optimizer's (``len(param_groups)``: an empty group, which no parameter names, counts).

    A name on one side only is no difference where it holds no state: the empty stand-in of a parameter frozen
    here (``holds_no_state``), or a checkpoint's entry never stepped (frozen at the save, or an import of a torch
    optimizer given every parameter, frozen ones too). Either loads as no state, as torch's AdamW takes a state
    dict with or without entries it never stepped, so one model's checkpoints load into an optimizer built from
    the module (frozen parameters left out) or from a parameter list (kept as stand-ins) alike.
    """
    out = []
    names = {p.name for p in mine}
    for p in mine:
        s = saved.get(p.name)
        if s is None:
            if not holds_no_state(p):  # a parameter that trains here: the checkpoint must hold it
                out.append(f"{p.name!r} {list(p.shape)}: in this optimizer, not in the checkpoint")
        elif s.shape != p.shape and not loads_as_no_state(s, p.shape):
            # Empty here, state there: a TieredOptimizer's stand-in for a frozen parameter, which its load (the
            # method, or the function given the optimizer) lays out first; a load given its state alone cannot.
            stand_in = p.shape == (0,) and math.prod(s.shape) > 0
            why = " (frozen here? load into the optimizer, not its chunked_state)" if stand_in else ""
            out.append(f"{p.name!r}: shape {list(s.shape)} in the checkpoint, {list(p.shape)} here{why}")
        elif saved_groups is not None and s.group != p.group:
            out.append(f"{p.name!r}: param group {s.group} in the checkpoint, {p.group} here")
    out += [
        f"{n!r} {list(s.shape)}: in the checkpoint, not in this optimizer"
        for n, s in saved.items()
        if n not in names and s.step > 0  # state this optimizer would drop; one never stepped holds none
    ]
    if saved_groups is not None and saved_groups != groups_here:
        out.append(f"{saved_groups} param groups in the checkpoint, {groups_here} here")
    return out


def is_positional(name: str) -> bool:
    """A name an optimizer built from a parameter list gives (``group{g}.param{i}``), which no model has."""
    return _POSITIONAL.match(name) is not None


def mismatch_fix(mine: list[str], saved: list[str]) -> str:
    fix = (
        "Build the optimizer on the model the checkpoint was saved from (the same names and shapes of the "
        "parameters with state; frozen ones, which hold none, may be left out or kept), or pass hparams='keep' "
        "when only the param groups differ."
    )
    if all(map(is_positional, mine)) != all(map(is_positional, saved)):
        fix += (
            " Names like 'group0.param3' come from an optimizer built from a parameter list: build both from "
            "the nn.Module, so that parameters carry their names."
        )
    return fix
