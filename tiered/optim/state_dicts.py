"""torch's view of a TieredOptimizer's state, without pulling the whole state into memory.

- ``export_state_dict(opt)``: ``state_dict()``'s per-parameter tensors in torch.optim.AdamW's layout. They are
  files in the optimizer's folder on NVMe, one a tensor, memory-mapped (MAP_SHARED) and unlinked at once, so
  they take disk, not RAM: the kernel pages them in as ``torch.save`` reads them and may drop them again;
  the disk space returns when the tensor is gone. The state streams into the files one chunk at a time,
  within ``host_budget``.
- ``parse_state_dict(opt, sd)``: a torch-layout dict checked against the optimizer before anything changes;
  ``TieredOptimizer.load_state_dict`` then streams it in chunk by chunk.
- ``scatter_state(opt, rows)``: such rows streamed into the chunks; the parameters are left as they are.
- ``LazyState``: ``opt.state[p]`` reads one parameter's state on access.

A backing file that cannot be made (a full disk, a quota) raises ``StateDictFileError`` before any state is
read, naming the file, the bytes it and the whole dict needed and the room left; the files made so far are
given back and the optimizer is unchanged.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from io_engine import format_size

from ..arguments import check_group
from ..layout.chunking import Chunk
from ..store.workdir import EXPORT_PREFIX
from .state_chunks import StateChunks

__all__ = ["export_state_dict", "parse_state_dict", "scatter_state", "load_state", "read_param_state", "LazyState",
           "with_hooks", "load_with_hooks", "StateDictFileError"]  # fmt: skip
MOMENTS = ("exp_avg", "exp_avg_sq")


def _names(p: torch.Tensor) -> tuple[str, ...]:
    # An fp32 parameter is its own master; a lower-precision one has an fp32 master worth keeping.
    return MOMENTS if p.dtype == torch.float32 else (*MOMENTS, "master")


class StateDictFileError(OSError):
    """A file that ``state_dict()`` keeps its tensors in could not be made (``errno``, ``filename``: which one)."""

    def __init__(self, err: OSError, path: str, what: str, size: int, total: int, folder: str):
        try:
            st = os.statvfs(folder)
            free = f"{format_size(st.f_bavail * st.f_frsize)} free there"
        except OSError:
            free = "its free space unknown"
        self.size, self.total = size, total
        super().__init__(
            err.errno,
            f"state_dict() could not make {path} ({format_size(size)}, for {what}): {err.strerror}. Its tensors are "
            f"files in the optimizer's folder, {format_size(total)} for the whole state dict, {free}. Free space "
            "on that disk, or give nvme_path a disk with room for the state dict beside the state; the optimizer "
            "is unchanged",
            path,
        )


def _mapped(folder: str, numel: int) -> tuple[torch.Tensor, str]:
    """An fp32 tensor backed by a new file in ``folder``, unlinked at once, and the file's path.

    The blocks are allocated up front, so a full disk raises ENOSPC here, rather than killing the process
    with SIGBUS when a page of the mapping is first written."""
    fd, path = tempfile.mkstemp(prefix=EXPORT_PREFIX, suffix=".bin", dir=folder)
    try:
        try:
            os.posix_fallocate(fd, 0, numel * 4)
        except OSError as e:  # posix_fallocate's error names no file
            raise OSError(e.errno, e.strerror, path) from e
        return torch.from_file(path, shared=True, size=numel, dtype=torch.float32), path
    finally:
        os.close(fd)
        os.unlink(path)


def _backing_files(opt: StateChunks, wanted: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """One file a tensor, each shaped like its parameter. On failure the files made so far go (the tensors are
    dropped) and StateDictFileError says which file, and how much the whole dict needed."""
    params = opt.params
    total = sum(4 * params[i].numel() * len(_names(params[i])) for i in wanted)
    views: dict[int, dict[str, torch.Tensor]] = {}
    for i in wanted:
        p, views[i] = params[i], {}
        for name in _names(p):
            if p.numel() == 0:
                views[i][name] = torch.empty(p.shape, dtype=torch.float32)
                continue
            try:
                views[i][name] = _mapped(opt.workdir, p.numel())[0].view(p.shape)
            except OSError as e:
                views.clear()  # unmaps the files made so far: their space returns before the error is read
                path = e.filename if isinstance(e.filename, str) else os.path.join(opt.workdir, EXPORT_PREFIX + "*")
                what = f"{name} of {opt.param_names[i]!r}"
                raise StateDictFileError(e, path, what, 4 * p.numel(), total, opt.workdir) from e
    return views


def export_state_dict(opt: StateChunks, indices: list[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """``state`` of torch's layout for the parameters ``indices`` (default: all) that have taken a step."""
    params, steps = opt.params, opt.step_counts
    wanted = [i for i in (range(len(params)) if indices is None else indices) if steps[i] > 0]
    # One mapping a tensor, not views of one: torch cannot deepcopy DTensors (FSDP2) whose local tensors share
    # a storage ("invalid python storage"), and frameworks deepcopy state dicts.
    views = _backing_files(opt, wanted)

    def copy(chunk: Any, record: torch.Tensor) -> None:
        rows = dict(zip(("master", *MOMENTS), opt.chunk_state_rows(chunk, record)))
        for pc in chunk.pieces:
            for name, dst in views.get(pc.param, {}).items():
                src = rows[name][pc.in_chunk]
                dst.view(-1)[pc.in_param].copy_(src)

    opt.for_each_chunk([c for c in opt.chunks if any(pc.param in views for pc in c.pieces)], copy, "state_dict()")
    return {i: {"step": torch.tensor(float(steps[i])), **d} for i, d in views.items()}


