"""A tiny GPT-2 and a synthetic dataset for the Trainer tests (nothing is downloaded)."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()

SAMPLES, SEQ, VOCAB = 24, 16, 64


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )  # dropout 0.1: the RNG matters
    return GPT2LMHeadModel(cfg)


def dataset(n: int = SAMPLES) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def args(
    out: str, *, max_steps: int, accum: int = 1, batch: int = 4, **kw: Any
) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        logging_steps=1,
        learning_rate=3e-3,
        warmup_steps=2,
        weight_decay=0.1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        **kw,
    )


class Recorder(TrainerCallback):  # type: ignore[misc]
    """Records the Trainer's loss per global step (and stops early when asked)."""

    def __init__(self, stop_at: int | None = None, echo: bool = False, pace_s: float = 0.0) -> None:
        self.losses: dict[int, float] = {}
        self.start: int | None = None
        self.stop_at, self.echo, self.pace_s = stop_at, echo, pace_s

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.start = state.global_step
        if self.echo:
            print(f"start {state.global_step}", flush=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])
            if self.echo:
                print(f"step {state.global_step} {float(logs['loss']).hex()}", flush=True)
            time.sleep(self.pace_s)  # lets the background commits keep up (a real step's time)


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
    """sha256 of the parameters and (when given) every optimizer state tensor."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().numpy().tobytes())
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in optimizer.state.items():
            h.update(names[id(p)].encode())
            for k in sorted(st):
                v = st[k]
                h.update(k.encode())
                h.update(
                    v.detach().cpu().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()
                )
    return h.hexdigest()


def trainer(model: torch.nn.Module, out: str, callbacks: list[Any], **kw: Any) -> Trainer:
    return Trainer(model=model, args=args(out, **kw), train_dataset=dataset(), callbacks=callbacks)


# -- the time-travel loop (test_hf_timetravel.py) ------------------------------------------
PATTERN_SAMPLES = 128  # 16 optimizer steps of 2 x 4 samples: one epoch


class PatternData(torch.utils.data.Dataset):  # type: ignore[misc]
    """Easily learnt sequences (each token the previous + 1, from one of 4 starts: the loss
    settles within a few steps); the samples in ``corrupt`` are random tokens instead (the
    bad data a rollback skips)."""

    def __init__(self, n: int = PATTERN_SAMPLES, corrupt: tuple[int, ...] = ()) -> None:
        g = torch.Generator().manual_seed(2)
        starts = torch.randint(0, 4, (n,), generator=g) * (VOCAB // 4)
        self.rows = [(s + torch.arange(SEQ)) % VOCAB for s in starts.tolist()]
        noise = torch.Generator().manual_seed(3)
        for i in corrupt:
            self.rows[i] = torch.randint(0, VOCAB, (SEQ,), generator=noise)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.rows[i]
        return {"input_ids": ids, "labels": ids.clone()}


class PatternStream(torch.utils.data.IterableDataset):  # type: ignore[misc]
    """The same samples as an IterableDataset: no sample indices reach the loader."""

    def __init__(self, n: int = PATTERN_SAMPLES) -> None:
        self.data = PatternData(n)

    def __iter__(self) -> Any:
        return (self.data[i] for i in range(len(self.data)))


def default_args(out: str, *, max_steps: int, **kw: Any) -> TrainingArguments:
    """The Trainer's defaults (clipping at max_grad_norm=1.0, linear decay, no warmup,
    tokens averaged across devices), 2 x 4 samples per optimizer step, on the CPU; a larger
    learning rate than the default so that the tiny model learns within a few steps."""
    return TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        **{
            "gradient_accumulation_steps": 2,
            "learning_rate": 3e-2,
            "logging_steps": 1,
            "report_to": [],
            "save_strategy": "no",
            "use_cpu": True,
            "disable_tqdm": True,
            "dataloader_num_workers": 0,
            **kw,
        },
    )
