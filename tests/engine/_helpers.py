"""Shared helpers: bitwise tensor comparison and a tiny training step."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dstt.store import Repository


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes (so NaN payloads and -0.0 compare exactly)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t if t.dtype in (torch.uint8, torch.bool) else t.view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def committed_steps(repo: Repository) -> list[int]:
    return [h.step for h in repo.reader().lineage()]


def stored(repo: Repository, step: int, path: str) -> torch.Tensor:
    from dstt.engine.tensors._convert import tensor_from_numpy

    r = repo.reader()
    h = r.find(step)
    return tensor_from_numpy(r.read_array(h, path), r.arrays(h)[path].dtype)


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


class MLP(torch.nn.Module):
    """Two linear layers and an MSE loss; ``forward(x, y) -> (out, loss)`` like TinyGPT."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(d_in, hidden)
        self.l2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.l2(torch.relu(self.l1(x)))
        return out, torch.nn.functional.mse_loss(out, y)


def mlp_batch(
    i: int, d_in: int = 8, d_out: int = 4, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return (
        torch.randn(4, d_in, generator=g).to(dtype),
        torch.randn(4, d_out, generator=g).to(dtype),
    )
