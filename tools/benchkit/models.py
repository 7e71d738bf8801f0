"""The model zoo: MLP stacks and pre-norm transformers at three sizes (``--models KIND:SIZE``),
each with its per-rank batch and the block class that stage 3 and FSDP2 shard by."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "mlp" or "gpt"
    size: str
    width: int
    layers: int
    batch: int  # rows (mlp) or sequences (gpt) per rank
    seq: int = 0
    vocab: int = 0
    heads: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.size}"

    def build(self) -> nn.Module:
        if self.kind == "mlp":
            return MLPStack(self.width, self.layers, classes=self.width)
        return Transformer(self.width, self.layers, self.heads, self.vocab, self.seq)

    @property
    def unit_class(self) -> type[nn.Module]:
        """Stage-3 units and FSDP2 ``fully_shard`` calls: one per block, then the root."""
        return MLPBlock if self.kind == "mlp" else Block

    def batch_for(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "mlp":
            x = torch.randn(self.batch, self.width, generator=generator)
            return x, torch.randint(0, self.width, (self.batch,), generator=generator)
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)

    def describe(self) -> str:
        if self.kind == "mlp":
            return f"MLP stack, width {self.width}, {self.layers} blocks, batch {self.batch} rows/rank"
        return (
            f"transformer, width {self.width}, {self.layers} blocks, {self.heads} heads, vocab {self.vocab}, "
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
}


def parse_models(text: str) -> list[ModelSpec]:
    specs = []
    for item in text.split(","):
        kind, _, size = item.strip().partition(":")
        if kind not in SIZES or size not in SIZES[kind]:
            choices = ", ".join(f"{k}:{s}" for k in SIZES for s in SIZES[k])
            raise SystemExit(f"error: --models: unknown model {item!r}; choose from {choices}")
        specs.append(ModelSpec(kind, size, **SIZES[kind][size]))
    return specs
