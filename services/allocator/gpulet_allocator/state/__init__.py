"""Where the allocator's state is kept: what goes to disk (:mod:`.records`) and the
checkpoint file with its group commit (:mod:`.checkpoint`).

The live, in-memory state is the decision core's ledger
(:mod:`gpulet_allocator.decide.engine.ledger`); this package persists it.
"""
