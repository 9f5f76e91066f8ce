"""IOConfig: the engine's knobs, validated once, loadable from a file written by `tiered-bench tune`."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from typing import Any, Literal

from .durable import write_json_atomic
from .sizes import parse_size

ENV_VAR = "TIERED_IO_CONFIG"
DirectMode = Literal["auto", "on", "off"]
SubmitMode = Literal["threads", "aio"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class IOConfig:
    """How the engine moves bytes.

    The defaults come from the GPU machine (bench/RESULTS.md, "The I/O configuration inside the step"):
    inside an optimizer step, where reads and write-backs share the disk, 1 MiB blocks over 32 threads beat
    8 MiB over 16 in every round of a same-model A/B (8 % off the step, with prefetch depth 8): small tasks
    let the engine's first-in first-out queue interleave reads and writes finely. Sweeps of one direction
    alone found the two within a few percent (32 x 1 MiB read faster in 8 of 10). Run `tiered-bench tune` to
    fit them to another disk.

    block_size:  a large request is split into tasks of this many bytes, spread over the threads.
    threads:     the disk's queue depth as the kernel sees it: worker threads, each with one synchronous
                 pread/pwrite in flight (``submit="threads"``), or kernel AIO requests in flight (``"aio"``).
    queue_depth: at most this many tasks wait in the engine's queue; a submit beyond it blocks until
                 workers catch up (bounded memory for huge batches of requests).
    submit:      "threads" (the default): each worker thread keeps one synchronous pread/pwrite in flight.
                 "aio": one thread keeps up to ``threads`` direct requests in the kernel's queue through Linux
                 kernel AIO (io_engine/kernel_aio.py), as DeepSpeed's libaio handle does; buffered pieces (an
                 unaligned head or tail, a filesystem without O_DIRECT) go to ``threads`` synchronous worker
                 threads beside it. Linux only; IOEngine refuses it where io_setup fails.
    direct:      "on" uses O_DIRECT and fails where the filesystem refuses it; "auto" falls back to
                 buffered I/O with one warning; "off" always goes through the page cache.
    alignment:   O_DIRECT's alignment of address, offset and length (4096 suits every common disk); at
                 most the page size, since host buffers are page-aligned.
    """

    block_size: int = 1 << 20
    threads: int = 32
    queue_depth: int = 4096
    direct: DirectMode = "auto"
    alignment: int = 4096
    submit: SubmitMode = "threads"

    def __post_init__(self) -> None:
        # Accept "8MiB" for sizes; frozen dataclasses need object.__setattr__ to normalise.
        object.__setattr__(self, "block_size", parse_size(self.block_size, name="block_size"))
        object.__setattr__(self, "alignment", parse_size(self.alignment, name="alignment"))
        if self.alignment < 512 or self.alignment & (self.alignment - 1) or self.alignment > mmap.PAGESIZE:
            # Above the page size, page-aligned host buffers would no longer be aligned enough.
            raise ValueError(
                f"alignment must be a power of two from 512 to the page size ({mmap.PAGESIZE}), got {self.alignment}"
            )
        if self.block_size < self.alignment or self.block_size % self.alignment:
            raise ValueError(
                f"block_size must be a positive multiple of alignment ({self.alignment}), got {self.block_size}"
            )
        for name in ("threads", "queue_depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.threads > 1024:
            raise ValueError(f"threads must be <= 1024, got {self.threads}")
        if self.direct not in ("auto", "on", "off"):
            raise ValueError(f"direct must be 'auto', 'on' or 'off', got {self.direct!r}")
        if self.submit not in ("threads", "aio"):
            raise ValueError(f"submit must be 'threads' or 'aio', got {self.submit!r}")

    def replace(self, **changes: Any) -> IOConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IOConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown IOConfig field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    def to_file(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, self.to_dict(), indent=2)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> IOConfig:
        try:
            with open(path) as f:
                data = json.load(f)
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a file that is not text
            raise ValueError(
                f"{os.fspath(path)} is not an IOConfig JSON file ({e}); rewrite it with `tiered-bench tune --out FILE`"
            ) from e
        if not isinstance(data, dict):
            raise ValueError(f"{os.fspath(path)} must hold a JSON object of IOConfig fields")
        data.pop("_measured", None)  # tune files may carry the figures they were chosen by
        return cls.from_dict(data)

    @classmethod
    def from_env(cls) -> IOConfig:
        """The config named by $TIERED_IO_CONFIG (a JSON file), else the defaults. A file that cannot be read or
        is not a valid IOConfig raises ValueError naming the variable and the file: the setting lives outside the
        program (a shell profile, a job script), so the message says where to look, and a caller that names its
        own paths in an OSError (the optimizer's folder) does not take it for one of those."""
        path = os.environ.get(ENV_VAR)
        if path:
            if not os.path.exists(path):
                raise ValueError(f"${ENV_VAR} names {path!r}, which does not exist (unset {ENV_VAR} for the defaults)")
            try:
                return cls.from_file(path)
            except (ValueError, TypeError, OSError) as e:  # bad value, unknown key (a newer version's), not JSON,
                raise ValueError(  # a folder, unreadable
                    f"${ENV_VAR} names {path!r}, which is not a usable IOConfig: {e} "
                    f"(fix the file, or unset {ENV_VAR} for the defaults)"
                ) from e
        return cls()
