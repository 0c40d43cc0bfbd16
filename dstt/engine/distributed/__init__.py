"""Several ranks of PyTorch-native parallelism: ``ranks`` (rank and world size, the ranks'
channel, opening the run on every rank together), ``sharding`` (which box of each tensor a
rank writes) and ``parallel`` (DDP, FSDP2, tensor and pipeline parallel).

A room because one rank's capture (``capture``) needs none of it; it imports ``tensors`` and
``state`` only, and ``ds`` builds on it. (Not ``parallel/``: a room is not named like one of
its modules.)
"""
