"""torch's view of a TieredOptimizer's state, without pulling the whole state into memory.

- ``export_state_dict(opt)``: ``state_dict()``'s per-parameter tensors in torch.optim.AdamW's layout. They are
  spans of a few files in the optimizer's folder on NVMe, memory-mapped (MAP_SHARED) and unlinked at once, so
  they take disk, not RAM: the kernel pages them in as ``torch.save`` reads them and may drop them again;
  a file's disk space returns when its last tensor is gone. The state streams into the files one chunk at a time,
  within ``host_budget``.
- ``parse_state_dict(opt, sd)``: a torch-layout dict checked against the optimizer before anything changes;
  ``TieredOptimizer.load_state_dict`` then streams it in chunk by chunk.
- ``scatter_state(opt, rows)``: such rows streamed into the chunks; the parameters are left as they are.
- ``read_param_state(opt, i)``, ``load_param_state(opt, i, entry)``: one parameter's state, read or replaced (what
  ``opt.state[p]`` does: state_view.py); ``reset_state(opt)``: every parameter's, none (``opt.state.clear()``).

A backing file that cannot be made (a full disk, a quota) or mapped (vm.max_map_count) raises
``StateDictFileError`` before any state is read, naming the file, the bytes it and the whole dict needed and the
room left (or the mappings and their limit); the files made so far are given back and the optimizer is unchanged.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import functools
import math
import mmap
import os
import tempfile
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from io_engine import format_size

from ..arguments import check_group, record_fused
from ..layout.chunking import Chunk
from ..store.workdir import EXPORT_PREFIX
from .state_chunks import StateChunks

__all__ = ["export_state_dict", "parse_state_dict", "parse_entry", "scatter_state", "load_state", "read_param_state",
           "load_param_state", "reset_state", "with_hooks", "load_with_hooks", "StateDictFileError"]  # fmt: skip
MOMENTS = ("exp_avg", "exp_avg_sq")


def _names(p: torch.Tensor) -> tuple[str, ...]:
    # An fp32 parameter is its own master; a lower-precision one has an fp32 master worth keeping.
    return MOMENTS if p.dtype == torch.float32 else (*MOMENTS, "master")


class StateDictFileError(OSError):
    """A file that ``state_dict()`` keeps its tensors in could not be made (``errno``, ``filename``: which one)."""

    def __init__(self, err: OSError, path: str, what: str, size: int, total: int, folder: str):
        self.size, self.total = size, total
        made = f"state_dict() could not make {path} ({format_size(size)}, for {what}): {err.strerror}"
        if err.errno in (errno.EMFILE, errno.ENFILE):
            message = (f"{made}. This process (or the system) has as many files open as it may: close some, or "
                       "raise the limit (ulimit -n); the optimizer is unchanged")  # fmt: skip
        elif err.errno == errno.ENOMEM:  # the file was made: the kernel refused to map it
            made = f"state_dict() could not map {path} ({format_size(size)}, for {what}): {err.strerror}"
            message = (f"{made}. Its tensors are files in the optimizer's folder, each mapped into memory; this "
                       f"process has {_mappings()} mappings and vm.max_map_count is {_map_limit()} (raise it: "
                       "sysctl -w vm.max_map_count=...), or its address space is limited (ulimit -v); the "
                       "optimizer is unchanged")  # fmt: skip
        else:
            try:
                st = os.statvfs(folder)
                free = f"{format_size(st.f_bavail * st.f_frsize)} free there"
            except OSError:
                free = "its free space unknown"
            message = (f"{made}. Its tensors are files in the optimizer's folder, {format_size(total)} for the "
                       f"whole state dict, {free}. Free space on that disk, or give nvme_path a disk with room for "
                       "the state dict beside the state; the optimizer is unchanged")  # fmt: skip
        super().__init__(err.errno, message, path)


def _mappings() -> str:
    try:
        with open("/proc/self/maps") as maps:
            return str(sum(1 for _ in maps))
    except OSError:
        return "an unknown number of"


def _map_limit() -> str:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


# A state dict's tensors share files, at most about FILES of them (each at least FILE_BYTES): one file (and one
# memory mapping) a tensor passed Linux's vm.max_map_count (65,530) at ~22k bf16 parameters, and each file cost
# milliseconds to make and to drop. More than one file, so that a tensor kept gives back the others' disk space.
FILES, FILE_BYTES, ALIGN = 64, 64 << 20, 64


class _Libc:
    """libc's mmap and munmap: Python's mmap keeps a duplicate of the file's descriptor open for the mapping's life
    (before Python 3.13), one a file, so dicts held (``opt.state[p]`` of each parameter) ran out of descriptors
    under ``ulimit -n``; a mapping made here holds none, as torch.from_file's did."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap, self.munmap = libc.mmap, libc.munmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)  # fmt: skip
        self.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


