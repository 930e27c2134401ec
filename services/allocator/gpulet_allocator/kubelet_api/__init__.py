"""Kubelet's gRPC APIs, generated from kubelet's own api.proto files.

Why: the wire format kubelet speaks (``/v1beta1.Registration/Register``,
``/v1beta1.DevicePlugin/*``, ``/v1.PodResourcesLister/*``) is defined by upstream's
protos, so they are vendored here (``deviceplugin/v1beta1``) and the ``*_pb2*``
modules next to them are produced by ``scripts/gen-protos``; never edit those by hand.
``podresources/v1`` lives in ``gpulet_common.kubelet_api``: the collector calls it too.
``scripts/vendor-kubelet-proto`` records where each proto came from.
"""
