"""The tests' own helpers (tests/helpers.py): a hang fails its test, and says where it stood."""

from __future__ import annotations

import threading

import pytest
from helpers import run_bounded


def test_a_hung_call_fails_with_every_threads_stack() -> None:
    """run_bounded's failure names the call that never returned and where it waits, so a hang seen once (a CI
    run under load) can be read without reproducing it."""
    release = threading.Event()

    def stuck_waiting_for_a_release_that_never_comes() -> None:
        release.wait()

    try:
        with pytest.raises(AssertionError, match="did not return within 0.2s") as failed:
            run_bounded(stuck_waiting_for_a_release_that_never_comes, timeout=0.2)
    finally:
        release.set()
    message = str(failed.value)
    assert "stuck_waiting_for_a_release_that_never_comes" in message and "release.wait()" in message
    assert "test_a_hung_call_fails_with_every_threads_stack" in message  # the test's own thread too


def test_a_call_that_returns_or_raises_in_time_is_its_result() -> None:
    assert run_bounded(lambda: 42, timeout=5) == 42
    with pytest.raises(ZeroDivisionError):
        run_bounded(lambda: 1 / 0, timeout=5)
