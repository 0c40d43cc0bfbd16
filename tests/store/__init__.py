"""Tests of dstt.store: round trips, interop, crash safety, a stateful model, typed errors.

A package (with ``__init__``) so that its module names (``store.test_errors``) cannot collide
with same-named test modules of other directories.
"""
