"""Missing and unexpected keys of a Hugging Face checkpoint, as ``transformers`` reports them
for ``from_pretrained``: which stored names a model lacks, and which of its keys nothing
stored provides (tied weights counted once).

[Note: missing and unexpected keys]
:func:`match_keys` follows ``transformers`` 5.x ``from_pretrained`` (``core_model_loading``
and ``PreTrainedModel.tie_weights``/``_adjust_missing_and_unexpected_keys``), for a model
whose state-dict keys are the stored names (no ``base_model_prefix`` added or removed, no
key renaming):

- missing: state-dict keys that are not stored. Non-persistent buffers are not in the state
  dict, so they are never missing.
- tied weights: Hugging Face stores a tied group (``lm_head.weight`` and
  ``model.embed_tokens.weight``) once. Tying is symmetric while loading: if any member of
  a group is stored, no member is missing; if none is, all are.
- unexpected: stored names that are not state-dict keys (nor tied aliases). A stored
  non-persistent buffer is unexpected unless a pattern excuses it.
- patterns: ``transformers`` then drops missing keys matching the model's
  ``_keys_to_ignore_on_load_missing`` and unexpected keys matching
  ``_keys_to_ignore_on_load_unexpected``, plus ``rotary_emb.inv_freq`` and
  ``position_ids`` where the model has such buffers (they used to be persistent);
  :func:`hf_ignore_patterns` collects these from a ``transformers`` model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from torch import nn


class KeyReport(NamedTuple):
    missing_keys: list[str]
    """Model state-dict keys the checkpoint does not provide, in the model's order."""
    unexpected_keys: list[str]
    """Stored names the model has no key for, in the checkpoint's order."""


def tied_groups(aliases: Mapping[str, str]) -> dict[str, frozenset[str]]:
    """Each tied name -> every name tied with it (chains of aliases included)."""
    neighbours: dict[str, set[str]] = {}
    for alias, canonical in aliases.items():
        neighbours.setdefault(alias, set()).add(canonical)
        neighbours.setdefault(canonical, set()).add(alias)
    groups: dict[str, frozenset[str]] = {}
    for name in neighbours:
        if name in groups:
            continue
        group, frontier = {name}, [name]
        while frontier:
            for other in neighbours[frontier.pop()] - group:
                group.add(other)
                frontier.append(other)
        groups.update(dict.fromkeys(group, frozenset(group)))
    return groups


def _pattern(patterns: Iterable[str]) -> re.Pattern[str] | None:
    patterns = list(patterns)
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def match_keys(
    stored_names: Iterable[str],
    model_keys: Iterable[str],
    aliases: Mapping[str, str],
    *,
    ignore_missing: Iterable[str] = (),
    ignore_unexpected: Iterable[str] = (),
) -> KeyReport:
    """Missing and unexpected keys as ``transformers``' ``from_pretrained`` reports them.

    ``model_keys``: the model's state-dict keys; ``aliases``: tied name -> the name it is
    tied to (either may be the one stored); ``ignore_missing``/``ignore_unexpected``: regular
    expressions, searched in each key (:func:`hf_ignore_patterns`). See [Note: missing and
    unexpected keys].
    """
    stored = list(dict.fromkeys(stored_names))
    model = list(dict.fromkeys(model_keys))
    groups = tied_groups(aliases)
    provided = set(stored)
    provided.update(name for key in stored for name in groups.get(key, ()))
    known = set(model) | set(groups)
    missing = [key for key in model if key not in provided]
    unexpected = [key for key in stored if key not in known]
    skip_missing, skip_unexpected = _pattern(ignore_missing), _pattern(ignore_unexpected)
    return KeyReport(
        [key for key in missing if skip_missing is None or not skip_missing.search(key)],
        [key for key in unexpected if skip_unexpected is None or not skip_unexpected.search(key)],
    )


def hf_ignore_patterns(module: nn.Module) -> tuple[list[str], list[str]]:
    """``(ignore_missing, ignore_unexpected)`` patterns a ``transformers`` model applies when
    loading: its ``_keys_to_ignore_on_load_missing``/``_unexpected``, plus ``rotary_emb.inv_freq``
    and ``position_ids`` when it has buffers of those names (they were persistent in older
    checkpoints). Empty lists for a module that is not a ``transformers`` model."""
    if not hasattr(module, "_keys_to_ignore_on_load_unexpected"):
        return [], []
    missing = list(getattr(module, "_keys_to_ignore_on_load_missing", None) or [])
    unexpected = list(getattr(module, "_keys_to_ignore_on_load_unexpected", None) or [])
    buffers = [name for name, _ in module.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        unexpected.append(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        unexpected.append(r"(^|\.)position_ids$")
    return missing, unexpected
