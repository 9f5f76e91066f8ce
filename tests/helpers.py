"""Helpers shared by the tests (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

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
