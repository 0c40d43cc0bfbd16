"""A tiny model and training step for the object-store tests (as in tests/engine/_helpers.py,
which a sibling test package cannot import)."""

from __future__ import annotations

import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    x, y = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    )


class MLP(torch.nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(d_in, hidden)
        self.l2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.l2(torch.relu(self.l1(x)))
        return out, torch.nn.functional.mse_loss(out, y)


def mlp_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())
