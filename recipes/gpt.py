"""A small decoder-only transformer (GPT-2 shape) used by the shardpar recipes and tests.

Nothing here knows about shardpar: the model is plain ``torch.nn`` so that the same
module can be trained single-process as a reference and wrapped at any ZeRO stage.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

__all__ = ["GPTConfig", "GPT", "Block", "small_gpt", "tiny_gpt", "param_groups", "muon_and_adamw_params"]


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int
    """Number of token ids; the embedding and the (tied) LM head have this many rows."""
    block_size: int
    """Longest context the learned position embedding covers."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    bias: bool = True
    """Whether Linear layers and LayerNorms carry a bias."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using the fused SDPA kernel."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C)
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_head)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, H, T, D)
        y = rearrange(y, "b h t d -> b t (h d)")
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(4x) -> GELU -> Linear."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model with a LM head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying: one Parameter reachable under two names. named_parameters() yields it
        # once (as tok_emb.weight), which is exactly what sharding and checkpoints must handle.
        self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init, drawn from the global torch RNG so a fixed seed gives fixed weights."""
        # Residual projections are scaled down so the residual stream's variance does not
        # grow with depth (GPT-2 paper, section 2.3).
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if module is self.lm_head:
                continue  # its weight is tok_emb.weight, initialised as an embedding below
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, include_positions: bool = True) -> int:
        """Number of distinct parameters (the tied head is counted once)."""
        n = sum(p.numel() for p in self.parameters())
        return n if include_positions else n - self.pos_emb.weight.numel()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, loss)``; ``loss`` is mean cross-entropy, or None without targets.

        ``idx`` and ``targets`` are (B, T) token ids with ``T <= block_size``.
        """
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block_size {self.config.block_size}; "
                "use a shorter --block-size or a model with a larger block_size"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        # Loss in fp32 even under autocast/mixed precision: the softmax over V is where
        # low precision hurts most.
        loss = F.cross_entropy(rearrange(logits.float(), "b t v -> (b t) v"), rearrange(targets, "b t -> (b t)"))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); greedy if temperature == 0."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :].float()  # (B, V)
            if temperature == 0.0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_id], dim=1)
        return idx


def _vocab_size() -> int:
    # Imported lazily so that `recipes.gpt` stays importable on its own.
    from recipes.data import VOCAB_SIZE

    return VOCAB_SIZE


def small_gpt(**overrides: Any) -> GPT:
    """~0.8M-parameter GPT sized for the character-level recipe; trains on CPU in minutes."""
    cfg: dict[str, Any] = dict(vocab_size=_vocab_size(), block_size=128, n_layer=4, n_head=4, n_embd=128)
    return GPT(GPTConfig(**(cfg | overrides)))


def tiny_gpt(**overrides: Any) -> GPT:
    """Tens of thousands of parameters, for fast tests."""
    cfg: dict[str, Any] = dict(vocab_size=_vocab_size(), block_size=32, n_layer=2, n_head=2, n_embd=32)
    return GPT(GPTConfig(**(cfg | overrides)))


def param_groups(model: nn.Module, weight_decay: float | None = None) -> list[dict[str, Any]]:
    """The usual two AdamW groups: decay for matrices/embeddings (``ndim >= 2``), none otherwise.

    Works on any module, including a ``shardpar.ShardedModule`` whose ``named_parameters()``
    keeps the original names (possibly with a prefix) and shapes. With ``weight_decay=None`` the
    decay group takes the optimizer's default.
    """
    return _decay_groups([p for _, p in model.named_parameters() if p.requires_grad], weight_decay)


def _decay_groups(params: list[nn.Parameter], weight_decay: float | None) -> list[dict[str, Any]]:
    decay_group: dict[str, Any] = {"params": [p for p in params if p.ndim >= 2]}
    if weight_decay is not None:
        decay_group["weight_decay"] = weight_decay
    return [decay_group, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


BLOCK_PARAMETER = re.compile(r"(^|\.)(blocks|layers)\.\d+\.")
"""A parameter inside a transformer block: ``blocks.N.`` in :class:`GPT`, ``layers.N.`` in
Llama (after any prefix a wrapper adds)."""


def muon_and_adamw_params(
    model: nn.Module, weight_decay: float | None = None
) -> tuple[list[nn.Parameter], list[dict[str, Any]]]:
    """nanochat's split of one model between two optimizers: the 2-D weight matrices inside the
    transformer blocks for Muon (it orthogonalises a matrix's update); everything else for
    AdamW (the embeddings and the head tied to one, the norms, the biases), as
    :func:`param_groups`' two groups.

    Works on a ``shardpar.ShardedModule`` as on the plain module (the names are kept).
    """
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (matrices if p.ndim == 2 and BLOCK_PARAMETER.search(name) else rest).append(p)
    return matrices, _decay_groups(rest, weight_decay)