_libc = functools.cache(_Libc)
_LIVE: dict[int, int] = {}  # each mapping's address and size, while a tensor over it lives


def exported(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a file ``state_dict()`` made here (a TieredOptimizer's state, which a
    framework's load may keep mapped: integrations/lightning.py)."""
    ptr = t.data_ptr()
    return any(addr <= ptr < addr + size for addr, size in list(_LIVE.items()))


def _unmap(addr: int, size: int) -> None:
    _LIVE.pop(addr, None)
    _libc().munmap(addr, size)


def _mapped(folder: str, size: int) -> tuple[ctypes.Array, str]:
    """``size`` bytes of a new file in ``folder``, unlinked at once, mapped (MAP_SHARED), and the file's path.

    The blocks are allocated up front, so a full disk raises ENOSPC here, rather than killing the process
    with SIGBUS when a page of the mapping is first written. The mapping goes when the last tensor on it does
    (``torch.frombuffer`` keeps the buffer, whose collection unmaps it)."""
    fd, path = tempfile.mkstemp(prefix=EXPORT_PREFIX, suffix=".bin", dir=folder)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:  # posix_fallocate's error names no file
            raise OSError(e.errno, e.strerror, path) from e
        libc = _libc()
        addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:  # MAP_FAILED
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        buffer = (ctypes.c_ubyte * size).from_address(addr)
        _LIVE[addr] = size
        # Not at exit (the process's end unmaps it): a tensor over it might still be read then, by a later exit hook.
        weakref.finalize(buffer, _unmap, addr, size).atexit = False
        return buffer, path
    finally:
        os.close(fd)
        os.unlink(path)


def _files(sizes: list[int]) -> list[list[int]]:
    """The tensors of ``sizes`` (bytes) in order, cut into files of at most max(FILE_BYTES, total / FILES) bytes
    (a tensor larger has one of its own)."""
    most = max(FILE_BYTES, -(-sum(sizes) // FILES))
    files: list[list[int]] = [[]]
    room = most
    for k, size in enumerate(sizes):
        if files[-1] and size > room:
            files.append([])
            room = most
        files[-1].append(k)
        room -= -(-size // ALIGN) * ALIGN
    return files if files[0] else []


def _backing_files(opt: StateChunks, wanted: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """fp32 tensors shaped as the parameters, in files shared by many (``_files``). Each tensor has memory of its
    own (``torch.frombuffer`` over its span of the mapping), not views of one storage: torch cannot deepcopy
    DTensors (FSDP2) whose local tensors share a storage ("invalid python storage"), frameworks deepcopy state
    dicts, and a deepcopy of one tensor copies it alone. On failure the files made so far go (the tensors are
    dropped) and StateDictFileError says which file, and how much the whole dict needed."""
    params = opt.params
    views = {i: {name: torch.empty(params[i].shape, dtype=torch.float32) for name in _names(params[i])}
             if params[i].numel() == 0 else {} for i in wanted}  # fmt: skip
    slots = [(i, name) for i in wanted if params[i].numel() for name in _names(params[i])]
    sizes = [4 * params[i].numel() for i, _ in slots]
    total = sum(-(-size // ALIGN) * ALIGN for size in sizes)  # as the files take it
    for file in _files(sizes):
        spans = [-(-sizes[k] // ALIGN) * ALIGN for k in file]
        try:
            mapping = _mapped(opt.workdir, sum(spans))[0]
        except OSError as e:
            views.clear()  # unmaps the files made so far: their space returns before the error is read
            path = e.filename if isinstance(e.filename, str) else os.path.join(opt.workdir, EXPORT_PREFIX + "*")
            (i, name), more = slots[file[0]], f" and {len(file) - 1} more" if len(file) > 1 else ""
            what = f"{name} of {opt.param_names[i]!r}{more}"
            raise StateDictFileError(e, path, what, sum(spans), total, opt.workdir) from e
        offset = 0
        for k, span in zip(file, spans):
            i, name = slots[k]
            views[i][name] = torch.frombuffer(mapping, dtype=torch.float32, count=sizes[k] // 4,
                                              offset=offset).view(params[i].shape)  # fmt: skip
            offset += span
        del mapping  # the tensors keep it; no local does (a failure's traceback would hold the file)
    return views


def export_state_dict(opt: StateChunks, indices: list[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """``state`` of torch's layout for the parameters ``indices`` (default: all) that have taken a step."""
    params, steps = opt.params, opt.step_counts
    wanted = [i for i in (range(len(params)) if indices is None else indices) if steps[i] > 0]
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
        one, steps[i] = parse_entry(opt, i, state.get(pid), p.shape if shapes is None else shapes[i])
        for r in range(3):
            rows[r][i] = one[r]
    return rows, steps, settings


def parse_entry(opt: StateChunks, i: int, s: Any, shape: torch.Size) -> tuple[list[torch.Tensor | None], int]:
    """Parameter ``i``'s entry ``s`` of a state dict's ``state``, checked: its rows [master, exp_avg, exp_avg_sq]
    (None where absent) and its step count. An empty entry (or None) is no state: no rows, step 0."""
    if not s:
        return [None, None, None], 0
    name = opt.param_names[i]
    if not isinstance(s, Mapping):
        raise TypeError(f"the state of {name!r} is a {type(s).__name__}, not a dict of tensors as AdamW's")
    if "max_exp_avg_sq" in s:
        raise ValueError(f"the state of {name!r} has max_exp_avg_sq (amsgrad=True), which TieredOptimizer does "
                         "not support")  # fmt: skip
    rows: list[torch.Tensor | None] = []
    for key in ("master", *MOMENTS):
        t = s.get(key)
        if t is None and key != "master":
            raise ValueError(f"the state of {name!r} has no {key!r}: it is not an AdamW state")
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != shape or not t.is_floating_point()):
            what = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            if isinstance(t, torch.Tensor) and t.shape == shape:
                what = f"of dtype {t.dtype} (AdamW's state is floating point)"
            raise ValueError(f"{key} of {name!r} is {what}; the parameter has shape {tuple(shape)}")
        rows.append(t)
    step = float(s.get("step", -1))
    if not (math.isfinite(step) and step >= 0 and step == int(step)):
        raise ValueError(f"the step count of {name!r} is {s.get('step')!r}: it must be a whole number >= 0")
    return rows, int(step)


def scatter_state(opt: StateChunks, rows: list[list[torch.Tensor | None]], fresh: list[bool] | None = None,
                  only: int | None = None, weight: bool = False) -> None:  # fmt: skip
    """Overwrite state rows; a missing master row is taken from the parameter, a missing moment is 0.

    The parameters are left as they are, as torch.optim.AdamW's load leaves them. A loaded master that no longer
    rounds to its bf16/fp16 parameter's value is then a write to the parameter since (the user's, made before or
    after the load), which wins at the next step as any write between steps does (ChunkUpdater.sync_masters): so
    ``model.load_state_dict(weights); opt.load_state_dict(sd)`` keeps the weights, and in either order the
    masters keep their precision where the weights are their rounding. A split chunk keeps only the masters' low
    halves, its parameters being the high halves, so that rule is applied here, element by element, against the
    weights at the time of the load: with split masters the weights must be loaded first, or the low halves of
    other weights loaded after are dropped at the next step as after any write (the README says so); the same
    weights written again are no write (``StateChunks.remember_weights``). A chunk
    that is ``fresh`` (no state yet) and gets none is already what it would become, and is skipped: so a
    ``load_state_dict(state_dict())`` before the first step, as accelerate's ``prepare`` does, is free.

    ``only``: parameter ``only``'s rows alone are loaded (``opt.state[p] = ...``); the other parameters of its
    chunks keep their state, read and written back as a state dict and its load would carry it; a write to one of
    them since the last step is still taken in at the next (its pieces in other chunks are not loaded here).
    ``weight``: parameter ``only``'s master was written through ``opt.state`` (not loaded): its parameter becomes
    the master's rounding, as writing the fp32 master of torch's AdamW over fp32 masters moves the weight. Set
    before a split chunk compares the masters with the weights, so the master written stands whole."""
    params = opt.params

    def install(c: Chunk, t: torch.Tensor) -> None:
        new = torch.zeros(3, c.numel, dtype=torch.float32)
        if only is not None:
            new.copy_(torch.stack(opt.chunk_state_rows(c, t)))
        for pc in c.pieces:
            if only is not None and pc.param != only:
                continue
            p = params[pc.param]
            for r in range(3):
                src = rows[r][pc.param] if rows[r][pc.param] is not None or r else p.detach()
                if src is not None:
                    new[r, pc.in_chunk] = src.detach().reshape(-1)[pc.in_param]
                elif only is not None:
                    new[r, pc.in_chunk] = 0
        opt.guard.chunk()  # may stop the load here (a Ctrl-C); from here the state is changed
        if weight:
            for pc in c.pieces:
                if pc.param == only:  # on the current stream, as the user's own write to it would be
                    params[pc.param].detach().view(-1)[pc.in_param].copy_(new[0, pc.in_chunk])
            opt.mark_synced(c, only)  # set by the load: its next chunks' reads take it as no write of the user's
        if c.split:
            bits = opt.strategy.gather_params(c, torch.empty(c.numel, dtype=torch.bfloat16))
            new[0] = torch.where(new[0].to(torch.bfloat16) == bits, new[0], bits.float())
            opt.remember_weights(c, bits, only)
        t.copy_(c.fmt.pack(new))
        opt.store.mark_dirty(c.key)

    def untouched(c: Chunk) -> bool:
        if only is not None:
            return all(pc.param != only for pc in c.pieces)
        return fresh is not None and all(fresh[pc.param] and rows[1][pc.param] is None for pc in c.pieces)

    chunks = [c for c in opt.chunks if not untouched(c)]
    opt.for_each_chunk(chunks, install, "load_state_dict()" if only is None else "opt.state[p] = ...", writes=True)
    for c in chunks:
        # The masters are in line with the parameters as they are now. With ``only``, the others' pieces here are
        # too, but a parameter written since may have pieces in chunks not touched: it stays written.
        opt.mark_synced(c, only)


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
        record_fused(groups[-1])  # a foreach=True set since construction: fused None in the dict, as torch has it
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
    # The groups' settings copied, as torch's load_state_dict deep-copies them: a tensor lr of the dict (another
    # optimizer's live one) is not shared, so its scheduler or fill_() does not drive this optimizer's lr.
    settings = copy.deepcopy(settings)
    scatter_state(opt, rows, fresh=[s == 0 for s in opt.steps])
    opt.steps[:] = steps
    for mine, theirs in zip(opt.param_groups, settings):
        mine.update(theirs)
        if "fused" not in theirs:  # a dict of an older torch: None, as torch's own load sets it
            mine["fused"] = None
        record_fused(mine)  # a None loaded (torch's AdamW's default) is what runs here: the fused kernel


def read_param_state(opt: StateChunks, index: int) -> dict[str, torch.Tensor]:
    """One parameter's state in torch's layout, read from its chunks now (host tensors of its size)."""
    return export_state_dict(opt, [index]).get(index, {})


def load_param_state(opt: StateChunks, index: int, entry: Any, master_written: bool = False) -> None:
    """``opt.state[p] = entry``: one parameter's state (its tensors local to this rank, or DTensors) checked as
    ``load_state_dict`` checks an entry, then streamed into that parameter's chunks alone; its step count set.
    An empty entry is no state: fresh moments and master, as torch's AdamW starts a parameter whose state is
    an empty dict. Under ``whole_load``, as ``load_state``. ``master_written``: the entry's master is a write
    into a dict ``opt.state[p]`` handed out, which a bf16/fp16 parameter follows (``scatter_state``'s ``weight``),
    where a load's master stands behind the weight (an fp32 parameter is its own master, and torch's AdamW
    ignores a ``master`` key in its state: so does this)."""
    if not isinstance(entry, Mapping):
        raise TypeError(f"opt.state[p] = {type(entry).__name__}: a parameter's state is a dict, as torch's AdamW "
                        "keeps it ('step', 'exp_avg', 'exp_avg_sq')")  # fmt: skip
    if entry and opt.shards.frozen[index]:
        raise ValueError(f"opt.state[p] = ...: {opt.param_names[index]!r} was frozen when the state was laid out, "
                         "so it has no place in the chunks: give its state through load_state_dict(), which lays "
                         "it out")  # fmt: skip
    local = opt.shards.to_local({"state": {index: dict(entry)}})["state"][index]
    one, step = parse_entry(opt, index, local, opt.params[index].shape)
    rows: Rows = [[None] * len(opt.params) for _ in range(3)]
    for r in range(3):
        rows[r][index] = one[r]
    weight = master_written and one[0] is not None and opt.params[index].dtype != torch.float32
    scatter_state(opt, rows, only=index, weight=weight)
    opt.steps[index] = step


def reset_state(opt: StateChunks) -> None:
    """Every parameter without state (``opt.state.clear()``), as ``load_param_state(opt, i, {})`` leaves one: fresh
    moments and masters (from the parameters), step counts 0, in one pass over the chunks. Each chunk is rewritten,
    a parameter's at step 0 too: its moments may have been loaded with a step count of 0, which torch's next
    step would use. Under ``whole_load``, as ``load_state``: a whole state (a torn one is whole after it)."""
    scatter_state(opt, [[None] * len(opt.params) for _ in range(3)])
    opt.steps[:] = [0] * len(opt.steps)
