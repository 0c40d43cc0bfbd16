"""One foreign checkpoint in torch's own terms: what every reader returns, what the writer takes.

A reader (``from_hf``, ``from_torch``, ``from_dcp``, ``from_deepspeed``, ``from_lightning``)
turns its framework's files into a :class:`Checkpoint`: model tensors by canonical dotted name
(parameters and persistent buffers apart, tied parameters once), the optimizer with its
parameters *named* (:class:`NamedOptimizer`), the scheduler's ``state_dict``, the RNG states
in the layout ``dstt.engine.state.torch_state.get_rng`` writes, the framework's progress objects
(``extra/transformers``, ``extra/lightning``), the logged metrics, and what the source did not
hold (``lacks``). ``dstt.integrations.imports.write`` then stores it as the engine would
store a captured step, so views, export and ``resume=True`` read it like any other commit.
Rejected alternative: each reader writing commits itself — five copies of the step layout,
and five places to get the optimizer objects subtly wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dstt.errors import SourceError

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "BUFFER_NAMES",
    "Checkpoint",
    "NamedOptimizer",
    "dedup_tied",
    "rng_object",
    "split_buffers",
    "split_by_model",
    "step_in_name",
]


@dataclass
class NamedOptimizer:
    """A torch optimizer's ``state_dict`` with parameter names instead of indices: ``groups``
    (hyperparameters and ``"params"``: the names, in group order) and ``state`` (name →
    that parameter's state: tensors and plain values)."""

    groups: list[dict[str, Any]]
    state: dict[str, dict[str, Any]]

    @staticmethod
    def of(osd: Mapping[str, Any], names: list[list[str]]) -> NamedOptimizer:
        """From ``optimizer.state_dict()`` and the names of each group's parameters (its
        ``"params"``: indices, or the names themselves)."""
        raw, state = osd.get("state") or {}, {}
        for g, group_names in zip(osd["param_groups"], names, strict=True):
            for idx, name in zip(g["params"], group_names, strict=True):
                if raw.get(idx):
                    state[name] = dict(raw[idx])
        return NamedOptimizer.named(osd["param_groups"], names, state)

    @staticmethod
    def named(
        groups: list[dict[str, Any]], names: list[list[str]], state: dict[str, dict[str, Any]]
    ) -> NamedOptimizer:
        """``groups``' hyperparameters with ``names`` as each group's ``"params"``."""
        return NamedOptimizer(
            [
                {**{k: v for k, v in g.items() if k != "params"}, "params": list(n)}
                for g, n in zip(groups, names, strict=True)
            ],
            state,
        )

    @property
    def names(self) -> list[str]:
        return [n for g in self.groups for n in g["params"]]


@dataclass
class Checkpoint:
    """One source checkpoint, read (see the module docstring)."""

    step: int
    source: str
    format: str
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: NamedOptimizer | None = None
    scheduler: Any = None
    #: object name (``rng``, or ``rng/r<rank>`` per rank) -> dstt's RNG object
    rng: dict[str, Any] = field(default_factory=dict)
    #: further objects stored as they are (``extra/transformers``, ``names/tied`` ...)
    objects: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    #: metrics of steps before this one that no imported checkpoint holds: (step, values)
    history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    #: what the source did not hold, in words (``"optimizer state"``, ``"RNG state"``)
    lacks: list[str] = field(default_factory=list)
    #: a model of the source's architecture (may live on the meta device), for dim names
    model: torch.nn.Module | None = None
    #: source files and their sizes in bytes (the import report's "read")
    files: dict[str, int] = field(default_factory=dict)

    def note_lacks(self) -> None:
        """Fill ``lacks`` from what is missing."""
        for what, missing in (
            ("optimizer state", self.optimizer is None),
            ("scheduler state", self.scheduler is None),
            ("RNG state", not self.rng),
        ):
            if missing and what not in self.lacks:
                self.lacks.append(what)


#: persistent buffers of torch's own modules (BatchNorm), told apart without the model
BUFFER_NAMES = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def split_buffers(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, buffers) of a model state dict without the model: a tensor is a buffer
    when it is not floating point or has a BatchNorm buffer's name."""
    p: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        is_param = t.is_floating_point() and name.rpartition(".")[2] not in BUFFER_NAMES
        (p if is_param else b)[name] = t
    return p, b


def split_by_model(
    tensors: Mapping[str, torch.Tensor], model: torch.nn.Module | None, *, where: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    """(parameters, buffers, tied names) of a model state dict: by ``model``'s own names when
    given (a tensor it does not have is a ``SourceError``), else by ``split_buffers``; tied
    tensors (sharing storage, or tied in ``model``) once."""
    from dstt.engine.state.model_names import param_names, tied_names
    from dstt.engine.state.torch_state import model_buffers
    from dstt.schema import user_name

    tensors, tied = dedup_tied(tensors)
    if model is None:
        params, buffers = split_buffers(tensors)
        return params, buffers, tied
    pnames = set(param_names(model).values())
    bnames = {user_name(p) for p in model_buffers(model)}
    tied = {**tied_names(model), **tied}
    params = {n: t for n, t in tensors.items() if n in pnames}
    buffers = {n: t for n, t in tensors.items() if n in bnames}
    unknown = sorted(set(tensors) - set(params) - set(buffers) - set(tied))
    if unknown:
        raise SourceError(
            f"{where}: tensors {unknown[:5]} are not in the model's "
            f"{type(model).__name__}; is model= the model that was trained?"
        )
    return params, buffers, tied


def dedup_tied(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors that share storage (tied weights, as ``torch.load`` restores them) once,
    under their first name; returns them and ``{further name: stored name}``."""
    out: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.dtype)
        if t.numel() and key[0] and key in seen:
            tied[name] = seen[key]
            continue
        seen.setdefault(key, name)
        out[name] = t
    return out, tied


def rng_object(state: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A framework's RNG snapshot (the Trainer's ``rng_state.pth`` layout: ``python``,
    ``numpy``, ``cpu``, optional ``cuda``) as dstt's RNG object."""
    try:
        py, npst, cpu = state["python"], state["numpy"], state["cpu"]
    except (KeyError, TypeError):
        raise SourceError(f"{where} is not an RNG snapshot (python, numpy, cpu)") from None
    out: dict[str, Any] = {
        "torch": bytes(torch.as_tensor(cpu).numpy().tobytes()),
        "numpy": (str(npst[0]), np.asarray(npst[1]), *[v for v in npst[2:]]),
        "python": py,
    }
    cuda = state.get("cuda")
    if cuda is not None:
        cuda = cuda if isinstance(cuda, list | tuple) else [cuda]
        out["cuda"] = [bytes(torch.as_tensor(c).numpy().tobytes()) for c in cuda]
    return out


_STEP = re.compile(r"(?:step|checkpoint|ckpt|iter|iteration)[-_=]?(\d+)", re.IGNORECASE)


def step_in_name(name: str) -> int | None:
    """The step a file or folder name states: the number after ``step``, ``global_step``,
    ``checkpoint-``, ``ckpt``, ``iter`` (``epoch=0-step=40.ckpt`` -> 40), or the whole name
    when it is a number (``1200.pt``); else None."""
    m = _STEP.search(name)
    if m:
        return int(m.group(1))
    stem = name.split(".", 1)[0]
    return int(stem) if stem.isdigit() else None
