"""A tiny GPT and a deterministic batch stream, shared by tests, the demo and the benchmark.

Everything is a pure function of its seed: batch ``i`` is drawn from a generator seeded with
``(seed, i)``, independent of the global RNG, so a resumed run sees exactly the batches an
uninterrupted run saw. The model uses dropout on purpose, so bit-exact resume also proves the
global torch RNG was restored. Rejected alternative: a real tokenizer/dataset — slow,
networked, and no more informative for checkpoint correctness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["Block", "SyntheticBatches", "TinyGPT", "make_batch"]


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        out: torch.Tensor = x + self.drop(self.mlp(self.ln2(x)))
        return out


class TinyGPT(nn.Module):
    """A decoder-only transformer: token + position embeddings, ``layers`` blocks, tied head."""

    def __init__(
        self,
        vocab: int = 64,
        d: int = 32,
        layers: int = 2,
        heads: int = 4,
        seq: int = 16,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.seq = seq
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.layers = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: captured once, under params/tok/weight
        self.positions: torch.Tensor
        self.register_buffer("positions", torch.arange(seq), persistent=False)
        for m in self.modules():  # GPT-2 style init keeps the initial loss near ln(vocab)
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(self.positions[:t])
        for block in self.layers:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def make_batch(
    i: int, *, batch_size: int = 8, seq: int = 16, vocab: int = 64, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i``: rows of arithmetic sequences mod ``vocab`` (learnable), inputs and targets."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 5, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class SyntheticBatches:
    """``n`` deterministic batches (a re-iterable sequence, like a DataLoader of one epoch)."""

    def __init__(
        self, n: int, *, batch_size: int = 8, seq: int = 16, vocab: int = 64, seed: int = 0
    ) -> None:
        self.n, self.batch_size, self.seq, self.vocab, self.seed = n, batch_size, seq, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return make_batch(
            i, batch_size=self.batch_size, seq=self.seq, vocab=self.vocab, seed=self.seed
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self[i] for i in range(self.n))
