"""The checkpoint format: what a checkpoint folder holds and what its manifest says. No I/O but JSON text.

A checkpoint is a folder::

    manifest.json      written last; its presence is what makes the folder a checkpoint
    objects.pt         torch.save of {"param_groups", "scheduler", "extra"}: the small Python objects
    master.bin         fp32 master weights of every parameter, back to back, in the ``params`` order
    exp_avg.bin        AdamW's first moments, same layout
    exp_avg_sq.bin     AdamW's second moments, same layout

The three row files are raw little-endian fp32 (``numpy.fromfile`` reads them): parameter ``p`` is the
elements ``[p.offset, p.offset + p.numel)`` of each. They are keyed by parameter *name*, so a loader
with another chunk size, host budget or parameter order finds its bytes by name, not by position.

Each file lists CRC-32 segments ``[byte_offset, nbytes, crc32]`` that tile it (one per state chunk at
save time) plus the whole file's CRC-32 (``zlib.crc32`` of its bytes; the segments combine into it with
``crc32_combine``). The manifest checks itself: ``manifest_crc32`` is the CRC-32 of the canonical JSON
(sorted keys, no spaces) of every other field, so a flipped bit in an offset cannot go unnoticed.

Every save has an identity, ``source["save_id"]`` (random; ``new_save_id``), which every rank's part of a
sharded checkpoint shares with its ``shards.json``: what lets ranks that load "the same path" tell whether they
opened the same checkpoint (sharded.py). Checkpoints saved before it have none.

A CRC catches accidents, not edits, so ``Manifest.parse`` also checks every field (validate.py): the files
listed are exactly ``FILES`` (a name, never a path), every count and offset is an int >= 0, offsets tile the
row files, and the files' listed sizes are what the parameters need (the reader then checks them on disk).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import sys
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..arguments import plain_names
from ..layout.chunking import STATE_ROWS
from ..store.checksum import ALGORITHM, crc32_combine
from .errors import CheckpointFormatError, ManifestDamagedError
from .validate import (
    FIX,
    MAX_UNIX_TIME,
    Invalid,
    array,
    boolean,
    float_dtype,
    integer,
    loads,
    mapping,
    need,
    real,
    show,
    string,
)

FORMAT = "tiered.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
OBJECTS = "objects.pt"
ROW_FILES: tuple[str, ...] = tuple(f"{row}.bin" for row in STATE_ROWS)  # master.bin, exp_avg.bin, exp_avg_sq.bin
FILES: tuple[str, ...] = (*ROW_FILES, OBJECTS)  # every name a manifest may list: a fixed set, never a path
ELEMENT_BYTES = 4
CRC_MAX = 0xFFFFFFFF

Segment = tuple[int, int, int]  # (byte offset, nbytes, crc32)
_SAVE_ID = re.compile(r"[0-9a-f]{8,64}")


def new_save_id() -> str:
    """A save's identity: random, so that two saves of one path differ even with the same state at the same time."""
    return secrets.token_hex(16)


def check_save_id(value: Any, what: str) -> str:
    """``value`` if it is a save id (lowercase hex, as ``new_save_id`` makes), else Invalid."""
    if not isinstance(value, str) or not _SAVE_ID.fullmatch(value):
        raise Invalid(f"{what} is {show(value)}: a save id is a string of 8 to 64 lowercase hex digits")
    return value


