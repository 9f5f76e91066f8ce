"""``shards.json``: the map of a checkpoint sharded across ranks, and every field of it checked before it is believed.

A sharded checkpoint (sharded.py saves it) is a folder of one complete checkpoint per rank, ``rank-00000/``,
``rank-00001/``, ..., and this map of which rows of which global parameter each holds::

    {"format": 2, "world_size": W, "shards_crc32": C, "save_id": S,
     "ranks": [{"dir": "rank-00000", "params": [[name, global_shape, first_row, rows], ...]}, ...]}

FSDP2 shards dimension 0, so a rank's shard of a parameter is the rows ``[first_row, first_row + rows)``; a
rank with an empty shard lists it with 0 rows. A loader finds a row's bytes by offset in a part's row files,
so a map that lies loads another row's bytes, or zeros, without any CRC failing. Hence, as for a manifest:

- ``shards_crc32`` is the CRC-32 of the canonical JSON of every other field: an accident is damage.
- An edit that recomputes it must still make sense: folders are exactly ``rank-%05d`` of 0..W-1 in order
  (names from a fixed set, never a path); every rank lists the same parameters with the same global shapes;
  per parameter the ranks' row ranges are disjoint and cover its first dimension exactly.
- Each part's own manifest records what its saver held (``source["shard"]``: rank, world size, the same
  list), under that manifest's CRC; a loader checks it against the map (``check_part``), so swapped lists,
  swapped folders or a folder linked to another rank's are refused too.
- ``save_id`` is the save's identity (manifest.py), the same in the map and in every part's manifest: a part
  copied in from another save of the same layout is refused by it. A map saved before save ids has none.
- Rank folders are opened only when they are real folders (``lstat``: a link is never followed).

Format 1 (no checksum, no record in the parts) is refused by name: its rows cannot be checked.
"""

from __future__ import annotations

import json
import math
import os
import stat
import zlib
from dataclasses import dataclass, replace
from typing import Any

from ..arguments import plain_names
from .errors import CheckpointCorruptError, CheckpointFormatError, CheckpointNotFoundError, ManifestDamagedError
from .fsops import SHARDS
from .manifest import check_save_id
from .regular_files import read_regular
from .validate import FIX, Invalid, array, integer, loads, mapping, show, string

__all__ = ["SHARDS", "FORMAT", "Layout", "Shard", "ShardMap", "rank_dir", "is_sharded", "read_map", "check_part"]

FORMAT = 2
MAX_SHARDS_BYTES = 256 << 20  # a 100B-parameter model's map at a few thousand ranks is far below this
MAX_WORLD = 1 << 20
Layout = list[tuple[str, tuple[int, ...], int, int]]  # per parameter: name, global shape, first row, rows


@dataclass(frozen=True)
class Shard:
    """Rows ``[first, first + rows)`` of the global parameter ``name`` of shape ``shape``."""

    name: str
    shape: tuple[int, ...]
    first: int
    rows: int

    def to_json(self) -> list[Any]:
        return [self.name, list(self.shape), self.first, self.rows]


