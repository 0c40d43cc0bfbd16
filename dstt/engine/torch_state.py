"""Discovering providers from plain PyTorch objects: model, optimizer, scheduler, RNG, data.

Array paths mirror module paths so inspection can rebuild the module tree:
``params/<module path with '/'>/<name>``, ``buffers/...`` (persistent buffers only) and
``optim/<state name>/<module path>/<name>`` for per-parameter optimizer tensors. Buffers are
cloned at capture time (forward legitimately updates BatchNorm statistics in place, which the
version guard would report as a race); parameters and optimizer state are copied live. Scalar
optimizer state (Adam's ``step``) is packed into one object, ``optim/state``, because a file per
0-d tensor per step costs ~1 ms each on this machine; it stays an array only when it lives on
an accelerator (reading it on the host would force a device sync in the optimizer hook).

Capture happens at two moments (see ``discover``): *step state* right after optimizer step k
(tensors, optimizer scalars, RNG, data position) and *boundary state* at the end of iteration k
(optimizer hyperparameters, LR scheduler, user ``extra_state``): when the loop asks
``TrackedData`` for the next batch, else just before optimizer step k+1. The usual loop calls
``scheduler.step()`` (and updates its own counters) after ``optimizer.step()``, and the resumed
step k+1 must see the learning rate the scheduler set for it. RNG stays with the step state
because the forward of step k+1 consumes it before the next optimizer step.
Rejected alternative: one snapshot in the post-step hook — a resumed run would redo the
scheduler step it already took and drift by one LR step.

Restore goes through ``optimizer.load_state_dict`` (the optimizer's own casting and device
rules), built from stored arrays, so a fresh optimizer with no state yet restores too.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import SchemaError
from ..store.predict import Prediction
from ._convert import flat_bytes, from_plain, store_dtype, to_plain, torch_dtype
from .predictions import optimizer_predictions
from .providers import (
    CompositeProvider,
    ObjectProvider,
    RestoreSource,
    StateProvider,
    TensorProvider,
)

__all__ = [
    "DataPosition",
    "OptimizerStateProvider",
    "Stateful",
    "TorchState",
    "TrackedData",
    "discover",
    "model_buffers",
    "model_params",
    "model_tensors",
    "optimizer_groups_provider",
    "param_names",
    "rng_provider",
    "scheduler_provider",
    "tensor_path",
]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict``/``load_state_dict`` (user ``extra_state`` entries)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@functools.lru_cache(maxsize=1 << 16)
def tensor_path(prefix: str, dotted: str) -> str:
    """``params`` + ``layers.0.attn.weight`` → ``params/layers/0/attn/weight`` (cached: it
    runs for every tensor of every captured step)."""
    return f"{prefix}/{dotted.replace('.', '/')}"


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) → dotted name (first name wins for tied parameters)."""
    return {id(p): name for name, p in model.named_parameters()}


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of ``model`` by array path."""
    return {**model_params(model), **model_buffers(model)}


def model_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {tensor_path("params", name): p for name, p in model.named_parameters()}


def model_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers (what ``state_dict`` holds), each once."""
    out: dict[str, torch.Tensor] = {}
    seen = {id(p) for p in model.parameters()}
    for mod_name, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out[tensor_path("buffers", f"{mod_name}.{bname}" if mod_name else bname)] = b
    return out


def _is_array_state(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.dim() > 0 or not v.is_cpu)


