"""Kubelet DRA plugin API, ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (stubs in ``v1``)."""
