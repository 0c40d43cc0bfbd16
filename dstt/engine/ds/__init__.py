"""DeepSpeed: ``deepspeed`` (an engine's state per rank), ``zero`` (ZeRO 1-3 partitions),
``ds_checkpoint`` (a ``CheckpointEngine`` into a run), ``_ds_tags`` (one tag, one
transaction), ``_statedict`` (state dicts as arrays plus a skeleton).

The top room: it builds on every other one (the providers of ``state``, the ranks of
``distributed``, the ``Pipeline`` of ``capture``) and none imports it, so a run without
DeepSpeed never loads it. (Not ``deepspeed/``: a room is not named like one of its modules.)
"""
