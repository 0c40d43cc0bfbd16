"""Which captured arrays the store may encode as predictions (``dstt.store.codec.predict``).

For ``Adam``/``AdamW`` with float32 state the step's ``exp_avg_sq`` and parameter follow from
the update rule, for ``SGD`` with momentum the parameter from its momentum buffer: this reads
the coefficients of the step just taken and names each parameter's arrays, on the training
thread, from Python floats and host scalars only (``capturable=True`` optimizers get no
predictions rather than a device sync). Only a hint: a wrong prediction costs bytes, never
correctness. Rejected alternative: fitting a linear model of earlier steps at write time
(more flush CPU for less than the exact rule).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from dstt.store._internal import Prediction, adam_predictions, sgd_predictions

__all__ = ["adam_state_predictions", "optimizer_predictions", "sgd_state_predictions"]

Params = Iterable[tuple[torch.Tensor, str]]
PathOf = Callable[[str, str], str]


def optimizer_predictions(
    optimizer: torch.optim.Optimizer, params: Params, path: PathOf
) -> Mapping[str, Prediction]:
    """Predictions for the optimizers this module knows (none for the others)."""
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        return adam_state_predictions(optimizer, params, path)
    if isinstance(optimizer, torch.optim.SGD):
        return sgd_state_predictions(optimizer, params, path)
    return {}


def _host_float(v: Any) -> float | None:  # noqa: ANN401 - a logged value of any kind
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or not v.is_cpu:
            return None
        return float(v.item())
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _fp32(*ts: Any) -> bool:
    first = ts[0]
    return all(
        isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == first.shape
        for t in ts
    )


def _stepped(
    optimizer: torch.optim.Optimizer,
    params: Params,
) -> Iterator[tuple[torch.Tensor, str, Mapping[str, Any], Mapping[str, Any]]]:
    """(parameter, name, its param group, its state) for parameters that have state."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for p, name in params:
        g = groups.get(id(p))
        st = optimizer.state.get(p)
        if g is not None and st:
            yield p, name, g, st


def adam_state_predictions(
    optimizer: torch.optim.Optimizer, params: Params, path: PathOf
) -> Mapping[str, Prediction]:
    """Predictions for every float32 parameter of a torch ``Adam``/``AdamW`` (no amsgrad);
    ``path(prefix, dotted name)`` gives array paths (``params``, ``optim/exp_avg``, ...)."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        return {}
    out: dict[str, Prediction] = {}
    for p, name, g, st in _stepped(optimizer, params):
        if g.get("amsgrad") or g.get("differentiable"):
            continue
        m, v = st.get("exp_avg"), st.get("exp_avg_sq")
        if not _fp32(p, m, v):
            continue
        lr, step = _host_float(g.get("lr")), _host_float(st.get("step"))
        b1, b2 = (_host_float(b) for b in g.get("betas", (None, None)))
        eps, wd = _host_float(g.get("eps")), _host_float(g.get("weight_decay", 0.0))
        if lr is None or step is None or b1 is None or b2 is None or eps is None or wd is None:
            continue
        decoupled = bool(g.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
        out.update(
            adam_predictions(
                param=path("params", name),
                exp_avg=path("optim/exp_avg", name),
                exp_avg_sq=path("optim/exp_avg_sq", name),
                lr=lr,
                betas=(b1, b2),
                eps=eps,
                weight_decay=wd,
                decoupled=decoupled,
                step=step,
            )
        )
    return out


def sgd_state_predictions(
    optimizer: torch.optim.Optimizer, params: Params, path: PathOf
) -> Mapping[str, Prediction]:
    """Predictions for every float32 parameter of a torch ``SGD`` with momentum, not Nesterov
    (whose update also needs the gradient, which is not captured)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return {}
    out: dict[str, Prediction] = {}
    for p, name, g, st in _stepped(optimizer, params):
        if g.get("nesterov") or not g.get("momentum"):
            continue
        buf = st.get("momentum_buffer")
        lr = _host_float(g.get("lr"))
        if lr is None or not _fp32(p, buf):
            continue
        out.update(
            sgd_predictions(
                param=path("params", name),
                momentum_buffer=path("optim/momentum_buffer", name),
                lr=lr,
            )
        )
    return out
