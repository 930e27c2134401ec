"""Kubelet podresources API (generated stubs live in the versioned subpackage)."""
