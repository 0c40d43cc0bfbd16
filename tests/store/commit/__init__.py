"""Tests of ``dstt.store.commit``: crash safety of every commit (``test_crash``; its child
``crash_child``), the commit job run elsewhere (``test_stepcommit``; ``orphan_child``), parts
(``test_parts``) and the multi-rank commit (``test_ranks``; ``rank_world``,
``rank_kill_child``).
"""
