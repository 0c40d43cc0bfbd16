"""Numeric analysis of logged metrics that every layer may use: numpy and the standard
library only, no store, no torch, no xarray.

Modules: ``spikes`` the loss-spike rule (``find_spikes``) of ``run.spikes()``, ``diagnose()``,
``dstt log``, the scrubber and retention, with the constants it defaults to (``SPIKE_WINDOW``,
``SPIKE_Z``, ``SPIKE_LEVEL``, ``SPIKE_MIN_PERIODS``, ``SPIKE_FLOOR``, ``SPIKE_SMALL``);
``mechanisms`` one pure check per spike mechanism (bad data, update too large, attention
logit growth, Adam's second moment, numerics), on numpy.

Rejected: keeping the rule in the store (where retention first needed it) — the rule is
about metrics, not bytes, and inspection, the widgets and the CLI import it too.
"""

from __future__ import annotations

from .spikes import (
    SPIKE_FLOOR,
    SPIKE_LEVEL,
    SPIKE_MIN_PERIODS,
    SPIKE_SMALL,
    SPIKE_WINDOW,
    SPIKE_Z,
    find_spikes,
)

__all__ = [
    "SPIKE_FLOOR",
    "SPIKE_LEVEL",
    "SPIKE_MIN_PERIODS",
    "SPIKE_SMALL",
    "SPIKE_WINDOW",
    "SPIKE_Z",
    "find_spikes",
]