@dataclass(frozen=True)
class ParamEntry:
    """One parameter: where its elements sit in the row files, and what it looked like."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # the parameter's own dtype ("bfloat16"); the state is always fp32
    offset: int  # first element in each row file
    numel: int
    group: int
    step: int  # AdamW step count (0: never updated)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "offset": self.offset,
            "numel": self.numel,
            "group": self.group,
            "step": self.step,
        }


@dataclass(frozen=True)
class FileEntry:
    """One data file: its size, whole-file CRC-32 and the segments that tile it."""

    name: str
    nbytes: int
    crc32: int
    segments: tuple[Segment, ...]

    def to_json(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "crc32": self.crc32, "segments": [list(s) for s in self.segments]}

    @classmethod
    def from_segments(cls, name: str, nbytes: int, segments: list[Segment]) -> FileEntry:
        """Sort ``segments``, check that they tile ``[0, nbytes)``, and combine them into the file CRC."""
        segs = sorted(segments)
        crc, pos = 0, 0
        for off, n, c in segs:
            if off != pos or n <= 0:
                raise ValueError(f"{name}: segments do not tile the file (gap or overlap at byte {pos})")
            crc = crc32_combine(crc, c, n)
            pos += n
        if pos != nbytes:
            raise ValueError(f"{name}: segments cover {pos} bytes of {nbytes}")
        return cls(name, nbytes, crc, tuple(segs))


@dataclass
class Manifest:
    """Everything a checkpoint says about itself. ``to_json``/``parse`` are each other's inverse."""

    step: int
    params: list[ParamEntry]
    files: dict[str, FileEntry]
    param_groups: list[dict[str, Any]]  # a JSON view for humans; objects.pt holds the exact values
    has_scheduler: bool = False
    extra_keys: list[str] = field(default_factory=list)
    objects_weights_only: bool = True  # objects.pt loads with torch.load(weights_only=True)
    created_unix: float = 0.0
    # How the saver was set up (informational), but its "save_id" (the save's identity) and, for a rank's part of
    # a sharded checkpoint, its "shard": the rows it holds, which loaders check against shards.json (check_part).
    source: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def save_id(self) -> str | None:
        """The identity of the save that wrote it (``source["save_id"]``), None for one saved before save ids."""
        return self.source.get("save_id")

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "checksum": ALGORITHM,
            "byte_order": "little",
            "state_dtype": "float32",
            "rows": dict(zip(STATE_ROWS, ROW_FILES)),
            "step": self.step,
            "numel": self.numel,
            "created_unix": self.created_unix,
            "params": [p.to_json() for p in self.params],
            "files": {name: f.to_json() for name, f in self.files.items()},
            "param_groups": self.param_groups,
            "has_scheduler": self.has_scheduler,
            "extra_keys": self.extra_keys,
            "objects_weights_only": self.objects_weights_only,
            "source": self.source,
            "versions": self.versions,
        }
        body["manifest_crc32"] = _self_crc(body)
        return body

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def parse(cls, text: str, where: str) -> Manifest:
        """Parse and check a manifest: its own CRC, then every field's type and range (validate.py), and that
        they add up. Raises ManifestDamagedError (not JSON, or fails its CRC) or CheckpointFormatError (a value
        that no tiered writes, named with the fix)."""
        data = loads(text, where)
        if not isinstance(data, dict) or (data.get("format") != FORMAT and "manifest_crc32" not in data):
            found = data.get("format") if isinstance(data, dict) else None
            raise CheckpointFormatError(f"{where} is not a tiered checkpoint manifest (format {show(found)})")
        # The CRC before any field is believed: a flipped bit anywhere, "format" and "version" included, is damage.
        if data.pop("manifest_crc32", None) != _self_crc(data):
            raise ManifestDamagedError(f"{where} does not match its manifest_crc32: the manifest is damaged")
        if data.get("format") != FORMAT:
            found = show(data.get("format"))
            raise CheckpointFormatError(f"{where} is not a tiered checkpoint manifest (format {found})")
        if data.get("version") != VERSION:
            raise CheckpointFormatError(
                f"{where} is checkpoint format version {show(data.get('version'))}; this "
                f"tiered reads version {VERSION}: use the tiered that wrote it"
            )
        if data.get("checksum") != ALGORITHM or data.get("byte_order") != "little" or sys.byteorder != "little":
            raise CheckpointFormatError(
                f"{where}: checksum {show(data.get('checksum'))} / byte order "
                f"{show(data.get('byte_order'))} on a {sys.byteorder}-endian machine is not "
                f"supported (this tiered reads {ALGORITHM!r}, little-endian)"
            )
        try:
            return cls._from_body(data)
        except Invalid as e:
            raise CheckpointFormatError(f"{where}: {e}; {FIX}") from e
        except (KeyError, TypeError, ValueError) as e:  # a check missed above: still one line, still refused
            raise CheckpointFormatError(f"{where} is malformed ({type(e).__name__}: {e}); {FIX}") from e

    @classmethod
    def _from_body(cls, d: dict[str, Any]) -> Manifest:
        """Every field typed and range-checked, the file names from the fixed set, offsets and sizes consistent."""
        rows = dict(zip(STATE_ROWS, ROW_FILES))
        if need(d, "rows", "the manifest") != rows:
            raise Invalid(f"rows is {show(d['rows'])}; a tiered checkpoint's rows are {rows}")
        if need(d, "state_dtype", "the manifest") != "float32":
            raise Invalid(f"state_dtype is {show(d['state_dtype'])}; a tiered checkpoint's state is 'float32'")
        groups = array(need(d, "param_groups", "the manifest"), "param_groups")
        for gi, g in enumerate(groups):
            mapping(g, f"param_groups[{gi}]")
        params = [_param(p, i, len(groups)) for i, p in enumerate(array(need(d, "params", "the manifest"), "params"))]
        # As the optimizer names them (plain_names): an earlier tiered saved a compiled model's under "_orig_mod."
        # names; a model's own "_orig_mod" submodule keeps its names where stripping would give two one name.
        names_read = plain_names([p.name for p in params])
        params = [p if p.name == n else replace(p, name=n) for p, n in zip(params, names_read)]
        pos, names = 0, set()
        for p in params:
            if p.name in names:
                raise Invalid(f"parameter {p.name!r} is listed twice")
            names.add(p.name)
            if p.numel != math.prod(p.shape):
                raise Invalid(f"parameter {p.name!r}: numel {p.numel} is not the product of its shape {list(p.shape)}")
            if p.offset != pos:
                raise Invalid(f"parameter {p.name!r}: offset {p.offset} is not {pos}, where the one before it ends")
            pos += p.numel
        files = {}
        for name, f in mapping(need(d, "files", "the manifest"), "files").items():
            if name not in FILES:
                raise Invalid(
                    f"files lists {show(name)}, which is not a file of a tiered checkpoint (it has only "
                    f"{', '.join(FILES)}, each directly in its folder); the file was not opened"
                )
            files[name] = _file(name, mapping(f, f"files[{name!r}]"))
        for name in FILES:
            if name not in files:
                raise Invalid(f"the file {name} is not listed")
        for name in ROW_FILES:
            if files[name].nbytes != pos * ELEMENT_BYTES:
                raise Invalid(
                    f"{name} is listed with {files[name].nbytes} bytes; the parameters need {pos * ELEMENT_BYTES}"
                )
        if integer(need(d, "numel", "the manifest"), "numel") != pos:
            raise Invalid(f"numel {d['numel']} is not the parameters' total {pos}")
        source = mapping(d.get("source", {}), "source")
        if "save_id" in source:
            check_save_id(source["save_id"], "source.save_id")
        return cls(
            step=integer(need(d, "step", "the manifest"), "step"),
            params=params,
            files=files,
            param_groups=groups,
            has_scheduler=boolean(need(d, "has_scheduler", "the manifest"), "has_scheduler"),
            extra_keys=[string(k, "extra_keys[]") for k in array(need(d, "extra_keys", "the manifest"), "extra_keys")],
            objects_weights_only=boolean(d.get("objects_weights_only", True), "objects_weights_only"),
            created_unix=real(need(d, "created_unix", "the manifest"), "created_unix (Unix seconds)", hi=MAX_UNIX_TIME),
            source=source,
            versions=mapping(d.get("versions", {}), "versions"),
        )


