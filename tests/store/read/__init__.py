"""Tests of ``dstt.store.read`` beyond every other test's reads: logical arrays read across
the ranks' shard maps (``test_shards``).
"""