Rows = list[list[torch.Tensor | None]]  # [master | exp_avg | exp_avg_sq][parameter], None where absent


def parse_state_dict(
    opt: StateChunks, sd: Any, shapes: list[torch.Size] | None = None
) -> tuple[Rows, list[int], list[dict]]:
    """Check ``sd`` against ``opt``; returns (rows[master|exp_avg|exp_avg_sq][param], steps, group settings).
    Raises ValueError/TypeError naming the problem before anything is changed. ``shapes``: the (local) shape of
    each parameter, where a frozen one's is not its empty placeholder's (param_set.lay_out_loaded)."""
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    state = sd.get("state") if isinstance(sd, dict) else None
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise ValueError("state_dict must have 'state' (dict) and 'param_groups' (list), as torch optimizers make")
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(groups)} param groups, this optimizer has {len(opt.param_groups)}")
    settings = []
    for gi, (mine, theirs) in enumerate(zip(opt.param_groups, groups)):
        if not isinstance(theirs, dict) or not isinstance(theirs.get("params"), list):
            raise ValueError(f"param group {gi} of the state_dict is not a dict with a 'params' list")
        if len(theirs["params"]) != len(mine["params"]):
            raise ValueError(f"param group {gi} has {len(theirs['params'])} params in the state_dict, "
                             f"{len(mine['params'])} here")  # fmt: skip
        new = {k: v for k, v in theirs.items() if k != "params"}
        check_group({**mine, **new}, f"param group {gi} of the state_dict")
        settings.append(new)
    ids = [pid for g in groups for pid in g["params"]]
    rows: Rows = [[None] * len(opt.params) for _ in range(3)]
    steps = [0] * len(opt.params)
    for i, (pid, p) in enumerate(zip(ids, opt.params)):
        s = state.get(pid)
        if not s:
            continue
        shape = p.shape if shapes is None else shapes[i]
        name = opt.param_names[i]
        if "max_exp_avg_sq" in s:
            raise ValueError(f"the state of {name!r} has max_exp_avg_sq (amsgrad=True), which TieredOptimizer does "
                             "not support")  # fmt: skip
        for r, key in enumerate(("master", *MOMENTS)):
            t = s.get(key)
            if t is None and key != "master":
                raise ValueError(f"the state of {name!r} has no {key!r}: it is not an AdamW state")
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != shape or not t.is_floating_point()):
                what = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{key} of {name!r} is {what}; the parameter has shape {tuple(shape)}")
            rows[r][i] = t
        step = float(s.get("step", -1))
        if not (math.isfinite(step) and step >= 0 and step == int(step)):
            raise ValueError(f"the step count of {name!r} is {s.get('step')!r}: it must be a whole number >= 0")
        steps[i] = int(step)
    return rows, steps, settings


def scatter_state(opt: StateChunks, rows: list[list[torch.Tensor | None]], fresh: list[bool] | None = None) -> None:
    """Overwrite state rows; a missing master row is taken from the parameter, a missing moment is 0.

    The parameters are left as they are, as torch.optim.AdamW's load leaves them. A loaded master that no longer
    rounds to its bf16/fp16 parameter's value is then a write to the parameter since (the user's, made before or
    after the load), which wins at the next step as any write between steps does (ChunkUpdater.sync_masters): so
    ``model.load_state_dict(weights); opt.load_state_dict(sd)`` keeps the weights, and in either order the
    masters keep their precision where the weights are their rounding. A split chunk keeps only the masters' low
    halves, its parameters being the high halves, so that rule is applied here, element by element, against the
    weights at the time of the load: with split masters the weights must be loaded first, or the low halves of
    weights loaded after are dropped at the next step as after any write (the README says so). A chunk
    that is ``fresh`` (no state yet) and gets none is already what it would become, and is skipped: so a
    ``load_state_dict(state_dict())`` before the first step, as accelerate's ``prepare`` does, is free."""
    params = opt.params

    def install(c: Chunk, t: torch.Tensor) -> None:
        new = torch.zeros(3, c.numel, dtype=torch.float32)
        for pc in c.pieces:
            p = params[pc.param]
            for r in range(3):
                src = rows[r][pc.param] if rows[r][pc.param] is not None or r else p.detach()
                if src is not None:
                    new[r, pc.in_chunk] = src.detach().reshape(-1)[pc.in_param]
        if c.split:
            bits = opt.strategy.gather_params(c, torch.empty(c.numel, dtype=torch.bfloat16))
            new[0] = torch.where(new[0].to(torch.bfloat16) == bits, new[0], bits.float())
        opt.guard.chunk()  # may stop the load here (a Ctrl-C); from here the state is changed
        t.copy_(c.fmt.pack(new))
        opt.store.mark_dirty(c.key)

    def untouched(c: Chunk) -> bool:
        return fresh is not None and all(fresh[pc.param] and rows[1][pc.param] is None for pc in c.pieces)

    chunks = [c for c in opt.chunks if not untouched(c)]
    opt.for_each_chunk(chunks, install, "load_state_dict()", writes=True)
    for c in chunks:
        opt.mark_synced(c)  # the masters are in line with the parameters as they are now


