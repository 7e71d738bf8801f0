"""Shared pytest setup: import paths and cleanup of the multi-rank harness."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The repository root, so `import shardpar`, `import recipes` and `from tests.support.harness
# import run_ranks` work however pytest was started.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.support.harness import shutdown_pools  # noqa: E402  (needs the path above)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Stop the rank pools while pytest still reports; atexit is only the fallback.
    shutdown_pools()
