"""Tests of ``dstt.store.codec``: XOR deltas and keyframes (``test_delta``), the flat steps'
batched encoder (``test_flat_delta``), Adam/SGD predictions (``test_predict``), several steps
in flight (``test_inflight_model``) and the reused buffers (``test_buffers``).
"""
