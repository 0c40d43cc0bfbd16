"""Discovering providers from plain PyTorch objects: model, optimizer, scheduler, RNG.

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

import itertools
import operator
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import SchemaError
from ..schema import canonical_name, tensor_path
from ..store import Encoded, Prediction, RankInfo
from ._convert import from_plain, to_plain
from .dtensors import stored_value
from .predictions import optimizer_predictions
from .providers import (
    CompositeProvider,
    ObjectProvider,
    RankObject,
    RestoreSource,
    StateProvider,
    TensorProvider,
)

__all__ = [
    "CONFIG_OBJECT",
    "TIED_OBJECT",
    "ModelInfoProvider",
    "OptimizerStateProvider",
    "Stateful",
    "TorchState",
    "canonical_names",
    "discover",
    "model_buffers",
    "model_config",
    "model_params",
    "model_tensors",
    "module_wrappers",
    "optimizer_groups_provider",
    "optimizer_object",
    "optimizers_of",
    "param_names",
    "rng_provider",
    "scheduler_provider",
    "tied_names",
]


ONE_RANK = RankInfo(0, 1)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict``/``load_state_dict`` (user ``extra_state`` entries)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def module_wrappers(model: torch.nn.Module) -> frozenset[str]:
    """Paths (as torch names them) of the DDP / ``DataParallel`` modules in ``model``: their
    ``module`` child is a wrapper, not part of the model's names."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return frozenset(n for n, m in model.named_modules()
                     if isinstance(m, DistributedDataParallel | DataParallel))


def canonical_names(model: torch.nn.Module, names: Iterable[str]) -> dict[str, str]:
    """Each of ``names`` (as ``model`` reports them) → its canonical name
    (``dstt.schema.canonical_name``); ``SchemaError`` if two land on one name."""
    wrappers = module_wrappers(model)
    out = {n: canonical_name(n, wrappers) for n in names}
    if len(set(out.values())) != len(out):
        seen: dict[str, str] = {}
        for raw, c in out.items():
            if c in seen:
                raise SchemaError(f"tensors {seen[c]!r} and {raw!r} both have the name {c!r} "
                                  "once wrapper prefixes are dropped; rename one of them")
            seen[c] = raw
    return out


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) → canonical dotted name (first name wins for tied parameters)."""
    named = list(model.named_parameters())
    canon = canonical_names(model, [n for n, _ in named])
    return {id(p): canon[name] for name, p in named}


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Tied parameters: every further canonical name of a parameter → the name it is stored
    under (``lm_head.weight`` → ``transformer.wte.weight``); empty when nothing is tied."""
    named = list(model.named_parameters(remove_duplicate=False))
    canon = canonical_names(model, dict.fromkeys(n for n, _ in named))
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in named:
        c = canon[name]
        stored = first.setdefault(id(p), c)
        if stored != c:
            out[c] = stored
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

    for name in ("register_module_module_registration_hook",
                 "register_module_parameter_registration_hook",
                 "register_module_buffer_registration_hook"):
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
        where = {id(t): (d, k) for mod in self.model.modules()
                 for d in (mod._buffers if self.buffers else mod._parameters,)
                 for k, t in d.items() if t is not None}
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
        if now is None or len(now) != len(self._values) or not all(
                map(operator.is_, now, self._values)):
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
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            found[f"{mod_name}.{bname}" if mod_name else bname] = b
    canon = canonical_names(model, found)
    return {tensor_path("buffers", canon[n]): b for n, b in found.items()}


_VALUES = operator.methodcaller("values")  # any mapping's, not only a dict's