def rank_dir(rank: int) -> str:
    """Rank ``rank``'s part. Rank 0's is fsops.FIRST_PART, whose manifest dates the whole (prune, latest)."""
    return f"rank-{rank:05d}"


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """A folder with a ``shards.json`` (not followed through a link: a link there is refused on reading)."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, SHARDS))


def total_rows(shape: tuple[int, ...]) -> int:
    """Rows of a parameter of ``shape`` (a 0-dim one is one row of one element)."""
    return shape[0] if shape else 1


def row_numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:])


@dataclass
class ShardMap:
    """``shards.json``, checked: ``ranks[k]`` is rank k's shards, in the optimizer's parameter order."""

    ranks: list[list[Shard]]
    save_id: str | None = None  # the save's identity, as in every part's manifest; None: saved before save ids

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def part_record(self, rank: int) -> dict[str, Any]:
        """What rank ``rank``'s part records of itself in its manifest (``source["shard"]``)."""
        return {"rank": rank, "world_size": self.world_size, "params": [s.to_json() for s in self.ranks[rank]]}

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format": FORMAT,
            "world_size": self.world_size,
            "ranks": [{"dir": rank_dir(k), "params": [s.to_json() for s in r]} for k, r in enumerate(self.ranks)],
        }
        if self.save_id is not None:
            body["save_id"] = self.save_id
        body["shards_crc32"] = _self_crc(body)
        return body

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True) + "\n"

    @classmethod
    def from_layouts(cls, layouts: list[Any], save_id: str | None = None) -> ShardMap:
        """From every rank's ``Shards.layout()`` (or its JSON form), in rank order."""
        return cls([[Shard(n, tuple(s), int(r0), int(r)) for n, s, r0, r in lay] for lay in layouts], save_id)

    @classmethod
    def parse(cls, text: str, where: str) -> ShardMap:
        """Its CRC, then every field, then that the ranges tile each parameter. ManifestDamagedError (not
        JSON, or fails its CRC) or CheckpointFormatError (what no tiered writes, named with the fix)."""
        data = loads(text, where)
        if not isinstance(data, dict):
            raise CheckpointFormatError(f"{where} is not a tiered shards map (a JSON object): {FIX}")
        if data.get("format") == 1 and "shards_crc32" not in data:
            raise CheckpointFormatError(
                f"{where} is a shards map of format 1, written by an earlier tiered without a checksum, so its row "
                f"ranges cannot be checked; this tiered reads format {FORMAT}. Load the checkpoint with the tiered "
                "that saved it and save it again with this one, or load an earlier checkpoint"
            )
        if data.pop("shards_crc32", None) != _self_crc(data):
            raise ManifestDamagedError(f"{where} does not match its shards_crc32: the map of the shards is damaged")
        if data.get("format") != FORMAT:
            raise CheckpointFormatError(
                f"{where} is a shards map of format {show(data.get('format'))}; this tiered reads format {FORMAT}: "
                "use the tiered that wrote it"
            )
        try:
            return cls._from_body(data)
        except Invalid as e:
            raise CheckpointFormatError(f"{where}: {e}; {FIX}") from e

    @classmethod
    def _from_body(cls, d: dict[str, Any]) -> ShardMap:
        world = integer(d.get("world_size"), "world_size", hi=MAX_WORLD)
        ranks = array(d.get("ranks"), "ranks")
        if world < 1 or len(ranks) != world:
            raise Invalid(f"world_size is {world} but ranks lists {len(ranks)}: they must agree, and be >= 1")
        out: list[list[Shard]] = []
        for k, r in enumerate(ranks):
            r = mapping(r, f"ranks[{k}]")
            if set(r) != {"dir", "params"}:
                raise Invalid(f"ranks[{k}] has the keys {show(sorted(r))}; a rank's entry has exactly dir and params")
            if r["dir"] != rank_dir(k):
                raise Invalid(
                    f"ranks[{k}].dir is {show(r['dir'])}; rank {k}'s part is the folder {rank_dir(k)!r}, directly in "
                    "the checkpoint (a fixed name, never a path); the folder was not opened"
                )
            shards = [_shard(e, f"ranks[{k}].params[{i}]") for i, e in enumerate(array(r["params"], f"ranks[{k}]"))]
            # As the manifests' names (manifest.py): stripped of "_orig_mod" only where they stay unique.
            names = plain_names([s.name for s in shards])
            out.append([s if s.name == n else replace(s, name=n) for s, n in zip(shards, names)])
        _check_tiling(out)
        save_id = None if d.get("save_id") is None else check_save_id(d["save_id"], "save_id")
        return cls(out, save_id)


def _shard(e: Any, what: str) -> Shard:
    if not isinstance(e, list) or len(e) != 4:
        raise Invalid(f"{what} is {show(e)}: it must be [name, global shape, first row, rows]")
    name = string(e[0], f"{what}'s name")
    shape = tuple(integer(s, f"parameter {name!r}: shape[{j}]") for j, s in enumerate(array(e[1], f"{what}'s shape")))
    first, rows = integer(e[2], f"parameter {name!r}: first row"), integer(e[3], f"parameter {name!r}: rows")
    if first + rows > total_rows(shape):
        raise Invalid(f"parameter {name!r}: rows {first}..{first + rows} lie outside its shape {list(shape)}")
    return Shard(name, shape, first, rows)


def _check_tiling(ranks: list[list[Shard]]) -> None:
    """Every rank lists the same parameters with the same shapes, and per parameter the ranges tile its rows."""
    first = ranks[0]
    names = [s.name for s in first]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise Invalid(f"rank 0 lists the parameters {show(twice)} more than once")
    for k, r in enumerate(ranks[1:], 1):
        if [(s.name, s.shape) for s in r] != [(s.name, s.shape) for s in first]:
            raise Invalid(f"rank {k} lists other parameters (or shapes) than rank 0: every rank lists all of them")
    for i, s0 in enumerate(first):
        spans = sorted((r[i].first, r[i].first + r[i].rows, k) for k, r in enumerate(ranks) if r[i].rows)
        end, last = 0, None
        for a, b, k in spans:
            if a != end:
                what = "overlap" if a < end else "leave rows out between them"
                after = f"rank {last}'s rows end at {end}" if last is not None else "its rows start at 0"
                raise Invalid(
                    f"parameter {s0.name!r}: the ranks' row ranges {what}: {after}, rank {k}'s are {a}..{b}; "
                    f"they must cover rows 0..{total_rows(s0.shape)} exactly once"
                )
            end, last = b, k
        if end != total_rows(s0.shape):
            raise Invalid(
                f"parameter {s0.name!r}: the ranks' rows cover 0..{end} of its {total_rows(s0.shape)}; they must cover "
                "every row exactly once"
            )


