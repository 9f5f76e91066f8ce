"""The rules that make a checkpoint a validated boundary. No I/O: JSON text and Python values in, errors out.

A checkpoint may come from anywhere (a colleague's disk, a download, an edited copy), and its manifest's CRC
only catches accidents: whoever edits a manifest can recompute it. So nothing it says is believed unchecked:

- JSON nesting is bounded (``MAX_DEPTH``) before the text is parsed: json's recursive parser raises
  RecursionError on a few hundred kilobytes of brackets, and the CRC and the CLI recurse over what it returns.
- Every number has a type and a range (``integer``, ``real``): an offset is an int >= 0, not 3.0, "3" or True,
  and no larger than a file offset can be.
- Param groups pass the optimizer constructor's own checks (``tiered.arguments.check_group``: ranges,
  finiteness, AdamW's flags): a checkpoint must not set what ``TieredOptimizer(...)`` would refuse.
- File names come from a fixed set (manifest.py), never a path; links are refused where files are opened
  (regular_files.py, reader.py).

Each check raises ``Invalid`` (one line: what, the bad value, the rule); the caller adds where and the fix
and raises it as a CheckpointFormatError. Call order: ``body = loads(text, where)``, then the field checks.
Once a load has passed them all, ``restore_groups`` writes the saved param groups into the optimizer's.

The caller's side of the boundary: ``checkpoint_path``, the one check of the path every way in is given (save, load,
export, import, ``latest_checkpoint``, the CLI), which refuses an empty one before anything is read or written.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

from ..arguments import check_group as check_optimizer_group
from ..arguments import folder_path
from .errors import CheckpointFormatError, ManifestDamagedError

MAX_DEPTH = 32  # a manifest needs 4 levels (params -> entry -> shape); param groups a few more
MAX_INT = 1 << 62  # byte offsets and sizes go to pread/pwrite as int64
MAX_UNIX_TIME = 253402300799.0  # 9999-12-31 23:59:59 UTC, the last second datetime can render
HPARAMS = ("lr", "betas", "eps", "weight_decay")
FIX = "load another checkpoint (this one is damaged, was edited, or was not written by tiered)"

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
_BRACKET = re.compile(r"[\[\]{}]")


def checkpoint_path(path: Any, name: str = "checkpoint path", example: str = "ckpt/step-1000") -> str:
    """The folder of a checkpoint (``name``: of checkpoints, for ``latest_checkpoint``'s root) a caller names, made
    absolute; ``""`` is refused by name (``ValueError``): an unset variable gives it, and it would name the current
    folder, which a save would replace (the process left in a deleted folder) and a load or the CLI would read."""
    return folder_path(path, name, example)


class Invalid(ValueError):
    """One field's problem, in words: the caller names the file and adds the fix."""


def show(value: Any) -> str:
    """``repr(value)``, cut short: a hostile value can be megabytes long, and messages stay one line."""
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


# ---------------------------------------------------------------------------------------------- JSON
def too_deep(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON ``text`` nests arrays and objects more than ``limit`` levels, found without recursion
    (brackets inside strings do not count)."""
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub('""', text)):
        if m.group() in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def loads(text: str, where: str) -> Any:
    """``json.loads(text)`` with its nesting bounded. Text that is not JSON is damage (ManifestDamagedError);
    nesting beyond ``MAX_DEPTH`` is a CheckpointFormatError."""
    if too_deep(text):
        raise CheckpointFormatError(
            f"{where} is nested more than {MAX_DEPTH} levels deep; a tiered manifest needs a handful: {FIX}"
        )
    try:
        return json.loads(text)
    except RecursionError as e:  # not reached after the depth check; kept so no RecursionError escapes
        raise CheckpointFormatError(f"{where} is nested too deeply to parse: {FIX}") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestDamagedError(f"{where} is not JSON ({e}): the manifest is damaged") from e


# -------------------------------------------------------------------------------------------- fields
def need(d: dict[str, Any], key: str, what: str) -> Any:
    """``d[key]``, or Invalid naming what lacks it."""
    if key not in d:
        raise Invalid(f"{what} has no {key!r}")
    return d[key]


def integer(value: Any, what: str, *, hi: int = MAX_INT) -> int:
    """An int (not a bool, float or string) in ``[0, hi]``."""
    if type(value) is not int:
        raise Invalid(f"{what} is {show(value)}: it must be an integer >= 0")
    if value < 0:
        raise Invalid(f"{what} is {value}: it must be an integer >= 0")
    if value > hi:
        raise Invalid(f"{what} is {value}: it must be at most {hi}")
    return value


def real(value: Any, what: str, *, lo: float = 0.0, hi: float = math.inf) -> float:
    """A finite int or float (not a bool or string) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(f"{what} is {show(value)}: it must be a number")
    if not math.isfinite(value):
        raise Invalid(f"{what} is {show(value)}: it must be finite")
    if not lo <= value <= hi:
        raise Invalid(f"{what} is {show(value)}: it must be in [{lo:.15g}, {hi:.15g}]")
    return float(value)


def string(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"{what} is {show(value)}: it must be a non-empty string")
    return value


def boolean(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"{what} is {show(value)}: it must be true or false")
    return value


def array(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise Invalid(f"{what} is {show(value)}: it must be a list")
    return value


def mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"{what} is {show(value)}: it must be a mapping")
    return value


def float_dtype(value: Any, what: str) -> str:
    """The name of a torch floating-point dtype ("bfloat16"): parameters are floating point."""
    import torch

    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise Invalid(f"{what} is {show(value)}: it must name a torch floating-point dtype, such as 'float32'")
    return value


# ------------------------------------------------------------------------------------------ objects.pt
def check_objects(objs: Any, *, groups: int, has_scheduler: bool, hparams: bool) -> None:
    """objects.pt's dict against its manifest: ``groups`` param groups, a scheduler state iff
    ``has_scheduler``, ``extra`` a dict or None; with ``hparams``, each group passes ``check_group``."""
    if not isinstance(objs, dict) or not {"param_groups", "scheduler", "extra"} <= set(objs):
        raise Invalid("it is not a tiered checkpoint's objects file (a dict of param_groups, scheduler, extra)")
    saved = array(objs["param_groups"], "param_groups")
    if len(saved) != groups:
        raise Invalid(f"it holds {len(saved)} param groups, the manifest lists {groups}")
    for gi, g in enumerate(saved):
        mapping(g, f"param group {gi}")
        if hparams:
            check_group(g, gi)
    if objs["scheduler"] is not None:
        mapping(objs["scheduler"], "the scheduler state")
    if (objs["scheduler"] is not None) != has_scheduler:
        raise Invalid(f"it {'lacks' if has_scheduler else 'holds'} a scheduler state, the manifest says otherwise")
    if objs["extra"] is not None:
        mapping(objs["extra"], "extra")


def restored(g: dict[str, Any]) -> dict[str, Any]:
    """What a load writes into an optimizer's param group from a saved one: every setting but ``params`` and
    ``param_names``, which are the optimizer's own (a name list copied into a group built from unnamed parameters
    makes torch's add_param_group refuse every unnamed group after, and state_dict() name them)."""
    return {k: v for k, v in g.items() if k not in ("params", "param_names")}


def restore_groups(groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    """Write saved param groups' settings (``restored``) into an optimizer's ``groups``, pairwise. A setting held
    here as a one-element floating-point tensor (an lr a scheduler ``fill_()``s, tensor betas) keeps its tensor, the
    saved number (a checkpoint holds numbers: save.plain) filled into it: the scheduler or compiled step that holds
    it goes on driving it, and in its dtype (a float would make a scheduler compute in float64), so a run resumed
    with a tensor lr stays bitwise the uninterrupted one. A tensor that two groups share and the checkpoint
    gives two numbers is left as it is, each group given its number as a float."""
    new = [restored(g) for g in saved]
    numbers: dict[int, set[float]] = {}
    for group, values in zip(groups, new):
        for key, value in values.items():
            for t, x in _fills(group.get(key), value):
                numbers.setdefault(id(t), set()).add(x)
    for group, values in zip(groups, new):
        for key, value in values.items():
            group[key] = _kept(group.get(key), value, numbers)


def _fills(live: Any, value: Any) -> list[tuple[torch.Tensor, float]]:
    """The tensors of ``live`` (a setting, or a tuple of them: betas) that ``value`` would be filled into."""
    if isinstance(live, torch.Tensor):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return [(live, float(value))] if number and live.numel() == 1 and live.is_floating_point() else []
    if isinstance(live, (tuple, list)) and isinstance(value, (tuple, list)) and len(live) == len(value):
        return [f for a, b in zip(live, value) for f in _fills(a, b)]
    return []


def _kept(live: Any, value: Any, numbers: dict[int, set[float]]) -> Any:
    """``value`` to set in place of ``live``: ``live`` itself where its tensors take ``value``'s numbers."""
    if isinstance(live, torch.Tensor):
        if not _fills(live, value) or len(numbers[id(live)]) != 1:
            return value
        with torch.no_grad():  # a setting, not part of any graph
            live.fill_(value)
        return live
    if _fills(live, value):  # a tuple (betas) holding tensors: those kept, the object too where all are
        kept = [_kept(a, b, numbers) for a, b in zip(live, value)]
        return live if all(k is a for k, a in zip(kept, live)) else type(value)(kept)
    return value


def check_group(g: dict[str, Any], gi: int) -> None:
    """What ``TieredOptimizer(...)`` demands of a param group's hyperparameters, and that they are finite."""
    for key in HPARAMS:
        need(g, key, f"param group {gi}")
    numbers = [(key, g[key]) for key in ("lr", "eps", "weight_decay")]
    betas = g["betas"]
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise Invalid(f"param group {gi}'s betas is {show(betas)}: it must be two numbers in [0, 1)")
    for key, value in [*numbers, ("betas", betas[0]), ("betas", betas[1])]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Invalid(f"param group {gi}'s {key} is {show(g[key])}: it must be a number")
    try:  # the constructor's own checks: ranges, finiteness, the AdamW flags (amsgrad, maximize, ...)
        check_optimizer_group(g, f"param group {gi}")
    except (TypeError, ValueError) as e:
        raise Invalid(f"param group {gi}: {e}") from e
