"""The store's folder on disk: ``index.json`` and one file per record under ``records/``.

Layout::

    nvme_path/.lock                  # FolderLock (lock.py)
    nvme_path/index.json             # {"format": "tiered.store", "version": 1, "checksum": ALGORITHM, "records": {...}}
    nvme_path/records/<key>.bin      # the record's raw bytes; <key> percent-quoted (see record_file_name)

The index lists only records whose file is whole (``Record.on_disk``), each with its shape, dtype, nbytes
and the checksum taken when it was written. It is replaced atomically, so a reader sees the last flush.
"""

from __future__ import annotations

import json
import math
import os
import urllib.parse
from collections.abc import Iterator
from hashlib import sha256
from typing import Any

import torch

from .checksum import ALGORITHM
from .records import Record, check_key

__all__ = ["INDEX_FILE", "RECORDS_DIR", "record_file_name", "record_path", "index_entry", "write_index", "read_index"]

INDEX_FILE = "index.json"
RECORDS_DIR = "records"


def record_file_name(key: str) -> str:
    safe = urllib.parse.quote(key, safe="-_.")  # injective: distinct keys get distinct names
    if len(safe) > 180:  # keep under NAME_MAX (255) with room to spare
        safe = f"{safe[:100]}~{sha256(key.encode()).hexdigest()[:24]}"
    return f"{safe}.bin"


def record_path(folder: str, key: str) -> str:
    """Where record ``key`` of the store at ``folder`` keeps its bytes."""
    return os.path.join(folder, RECORDS_DIR, record_file_name(key))


def index_entry(rec: Record) -> dict[str, Any]:
    """``rec``'s line in the index. Call it under the store's lock, so the entry is one consistent state."""
    return {"file": os.path.basename(rec.path), "shape": list(rec.shape), "nbytes": rec.nbytes,
            "dtype": str(rec.dtype).removeprefix("torch."), "checksum": rec.checksum}  # fmt: skip


def write_index(folder: str, entries: dict[str, dict[str, Any]]) -> None:
    """Write index.json atomically: a temp file, fsync, rename (the commit), fsync of the folder."""
    path = os.path.join(folder, INDEX_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": "tiered.store", "version": 1, "checksum": ALGORITHM, "records": entries}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(folder: str) -> Iterator[Record]:
    """The records of the index at ``folder`` (none when it has no index), on NVMe only, in index order.

    Lazy: a malformed entry raises ``ValueError`` (naming the record and the fix) only once the entries
    before it have been yielded.
    """
    path = os.path.join(folder, INDEX_FILE)
    if not os.path.exists(path):
        return
    fix = "restore it from a copy, or move the folder aside and start a new store"
    try:
        with open(path) as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a TieredStore index ({err}): {fix}") from err
    if not isinstance(data, dict) or data.get("format") != "tiered.store" or data.get("version") != 1:
        raise ValueError(f"{path} is not a version-1 TieredStore index: {fix}")
    if data.get("checksum") != ALGORITHM:
        raise ValueError(f"{path} uses checksum {data.get('checksum')!r}; this version reads {ALGORITHM!r}")
    for key, e in data.get("records", {}).items():
        try:
            dtype, shape = getattr(torch, e["dtype"]), tuple(int(s) for s in e["shape"])
            if not isinstance(dtype, torch.dtype) or int(e["nbytes"]) != math.prod(shape) * dtype.itemsize:
                raise ValueError("its dtype and shape do not match its nbytes")
            if os.sep in e["file"] or e["file"].startswith("."):
                raise ValueError(f"bad file name {e['file']!r}")
            rec = Record(check_key(key), os.path.join(folder, RECORDS_DIR, e["file"]), shape, dtype, e["nbytes"])
            rec.on_disk, rec.checksum = True, int(e["checksum"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: the entry for record {key!r} is malformed ({exc}): {fix}") from exc
        yield rec
