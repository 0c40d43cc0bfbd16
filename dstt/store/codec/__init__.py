"""Fewer bytes per step, losslessly: XOR deltas and their policy (``xor``), Adam/SGD state
predicted from the update rule (``predict``), the one encoder of a step — a whole flat step at
once (``flatdelta``), its grouped predictions (``flatpredict``) and what it keeps per layout
(``layout_state``) — the writer's bases and in-flight bookkeeping (``delta``) and reusable
memory (``buffers``)."""

from .xor import DeltaPolicy

__all__ = ["DeltaPolicy"]
