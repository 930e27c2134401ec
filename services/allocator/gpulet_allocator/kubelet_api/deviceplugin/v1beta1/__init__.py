"""Kubelet device plugin API v1beta1: vendored api.proto and its generated stubs."""
