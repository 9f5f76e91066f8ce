"""Helpers shared by the tests (imported as `helpers`: tests/conftest.py puts tests/ and its folders on sys.path)."""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

TIMEOUT = 30.0  # seconds: only reached when something hangs

TESTS_ROOT = os.path.dirname(os.path.abspath(__file__))  # tests/: these helpers and the rank workers
REPO = os.path.dirname(TESTS_ROOT)  # the repository's root


def flip_byte(path, offset: int) -> None:
    """Damage a file as a bad disk would: one bit of the byte at ``offset`` flipped, the size kept."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x10]))


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
    assert not thread.is_alive(), f"call did not return within {timeout}s; where each thread stood:\n{stacks()}"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def stacks() -> str:
    """Every thread's stack, innermost call last: what a hang left stuck where (a hung test's failure carries it)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, '?')} ({ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def wait_until(condition, timeout=TIMEOUT, poll=0.01) -> bool:
    """Poll `condition()` until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def main_thread_joins() -> bool:
    """In a script's other thread, once its main thread has run its last line: whether the main thread now waits,
    at the interpreter's exit, for a thread to end (Python's own join of non-daemon threads, or an exit hook's
    join). Read from the main thread's innermost Python frame, so it needs no cooperation from the exit code."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    # join (3.13+) and _wait_for_tstate_lock (3.10-3.12): Thread.join; _shutdown: the interpreter's own join loop
    return frame is not None and frame.f_code.co_name in ("join", "_wait_for_tstate_lock", "_shutdown")


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


# ------------------------------------------------------------------------------------------- real faults
@contextlib.contextmanager
def small_tmpfs(size: str = "1m"):
    """A freshly mounted tmpfs of ``size`` (a real ENOSPC source); skips the test where mounting is not
    permitted (not root, or no CAP_SYS_ADMIN). Unmounted (lazily, so a leaked descriptor cannot stick) on exit."""
    import pytest

    path = tempfile.mkdtemp(prefix="tiered-tmpfs-")
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path],
                        capture_output=True, text=True)  # fmt: skip
    if rc.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here ({rc.stderr.strip() or rc.returncode}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(path)


def run_script(code: str, *, timeout: float = 120.0, cwd=None, env=None, user: str | None = None):
    """Run ``code`` in a fresh ``python -c`` (optionally as ``user`` via setpriv, without root's
    CAP_DAC_OVERRIDE) under a hard timeout. Returns the CompletedProcess; a hang fails the test."""
    import pytest

    cmd = [sys.executable, "-c", code]
    if user is not None:
        import pwd

        # numeric ids: the user's group may have another name (nobody: nogroup)
        entry = pwd.getpwuid(int(user)) if str(user).isdigit() else pwd.getpwnam(user)
        cmd = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", "--inh-caps=-all",
               *cmd]  # fmt: skip
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script hung (no exit within {timeout} s); output so far:\n{e.stdout}\n{e.stderr}")
