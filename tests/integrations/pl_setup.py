"""A tiny GPT LightningModule and synthetic data for the Lightning tests (CPU, no downloads)."""

from __future__ import annotations

import hashlib
import time
import warnings
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from dstt.testing.models import TinyGPT

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*GPU available but not used.*")

SAMPLES, SEQ, VOCAB, BATCH = 24, 16, 64, 4  # 6 batches per epoch


class TinyLM(LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = TinyGPT(vocab=VOCAB, d=32, layers=2, heads=4, seq=SEQ, dropout=0.1)
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.net(x, y)
        self.log("train_loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.lr_schedulers().step()
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    y = torch.roll(x, -1, dims=1)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class ResumableLoader:
    """A train loader with Lightning's stateful-loader interface: resumes mid-epoch."""

    def __init__(self, inner: DataLoader) -> None:
        self.inner, self._skip, self._done = inner, 0, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Any:
        skip, self._skip = self._skip, 0
        self._done = skip
        for i, b in enumerate(self.inner):
            if i >= skip:
                self._done = i + 1
                yield b

    def state_dict(self) -> dict[str, int]:
        # all batches drawn: the next pass is a new epoch from its first batch
        return {"done": self._done % len(self.inner)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state["done"])


class Recorder(Callback):
    """Loss (and, with ``hashes``, model+optimizer hash) per global step; stops when asked."""

    def __init__(
        self,
        stop_at: int | None = None,
        echo: bool = False,
        pace_s: float = 0.0,
        hashes: bool = False,
    ) -> None:
        self.losses: dict[int, float] = {}
        self.hashes: dict[int, str] | None = {} if hashes else None
        self.start: int | None = None
        self.stop_at, self.echo, self.pace_s = stop_at, echo, pace_s

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = trainer.global_step
        if self.hashes is not None:
            self.hashes[trainer.global_step] = state_hash(pl_module, trainer.optimizers[0])
        if self.echo:
            print(f"start {trainer.global_step}", flush=True)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        k = trainer.global_step
        loss = float(outputs["loss"])
        self.losses[k] = loss
        if self.hashes is not None and k not in self.hashes:
            self.hashes[k] = state_hash(pl_module, trainer.optimizers[0])
        if self.echo:
            print(f"step {k} {loss.hex()}", flush=True)
        time.sleep(self.pace_s)
        if self.stop_at is not None and k >= self.stop_at:
            trainer.should_stop = True


def make_trainer(callbacks: list[Any], *, steps: int, accum: int = 1) -> Trainer:
    return Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accum,
        callbacks=callbacks,
    )


def model(seed: int = 0, manual: bool = False) -> TinyLM:
    lightning.seed_everything(seed, verbose=False)
    return TinyLM(manual=manual)


def state_hash(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    names = {id(p): n for n, p in module.named_parameters()}
    for n, p in sorted(module.named_parameters()):
        h.update(n.encode())
        h.update(p.detach().numpy().tobytes())
    for p, st in optimizer.state.items():
        h.update(names[id(p)].encode())
        for k in sorted(st):
            v = st[k]
            h.update(v.detach().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


# -- the time-travel loop: a learnable stream with corrupted samples planted in one step ----
TRAVEL_SAMPLES, TRAVEL_STEPS, ACCUM, SPIKE = 320, 40, 2, 38  # 40 steps per epoch
PLANTED = (300, 301, 302)  # 3 of the 4 samples of step 38's last micro-batch


class TravelLM(LightningModule):
    """Logs ``loss`` (what ``run.spikes()`` looks at by default); automatic optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyGPT(vocab=VOCAB, d=32, layers=2, heads=4, seq=SEQ, dropout=0.1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.net(x, y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def travel_data(planted: tuple[int, ...] = PLANTED) -> TensorDataset:
    """Each sample counts up modulo 8 from a random token (quickly learnt); the planted ones
    are random tokens from the rest of the vocabulary, with random labels."""
    g = torch.Generator().manual_seed(2)
    start = torch.randint(0, 8, (TRAVEL_SAMPLES, 1), generator=g)
    x = (start + torch.arange(SEQ)) % 8
    y = (x + 1) % 8
    for i in planted:
        x[i] = torch.randint(8, VOCAB, (SEQ,), generator=g)
        y[i] = torch.randint(8, VOCAB, (SEQ,), generator=g)
    return TensorDataset(x, y)


def travel_loader(data: TensorDataset | None = None) -> DataLoader:
    return DataLoader(travel_data() if data is None else data, batch_size=BATCH, shuffle=False)


def travel_trainer(callbacks: list[Any], *, steps: int = TRAVEL_STEPS) -> Trainer:
    return Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=1.0,
        callbacks=callbacks,
    )


def travel_model(seed: int = 0) -> TravelLM:
    lightning.seed_everything(seed, verbose=False)
    return TravelLM()


class Batches(Callback):
    """The batches Lightning trained on, in order (``x`` of each), and each one's loss."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.losses: list[float] = []

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.seen.append(batch[0].clone())

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
