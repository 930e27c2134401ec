"""Kubelet plugin registration API, ``pluginregistration.Registration`` (stubs in ``v1``)."""
