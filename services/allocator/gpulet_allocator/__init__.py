"""gpulet's GPU allocator.

Where things are:

* :mod:`.kubelet` -- where kubelet's calls enter (the device plugin; DRA's kubelet
  plugin later), one adapter per kubelet API;
* :mod:`.decide` -- where decisions are made: the one decision core and its engine;
* :mod:`.state` -- where state is kept on disk (the checkpoint);
* :mod:`.service` -- the allocator service: the core served over NATS, kept in step
  with kubelet's PodResources and the pod watch;
* :mod:`.protocol` -- the contract between the adapters and the service;
* :mod:`.kubelet_api` -- kubelet's generated gRPC stubs.
"""
