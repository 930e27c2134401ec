"""Settings of the kubelet device plugin.

A msgspec Struct like the other settings in :mod:`gpulet_common.settings`, so the
service settings can embed it as one field and decode it from the config file.
Every timeout is bounded: kubelet must never wait on us indefinitely.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from gpulet_allocator.plugin.resources import ResourceNames

Positive = Annotated[float, msgspec.Meta(gt=0)]


class PluginConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    plugin_dir: str = "/var/lib/kubelet/device-plugins/"
    kubelet_socket: str = "kubelet.sock"
    # Socket files are "<prefix>-<sanitised resource name>.sock".
    socket_prefix: str = "gpulet"
    resources: ResourceNames = ResourceNames()
    # Serve gpulet.io/gpu-core and gpulet.io/gpu-memory next to whole GPUs.
    shares: bool = True
    # Deadline of one backend call (Allocate / GetPreferredAllocation).
    backend_timeout_s: Positive = 5.0
    # If the backend cannot answer GetPreferredAllocation, answer with a simple local
    # choice instead of an error: the call is only a hint, and failing it fails pod
    # admission for the whole node (NVIDIA #231, #2038).
    preferred_fallback: bool = True
    register_timeout_s: Positive = 5.0
    register_backoff_initial_s: Positive = 0.2
    register_backoff_max_s: Positive = 5.0
    # How often the plugin dir is polled for a kubelet restart or a deleted socket.
    watch_interval_s: Positive = 0.5
    stop_grace_s: Positive = 1.0
    # Device files are looked up under dev_root and reported to kubelet as host_dev.
    dev_root: str = "/dev"
    host_dev: str = "/dev"
    pass_device_specs: bool = True
