"""Kubelet DRA health API (KEP-4680), ``<version>.DRAResourceHealth``.

Upstream folder ``dra-health`` (not a Python name); one subpackage per version kubelet
may dial: ``v1alpha1``, ``v1beta1`` and ``v1``, all served by the DRA kubelet plugin.
"""