def _self_crc(body: dict[str, Any]) -> int:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return zlib.crc32(canon.encode())


def read_map(root: str, dir_fd: int | None = None) -> ShardMap:
    """``root/shards.json``, checked (``ShardMap.parse``), with every rank folder it names checked to be a real
    folder (a link is refused, not followed). CheckpointNotFoundError when there is none. ``dir_fd``: an open
    descriptor of ``root``, through which the map and the folders are looked at (``root`` then only names them)."""
    fpath = os.path.join(root, SHARDS)
    try:
        data = read_regular(fpath, MAX_SHARDS_BYTES, dir_fd=dir_fd)  # no link followed, no FIFO waited on
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            root, f"it has no {SHARDS}, so it is not a checkpoint sharded across ranks"
        ) from None
    except OSError as e:
        raise CheckpointCorruptError(root, [(fpath, f"cannot be read ({e.strerror or e})")]) from e
    if len(data) > MAX_SHARDS_BYTES:
        raise CheckpointFormatError(f"{fpath} is larger than {MAX_SHARDS_BYTES} bytes, more than any map needs: {FIX}")
    try:
        shards = ShardMap.parse(data.decode("utf-8", errors="replace"), fpath)
    except ManifestDamagedError as e:
        raise CheckpointCorruptError(root, [(fpath, str(e))]) from e
    for k in range(shards.world_size):
        folder = os.path.join(root, rank_dir(k))
        try:
            mode = os.stat(folder if dir_fd is None else rank_dir(k), dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            raise CheckpointCorruptError(
                root, [(folder, f"is missing: {SHARDS} lists rank {k}'s part there")]
            ) from None
        if stat.S_ISLNK(mode):
            raise CheckpointFormatError(
                f"{folder} is a symbolic link; {SHARDS} lists rank {k}'s part there, and tiered never follows a link "
                f"out of a checkpoint folder: put the folder itself there, or {FIX}"
            )
        if not stat.S_ISDIR(mode):
            raise CheckpointFormatError(f"{folder} is not a folder; rank {k}'s part of a checkpoint is one: {FIX}")
    return shards


def check_part(shards: ShardMap, rank: int, source: dict[str, Any], params: list[Any], where: str) -> None:
    """Rank ``rank``'s part, by its manifest's ``source`` and ``params`` (ParamEntry), is what the map says:
    the part its saver wrote for that rank, holding those rows. CheckpointFormatError naming both, else."""
    record, expected = source.get("shard"), shards.part_record(rank)
    if record != expected:
        if isinstance(record, dict) and {"rank", "world_size"} <= set(record):
            says = f"rank {show(record['rank'])} of {show(record['world_size'])}'s shards"
            if record.get("rank") == rank and record.get("world_size") == shards.world_size:
                says += f", rows {show(record.get('params'))}"
        else:
            says = "no record of the shards it holds"
        raise CheckpointFormatError(
            f"{where} says it holds {says}; {SHARDS} lists it as rank {rank} of {shards.world_size}'s, rows "
            f"{show(expected['params'])}: the map and the part disagree (edited, swapped or linked folders); {FIX}"
        )
    if shards.save_id is not None and source.get("save_id") != shards.save_id:
        raise CheckpointFormatError(
            f"{where} was written by another save (save id {show(source.get('save_id'))}) than {SHARDS} (save id "
            f"{shards.save_id}): a part of another checkpoint was put in this one; {FIX}"
        )
    held = {p.name: tuple(p.shape) for p in params}
    for s in shards.ranks[rank]:
        local = (s.rows, *s.shape[1:]) if s.shape else ()
        if held.get(s.name) != local:
            found = "nothing" if s.name not in held else f"shape {list(held[s.name])}"
            raise CheckpointFormatError(
                f"{where}: {SHARDS} lists {s.rows} rows of {s.name!r} {list(s.shape)} in rank {rank}'s part, whose "
                f"manifest holds {found} for it; {FIX}"
            )
    if len(held) != len(shards.ranks[rank]):
        extra = sorted(set(held) - {s.name for s in shards.ranks[rank]})
        raise CheckpointFormatError(f"{where} holds parameters {show(extra)} that {SHARDS} does not list; {FIX}")
