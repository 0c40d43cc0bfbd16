"""Tests of dstt.store, one folder per room of the store (``storage/``, ``format/``, ``codec/``,
``index/``, ``read/``, ``maintenance/``, ``commit/``, ``flusher/``: the module under test lives
in that room). Here, the store's top level: round trips through ``save``/``load`` and the
repository (``test_roundtrip``), a stateful model of a run's timelines (``test_model``), the
typed errors of bad input and damaged runs (``test_errors``); ``_util`` holds shared helpers.

Packages (with ``__init__``) so that their module names (``store.test_errors``,
``store.commit.test_crash``) cannot collide with same-named test modules of other directories.
"""
