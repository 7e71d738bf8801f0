"""The model zoo: MLP stacks and pre-norm transformers at three sizes (``--models KIND:SIZE``),
and the overhead stack (``overhead``, see [Note: the overhead model]), each with its per-rank
batch and the block class that stage 3 and FSDP2 shard by; and a nanochat-shaped GPT
(``nanochat:tiny``, ``nanochat:small``: :class:`NanochatGPT`) for issue #43's Muon benchmark,
the one model trained with Muon + AdamW (``ModelSpec.optimizers``, see optimizers.py).

[Note: the overhead model]
``overhead`` (``overhead:64``; ``overhead:4`` for quick runs, e.g. the tests) is issue #44's
model: 64 residual blocks of a LayerNorm and two Linear(64, 64), then a Linear(64, 64) head: 386
parameter tensors (weights of 4,096 elements, biases and norms of 64), Ψ = 544,832, batch 2 rows
per rank. Its compute is negligible, so its step time is what the host spends per step:
autograd's and the optimizer's per-tensor work, which plain torch also pays (at world size 1 it
is the floor), and the wrapper's, which grows with the number of tensors, not their size.
Compare it with plain torch at world size 1 (``--configs stage0,stage1,stage2,stage3,torch``)
and with the peers at world size N; the *host ms* and *shardpar calls* columns of the timing
table say where the difference goes ([Note: host columns] in measure.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .optimizers import ADAMW, MUON_ADAMW


class MLPBlock(nn.Module):
    """Residual feed-forward block: x + W2 gelu(W1 x)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(x)))


class MLPStack(nn.Module):
    def __init__(self, width: int, layers: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class OverheadBlock(nn.Module):
    """Residual pre-norm block of two square Linears: x + W2 gelu(W1 LN(x)); six parameter
    tensors, of which the biases and the norm's are ``width`` elements."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class OverheadStack(nn.Module):
    """Many small blocks, then a head: see [Note: the overhead model]."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OverheadBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Block(nn.Module):
    """Pre-norm transformer block with causal SDPA attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = MLPBlock(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, c/heads)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, c))
        return self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (batch, seq, vocab)


def _norm(x: torch.Tensor) -> torch.Tensor:
    """nanochat's RMSNorm: no learnable scale, so its model has matrices only."""
    return F.rms_norm(x, (x.size(-1),))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (batch, seq, heads, head_dim): its two halves rotated by the
    position's angles (``cos``, ``sin``: (1, seq, 1, head_dim/2))."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class NanochatAttention(nn.Module):
    """Causal attention as nanochat's: separate bias-free q, k, v and output projections,
    RoPE on q and k, then QK norm."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_q, self.c_k, self.c_v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.c_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, c // self.heads) for proj in (self.c_q, self.c_k, self.c_v))
        q, k = _norm(_rotate(q, cos, sin)), _norm(_rotate(k, cos, sin))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))  # y: (b, heads, t, c/heads)


class NanochatBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + W2 relu(W1 norm(x))^2; no biases."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn = NanochatAttention(width, heads)
        self.c_fc = nn.Linear(width, 4 * width, bias=False)
        self.c_proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(_norm(x), cos, sin)
        return x + self.c_proj(F.relu(self.c_fc(_norm(x))).square())


class NanochatGPT(nn.Module):
    """nanochat's GPT in shape: token embedding (no position embedding: RoPE in every block),
    an RMSNorm after it, blocks, a final RMSNorm, an untied bias-free head and nanochat's logit
    soft cap of 15. Every parameter is a matrix: the blocks' go to Muon, the embedding and the
    head to AdamW (:meth:`muon_params`, :meth:`adamw_params`), as nanochat's optimizers split
    them. Default torch initialisation (nanochat zeroes its output projections and head, which
    would make the first steps of a short run degenerate)."""

    def __init__(self, width: int, layers: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(NanochatBlock(width, heads) for _ in range(layers))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        half = width // heads // 2
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), 10000.0 ** (-torch.arange(half) / half))
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)  # (1, seq, 1, head_dim/2)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:, :t], self.sin[:, :t]
        x = _norm(self.wte(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(_norm(x))
        return 15.0 * torch.tanh(logits / 15.0)  # (batch, seq, vocab)

    def muon_params(self) -> list[nn.Parameter]:
        """The blocks' matrices, Muon's share."""
        return list(self.blocks.parameters())

    def adamw_params(self) -> list[nn.Parameter]:
        """The embedding and the head, AdamW's share."""
        return [self.wte.weight, self.lm_head.weight]


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "mlp", "gpt", "overhead" or "nanochat"
    size: str
    width: int
    layers: int
    batch: int  # rows (mlp) or sequences (gpt) per rank
    seq: int = 0
    vocab: int = 0
    heads: int = 0
    optimizers: str = ADAMW
    """What every configuration trains it with (optimizers.py): ``"adamw"``, or nanochat's
    ``"muon+adamw"`` (Muon over the blocks' matrices, AdamW over the rest)."""

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.size}"

    def build(self) -> nn.Module:
        if self.kind == "mlp":
            return MLPStack(self.width, self.layers, classes=self.width)
        if self.kind == "nanochat":
            return NanochatGPT(self.width, self.layers, self.heads, self.vocab, self.seq)
        if self.kind == "overhead":
            return OverheadStack(self.width, self.layers)
        return Transformer(self.width, self.layers, self.heads, self.vocab, self.seq)

    @property
    def unit_class(self) -> type[nn.Module]:
        """Stage-3 units and FSDP2 ``fully_shard`` calls: one per block, then the root."""
        return {"mlp": MLPBlock, "nanochat": NanochatBlock, "overhead": OverheadBlock}.get(self.kind, Block)

    def batch_for(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind in ("mlp", "overhead"):
            x = torch.randn(self.batch, self.width, generator=generator)
            return x, torch.randint(0, self.width, (self.batch,), generator=generator)
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)

    def describe(self) -> str:
        if self.kind == "mlp":
            return f"MLP stack, width {self.width}, {self.layers} blocks, batch {self.batch} rows/rank"
        if self.kind == "overhead":
            return (
                f"overhead stack, {self.layers} blocks of two Linear({self.width}, {self.width}) and a LayerNorm, "
                f"{6 * self.layers + 2} parameter tensors, batch {self.batch} rows/rank"
            )
        shape = "nanochat-shaped GPT (RoPE, QK norm, relu^2, untied head)" if self.kind == "nanochat" else "transformer"
        return (
            f"{shape}, width {self.width}, {self.layers} blocks, {self.heads} heads, vocab {self.vocab}, "
            f"batch {self.batch}x{self.seq} tokens/rank"
        )


