"""Checkpoints: sharded safetensors files plus a JSON manifest, and the Hugging Face layout.

``sharded`` is the save/load protocol every rank runs, ``format`` the manifest and ranged
reads, ``io`` the files themselves, ``offline`` the work behind the command-line tools.
"""

from .format import latest_checkpoint
from .sharded import load_checkpoint, save_checkpoint, save_full

__all__ = ["save_checkpoint", "load_checkpoint", "save_full", "latest_checkpoint"]
