"""Fewer bytes per step, losslessly: XOR deltas and their policy (``xor``), Adam/SGD state
predicted from the update rule (``predict``), the per-step encoder/decoder (``delta``) and its
reusable scratch memory (``buffers``); a whole flat step encoded at once (``flatdelta``), its
grouped predictions (``flatpredict``) and what it keeps per layout (``layout_state``)."""

from .xor import DeltaPolicy

__all__ = ["DeltaPolicy"]
