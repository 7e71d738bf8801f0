"""What the checkpoint tools share: the import path, one-line errors, exit codes.

Arguments are parsed before shardpar (and so torch) is imported, so a usage error is
answered at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python tools/x.py` from a checkout, shardpar not installed

DTYPES = ["bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line ``error: ...`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def run(main: Callable[[], None]) -> NoReturn:
    """Exit 0 if ``main`` succeeds, 1 with one line ``error: ...`` on bad input."""
    try:
        main()
    except Exception as error:
        from shardpar import CheckpointError

        if not isinstance(error, (CheckpointError, ValueError, OSError)):
            raise  # a bug, not bad input: keep the traceback
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)
