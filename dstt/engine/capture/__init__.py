"""Copying and flushing one rank's steps: ``staging`` (batched copies, version guard),
``flatlane`` (the step's flat plan, its segments, the buffer ring), ``flight`` (one staged
step and its metrics), ``pipeline`` (copy thread, writers), ``flatwrite`` (the lane's writes
through the store's ``StepSink``), ``committer`` (commits in step order), ``summaries``
(write-time summaries), ``governor`` (encode or write raw), ``light`` (light steps of
``every="auto"``), ``budget`` (what ``every="auto"`` may cost training).

A room because it is the hot path, and knows no rank: it imports ``tensors`` and ``state``
only. ``light`` stays torch-free (``dstt log`` reads it): this ``__init__`` imports nothing.
"""
