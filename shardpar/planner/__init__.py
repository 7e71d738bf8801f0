"""The memory planner and communication model (see ``model.py``)."""

from .model import *  # noqa: F401,F403
from .model import __all__  # noqa: F401
