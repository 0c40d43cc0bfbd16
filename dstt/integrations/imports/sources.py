"""Which checkpoints a list of paths holds, in what format, at which step.

A path is one checkpoint when it is one (a Trainer folder, a DCP folder, a DeepSpeed tag, a
Lightning ``.ckpt``, a ``torch.save`` or ``.safetensors`` file); otherwise a folder is
searched one level down, so the folder a framework saves into imports whole. Each source's
step is found cheaply (``trainer_state.json``, the name, a memory-mapped look at a small file's
keys) so sources sort before any is read; the reader confirms it.

Rejected alternative: a recursive walk — a run folder often holds unrelated ``.pt`` files
(datasets, tokenizers) deeper down; one level is what every framework's layout needs.
Markers and folder names: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from dstt.errors import SourceError

from .checkpoint import step_in_name

__all__ = ["FORMATS", "Source", "Unknown", "find_sources", "reader_of"]

#: every format the importer reads: its module, reading function and step function (None:
#: the step in the folder's name)
_MODULES = {
    "hf-trainer": ("from_hf", "read_hf", "step_of_hf"),
    "torch": ("from_torch", "read_torch", "step_of_torch"),
    "lightning": ("from_lightning", "read_lightning", "step_of_lightning"),
    "dcp": ("from_dcp", "read_dcp", None),
    "deepspeed": ("from_deepspeed", "read_deepspeed", None),
}
FORMATS = tuple(_MODULES)
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".tar", ".safetensors")


@dataclass(frozen=True)
class Source:
    """One checkpoint to import: its path, format and (provisional) step."""

    path: str
    format: str
    step: int | None


@dataclass(frozen=True)
class Unknown:
    """A path that holds no checkpoint the importer knows."""

    path: str
    reason: str


def _kind(path: str) -> str | None:
    from .from_dcp import is_dcp_folder
    from .from_deepspeed import is_deepspeed_tag
    from .from_hf import is_hf_folder

    if os.path.isdir(path):
        if is_hf_folder(path):
            return "hf-trainer"
        if is_dcp_folder(path):
            return "dcp"
        if is_deepspeed_tag(path):
            return "deepspeed"
        return None
    if path.endswith(".ckpt"):
        return "lightning"
    if path.endswith(TORCH_SUFFIXES):
        return "torch"
    return None


def _function(fmt: str, name: str) -> Callable[..., Any]:
    """A function of a format's module (imported on demand: each pulls its framework)."""
    fn: Callable[..., Any] = getattr(import_module(f".{_MODULES[fmt][0]}", __package__), name)
    return fn


def _step(path: str, kind: str) -> int | None:
    named = step_in_name(os.path.basename(os.path.normpath(path)))
    step_of = _MODULES[kind][2]
    if step_of is None:
        return named
    found: int | None = _function(kind, step_of)(path)
    return (found or named) if kind == "hf-trainer" else found


#: files a framework writes beside its checkpoints (arguments, RNG, tokenizers)
_BESIDE = {"training_args.bin", "optimizer.pt", "scheduler.pt"}


def find_sources(
    paths: Iterable[str], *, step: int | None = None
) -> tuple[list[Source], list[Unknown], list[Unknown]]:
    """``(sources, unknown, ignored)`` under ``paths`` (see the module docstring): sources
    sorted by step (those without a known step last); paths that hold none; files found in a
    folder that are no step's checkpoint (a final ``model.safetensors`` beside the Trainer's
    ``checkpoint-*``). ``step`` overrides the step of a single source."""
    found: list[Source] = []
    unknown: list[Unknown] = []
    ignored: list[Unknown] = []
    for raw in paths:
        path = os.path.abspath(os.fspath(raw))
        if not os.path.exists(path):
            unknown.append(Unknown(path, "no such file or folder"))
            continue
        kind = _kind(path)
        if kind is not None:
            found.append(Source(path, kind, _step(path, kind)))
            continue
        if not os.path.isdir(path):
            unknown.append(
                Unknown(
                    path,
                    "not a checkpoint file dstt imports (.pt, .pth, .bin, .ckpt, .safetensors)",
                )
            )
            continue
        inner = []
        for name in sorted(os.listdir(path)):
            child = os.path.join(path, name)
            if name.startswith((".", "rng_state")) or name in _BESIDE:
                continue
            k = _kind(child)
            if k is None:
                continue
            found_step = _step(child, k)
            if found_step is None and k in ("torch", "lightning"):  # weights saved beside
                ignored.append(Unknown(child, "a file without a step in its name or contents"))
                continue
            inner.append(Source(child, k, found_step))
        if not inner:
            unknown.append(
                Unknown(
                    path,
                    "holds no checkpoint dstt imports (a Trainer, DCP "
                    "or DeepSpeed folder, .ckpt, .pt, .safetensors) "
                    "here or one level down",
                )
            )
        found.extend(inner)
    if step is not None:
        if len(found) != 1:
            raise SourceError(
                f"step= names the step of one checkpoint, but {len(found)} were "
                "found; give one source, or let each say its own step"
            )
        found = [Source(found[0].path, found[0].format, step)]
    found.sort(key=lambda s: (s.step is None, s.step or 0, s.path))
    return found, unknown, ignored


Reader = Callable[..., object]


def reader_of(fmt: str) -> Reader:
    """The reading function of a format."""
    if fmt not in _MODULES:
        raise ValueError(f"unknown checkpoint format {fmt!r}; dstt imports {', '.join(FORMATS)}")
    return _function(fmt, _MODULES[fmt][1])