SIZES = {
    "mlp": {
        "tiny": {"width": 32, "layers": 2, "batch": 8},
        "small": {"width": 256, "layers": 4, "batch": 128},
        "large": {"width": 512, "layers": 4, "batch": 128},
    },
    "gpt": {
        "tiny": {"width": 32, "layers": 2, "heads": 2, "vocab": 64, "seq": 16, "batch": 2},
        "small": {"width": 192, "layers": 4, "heads": 4, "vocab": 2048, "seq": 64, "batch": 4},
        "large": {"width": 256, "layers": 6, "heads": 4, "vocab": 4096, "seq": 64, "batch": 4},
    },
    "overhead": {  # the size is the number of blocks: see [Note: the overhead model]
        "4": {"width": 64, "layers": 4, "batch": 2},
        "64": {"width": 64, "layers": 64, "batch": 2},
    },
}
DEFAULT_SIZE = {"overhead": "64"}
"""The size a bare kind means (``--models overhead`` is ``overhead:64``)."""


NANOCHAT_SIZES = {
    "tiny": {"width": 32, "layers": 2, "heads": 2, "vocab": 64, "seq": 16, "batch": 2},
    "small": {"width": 128, "layers": 4, "heads": 2, "vocab": 2048, "seq": 64, "batch": 4},
}
"""Sizes of :class:`NanochatGPT`, ``--models nanochat:SIZE`` (issue #43's benchmark: small, 24
block matrices of 786 K elements to Muon and 524 K of embedding and head to AdamW, a launch of
four configurations at the default rounds in under a minute on 2 cores at world size 2). Head
dim 16 and 64, even, as RoPE's two halves need."""
SIZES["nanochat"] = NANOCHAT_SIZES
OPTIMIZERS = {"nanochat": MUON_ADAMW}
"""The kinds not trained with AdamW alone (``ModelSpec.optimizers``)."""


def parse_models(text: str) -> list[ModelSpec]:
    specs = []
    for item in text.split(","):
        kind, _, size = item.strip().partition(":")
        size = size or DEFAULT_SIZE.get(kind, "")
        if kind not in SIZES or size not in SIZES[kind]:
            choices = ", ".join([*(f"{k}:{s}" for k in SIZES for s in SIZES[k]), *DEFAULT_SIZE])
            raise SystemExit(f"error: --models: unknown model {item!r}; choose from {choices}")
        specs.append(ModelSpec(kind, size, **SIZES[kind][size], optimizers=OPTIMIZERS.get(kind, ADAMW)))
    return specs
