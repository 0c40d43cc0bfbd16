"""Light steps (``every="auto"``): the record a step the engine did not store leaves behind.

A light step is an optimizer step taken while the engine was busy: none of its tensors are
written. Its metrics and sample indices already ride with the next commit, so the record adds
only which steps were light and each one's **loss fingerprint** (the logged loss's float64
bits in hex), which a rebuild compares bit for bit. The next stored commit carries the
record since the previous one as ONE object, :data:`LIGHT_OBJECT`. Rejected alternatives: a
file per light step (per-file costs, thousands of tiny files); the loss as a decimal metric
(a rounded print of it would compare equal to a slightly different loss).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from dstt import schema

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "LIGHT_OBJECT",
    "LOSS_METRIC",
    "light_record",
    "loss_bits",
    "loss_of",
    "step_loss",
]

#: the commit object listing the light steps before it (and their loss fingerprints)
LIGHT_OBJECT = schema.LIGHT_OBJECT
#: the metric whose value is a light step's loss fingerprint
LOSS_METRIC = "loss"


def loss_bits(value: object) -> str | None:
    """The fingerprint of a logged loss: its float64 bits as 16 hex digits (None: no
    number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return struct.pack(">d", float(value)).hex()


def loss_of(bits: str) -> float:
    """The loss a fingerprint holds (inverse of :func:`loss_bits`)."""
    out: float = struct.unpack(">d", bytes.fromhex(bits))[0]
    return out


def step_loss(micro: Sequence[float]) -> float:
    """The loss of one optimizer step from its micro-batches' losses, as a framework
    callback fingerprints it and a rebuild recomputes it: the one loss, or their sum
    accumulated in float32 (as a tensor sum of float32 losses is)."""
    if len(micro) == 1:
        return float(micro[0])
    import torch

    acc = torch.zeros((), dtype=torch.float32)
    for x in micro:
        acc = acc + float(x)
    return float(acc)


def light_record(
    steps: Sequence[int],
    metrics: Callable[[int], Mapping[str, Any] | None],
    fingerprints: Mapping[int, float | None] | None = None,
) -> dict[str, Any]:
    """The :data:`LIGHT_OBJECT` of ``steps``; ``metrics(k)`` gives what step ``k`` logged.
    ``fingerprints``: a step's loss as a framework callback took it (its training step's
    own loss, whatever the user logged as ``loss``; None: none that a rebuild can check),
    used before the logged one."""
    fp = fingerprints or {}
    losses = [
        loss_bits(fp[k]) if k in fp else loss_bits((metrics(k) or {}).get(LOSS_METRIC))
        for k in steps
    ]
    return {"steps": [int(k) for k in steps], "loss": losses}
