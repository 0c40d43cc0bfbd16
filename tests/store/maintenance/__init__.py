"""Tests of ``dstt.store.maintenance``: gc's sweep of interrupted writes (``test_gc_sweep``)
and renaming and deleting timelines under power cuts (``test_timelines``).
"""
