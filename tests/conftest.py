"""Shared fixtures. Tests marked `gpu` skip (never fail) where CUDA is missing."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# The tests live in folders by what they hold (unit/<package>, acceptance, gpu, tools), and import the shared
# helpers and, for the CUDA twins, their CPU twins by module name: every folder is on sys.path, whatever pytest
# collects first. Rank processes (spawn) inherit it.
for _folder in sorted(p for p in Path(__file__).resolve().parent.rglob("*") if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def pytest_configure(config):
    # The Ctrl-C tests press Ctrl-C as in a terminal. A test run started in the background (as CI may
    # be: nohup, `cmd &`) inherits SIGINT ignored, and so would every process it starts: restore Python's
    # default, which raises KeyboardInterrupt here and is reset to SIG_DFL in the processes we spawn.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The disk-bandwidth cache (tiered/telemetry.py) of this test run, not the user's ~/.cache; inherited by
    # the processes the tests start.
    os.environ["TIERED_CACHE_DIR"] = tempfile.mkdtemp(prefix="tiered-test-cache-")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