class OptimizerStateProvider:
    """Per-parameter optimizer state (Adam/AdamW/SGD/...): tensors as arrays, scalars packed."""

    OBJECT = "optim/state"
    #: ``tensors()`` returns a new mapping whenever the state's tensors changed
    stable = True

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                 key: str = "") -> None:
        self.optimizer = optimizer
        #: the object's name: ``optim/state``, or ``optim/state/<key>`` for one of several
        #: optimizers (their arrays need no key: each holds other parameters)
        self.object_name = optimizer_object(self.OBJECT, key)
        self._names = names
        self._plist: list[tuple[torch.Tensor, str]] = []
        self._plist_params: list[torch.Tensor] = []
        self._plist_key: tuple[Any, ...] = ()
        self._owners: list[Any] = []  # the optimizer state's keys and values last looked up
        self._dicts: list[Any] = []
        self._looked_up: list[tuple[torch.Tensor, str]] | None = None  # ... for this plist
        self._per_param: list[dict[str, Any] | None] = []
        self._sig_keys: list[str] = []
        self._sig_values: list[Any] = []
        self._tensors: dict[str, torch.Tensor] = {}
        self._object: Encoded | None = None

    def params(self) -> Iterator[tuple[torch.Tensor, str]]:
        """Parameters in ``state_dict`` order with their dotted names."""
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                yield p, self._names.get(id(p), f"unnamed.group{gi}.param{pi}")

    def _param_list(self) -> list[tuple[torch.Tensor, str]]:
        groups = self.optimizer.param_groups
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if key != self._plist_key:
            self._plist, self._plist_key = list(self.params()), key
            self._plist_params = [p for p, _ in self._plist]
        return self._plist

    def _changed(self) -> list[tuple[str, dict[str, Any]]] | None:
        """The (name, state) of every parameter with state, or None when no key or value
        object changed since the last call (a step of Adam changes values in place). The
        check is C-level maps over the parameters — no Python line per parameter — and
        the items are built only when something changed."""
        state = self.optimizer.state
        plist = self._param_list()
        # each parameter's state dict, in parameter order. Looking a parameter up hashes it
        # (``Tensor.__hash__`` is a Python function): done only when the state's keys or dict
        # objects changed, read back from ``state`` itself, which iterates without hashing
        owners, dicts = list(state), list(state.values())
        if not (self._looked_up is plist and len(owners) == len(self._owners)
                and all(map(operator.is_, owners, self._owners))
                and all(map(operator.is_, dicts, self._dicts))):
            self._owners, self._dicts, self._looked_up = owners, dicts, plist
            self._per_param = list(map(state.get, self._plist_params))
        sts = list(filter(None, self._per_param))  # a dict filled since counts now
        keys = list(itertools.chain.from_iterable(sts))
        values = list(itertools.chain.from_iterable(map(_VALUES, sts)))
        if (keys == self._sig_keys and len(values) == len(self._sig_values)
                and all(map(operator.is_, values, self._sig_values))):
            return None
        self._sig_keys, self._sig_values = keys, values
        return [(name, st) for p, name in self._plist if (st := state.get(p))]

    def _refresh(self) -> None:
        """Rebuild the cached tensors (and drop the cached object) if the state changed."""
        items = self._changed()
        if items is not None:
            self._object = None
            self._tensors = {tensor_path(f"optim/{key}", name): v
                             for name, st in items for key, v in st.items()
                             if isinstance(v, torch.Tensor)}

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Every tensor of the state (0-d step counters included: the engine copies them
        with the rest, in one batched copy) by array path; cached while unchanged."""
        self._refresh()
        return self._tensors

    def capture(self) -> tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]:
        """``(tensors(), objects())`` with one look at the optimizer's state."""
        self._refresh()
        return self._tensors, self._objects()

    def predictions(self) -> Mapping[str, Prediction]:
        """Arrays of the step just taken that the store may encode as predictions."""
        return optimizer_predictions(self.optimizer, self.params(), tensor_path)

    def objects(self) -> Mapping[str, Any]:
        """Which keys of each parameter's state are arrays, and the values of the others
        (plain data, snapshot now). While the state holds only tensors — Adam, AdamW, SGD
        with momentum — this is the same ``Encoded`` value at every step (its JSON built
        once: ~1 ms per step saved at 400 parameters)."""
        self._refresh()
        return self._objects()

    def _objects(self) -> Mapping[str, Any]:
        if self._object is not None:
            return {self.object_name: self._object}
        state: dict[str, Any] = {}
        plain = False
        for p, name in self._param_list():
            st = self.optimizer.state.get(p)
            if not st:
                continue
            values = {k: to_plain(v) for k, v in st.items() if not isinstance(v, torch.Tensor)}
            plain = plain or bool(values)
            state[name] = {"arrays": [k for k, v in st.items() if isinstance(v, torch.Tensor)],
                           "values": values}
        obj = {"format": 2, "params": state}
        if not plain:  # nothing to snapshot: encoded once, reused while the structure holds
            self._object = Encoded.of(obj)
            return {self.object_name: self._object}
        return {self.object_name: obj}

    def restore(self, source: RestoreSource) -> None:
        name = self.object_name
        saved = source.object(name) if source.has_object(name) else {}
        entries = saved.get("params", {}) if saved else {}
        state: dict[int, dict[str, Any]] = {}
        for idx, (param, name) in enumerate(self.params()):
            entry = entries.get(name)
            if entry is None:
                continue
            values = {k: from_plain(v) for k, v in entry["values"].items()}
            for key in entry["arrays"]:
                path = tensor_path(f"optim/{key}", name)
                # a DTensor parameter's state of its shape is a DTensor of its placements
                like = param if tuple(source.shape(path)) == tuple(param.shape) else None
                values[key] = stored_value(source, path, like)
            state[idx] = values
        unknown = set(entries) - {name for _, name in self.params()}
        if unknown:
            raise SchemaError(
                f"step {source.step} has optimizer state for parameters the live optimizer "
                f"does not have: {sorted(unknown)[:5]}"
            )
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def optimizer_object(base: str, key: str) -> str:
    """``optim/state`` / ``optim/param_groups`` of the only optimizer, ``<base>/<key>`` of one
    of several (``key``: its index in the list, or its key in the dict, given to the
    session)."""
    return f"{base}/{key}" if key else base


