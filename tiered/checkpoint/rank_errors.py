"""A collective (FSDP2) save's or load's failure, raised on every rank with the class of the rank that failed.

Why the class matters: a caller's ``except OSError`` (a full disk is InsufficientSpaceError, an OSError) or
``except TypeError`` around ``save_checkpoint`` must catch the same failure under FSDP2 as in one process, on every
rank, also on the ranks where nothing failed.

Why not send the exception itself: unpickling calls its class with ``args``, and a class whose constructor takes
other arguments (CheckpointCorruptError takes the checkpoint and its problems) cannot be rebuilt that way. A
failure travels as ``Failure`` instead (the class's module and name, errno, message, plain attributes), and
``rank_error`` makes an instance of that class on every rank without calling its constructor. Only classes of
the builtins, tiered and io_engine are looked up by name; any other (a user's own error, raised by a
scheduler's ``state_dict``) becomes a CheckpointError carrying its message.

A collective that fails on a rank because another is gone (no failure to gather) is raised there by
``collective_lost``, naming what failed of which checkpoint.
"""

from __future__ import annotations

import builtins
import importlib
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError, error_state, rebuild_error

__all__ = ["Failure", "rank_error", "collective_lost"]

_KNOWN = ("tiered", "io_engine")  # packages whose error classes are looked up by name


def _plain(value: Any, rename: tuple[str, str] | None) -> Any:
    """``value`` if it is made of strings, numbers, None, lists and tuples (the hidden temp folder's path renamed
    to the user's in every string), else KeyError: such an attribute is not sent."""
    if isinstance(value, str):
        return value.replace(*rename) if rename else value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, rename) for v in value)
    raise KeyError(value)


@dataclass(frozen=True)
class Failure:
    """One rank's error, in a form every rank can rebuild (``rank_error``)."""

    rank: int
    module: str
    qualname: str
    text: str
    errno: int | None = None
    filename: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, rank: int, e: BaseException, rename: tuple[str, str] | None = None) -> Failure:
        """``rename``: (the hidden temp folder, the user's path), so that no message names the temp folder."""
        attrs = {}
        for key, value in vars(e).items():
            try:
                attrs[key] = _plain(value, rename)
            except KeyError:
                continue  # an object only the failing rank could use: the message says what it was
        filename = getattr(e, "filename", None) if isinstance(e, OSError) else None
        return cls(
            rank,
            type(e).__module__,
            type(e).__qualname__,
            _plain(str(e), rename),
            e.errno if isinstance(e, OSError) else None,
            _plain(filename, rename) if isinstance(filename, str) else None,
            attrs,
        )

    def line(self) -> str:
        return f"rank {self.rank}: {self.qualname}: {self.text}"


def _class_of(f: Failure) -> type[Exception]:
    """The failing rank's class where it is a builtin's, tiered's or io_engine's; else CheckpointError."""
    if f.module != "builtins" and f.module.split(".")[0] not in _KNOWN:
        return CheckpointError
    try:
        obj: Any = builtins if f.module == "builtins" else importlib.import_module(f.module)
        for part in f.qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return CheckpointError
    return obj if isinstance(obj, type) and issubclass(obj, Exception) else CheckpointError


_PARTIAL: dict[type, type] = {}


def _partial_class(cls: type[Exception]) -> type[Exception]:
    """``cls`` that is also a CheckpointError, so that the optimizer sees ``partial_load`` and marks itself
    broken (it looks for it on CheckpointError only), while ``except cls`` still catches it."""
    if issubclass(cls, CheckpointError):
        return cls
    if cls not in _PARTIAL:
        try:
            body = {"__module__": __name__, "__reduce__": _reduce, "partial_of": cls}  # _reduce: it pickles
            made = type(cls.__name__, (CheckpointError, cls), body)
        except TypeError:  # a builtin whose layout allows no second base: the checkpoint error alone
            made = CheckpointError
        _PARTIAL[cls] = made
    return _PARTIAL[cls]


def _reduce(err: Exception) -> tuple[Any, ...]:
    """Pickle a made class's error by its ``cls`` (a class pickle finds), made again where it is loaded."""
    return _rebuild, (type(err).partial_of, *error_state(err))  # type: ignore[attr-defined]


def _rebuild(cls: type[Exception], args: tuple[Any, ...], attrs: dict[str, Any]) -> BaseException:
    return rebuild_error(_partial_class(cls), args, attrs)


def rank_error(failures: list[Failure], what: str, *, partial_load: bool = False) -> Exception:
    """The error every rank raises: the first failing rank's class (``_class_of``), its attributes, and a message
    of ``what`` and every rank's failure, one a line. Its constructor is not called (the module docstring)."""
    first = failures[0]
    cls = _class_of(first)
    if partial_load:
        cls = _partial_class(cls)
    message = f"{what}: " + "; ".join(f.line() for f in failures)
    # Some classes cannot be made this way (MemoryError's __new__ refuses a class beside it, ExceptionGroup wants
    # its list, UnicodeDecodeError's text comes from fields it lacks): the nearest base class that can, in order.
    for base in cls.__mro__:
        if not issubclass(base, Exception) or base is Exception:
            continue  # BaseExceptionGroup, object; Exception itself says less than a CheckpointError
        try:
            err = _made(base, first, message)
            if str(err):
                break
        except Exception:  # noqa: BLE001  # any failure to rebuild: the next base class
            continue
    else:
        err = _made(CheckpointError, first, message)
    if isinstance(err, CheckpointError):
        err.partial_load = partial_load
    elif partial_load:  # no class both this and a CheckpointError: the optimizer must still see partial_load
        err = _made(CheckpointError, first, message)
        err.partial_load = True  # type: ignore[attr-defined]
    return err


def collective_lost(e: Exception, what: str, *, call: str = "save", partial_load: bool = False) -> Exception:
    """The error for a collective of a save or load (``call``) that failed on this rank because a rank died or left
    (gloo's "Connection closed by peer", a timeout): its class where it takes a message (an ``except`` that caught
    the collective's error catches this), else RuntimeError, saying ``what`` of the checkpoint; ``partial_load``:
    this rank had begun to install, so the class is also a CheckpointError carrying it (``_partial_class``), as
    ``rank_error``'s. The caller raises it from ``e``."""
    message = f"{what}: a rank left the {call} (died, or was stopped?): {type(e).__name__}: {e}"
    cls = _partial_class(type(e)) if partial_load else type(e)
    try:
        err = cls(message)
    except Exception:  # noqa: BLE001 - a class made otherwise: the base every collective's error has
        err = CheckpointError(message) if partial_load else RuntimeError(message)
    if not (isinstance(err, Exception) and str(err)):
        err = CheckpointError(message) if partial_load else RuntimeError(message)
    if isinstance(err, CheckpointError):
        err.partial_load = partial_load
    return err


def _made(cls: type[Exception], first: Failure, message: str) -> Exception:
    """An instance of ``cls`` with ``first``'s attributes and ``message``, its constructor not called."""
    args: tuple[Any, ...] = (message,)
    if issubclass(cls, OSError) and first.errno is not None:
        args = (first.errno, message) + ((first.filename,) if first.filename is not None else ())
    err = rebuild_error(cls, args, first.attrs)
    if "message" in first.attrs:
        err.message = message  # type: ignore[attr-defined]  # what tiered's errors' __str__ returns
    return err
