"""Reliability tests (issue 7): crash soak, corruption, disk full, concurrency, leaks,
read-only runs — each proving that dstt does not lose or silently damage a run.

A package (with ``__init__``) so its module names cannot collide with other test folders.
"""