class OptimizerStateProvider:
    """Per-parameter optimizer state (Adam/AdamW/SGD/...): tensors as arrays, scalars packed."""

    OBJECT = "optim/state"

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> None:
        self.optimizer = optimizer
        self._names = names

    def params(self) -> Iterator[tuple[torch.Tensor, str]]:
        """Parameters in ``state_dict`` order with their dotted names."""
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                yield p, self._names.get(id(p), f"unnamed.group{gi}.param{pi}")

    def tensors(self) -> Mapping[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for p, name in self.params():
            for key, v in self.optimizer.state.get(p, {}).items():
                if _is_array_state(v):
                    out[tensor_path(f"optim/{key}", name)] = v
        return out

    def predictions(self) -> Mapping[str, Prediction]:
        """Arrays of the step just taken that the store may encode as predictions."""
        return optimizer_predictions(self.optimizer, self.params(), tensor_path)

    def objects(self) -> Mapping[str, Any]:
        """The non-array state, packed: 0-d tensors (Adam's ``step`` of every parameter) go
        into one array per (key, dtype, device) with a single ``torch.stack`` — a snapshot
        taken here, on the training thread, at the cost of one call instead of a tagged
        object per parameter (~10 µs each); anything else stays a plain value."""
        names: list[str] = []
        arrays: list[list[str]] = []
        scalars: dict[tuple[str, torch.dtype, torch.device], tuple[list[int],
                                                                   list[torch.Tensor]]] = {}
        values: dict[str, dict[str, Any]] = {}
        for p, name in self.params():
            st = self.optimizer.state.get(p)
            if st is None:
                continue
            i = len(names)
            names.append(name)
            keys: list[str] = []
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    if v.dim() > 0 or not v.is_cpu:
                        keys.append(k)
                        continue
                    idx, ts = scalars.setdefault((k, v.dtype, v.device), ([], []))
                    idx.append(i)
                    ts.append(v)
                else:
                    values.setdefault(name, {})[k] = to_plain(v)
            arrays.append(keys)
        packed = [{"key": k, "dtype": store_dtype(dt, what=f"optimizer state {k!r}"),
                   "params": idx, "values": _scalar_bytes(ts, dt)}
                  for (k, dt, _), (idx, ts) in scalars.items()]
        return {self.OBJECT: {"packed": 1, "params": names, "arrays": arrays,
                              "scalars": packed, "values": values}}

    def restore(self, source: RestoreSource) -> None:
        saved = source.object(self.OBJECT) if source.has_object(self.OBJECT) else {}
        entries = _unpack_state(saved)
        state: dict[int, dict[str, Any]] = {}
        for idx, (_, name) in enumerate(self.params()):
            entry = entries.get(name)
            if entry is None:
                continue
            values = {k: from_plain(v) for k, v in entry["values"].items()}
            for key in entry["arrays"]:
                values[key] = source.array(tensor_path(f"optim/{key}", name))
            state[idx] = values
        unknown = set(entries) - {name for _, name in self.params()}
        if unknown:
            raise SchemaError(
                f"step {source.step} has optimizer state for parameters the live optimizer "
                f"does not have: {sorted(unknown)[:5]}"
            )
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _scalar_bytes(ts: list[torch.Tensor], dtype: torch.dtype) -> np.ndarray:
    """The values of 0-d CPU tensors as raw bytes (a snapshot): ``item()`` per tensor is
    ~10x cheaper than ``torch.stack`` of many 0-d tensors, and exact for every dtype
    (Python floats hold float64; bf16/fp16 values convert back exactly)."""
    col = torch.tensor([t.item() for t in ts], dtype=dtype)
    return flat_bytes(col).numpy().copy()


def _unpack_state(saved: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{param name: {"arrays": [keys], "values": {key: plain value}}}`` from the packed
    object written by ``OptimizerStateProvider.objects``."""
    if not saved:
        return {}
    names = list(saved["params"])
    out: dict[str, dict[str, Any]] = {
        n: {"arrays": list(keys), "values": dict(saved["values"].get(n, {}))}
        for n, keys in zip(names, saved["arrays"], strict=True)}
    for sc in saved["scalars"]:
        dt = torch_dtype(sc["dtype"])
        raw = np.asarray(sc["values"], dtype=np.uint8).copy()
        col = torch.from_numpy(raw).view(dt)
        for j, i in enumerate(sc["params"]):
            out[names[i]]["values"][sc["key"]] = col[j].clone()
    return out


def optimizer_groups_provider(optimizer: torch.optim.Optimizer,
                              names: Mapping[int, str]) -> ObjectProvider:
    """Hyperparameters of every param group (lr, betas, weight decay, ...) as one object."""

    def group_names(group: Mapping[str, Any], gi: int) -> list[str]:
        return [names.get(id(p), f"unnamed.group{gi}.param{pi}")
                for pi, p in enumerate(group["params"])]

    def get() -> list[dict[str, Any]]:
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": group_names(g, gi)}
                for gi, g in enumerate(optimizer.param_groups)]

    def set(groups: list[dict[str, Any]]) -> None:
        live = optimizer.param_groups
        if len(groups) != len(live):
            raise SchemaError(f"stored optimizer has {len(groups)} param groups, the live one "
                              f"has {len(live)}")
        for gi, (g, saved) in enumerate(zip(live, groups, strict=True)):
            if list(saved["params"]) != group_names(g, gi):
                raise SchemaError(f"param group {gi} holds different parameters than the stored "
                                  "one; was the run written by a different model/optimizer?")
            for k, v in saved.items():
                if k != "params":
                    g[k] = v

    return ObjectProvider("optim/param_groups", get, set)


def scheduler_provider(scheduler: Any) -> ObjectProvider:
    return ObjectProvider("scheduler", scheduler.state_dict, scheduler.load_state_dict)


def _get_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    np.random.set_state(tuple(state["numpy"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def rng_provider() -> ObjectProvider:
    """Global RNGs: torch CPU, CUDA (when initialized), numpy's legacy global, ``random``."""
    return ObjectProvider("rng", _get_rng, _set_rng)


@dataclass(frozen=True)
class DataPosition:
    """Where the data stream is: epoch and batches consumed in it (and in total)."""

    epoch: int = 0
    batch: int = 0
    total: int = 0


class TrackedData:
    """Iterable wrapper counting batches; skips the already-consumed ones after a resume.

    ``on_next`` is called before each batch is drawn: the end of the previous iteration.
    One pass over the wrapper is one epoch. The first pass skips ``skip`` batches (on resume:
    the batches the restored step had consumed) by drawing and dropping them (exact for
    deterministic loaders; a shuffled ``DataLoader`` must be seeded per epoch for the order to
    repeat).
    """

    def __init__(self, loader: Iterable[Any], position: DataPosition = DataPosition(), *,
                 skip: int = 0, on_next: Callable[[], None] | None = None) -> None:
        self.loader = loader
        self.position = position
        self._skip = skip
        self._on_next = on_next

    def __len__(self) -> int:
        return len(self.loader) - self._skip  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.position.epoch)  # type: ignore[union-attr]
        it = iter(self.loader)
        skip, self._skip = self._skip, 0
        for _ in range(skip):
            try:
                next(it)
            except StopIteration:
                break
        while True:
            if self._on_next is not None:
                self._on_next()  # the iteration boundary, before the loader advances
            try:
                batch = next(it)
            except StopIteration:
                break
            p = self.position
            self.position = DataPosition(p.epoch, p.batch + 1, p.total + 1)
            yield batch
        self.position = DataPosition(self.position.epoch + 1, 0, self.position.total)

    def state(self) -> dict[str, int]:
        p = self.position
        return {"epoch": p.epoch, "batch": p.batch, "total": p.total}


@dataclass(frozen=True)
class TorchState:
    """Providers of a plain-PyTorch trainer, split by capture moment (see module docstring)."""

    step_state: CompositeProvider
    boundary_state: CompositeProvider


def discover(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None, *,
             scheduler: Any = None, rng: bool = True,
             extra_state: Mapping[str, Stateful] | None = None,
             extra: Iterable[StateProvider] = ()) -> TorchState:
    """Build the providers for a model, optimizer, scheduler, global RNGs and user state."""
    step, boundary = CompositeProvider(), CompositeProvider()
    names = param_names(model) if model is not None else {}
    if model is not None:
        step.add(TensorProvider(lambda: model_params(model)))
        # buffers change legitimately inside forward (BatchNorm statistics): clone at capture
        step.add(TensorProvider(lambda: model_buffers(model), snapshot=True))
    if optimizer is not None:
        step.add(OptimizerStateProvider(optimizer, names))
        boundary.add(optimizer_groups_provider(optimizer, names))
    if scheduler is not None:
        boundary.add(scheduler_provider(scheduler))
    for name, obj in (extra_state or {}).items():
        if not isinstance(obj, Stateful):
            raise TypeError(f"extra_state[{name!r}] needs state_dict() and load_state_dict()")
        boundary.add(ObjectProvider(f"extra/{name}", obj.state_dict, obj.load_state_dict))
    for p in extra:
        step.add(p)
    if rng:
        step.add(rng_provider())  # last: restoring it must be the final word on RNG state
    return TorchState(step, boundary)
