"""Where the allocator's decisions are made: one core, whatever kubelet adapter asks.

:class:`~.core.AllocatorCore` is the interface (its module docstring lists the pieces:
ledger access and health gating, whole-GPU and share decisions, the scheduler
handshake, checkpoints and the lost record, releases). The engine (:mod:`.engine`)
places; :mod:`.koordinator` reads koord-scheduler's decisions. Nothing here does I/O
or imports a kubelet adapter (:mod:`gpulet_allocator.kubelet`) or the NATS service.
"""
