"""Checkpoints: sharded safetensors files plus a JSON manifest, and the Hugging Face layout.

What every rank runs: ``save`` (save_checkpoint), ``load`` (load_checkpoint), ``export``
(save_full) and ``pretrained`` (load_pretrained), on the shared ``protocol`` (entering
together, agreeing after every phase, the model's inventory); ``async_save`` writes a save
in the background (the handle every save returns, the thread, what happens at exit). What
is on disk: ``format`` (the manifest, ``latest``), read by ``reader``; ``json_values``
(scalar values as JSON); ``hf`` (the Hugging Face layout) with ``hf_keys`` and
``hf_config``. The files themselves: ``io`` (the one safetensors reader and writer),
``host_bytes`` (a tensor's bytes, CUDA included; the staging buffer of background saves),
``files`` (regular files only, atomic commits), ``dtypes``. ``reorder`` carries tensors kept
in another element order; ``offline`` is the work behind the command-line tools.
"""

from .async_save import SaveHandle
from .export import save_full
from .format import latest_checkpoint
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "save_full", "latest_checkpoint", "SaveHandle"]
