"""Kubelet's gRPC APIs that more than one service calls, generated from kubelet's protos.

``podresources/v1``: ``v1.PodResourcesLister`` (the allocator releases grants of pods
kubelet no longer lists; the collector labels GPUs with the pods holding them). The
device plugin API, spoken only by the allocator, stays in
``gpulet_allocator.kubelet_api``. Stubs are produced by ``scripts/gen-protos``; never
edit them by hand.
"""
