"""Small deterministic models for the parity tests, and the data each one trains on.

Every model carries its own data and loss so the parity helpers need no per-model code:

- ``example(n, generator)`` -> ``(inputs, targets)``, a batch of ``n`` samples drawn only from
  ``generator`` (so a batch is a function of the seed it was drawn with);
- ``loss(output, targets)`` -> a scalar, the *mean* over the batch (so the loss of a global
  batch is the average of the per-rank losses over equal slices).

Models are built by :class:`ModelSpec`, a small picklable description that the harness can
send to the ranks; ``spec.build()`` seeds torch first, so every rank and the reference build
bit-identical weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


class MLPStack(nn.Module):
    """Linear/Tanh stack; ``extra`` adds a 1-D parameter of that size (used by forward) so
    tests can put the total parameter count exactly where they need it (padding edges)."""

    def __init__(self, sizes: tuple[int, ...] = (8, 16, 16, 4), extra: int = 0) -> None:
        super().__init__()
        self.sizes = tuple(sizes)
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < len(sizes) - 2:
                layers.append(nn.Tanh())
        self.layers = nn.Sequential(*layers)
        self.extra = nn.Parameter(torch.randn(extra) * 0.1) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        if self.extra is not None:
            out = out + torch.tanh(self.extra).mean()
        return out

    def example(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.sizes[0], generator=generator)
        y = torch.randn(n, self.sizes[-1], generator=generator)
        return x, y

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, targets)


class KitchenSink(nn.Module):
    """Everything that makes parameter bookkeeping hard, in one small model.

    - ``head.weight`` is tied to ``emb.weight`` (two state-dict keys, one parameter);
    - ``frozen_bias`` has ``requires_grad=False`` (in the state dict, never updated);
    - ``scale`` is a persistent buffer and ``mask`` a non-persistent one; with
      ``norm="batch"`` a BatchNorm1d (running statistics, updated by forward) is added too.
      BatchNorm normalises with the statistics of the batch each rank sees, so it can only
      be compared with torch DDP (same per-rank semantics), never with one process on the
      global batch;
    - ``unused`` is a Linear that forward never calls (it never gets a gradient);
    - with ``branches=True``, ``branch_a`` or ``branch_b`` runs depending on the parity of
      the first token of the batch: deterministic (integer data), but different on
      different ranks, so some parameters get a gradient on some ranks only.
    """

    vocab = 16
    dim = 8
    seq = 3

    def __init__(self, norm: str = "buffer", branches: bool = False) -> None:
        super().__init__()
        dim = self.dim
        self.emb = nn.Embedding(self.vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.frozen_bias = nn.Parameter(torch.randn(dim) * 0.1, requires_grad=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.register_buffer("mask", torch.ones(dim), persistent=False)
        self.bn = nn.BatchNorm1d(dim) if norm == "batch" else None
        self.unused = nn.Linear(dim, dim)
        self.branches = branches
        if branches:
            self.branch_a = nn.Linear(dim, dim)
            self.branch_b = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, self.vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(dim=1)  # (B, dim)
        h = torch.tanh(self.body(h) + self.frozen_bias) * self.scale * self.mask
        if self.bn is not None:
            h = self.bn(h)
        if self.branches:
            branch = self.branch_a if int(tokens[0, 0]) % 2 == 0 else self.branch_b
            h = h + torch.tanh(branch(h))
        h = h + self.out(h)
        return self.head(h)  # (B, vocab)

    def example(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (n, self.seq), generator=generator)
        targets = torch.randint(0, self.vocab, (n,), generator=generator)
        return tokens, targets

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, targets)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(
            dim, 3 * dim, bias=False
        )  # a key bias gets a zero gradient (softmax shift): Adam would amplify its noise
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Token + position embedding, 2 pre-LN blocks (SDPA attention + MLP), tied LM head."""

    vocab = 24
    dim = 16
    heads = 2
    seq = 5

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(self.vocab, self.dim)
        self.pos = nn.Parameter(torch.randn(self.seq, self.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(self.dim, self.heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(self.dim)
        self.head = nn.Linear(self.dim, self.vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)

    def example(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(0, self.vocab, (n, self.seq + 1), generator=generator)
        return data[:, :-1], data[:, 1:]

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, self.vocab), targets.reshape(-1))


class GatedBlock(nn.Module):
    """Three ``dim x dim`` tensors: two bias-free Linear weights and a ``gate`` registered on
    the block itself but used at the end of its forward (its gradient is ready first, though
    the block's hook runs before its children's)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(dim, dim) * 0.3)
        self.a = nn.Linear(dim, dim, bias=False)
        self.b = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.b(torch.tanh(self.a(x)))) @ self.gate


class ShuffledBlocks(nn.Module):
    """Blocks that forward runs in another order than they are registered in: ``order`` (by
    default the third, the first, the fourth, the second), never running those in ``skip``
    (their parameters get no gradient); ``checkpoint`` wraps each block in reentrant
    activation checkpointing. ``mix`` and ``head`` are registered on the model itself, so
    they come first in registration order (last in a reverse-order layout), and are used at
    the end of forward. Every tensor has 36 elements, a multiple of 1 to 4 and 6."""

    dim = 6

    def __init__(
        self, order: tuple[int, ...] = (2, 0, 3, 1), skip: tuple[int, ...] = (), checkpoint: bool = False
    ) -> None:
        super().__init__()
        self.order = tuple(i for i in order if i not in skip)
        self.checkpoint = checkpoint
        self.mix = nn.Parameter(torch.randn(self.dim, self.dim) * 0.3)
        self.head = nn.Parameter(torch.randn(self.dim, self.dim) * 0.3)
        self.blocks = nn.ModuleList(GatedBlock(self.dim) for _ in range(max(order) + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:  # reentrant checkpointing passes gradients only to inputs that need one
            x = x.detach().requires_grad_(True)
        for i in self.order:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(self.blocks[i], x, use_reentrant=True)
            else:
                x = self.blocks[i](x)
        return torch.tanh(x @ self.mix) @ self.head

    def example(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, self.dim, generator=generator), torch.randn(n, self.dim, generator=generator)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, targets)


FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLPStack,
    "kitchen": KitchenSink,
    "transformer": TinyTransformer,
    "shuffled": ShuffledBlocks,
}


@dataclass(frozen=True)
class ModelSpec:
    """A picklable, hashable recipe for one model: factory name, keyword options, seed."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    seed: int = 0

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return FACTORIES[self.name](**dict(self.options))


def spec(name: str, seed: int = 0, **options: Any) -> ModelSpec:
    return ModelSpec(name, tuple(sorted(options.items())), seed)


MLP = spec("mlp")
KITCHEN = spec("kitchen")
KITCHEN_BRANCHES = spec("kitchen", branches=True)
KITCHEN_BATCHNORM = spec("kitchen", norm="batch", branches=True)
TRANSFORMER = spec("transformer")


def param_groups(
    model: nn.Module, lr: float | None = None, exclude_from_decay: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Two groups the usual way: ``ndim >= 2`` decays (0.1), the rest does not (0.0).

    With ``lr``, the no-decay group trains at half that rate, so a mix-up between groups shows.
    Names starting with a prefix in ``exclude_from_decay`` go to the no-decay group whatever
    their shape. Frozen parameters are included on purpose: torch skips them (no grad) and
    shardpar must accept and skip them too.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.ndim >= 2 and not name.startswith(exclude_from_decay):
            decay.append(param)
        else:
            no_decay.append(param)
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if lr is not None:
        groups[0]["lr"] = lr
        groups[1]["lr"] = lr / 2
    return groups


def trainable_numel(model: nn.Module) -> int:
    """Ψ: unique trainable parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
