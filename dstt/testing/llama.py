"""A Llama-style decoder built from a config, in plain torch: for checks at real model sizes.

RMSNorm before attention and MLP, rotary position embeddings, grouped-query attention through
``F.scaled_dot_product_attention`` (causal), a SwiGLU MLP, an untied output head; random init
(normal, std 0.02), no dropout. Two presets: ``LLAMA_125M`` (d=768, 12 layers, vocab 32k:
~134 M parameters) and ``LLAMA_1B`` (d=2048, 16 layers, 8 KV heads, vocab 32k: ~1.1 B), built
on any device with ``with torch.device(dev): TinyLlama(cfg)`` (initialized there, no CPU
detour). ``bench/gpu_check.py`` trains them to measure capture at those sizes.

Rejected alternative: ``transformers.LlamaForCausalLM`` from a config — an optional
dependency that a bare GPU machine may lack, whose module names (the checkpoint's array paths,
so the bytes and tensor counts measured) change between its versions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LLAMA_1B", "LLAMA_125M", "LlamaConfig", "RMSNorm", "TinyLlama"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a :class:`TinyLlama` (``heads`` must divide ``d``, ``kv_heads`` ``heads``)."""

    vocab: int = 32000
    d: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: int = 12
    ffn: int = 2048
    seq: int = 1024
    rope_theta: float = 10000.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d % self.heads or self.heads % self.kv_heads or (self.d // self.heads) % 2:
            raise ValueError(
                f"heads={self.heads} must divide d={self.d} into even head "
                f"sizes and kv_heads={self.kv_heads} must divide heads"
            )

    @property
    def head_dim(self) -> int:
        return self.d // self.heads

    def params(self) -> int:
        """The parameter count, without building the model."""
        kv = self.kv_heads * self.head_dim
        block = 2 * self.d * self.d + 2 * self.d * kv + 3 * self.d * self.ffn + 2 * self.d
        return 2 * self.vocab * self.d + self.layers * block + self.d


LLAMA_125M = LlamaConfig()
LLAMA_1B = LlamaConfig(d=2048, layers=16, heads=32, kv_heads=8, ffn=8192, seq=2048)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split convention; ``x`` is (batch, heads, time, head_dim)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:  # grouped-query: each KV head serves a group of queries
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.wo(a.transpose(1, 2).reshape(b, t, -1))
        return out


class SwiGLU(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, ffn, bias=False)  # gate
        self.w3 = nn.Linear(d, ffn, bias=False)  # up
        self.w2 = nn.Linear(ffn, d, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d, cfg.eps)
        self.mlp = SwiGLU(cfg.d, cfg.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class TinyLlama(nn.Module):
    """``forward(idx, targets=None) -> (logits, loss)``, like ``TinyGPT``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d, cfg.eps)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.seq).float(), inv)  # (seq, head_dim / 2)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos(), persistent=False)  # not model state
        self.register_buffer("sin", angles.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.cfg.seq:
            raise ValueError(f"sequence of {t} tokens, the model's rotary table has {self.cfg.seq}")
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.tok(idx)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
            )
        return logits, loss
