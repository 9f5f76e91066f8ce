"""Helpers shared by the tests (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import mmap
import os
import threading

TIMEOUT = 30.0  # seconds: only reached when something hangs


def run_bounded(fn, timeout=TIMEOUT):
    """Run fn() in a daemon thread; return its result or re-raise its exception; fail if it hangs."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"call did not return within {timeout}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def odirect_512_supported(directory) -> bool:
    """Whether O_DIRECT on this filesystem takes 512-byte aligned offsets, lengths and addresses."""
    probe = os.path.join(directory, ".odirect512")
    with open(probe, "wb") as f:
        f.write(bytes(8192))
    mm = mmap.mmap(-1, 8192)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        os.unlink(probe)
        return False
    try:
        return os.preadv(fd, [memoryview(mm)[512:1024]], 512) == 512
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)
