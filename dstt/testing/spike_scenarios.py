"""Tiny CPU training runs with one loss-spike mechanism planted in each, for the tests and the
benchmark of ``run.explain`` (issue 40).

:func:`scenario` trains a :class:`~dstt.testing.models.TinyGPT` under ``dstt.session`` with
every step committed, on a map-style dataset read in order (so replay finds each step's
samples), and plants one of ``bad_data``, ``update_too_large``, ``attention_logit_growth``,
``adam_second_moment``, ``numerics`` (or ``clean``: nothing). :class:`Scenario` says what was
planted and where; :meth:`Scenario.replay` gives the replay objects for ``run.explain``.
Rejected alternative: spikes written into a run's metrics directly (fast, but then the
weights, optimizer state and batches hold no mechanism, and the checks would test nothing).
How each is planted: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

import dstt
from dstt.analysis import mechanisms
from dstt.errors import ConfigError

from .models import TinyGPT, make_batch

if TYPE_CHECKING:
    import os

__all__ = ["MECHANISMS", "Scenario", "Sequences", "scenario"]

MECHANISMS = (*mechanisms.MECHANISMS, "clean")  # and a run without a spike
SEQ, VOCAB, BATCH, D, LAYERS, HEADS = 16, 32, 8, 32, 2, 4
GROWTH_PUSH = 0.1  #: the attention scenario's push on the query/key weights (per step)


class Sequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` arithmetic sequences (a pure function of ``seed``); ``bad`` samples get random
    targets."""

    def __init__(self, n: int, *, seed: int = 0, bad: tuple[int, ...] = ()) -> None:
        x, y = make_batch(0, batch_size=n, seq=SEQ, vocab=VOCAB, seed=seed)
        g = torch.Generator().manual_seed(seed + 99)
        for i in bad:
            y[i] = torch.randint(0, VOCAB, (SEQ,), generator=g)
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss the scenarios' loop back-propagates (replay's ``loss_fn``)."""
    x, y = batch
    out: torch.Tensor = model(x, y)[1]
    return out


@dataclass(frozen=True)
class Scenario:
    """A trained run with ``mechanism`` planted: ``step`` is the first step whose logged loss
    shows it (None for ``clean``), ``points_at`` the planted tensors or sample indices."""

    path: str
    mechanism: str
    seed: int
    step: int | None
    points_at: tuple[Any, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    def build(self) -> tuple[TinyGPT, torch.optim.Optimizer]:
        """A model and optimizer built as the run built them (for replay)."""
        return _build(self.mechanism, self.seed)

    def replay(self) -> dict[str, Any]:
        """Replay objects for ``run.explain(..., replay=...)``."""
        model, opt = self.build()
        data = Sequences(self.options["samples"], seed=self.seed, bad=self.options["bad"])
        return {"model": model, "optimizer": opt, "dataset": data, "loss_fn": loss_fn}


def _build(mechanism: str, seed: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(vocab=VOCAB, d=D, layers=LAYERS, heads=HEADS, seq=SEQ, dropout=0.0)
    if mechanism == "attention_logit_growth":
        qk = [p for n, p in model.named_parameters() if n.endswith("qkv.weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("qkv.weight")]
        groups: list[dict[str, Any]] = [{"params": rest}, {"params": qk, "lr": 3e-2}]
        return model, torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.0)
    if mechanism == "adam_second_moment":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.0, 0.999), eps=1e-12)
        return model, opt
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def scenario(
    path: str | os.PathLike[str],
    mechanism: str,
    *,
    seed: int = 0,
    steps: int = 32,
    at: int = 30,
) -> Scenario:
    """Train ``steps`` steps into a new run at ``path`` with ``mechanism`` (one of
    :data:`MECHANISMS`) planted so that the loss logged at step ``at`` shows it."""
    if mechanism not in MECHANISMS:
        raise ConfigError(f"unknown mechanism {mechanism!r}; one of {', '.join(MECHANISMS)}")
    if not 12 <= at <= steps:
        raise ConfigError(f"at must be in 12..steps ({steps}), got {at}: the spike rule needs")
    samples = steps * BATCH
    g = torch.Generator().manual_seed(seed + 7)
    bad: tuple[int, ...] = ()
    points: tuple[Any, ...] = ()
    if mechanism == "bad_data":  # the batch of step `at` holds samples (at-1)*B .. at*B-1
        picks = torch.randperm(BATCH, generator=g)[:2].tolist()
        bad = tuple(sorted((at - 1) * BATCH + int(i) for i in picks))
        points = bad
    model, opt = _build(mechanism, seed)
    data = Sequences(samples, seed=seed, bad=bad)
    loader = DataLoader(data, batch_size=BATCH, shuffle=False)
    quiet = [p for n, p in model.named_parameters() if n.startswith("layers.1.mlp.")]
    qk = [p for n, p in model.named_parameters() if n.endswith("qkv.weight")]
    nan_param = dict(model.named_parameters())["layers.0.mlp.0.weight"]
    if mechanism == "adam_second_moment":
        points = tuple(n for n, _ in model.named_parameters() if n.startswith("layers.1.mlp."))
    elif mechanism == "numerics":
        points = ("layers.0.mlp.0.weight",)
    elif mechanism == "attention_logit_growth":
        points = tuple(f"layers.{i}" for i in range(LAYERS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend (restored below)
    try:
        _train(mechanism, path, model, opt, loader, at, quiet, qk, nan_param)
    finally:
        torch.set_num_threads(threads)
    planted = None if mechanism == "clean" else at
    opts = {"samples": samples, "bad": bad}
    return Scenario(str(path), mechanism, seed, planted, points, opts)


def _train(
    mechanism: str,
    path: str | os.PathLike[str],
    model: TinyGPT,
    opt: torch.optim.Optimizer,
    loader: DataLoader[Any],
    at: int,
    quiet: list[torch.nn.Parameter],
    qk: list[torch.nn.Parameter],
    nan_param: torch.nn.Parameter,
) -> None:
    with dstt.session(model, opt, run=path, every=1) as s:
        for batch in s.data(loader):
            k = s.step + 1  # the step this iteration makes
            loss = loss_fn(model, batch)
            loss.backward()
            if mechanism == "adam_second_moment" and k < at - 1:
                for p in quiet:  # the quiet stretch: v decays to the small gradients
                    if p.grad is not None:
                        p.grad.mul_(1e-4)
            if mechanism == "attention_logit_growth" and k < at:
                for p in qk:  # pushes |W_q|, |W_k| up: logit growth, sped up for a short run
                    if p.grad is not None:
                        p.grad[: 2 * D].add_(p.detach()[: 2 * D].sign(), alpha=-GROWTH_PUSH)
            if mechanism == "numerics" and k == at - 1 and nan_param.grad is not None:
                nan_param.grad.view(-1)[7] = float("nan")  # a non-finite gradient element
            lr = [grp["lr"] for grp in opt.param_groups]
            if mechanism == "update_too_large" and k == at - 1:
                for grp in opt.param_groups:
                    grp["lr"] *= 100.0
            opt.step()
            for grp, v in zip(opt.param_groups, lr, strict=True):
                grp["lr"] = v
            opt.zero_grad(set_to_none=True)
            s.log(loss=float(loss.item()))
