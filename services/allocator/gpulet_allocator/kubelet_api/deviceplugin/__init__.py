"""Kubelet deviceplugin API (generated stubs live in the versioned subpackage)."""
