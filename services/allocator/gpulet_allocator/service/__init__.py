"""The allocator service: the decision core served over NATS, kept in step with kubelet.

* :mod:`.nats` -- :class:`AllocatorService`: its lifecycle and the ``nats.micro``
  endpoints (contract: :mod:`gpulet_allocator.protocol`);
* :mod:`.release` -- asking kubelet's PodResources which containers live, releasing
  the rest and rebuilding a lost record (:mod:`.podresources` speaks the API);
* :mod:`.handshake` -- the pod watch and the Event writer of koord-scheduler's
  decisions (:mod:`.pod_watch`).

The decisions themselves are :mod:`gpulet_allocator.decide`'s; the checkpoint is
:mod:`gpulet_allocator.state`'s.
"""

from gpulet_allocator.service.nats import AllocatorService, checkpoint_path

__all__ = ["AllocatorService", "checkpoint_path"]
