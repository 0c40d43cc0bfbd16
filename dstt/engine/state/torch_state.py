"""Discovering providers from plain PyTorch objects: model, optimizer, scheduler, RNG.

Array paths mirror module paths (``params/...``, persistent ``buffers/...``, ``optim/<state>/
...``); buffers are cloned at capture (forward updates them in place), parameters and optimizer
state copied live. Capture happens at two moments: *step state* right after optimizer step k
(tensors, optimizer scalars, RNG, data position) and *boundary state* at the end of iteration
k (hyperparameters, LR scheduler, ``extra_state``), so a resumed step k+1 sees the learning
rate its scheduler set. Rejected alternative: one snapshot in the post-step hook (a resume
would redo a scheduler step and drift by one LR step). Optimizers: ``optimizers.py``; model
names: ``model_names.py``. More: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import operator
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from dstt import schema
from dstt.schema import tensor_path
from dstt.store._internal import RankInfo

from .model_names import ModelInfoProvider, canonical_names, param_names
from .optimizers import OptimizerStateProvider, optimizer_groups_provider, optimizers_of
from .providers import (
    CompositeProvider,
    ObjectProvider,
    RankObject,
    StateProvider,
    TensorProvider,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = [
    "ONE_RANK",
    "ModelTensors",
    "Stateful",
    "TorchState",
    "discover",
    "extra_state_objects",
    "get_rng",
    "model_buffers",
    "model_params",
    "model_tensors",
    "rng_provider",
    "scheduler_provider",
    "set_rng",
]


ONE_RANK = RankInfo(0, 1)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict``/``load_state_dict`` (user ``extra_state`` entries)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def extra_state_objects(
    extra_state: Mapping[str, Stateful] | None, info: RankInfo, **flags: bool
) -> list[RankObject]:
    """One ``RankObject`` (``extra/<name>``, ``flags`` as ``RankObject`` takes them) per user
    ``extra_state`` entry; ``TypeError`` for one without ``state_dict``/``load_state_dict``."""
    out = []
    for name, obj in (extra_state or {}).items():
        if not isinstance(obj, Stateful):
            raise TypeError(f"extra_state[{name!r}] needs state_dict() and load_state_dict()")
        name = f"{schema.EXTRA_OBJECT}/{name}"
        out.append(RankObject(name, info, obj.state_dict, obj.load_state_dict, **flags))
    return out


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of ``model`` by array path."""
    return {**model_params(model), **model_buffers(model)}


_generation = [0]  # bumped whenever any module registers a module, parameter or buffer
_hooked = [False]


def _bump(*_: Any) -> None:
    _generation[0] += 1


def _install_registration_hooks() -> None:
    if _hooked[0]:
        return
    from torch.nn.modules import module as m

    for name in (
        "register_module_module_registration_hook",
        "register_module_parameter_registration_hook",
        "register_module_buffer_registration_hook",
    ):
        reg = getattr(m, name, None)
        if reg is not None:
            reg(_bump)
    _hooked[0] = True