def _param(p: Any, i: int, groups: int) -> ParamEntry:
    p = mapping(p, f"params[{i}]")
    name = string(need(p, "name", f"params[{i}]"), f"params[{i}].name")  # as saved; stripped by the caller
    what = f"parameter {name!r}"
    shape = array(need(p, "shape", what), f"{what}: shape")
    group = integer(need(p, "group", what), f"{what}: group")
    if group >= groups:
        raise Invalid(f"{what}: group is {group}, but param_groups lists {groups} group(s)")
    return ParamEntry(
        name,
        tuple(integer(s, f"{what}: shape[{k}]") for k, s in enumerate(shape)),
        float_dtype(need(p, "dtype", what), f"{what}: dtype"),
        integer(need(p, "offset", what), f"{what}: offset"),
        integer(need(p, "numel", what), f"{what}: numel"),
        group,
        integer(need(p, "step", what), f"{what}: step"),
    )


def _file(name: str, f: dict[str, Any]) -> FileEntry:
    segments = []
    for k, seg in enumerate(array(need(f, "segments", name), f"{name}: segments")):
        if not isinstance(seg, list) or len(seg) != 3:
            raise Invalid(f"{name}: segment {k} is {show(seg)}: it must be [byte offset, nbytes, crc32]")
        off, n, crc = seg
        segments.append(
            (integer(off, f"{name}: segment {k} offset"), integer(n, f"{name}: segment {k} nbytes"),
             integer(crc, f"{name}: segment {k} crc32", hi=CRC_MAX))
        )  # fmt: skip
    try:
        entry = FileEntry.from_segments(name, integer(need(f, "nbytes", name), f"{name}: nbytes"), segments)
    except ValueError as e:
        raise Invalid(str(e)) from e
    if entry.crc32 != integer(need(f, "crc32", name), f"{name}: crc32", hi=CRC_MAX):
        raise Invalid(f"{name}: its segment CRCs do not combine into its crc32")
    return entry


def _self_crc(body: dict[str, Any]) -> int:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return zlib.crc32(canon.encode())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def json_view(value: Any) -> Any:
    """A JSON-safe rendering of a hyperparameter value (tuples become lists, other objects their repr)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [json_view(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_view(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return json_view(value.item())
    return repr(value)
