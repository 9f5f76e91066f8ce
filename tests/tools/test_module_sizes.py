"""Every module of the packages reads in one sitting: one concept, at most ``MAX_LINES`` lines.

A module past it is split along a seam of its own into a module that explains itself, with a row in
docs/internals.md. Only the source is read, so the test is fast.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
PACKAGES = ("io_engine", "tiered")
MAX_LINES = 450


def test_every_module_stays_within_the_line_guideline() -> None:
    over = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_LINES:
                over[str(path.relative_to(ROOT))] = lines
    assert not over, (
        f"modules over {MAX_LINES} lines: {over}; split each along a natural seam into a module of its own "
        "(and give it a row in docs/internals.md)"
    )