class ModelTensors:
    """``model_params``/``model_buffers`` of one model, cached across steps.

    Walking ``named_parameters()`` costs ~5 µs per module, on the training thread, at every
    captured step. Instead the (module dict, name) slot of every tensor is found once; a step
    reads the slots (one dict lookup each) and rebuilds the mapping only when a tensor object
    changed — or when any module registered a module, parameter or buffer since (torch's
    global registration hooks bump a generation counter). ``buffers=True``: the persistent
    buffers (``state_dict``'s), each once, not parameters.
    """

    #: the same mapping object at every call until a tensor of it changes (a new one then)
    stable = True

    def __init__(self, model: torch.nn.Module, *, buffers: bool = False) -> None:
        _install_registration_hooks()
        self.model, self.buffers = model, buffers
        self._gen = -1
        # the (module dict, name) slot of every tensor, as two columns: a step reads them
        # with one C-level map, no Python frame or line per tensor
        self._dicts: list[dict[str, Any]] = []
        self._keys: list[str] = []
        self._values: list[Any] = []
        self._out: dict[str, torch.Tensor] = {}

    def _rebuild(self) -> None:
        out = model_buffers(self.model) if self.buffers else model_params(self.model)
        # the modules' own dicts (torch's, private): a lookup in them sees a replaced tensor
        where = {
            id(t): (d, k)
            for mod in self.model.modules()
            for d in (mod._buffers if self.buffers else mod._parameters,)  # noqa: SLF001
            for k, t in d.items()
            if t is not None
        }
        slots = [where[id(t)] for t in out.values()]
        self._dicts = [d for d, _ in slots]
        self._keys = [k for _, k in slots]
        self._values = list(out.values())
        self._out = out
        self._gen = _generation[0]

    def __call__(self) -> dict[str, torch.Tensor]:
        if self._gen != _generation[0]:
            self._rebuild()
            return self._out
        try:
            now = list(map(operator.getitem, self._dicts, self._keys))
        except KeyError:
            now = None
        if (
            now is None
            or len(now) != len(self._values)
            or not all(map(operator.is_, now, self._values))
        ):
            self._rebuild()
        return self._out


def model_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by array path (canonical names; tied ones once, under their first name)."""
    named = list(model.named_parameters())
    canon = canonical_names(model, [n for n, _ in named])
    return {tensor_path("params", canon[n]): p for n, p in named}


def model_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers (what ``state_dict`` holds), each once."""
    found: dict[str, torch.Tensor] = {}
    seen = {id(p) for p in model.parameters()}
    for mod_name, mod in model.named_modules():
        # torch has no public list of which buffers are persistent (state_dict's rule)
        for bname, b in mod._buffers.items():  # noqa: SLF001
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:  # noqa: SLF001
                continue
            seen.add(id(b))
            found[f"{mod_name}.{bname}" if mod_name else bname] = b
    canon = canonical_names(model, found)
    return {tensor_path("buffers", canon[n]): b for n, b in found.items()}


def scheduler_provider(scheduler: Any) -> ObjectProvider:
    return ObjectProvider(schema.SCHEDULER_OBJECT, scheduler.state_dict, scheduler.load_state_dict)


def get_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    np.random.set_state(tuple(state["numpy"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def rng_provider(info: RankInfo = ONE_RANK) -> ObjectProvider:
    """Global RNGs: torch CPU, CUDA (when initialized), numpy's legacy global, ``random``;
    each rank's own (``rng/r<rank>`` with several)."""
    return RankObject(schema.RNG_OBJECT, info, get_rng, set_rng, required=True)


@dataclass(frozen=True)
class TorchState:
    """Providers of a plain-PyTorch trainer, split by capture moment (see module docstring)."""

    step_state: CompositeProvider
    boundary_state: CompositeProvider


def discover(
    model: torch.nn.Module | None,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    rng: bool = True,
    extra_state: Mapping[str, Stateful] | None = None,
    extra: Iterable[StateProvider] = (),
) -> TorchState:
    """Build the providers for a model, its optimizer(s) (one, a list or a dict:
    ``optimizers_of``), scheduler, global RNGs and user state."""
    step, boundary = CompositeProvider(), CompositeProvider()
    names = param_names(model) if model is not None else {}
    if model is not None:
        step.add(ModelInfoProvider(model))
        step.add(TensorProvider(ModelTensors(model)))
        # buffers change legitimately inside forward (BatchNorm statistics): clone at capture
        step.add(TensorProvider(ModelTensors(model, buffers=True), snapshot=True))
    for key, opt in optimizers_of(optimizer).items():
        step.add(OptimizerStateProvider(opt, names, key))
        boundary.add(optimizer_groups_provider(opt, names, key))
    if scheduler is not None:
        boundary.add(scheduler_provider(scheduler))
    for obj in extra_state_objects(extra_state, ONE_RANK, required=True):
        boundary.add(obj)
    for p in extra:
        step.add(p)
    if rng:
        step.add(rng_provider())  # last: restoring it must be the final word on RNG state
    return TorchState(step, boundary)
