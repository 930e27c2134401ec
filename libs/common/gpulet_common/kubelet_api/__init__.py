"""Kubelet's gRPC APIs that more than one service calls, generated from kubelet's protos.

``podresources/v1``: ``v1.PodResourcesLister`` (the allocator releases grants of pods
kubelet no longer lists; the collector labels GPUs with the pods holding them).

``dra/v1`` (``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``), ``pluginregistration/v1``
(``pluginregistration.Registration``) and ``dra_health/{v1alpha1,v1beta1,v1}``
(``DRAResourceHealth``, upstream folder ``dra-health``): the DRA kubelet plugin's
APIs, kept here, neutral, so no service owns them. The
device plugin API, spoken only by the allocator, stays in
``gpulet_allocator.kubelet_api``. Stubs are produced by ``scripts/gen-protos``; never
edit them by hand.
"""
