"""The Hugging Face config files an export writes beside the weights (``config.json`` and
``generation_config.json``), so that ``transformers.AutoModelForCausalLM.from_pretrained(OUT)``
takes an export as it takes a ``save_pretrained`` directory.

They come from the model: a ``transformers.PreTrainedModel`` has ``.config`` and, when it can
generate, ``.generation_config``, both with ``to_json_string()``. ``save_full`` writes them
at once; ``save_checkpoint`` stores them in the manifest (``hf_config``, covered by
``manifest_sha256`` like every other field), from where ``tools/consolidate.py`` writes them.
Nothing here imports transformers: the model is recognised by those methods alone.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from .dtypes import dtype_name

FILE_NAMES = {"config": "config.json", "generation_config": "generation_config.json"}
"""Key in the manifest's ``hf_config`` -> the file an export writes it to."""


def _as_json(config: Any) -> dict[str, Any] | None:
    to_json_string = getattr(config, "to_json_string", None)
    return json.loads(to_json_string()) if callable(to_json_string) else None


def hf_config_of(module: nn.Module) -> dict[str, dict[str, Any]] | None:
    """``{"config": ..., "generation_config": ...}`` of a transformers model (the second only
    when it has one); None for any other model. ``architectures`` names the model's class,
    as ``save_pretrained`` records it."""
    config = _as_json(getattr(module, "config", None))
    if config is None:
        return None
    found = {"config": {**config, "architectures": [type(module).__name__]}}
    generation = _as_json(getattr(module, "generation_config", None))
    if generation is not None:
        found["generation_config"] = generation
    return found


def config_files(
    hf_config: dict[str, dict[str, Any]] | None, weights_dtype: torch.dtype | None
) -> dict[str, dict[str, Any]]:
    """File name -> JSON object for an export; the config's dtype records the dtype of the
    exported weights (``--dtype bf16`` exports load as bf16), as ``save_pretrained`` does."""
    if hf_config is None:
        return {}
    files = {FILE_NAMES[key]: value for key, value in hf_config.items()}
    if weights_dtype is not None:
        config = files["config.json"]
        key = "torch_dtype" if "torch_dtype" in config else "dtype"  # transformers < 4.56 reads torch_dtype
        files["config.json"] = {**config, key: dtype_name(weights_dtype)}
    return files


def floating_dtype(dtypes: list[torch.dtype]) -> torch.dtype | None:
    """The dtype of the first floating-point tensor exported (the model's dtype, as
    transformers takes it), or None if there is none."""
    return next((dtype for dtype in dtypes if dtype.is_floating_point), None)
