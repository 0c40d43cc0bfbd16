"""Tests of ``dstt.store.flusher``: a framed flat layout written in one piece, O_DIRECT
included, and its digests (``test_flat_direct``).
"""
