"""Tests of ``dstt.store.index``: the run's index under cuts, damage and repair
(``test_index``; its killed child ``index_kill_child``), rows from headers
(``test_index_rows``) and the index job's pipe (``test_index_job_pipe``).
"""