def optimizers_of(optimizer: Any) -> dict[str, torch.optim.Optimizer]:
    """The optimizers a session captures, by key: ``{"": opt}`` for one; ``{"0": a, "1": b}``
    for a list or tuple; a dict's own keys (strings without ``/``). Anything else is a
    ``ConfigError`` that says what is accepted."""
    from ..errors import ConfigError

    if optimizer is None:
        return {}
    if isinstance(optimizer, torch.optim.Optimizer):
        return {"": optimizer}
    if isinstance(optimizer, Mapping):
        items = list(optimizer.items())
    elif isinstance(optimizer, list | tuple):
        items = [(str(i), o) for i, o in enumerate(optimizer)]
    else:
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, a list of them or a dict "
                          f"of them, not {type(optimizer).__name__}")
    if not items:
        raise ConfigError("the list or dict of optimizers is empty")
    out: dict[str, torch.optim.Optimizer] = {}
    for key, opt in items:
        if not isinstance(key, str) or not key or "/" in key:
            raise ConfigError(f"optimizer keys must be non-empty strings without '/', not "
                              f"{key!r}")
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"optimizer {key!r} is a {type(opt).__name__}, not a "
                              "torch.optim.Optimizer (unwrap framework wrappers first)")
        out[key] = opt
    if len(out) == 1:
        return {"": next(iter(out.values()))}
    seen: dict[int, str] = {}
    for key, opt in out.items():
        for g in opt.param_groups:
            for p in g["params"]:
                if seen.setdefault(id(p), key) != key:
                    raise ConfigError(f"optimizers {seen[id(p)]!r} and {key!r} hold the same "
                                      "parameter; each parameter needs one optimizer")
    return out


def optimizer_groups_provider(optimizer: torch.optim.Optimizer,
                              names: Mapping[int, str], key: str = "") -> ObjectProvider:
    """Hyperparameters of every param group (lr, betas, weight decay, ...) as one object.
    A group's parameter names are listed again only when its parameters changed (checked
    with a C-level map): no Python line per parameter at each step."""
    named: dict[int, tuple[list[Any], list[str]]] = {}  # group -> (its params, their names)

    def group_names(group: Mapping[str, Any], gi: int) -> list[str]:
        params = group["params"]
        hit = named.get(gi)
        if hit is not None and len(hit[0]) == len(params) and all(
                map(operator.is_, hit[0], params)):
            return hit[1]
        out = [names.get(id(p), f"unnamed.group{gi}.param{pi}") for pi, p in enumerate(params)]
        named[gi] = (list(params), out)
        return out

    def get() -> list[dict[str, Any]]:
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": list(group_names(g, gi))}
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

    return ObjectProvider(optimizer_object("optim/param_groups", key), get, set)


TIED_OBJECT = "names/tied"
CONFIG_OBJECT = "model/config"


class ModelInfoProvider:
    """What readers need to know of the model beyond its tensors, taken once at session
    start and stored with every step (encoded once): ``names/tied`` — every further name of a
    tied parameter → the name it is stored under (only when something is tied) — and
    ``model/config`` — a Hugging Face model's ``config`` as JSON (what ``dstt export --format
    hf`` writes as ``config.json``). Nothing to restore: they describe the model."""

    stable = True

    def __init__(self, model: torch.nn.Module) -> None:
        self._objects: dict[str, Encoded] = {}
        tied = tied_names(model)
        if tied:
            self._objects[TIED_OBJECT] = Encoded.of(tied)
        config = model_config(model)
        if config is not None:
            self._objects[CONFIG_OBJECT] = Encoded.of(config)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {}

    def objects(self) -> Mapping[str, Any]:
        return self._objects

    def restore(self, source: RestoreSource) -> None:
        return None


def model_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """A Hugging Face ``PreTrainedModel``'s config as plain JSON (found through wrappers:
    ``torch.compile``, DDP), or None."""
    import json

    seen = 0
    while seen < 4 and getattr(model, "config", None) is None:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model, seen = inner, seen + 1
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    try:
        out = json.loads(to_json())
    except (TypeError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def scheduler_provider(scheduler: Any) -> ObjectProvider:
    return ObjectProvider("scheduler", scheduler.state_dict, scheduler.load_state_dict)


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
    return RankObject("rng", info, get_rng, set_rng, required=True)


@dataclass(frozen=True)
class TorchState:
    """Providers of a plain-PyTorch trainer, split by capture moment (see module docstring)."""

    step_state: CompositeProvider
    boundary_state: CompositeProvider


def discover(model: torch.nn.Module | None, optimizer: Any = None, *,
             scheduler: Any = None, rng: bool = True,
             extra_state: Mapping[str, Stateful] | None = None,
             extra: Iterable[StateProvider] = ()) -> TorchState:
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
    for name, obj in (extra_state or {}).items():
        if not isinstance(obj, Stateful):
            raise TypeError(f"extra_state[{name!r}] needs state_dict() and load_state_dict()")
        boundary.add(RankObject(f"extra/{name}", ONE_RANK, obj.state_dict, obj.load_state_dict,
                                required=True))
    for p in extra:
        step.add(p)
    if rng:
        step.add(rng_provider())  # last: restoring it must be the final word on RNG state
    return TorchState(step, boundary)
