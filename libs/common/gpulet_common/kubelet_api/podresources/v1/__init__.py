"""Kubelet pod resources API v1: vendored api.proto and its generated stubs."""