def with_hooks(opt: torch.optim.Optimizer, export: Any) -> dict[str, Any]:
    """torch's ``Optimizer.state_dict`` around ``export()`` (the per-parameter state): its pre-hooks, the param
    groups with parameter indices, its post-hooks."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    groups, start = [], 0
    for g in opt.param_groups:
        groups.append(
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + len(g["params"])))}
        )
        start += len(g["params"])
    sd = {"state": export(), "param_groups": groups}
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, sd)
        sd = sd if result is None else result
    return sd


def load_with_hooks(opt: torch.optim.Optimizer, state_dict: Any, load: Any) -> None:
    """torch's ``Optimizer.load_state_dict`` hooks around ``load(state_dict)``."""
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        state_dict = state_dict if result is None else result
    load(state_dict)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def load_state(opt: StateChunks, sd: Any) -> None:
    """``TieredOptimizer.load_state_dict``'s work: ``sd`` (its tensors local to this rank) checked whole, then
    streamed in; the step counts and the groups' hyperparameters set from it. Under ``whole_load``: stopped part-way,
    the optimizer is marked broken."""
    rows, steps, settings = parse_state_dict(opt, sd)
    scatter_state(opt, rows, fresh=[s == 0 for s in opt.steps])
    opt.steps[:] = steps
    for mine, theirs in zip(opt.param_groups, settings):
        mine.update(theirs)


def read_param_state(opt: StateChunks, index: int) -> dict[str, torch.Tensor]:
    """One parameter's state in torch's layout, read from its chunks now (host tensors of its size)."""
    return export_state_dict(opt, [index]).get(index, {})


class LazyState(MutableMapping):
    """``opt.state``: ``opt.state[p]`` reads ``p``'s state (``step``, ``exp_avg``, ``exp_avg_sq``, and ``master``
    for low-precision parameters) when asked; ``p in opt.state`` says whether it has taken a step.

    Iterating yields nothing and ``len`` is 0 (``bool`` says whether any parameter has state): frameworks
    walk ``optimizer.state`` to move every tensor to a device (Lightning does at the start and end of
    ``fit``), which would pull the whole state into memory. The state lives in the tiers; it changes
    through ``step`` and ``load_state_dict`` only, so assigning to it raises.
    """

    def __init__(self, usable: Callable[[], AbstractContextManager[StateChunks]], current: Callable[[], StateChunks],
                 to_global: Any = lambda state: state):  # fmt: skip
        """``usable()``: the optimizer's state, held still and checked usable for a block (a layout changed since
        is followed first, so the state is read under the layout of now); ``current()``: the state as it is, for
        questions a closed or broken optimizer still answers. Both bound methods of the optimizer, held weakly:
        its ``state`` must not keep it alive (it closes when collected)."""
        self._usable, self._current = weakref.WeakMethod(usable), weakref.WeakMethod(current)  # type: ignore[arg-type]
        self._to_global = to_global  # under FSDP2: the local tensors as DTensors, as in state_dict()

    def _state(self) -> StateChunks | None:
        current = self._current()
        return None if current is None else current()

    @staticmethod
    def _index(state: StateChunks, p: object) -> int | None:
        if not isinstance(p, torch.Tensor):
            return None
        params = (q for g in state.param_groups for q in g["params"])  # as the user has them (DTensors under FSDP2)
        return next((i for i, q in enumerate(params) if q is p), None)

    def __getitem__(self, p: object) -> dict[str, torch.Tensor]:
        state = self._state()
        i = None if state is None else self._index(state, p)
        if state is None or i is None or state.steps[i] == 0:
            return {}
        usable = self._usable()
        assert usable is not None  # the optimizer is alive: its state was just read
        with usable() as state:
            return self._to_global({i: read_param_state(state, i)})[i]

    def __contains__(self, p: object) -> bool:
        state = self._state()
        i = None if state is None else self._index(state, p)
        return state is not None and i is not None and state.steps[i] > 0

    def __setitem__(self, p: object, value: Any) -> None:
        raise TypeError("TieredOptimizer.state is read-only (the state lives in its tiers): change it through "
                        "step() or load_state_dict()")  # fmt: skip

    def __delitem__(self, p: object) -> None:
        self.__setitem__(p, None)

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        # Whether any parameter has taken a step, as for torch's dict: torch.distributed.checkpoint tests it
        # and, finding no state, runs a zero-gradient step to make some, which would decay trained moments.
        state = self._state()
        return state is not None and any(state.steps)

    def __repr__(self) -> str:
        return "<TieredOptimizer state: read one parameter's with opt.state[p]>"
