"""An optimizer's state as the engine captures it: per-parameter tensors as arrays, the rest
packed; hyperparameters per group; several optimizers by key.

``OptimizerStateProvider`` hands the engine every state tensor under ``optim/<state>/<param
path>`` and one object, ``optim/state`` (which keys are arrays, the other values), cached while
the structure holds; ``optimizer_groups_provider`` snapshots ``optim/param_groups`` at the end
of each iteration; several optimizers (``optimizers_of``) are named ``<base>/<key>``. Restore
goes through ``optimizer.load_state_dict``. Rejected alternative: ``optimizer.state_dict()``
per step (new nested dicts on the training thread every step).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from dstt import schema
from dstt.engine.tensors._convert import from_plain, to_plain
from dstt.engine.tensors.dtensors import stored_value
from dstt.errors import SchemaError
from dstt.schema import tensor_path
from dstt.store._internal import Encoded, Prediction

from .predictions import optimizer_predictions
from .providers import ObjectProvider, RestoreSource

__all__ = [
    "OptimizerStateProvider",
    "optimizer_groups_provider",
    "optimizer_object",
    "optimizers_of",
]


_VALUES = operator.methodcaller("values")  # any mapping's, not only a dict's


class OptimizerStateProvider:
    """Per-parameter optimizer state (Adam/AdamW/SGD/...): tensors as arrays, scalars packed."""

    OBJECT = schema.OPTIM_STATE_OBJECT
    #: ``tensors()`` returns a new mapping whenever the state's tensors changed
    stable = True

    def __init__(
        self, optimizer: torch.optim.Optimizer, names: Mapping[int, str], key: str = ""
    ) -> None:
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
        if not (
            self._looked_up is plist
            and len(owners) == len(self._owners)
            and all(map(operator.is_, owners, self._owners))
            and all(map(operator.is_, dicts, self._dicts))
        ):
            self._owners, self._dicts, self._looked_up = owners, dicts, plist
            self._per_param = list(map(state.get, self._plist_params))
        sts = list(filter(None, self._per_param))  # a dict filled since counts now
        keys = list(itertools.chain.from_iterable(sts))
        values = list(itertools.chain.from_iterable(map(_VALUES, sts)))
        if (
            keys == self._sig_keys
            and len(values) == len(self._sig_values)
            and all(map(operator.is_, values, self._sig_values))
        ):
            return None
        self._sig_keys, self._sig_values = keys, values
        return [(name, st) for p, name in self._plist if (st := state.get(p))]

    def _refresh(self) -> None:
        """Rebuild the cached tensors (and drop the cached object) if the state changed."""
        items = self._changed()
        if items is not None:
            self._object = None
            self._tensors = {
                tensor_path(f"optim/{key}", name): v
                for name, st in items
                for key, v in st.items()
                if isinstance(v, torch.Tensor)
            }

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
            state[name] = {
                "arrays": [k for k, v in st.items() if isinstance(v, torch.Tensor)],
                "values": values,
            }
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
    from dstt.errors import ConfigError

    if optimizer is None:
        return {}
    if isinstance(optimizer, torch.optim.Optimizer):
        return {"": optimizer}
    if isinstance(optimizer, Mapping):
        items = list(optimizer.items())
    elif isinstance(optimizer, list | tuple):
        items = [(str(i), o) for i, o in enumerate(optimizer)]
    else:
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer, a list of them or a dict "
            f"of them, not {type(optimizer).__name__}"
        )
    if not items:
        raise ConfigError("the list or dict of optimizers is empty")
    out: dict[str, torch.optim.Optimizer] = {}
    for key, opt in items:
        if not isinstance(key, str) or not key or "/" in key:
            raise ConfigError(f"optimizer keys must be non-empty strings without '/', not {key!r}")
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer {key!r} is a {type(opt).__name__}, not a "
                "torch.optim.Optimizer (unwrap framework wrappers first)"
            )
        out[key] = opt
    if len(out) == 1:
        return {"": next(iter(out.values()))}
    seen: dict[int, str] = {}
    for key, opt in out.items():
        for g in opt.param_groups:
            for p in g["params"]:
                if seen.setdefault(id(p), key) != key:
                    raise ConfigError(
                        f"optimizers {seen[id(p)]!r} and {key!r} hold the same "
                        "parameter; each parameter needs one optimizer"
                    )
    return out


def optimizer_groups_provider(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], key: str = ""
) -> ObjectProvider:
    """Hyperparameters of every param group (lr, betas, weight decay, ...) as one object.
    A group's parameter names are listed again only when its parameters changed (checked
    with a C-level map): no Python line per parameter at each step."""
    named: dict[int, tuple[list[Any], list[str]]] = {}  # group -> (its params, their names)

    def group_names(group: Mapping[str, Any], gi: int) -> list[str]:
        params = group["params"]
        hit = named.get(gi)
        if (
            hit is not None
            and len(hit[0]) == len(params)
            and all(map(operator.is_, hit[0], params))
        ):
            return hit[1]
        out = [names.get(id(p), f"unnamed.group{gi}.param{pi}") for pi, p in enumerate(params)]
        named[gi] = (list(params), out)
        return out

    def get() -> list[dict[str, Any]]:
        return [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(group_names(g, gi))}
            for gi, g in enumerate(optimizer.param_groups)
        ]

    def set(groups: list[dict[str, Any]]) -> None:
        live = optimizer.param_groups
        if len(groups) != len(live):
            raise SchemaError(
                f"stored optimizer has {len(groups)} param groups, the live one has {len(live)}"
            )
        for gi, (g, saved) in enumerate(zip(live, groups, strict=True)):
            if list(saved["params"]) != group_names(g, gi):
                raise SchemaError(
                    f"param group {gi} holds different parameters than the stored "
                    "one; was the run written by a different model/optimizer?"
                )
            for k, v in saved.items():
                if k != "params":
                    g[k] = v

    return ObjectProvider(optimizer_object(schema.OPTIM_GROUPS_OBJECT, key), get, set)
