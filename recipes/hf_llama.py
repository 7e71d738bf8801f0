"""A Hugging Face ``transformers`` causal LM built from a config (random init, no download),
so the recipe shows shardpar wrapping a model it did not write -- tied input/output
embeddings included. Needs the optional extra: ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes.gpt import _vocab_size


class HFCausalLM(nn.Module):
    """Adapts a transformers causal LM to the recipe's ``model(idx, targets) -> (logits, loss)``.

    The recipe's targets are already the next characters, so the loss is computed here
    instead of passing ``labels=`` (transformers would shift them a second time).
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        logits = self.lm(input_ids=idx, use_cache=False).logits  # (batch, time, vocab)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def hf_llama(block_size: int = 128, **overrides: Any) -> HFCausalLM:
    """A small Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU) with its
    LM head tied to the token embedding."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:  # optional extra
        raise ImportError('--model hf-llama needs Hugging Face transformers: pip install -e ".[hf]"') from error
    config = LlamaConfig(
        **(
            dict(
                vocab_size=_vocab_size(),
                hidden_size=128,
                intermediate_size=344,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=block_size,
                tie_word_embeddings=True,
                use_cache=False,
            )
            | overrides
        )
    )
    return HFCausalLM(LlamaForCausalLM(config))


def decoder_layer_class() -> type[nn.Module]:
    """The block class to name in ``wrap_policy`` at stage 3."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer
