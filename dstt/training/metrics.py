"""Which step an ``s.log(...)`` call belongs to, and the metrics of steps not committed yet.

A metric belongs to the optimizer step of the iteration that logged it, whichever side of
``optimizer.step()`` the call sits: the session learns the loop's placement from the first
``s.log`` call; ``s.log(step=k, ...)`` always wins. Metrics are kept per step until the step's
commit is sealed; steps not captured (``every=K``) hand theirs to the next commit, as the
object ``metrics/history``. Rejected alternative: packing the history into the commit
header's metrics — the header holds flat scalars only (``dstt.store.Metric``), and a JSON
string there would look like a metric. Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Any, Literal

import torch

from dstt.errors import DsttWarning

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["MetricLog", "metric_value"]


Placement = Literal["before", "after"]


class MetricLog:
    """Per-step metrics of one session, from ``s.log`` to the commit that carries them."""

    def __init__(self, start_step: int) -> None:
        self.placement: Placement | None = None
        self._steps: dict[int, dict[str, Any]] = {}
        self._times: dict[int, float] = {}
        self._handed = start_step  # steps up to this one belong to commits already sealed
        self._warned_late = False

    def target(self, step_now: int, taken: int) -> int:
        """The step a call without ``step=`` belongs to: ``step_now`` steps taken so far,
        ``taken`` of them in this session."""
        if self.placement is None:
            self.placement = "after" if taken else "before"
        return step_now + 1 if self.placement == "before" else step_now

    def add(self, step: int, metrics: Mapping[str, Any]) -> None:
        if step <= self._handed:
            if not self._warned_late:
                self._warned_late = True
                warnings.warn(
                    f"dstt: metrics {sorted(metrics)} for step {step} arrived after that "
                    "step's commit was sealed; they are dropped (log before the next "
                    "optimizer.step(), or pass s.log(step=...) for a later step)",
                    DsttWarning,
                    stacklevel=3,
                )
            return
        self._steps.setdefault(step, {}).update(metrics)
        self._times.setdefault(step, time.time())

    def take(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Metrics of ``step`` and the history object of the uncommitted steps before it
        (None if there are none); the steps up to ``step`` are handed over."""
        own = self._steps.pop(step, {})
        self._times.pop(step, None)
        earlier = sorted(k for k in self._steps if k < step)
        self._handed = max(self._handed, step)
        if not earlier:
            return own, None
        return own, {
            "steps": earlier,
            "time": [self._times.pop(k) for k in earlier],
            "metrics": [self._steps.pop(k) for k in earlier],
        }

    def fold_future(self, step: int) -> None:
        """At close: metrics logged for steps never taken (an eval after the last step in
        log-before-step placement) join ``step``'s, without overwriting what it logged."""
        later = sorted(k for k in self._steps if k > step)
        if not later:
            return
        into = self._steps.setdefault(step, {})
        self._times.setdefault(step, self._times[later[0]])
        for k in later:
            for name, v in self._steps.pop(k).items():
                into.setdefault(name, v)
            self._times.pop(k, None)


def metric_value(name: str, v: Any) -> float | int | str | bool:
    """A scalar metric value (tensors and numpy scalars unwrapped); ``TypeError`` otherwise."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise TypeError(
                f"metric {name!r} must be a scalar, got a tensor of shape {tuple(v.shape)}"
            )
        v = v.item()
    elif hasattr(v, "item") and callable(v.item):  # numpy scalars
        v = v.item()
    if isinstance(v, bool | int | float | str):
        return v
    raise TypeError(f"metric {name!r} must be a number, string or bool, not {type(v).__name__}")
