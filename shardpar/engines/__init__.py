"""One engine per stage; each stage extends the one below (see DESIGN.md, layer 3)."""

from .base import Engine
from .ddp import AllReduceEngine

ENGINES: dict[int, type[Engine]] = {0: AllReduceEngine}

__all__ = ["ENGINES", "Engine", "AllReduceEngine"]
