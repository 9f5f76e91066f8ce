"""The hidden names beside a checkpoint (``.NAME.KIND-HOST-PID-RAND``: temp, aside and deleting folders), and which
of them this process made.

A hidden name carries its host and pid, so that ``fsops.sweep`` may remove those of a dead process of this host.
Its own pid alone does not make a name this process's: a container's first process has the same pid at every start
(a killed predecessor's names carry it), and two containers that share a host name (``--network=host``) may both
run as that pid. So this process counts the names it made itself (``hidden_name``), under way until ``ended``; a
name of its pid that it did not make is never removed (it may be another live process's save, or the only copy of
a checkpoint an interrupted overwrite left aside).
"""

from __future__ import annotations

import os
import re
import secrets
import socket

from .errors import CheckpointPathError

_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
_HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|deleting)-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]+$")
NAME_MAX = 255  # bytes of one name, on every filesystem Linux mounts for data
# What hidden_name adds to a name at most: ".", ".deleting-", the host, "-", a 7-digit pid, "-", 8 hex digits.
HIDDEN_EXTRA = len(f"..deleting-{_HOST}-{9999999}-{'f' * 8}")
# The names (their last component) this process made: a save, commit or deletion under way (``hidden_name`` to
# ``ended``), left by ``sweep``; and those whose save has ended but that are still on disk (a failed rmtree, a
# collective save whose peer died), which the next ``sweep`` removes. Names of its pid it did not make are in neither.
_UNDER_WAY: set[str] = set()
_ENDED_HERE: set[str] = set()


def check_target(path: str) -> None:
    """What a save refuses at ``path`` before it makes anything: a symbolic link (the commit would swap the link
    out, not write where it points, and leave it behind under a hidden name), and a name too long for the hidden
    names beside it (its temp folder would fail with ENAMETOOLONG)."""
    if os.path.islink(path):
        raise CheckpointPathError(
            f"{path} is a symbolic link (to {os.readlink(path)}); a save neither replaces a link nor writes through "
            "it: save to the folder it points to (os.path.realpath), or remove the link first"
        )
    name = os.fsencode(os.path.basename(path))
    if len(name) > NAME_MAX - HIDDEN_EXTRA:
        raise ValueError(
            f"the checkpoint name {os.path.basename(path)[:40]!r}... ({path}) is {len(name)} bytes: a save needs "
            f"names of at most {NAME_MAX - HIDDEN_EXTRA} bytes (the filesystem's {NAME_MAX}, less room for the "
            "temporary names it makes beside the checkpoint); choose a shorter name"
        )


def hidden_name(path: str, kind: str) -> str:
    """``parent/.NAME.KIND-HOST-PID-RAND``: a sibling no reader takes for a checkpoint. Under way, so that ``sweep``
    leaves it, until ``ended``: every path out of its save, the failed ones too, must call ``ended``."""
    parent, name = os.path.split(path)
    hidden = f".{name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    _UNDER_WAY.add(hidden)
    return os.path.join(parent, hidden)


def ended(path: str) -> None:
    """The save, commit or deletion that named ``path`` by ``hidden_name`` is over (done, or failed): whatever is
    still there under that name is a leftover, which the next ``sweep`` removes, in this process too."""
    name = os.path.basename(path)
    if name in _UNDER_WAY:
        _UNDER_WAY.discard(name)
        if os.path.lexists(path):
            _ENDED_HERE.add(name)


def under_way_here(entry: str) -> bool:
    """``entry`` (a name in a folder) is one of this process's saves, commits or deletions under way."""
    return entry in _UNDER_WAY


def ended_here(entry: str) -> bool:
    """``entry`` was made by this process, and its save has ended: a leftover ``sweep`` may remove."""
    return entry in _ENDED_HERE


def gone(path: str) -> None:
    """``sweep`` removed ``path`` (or put it back as a checkpoint): nothing of this process's is left under it."""
    if not os.path.lexists(path):
        _ENDED_HERE.discard(os.path.basename(path))
