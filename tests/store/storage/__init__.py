"""Tests of ``dstt.store.storage``: the memory fake's crash model (``test_memory_fake``)
and every local backend against the shipped ``Storage`` conformance suite
(``test_storage_conformance``; S3 runs it in ``tests/s3``).
"""
