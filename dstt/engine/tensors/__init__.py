"""One tensor, below every other room: ``_convert`` (torch <-> store: dtype names, byte
views, plain objects) and ``dtensors`` (a DTensor's local view and box, restore into any
placement).

A room of its own because every other room, and inspection's restore, needs these two and
nothing else of the engine. Rejected alternative: keeping ``dtensors`` with the ranks —
``state``'s providers restore through it, so ``state`` would import upward.
"""
