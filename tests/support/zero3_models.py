"""Models for the stage-3 tests (``tests/test_zero3.py``), kept apart from ``tests.support.models``.

:class:`Z3LM` is a small pre-LN transformer language model with everything stage 3 has to
get right in one place:

- ``head.weight`` is tied to ``tok.weight`` (two state-dict keys, one parameter, used at the
  start and at the end of forward);
- every block has a frozen parameter (``frozen_scale``, ``requires_grad=False``), which
  stage 3 shards and gathers like any other;
- a persistent buffer (``pos_scale``) and a non-persistent one (``mask``);
- 1-D and 2-D parameters, so the usual two param groups (decay for ``ndim >= 2``) differ.

Options add the awkward cases: a block applied twice in one forward (``repeat``), a whole
block that forward never calls (``spare``), a parameter forward never uses (``unused``),
a forward whose block order depends on the rank (``reverse_on_rank``; ``skip_on_rank``
skips the last block there), and blocks whose MLP
weights are frozen (``frozen_mlp``: frozen weights dominate, as in adapter fine-tuning).

Every block has exactly the same parameter count, so a rank-dependent block order issues
collectives of matching sizes (the engine can then detect the mismatch after forward
instead of crashing inside a collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else None


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, frozen_mlp: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        # No qkv bias: a key bias gets a (near) zero gradient that Adam would amplify.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.frozen_scale = nn.Parameter(torch.linspace(0.8, 1.2, dim), requires_grad=False)
        if frozen_mlp:
            self.fc.weight.requires_grad_(False)
            self.fc2.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d)) * self.frozen_scale
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class Z3LM(nn.Module):
    vocab = 32
    dim = 16
    heads = 2
    seq = 6

    def __init__(
        self,
        layers: int = 3,
        repeat: int | None = None,
        spare: bool = False,
        unused: bool = False,
        reverse_on_rank: int | None = None,
        skip_on_rank: int | None = None,
        frozen_mlp: bool = False,
    ) -> None:
        super().__init__()
        dim = self.dim
        self.tok = nn.Embedding(self.vocab, dim)
        self.pos = nn.Parameter(torch.randn(self.seq, dim) * 0.1)
        self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, self.seq).unsqueeze(1))
        self.register_buffer("mask", torch.ones(dim), persistent=False)
        self.blocks = nn.ModuleList(Block(dim, self.heads, frozen_mlp) for _ in range(layers))
        self.spare = Block(dim, self.heads) if spare else None
        self.unused = nn.Parameter(torch.randn(dim) * 0.1) if unused else None
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, self.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.repeat = repeat
        self.reverse_on_rank = reverse_on_rank
        self.skip_on_rank = skip_on_rank

    def block_order(self) -> list[nn.Module]:
        order: list[nn.Module] = []
        for index, block in enumerate(self.blocks):
            order.append(block)
            if index == self.repeat:
                order.append(block)  # the same unit twice in one forward
        rank = _rank()
        if rank is not None and rank == self.reverse_on_rank:
            order.reverse()
        if rank is not None and rank == self.skip_on_rank:
            order.pop()
        return order

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos[:t] * self.pos_scale[:t]
        for block in self.block_order():
            x = block(x)
        return self.head(self.ln_f(x) * self.mask)  # (B, T, vocab)

    # data and loss -------------------------------------------------------------------

    @classmethod
    def example(cls, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` sequences of ``seq`` tokens and their next-token targets, from ``generator`` only."""
        data = torch.randint(0, cls.vocab, (n, cls.seq + 1), generator=generator)
        return data[:, :-1], data[:, 1:]

    @classmethod
    def loss(cls, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy (so a global batch's loss is the mean of equal slices')."""
        return F.cross_entropy(output.reshape(-1, cls.vocab), targets.reshape(-1))


@dataclass(frozen=True)
class LMSpec:
    """Picklable, hashable recipe for a :class:`Z3LM`; ``build()`` seeds torch first so every
    rank and every reference get bit-identical weights."""

    options: tuple[tuple[str, Any], ...] = ()
    seed: int = 0

    def build(self) -> Z3LM:
        torch.manual_seed(self.seed)
        return Z3LM(**dict(self.options))

    def with_seed(self, seed: int) -> LMSpec:
        return LMSpec(self.options, seed)


def lm(seed: int = 0, **options: Any) -> LMSpec:
    return LMSpec(tuple(sorted(options.items())), seed)


def decay_groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """Two groups, the usual way: ``ndim >= 2`` decays, the rest does not (and trains at half
    the rate, so a mix-up between the groups shows). Frozen parameters are included: the
    optimizer must accept and skip them."""
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": 0.1, "lr": lr},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2},
    ]
