"""Settings of the allocator service and of the kubelet device plugin.

Why both live here
------------------
The allocator (which decides) and the device plugin (which speaks kubelet's protocol)
run as two services, possibly in two sidecars, but must agree on the resource names,
so they read one section, ``[allocator]``, with the plugin's part nested as
``[allocator.plugin]``. The structs live in ``gpulet_common`` because the common
package never imports a service; the plugin package re-exports
:class:`PluginConfig` and :class:`ResourceNames` from here.

Every timeout is bounded and positive: kubelet must never wait on us indefinitely.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gpulet_common.settings.collector import POD_RESOURCES_SOCKET

Positive = Annotated[float, msgspec.Meta(gt=0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]


class ResourceNames(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Kubelet resource names; configurable so two plugins can coexist on a node."""

    # Whole GPUs; device IDs are GPU UUIDs.
    gpu: str = "nvidia.com/gpu"
    # Core units of a share, 100 per GPU; device IDs <uuid>::core-<n>.
    core: str = "gpulet.io/gpu-core"
    # Memory units of a share, 256 MiB each; device IDs <uuid>::mem-<n>.
    memory: str = "gpulet.io/gpu-memory"


class PluginConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The kubelet device plugin (``gpulet device-plugin``)."""

    # Kubelet's device-plugin directory; while it is missing the plugin waits, degraded.
    plugin_dir: str = "/var/lib/kubelet/device-plugins/"
    # Kubelet's registration socket, in plugin_dir.
    kubelet_socket: str = "kubelet.sock"
    # Socket files are "<prefix>-<sanitised resource name>.sock".
    socket_prefix: str = "gpulet"
    # Kubelet resource names (also what the allocator answers for).
    resources: ResourceNames = ResourceNames()
    # Serve gpulet.io/gpu-core and gpulet.io/gpu-memory next to whole GPUs.
    shares: bool = True
    # Deadline of one backend call (Allocate / GetPreferredAllocation), NATS included.
    backend_timeout_s: Positive = 5.0
    # If the backend cannot answer GetPreferredAllocation, answer with a simple local
    # choice instead of an error: the call is only a hint, and failing it fails pod
    # admission for the whole node (NVIDIA #231, #2038).
    preferred_fallback: bool = True
    # Deadline of one Register call to kubelet.
    register_timeout_s: Positive = 5.0
    # Back-off between failed registrations: starts here, doubles up to the maximum.
    register_backoff_initial_s: Positive = 0.2
    # The longest back-off between two registration attempts.
    register_backoff_max_s: Positive = 5.0
    # How often the plugin dir is polled for a kubelet restart or a deleted socket.
    watch_interval_s: Positive = 0.5
    # Grace given to in-flight gRPC calls when the plugin stops.
    stop_grace_s: Positive = 1.0
    # Device files are looked up under dev_root and reported to kubelet as host_dev.
    dev_root: str = "/dev"
    # The host's /dev as kubelet sees it (the paths in the device specs).
    host_dev: str = "/dev"
    # Hand kubelet device specs for /dev/nvidiaN and the control devices that exist.
    pass_device_specs: bool = True


class MpsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a share is limited inside the container (CUDA MPS client variables)."""

    # Set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (core units) and
    # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (memory units) for shares.
    enabled: bool = True
    # Host directory of the MPS control daemon's pipes. When set, it is mounted at the
    # same path in share containers and CUDA_MPS_PIPE_DIRECTORY points there.
    pipe_directory: str = ""


class CdiSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Container Device Interface names in the Allocate response (CRI field)."""

    # Add CDI device names (Kubernetes 1.28+ with a CDI-enabled container runtime).
    enabled: bool = False
    # "<kind>=<device>", e.g. nvidia.com/gpu=GPU-... (nvidia-ctk's spec).
    kind: str = "nvidia.com/gpu"
    # Name devices by UUID or by index, matching `nvidia-ctk cdi generate
    # --device-name-strategy`.
    device_name: Literal["uuid", "index"] = "uuid"


class AllocatorSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Run the allocator and the device plugin (false: both start idle).
    enabled: bool = True
    # Allocation checkpoint; empty: <state_dir>/allocator/allocations.json.
    checkpoint_path: str = ""
    # How long the device plugin waits for the allocator's NATS reply. Keep it below
    # plugin.backend_timeout_s so the plugin reports "allocator unavailable" itself.
    request_timeout_s: PositiveSeconds = 2.0
    # Kubelet's PodResources API; allocations of pods it no longer lists are released.
    # A missing socket (no kubelet, a laptop) is skipped quietly.
    pod_resources_socket: str = POD_RESOURCES_SOCKET
    # How often PodResources is asked.
    release_interval_s: PositiveSeconds = 30.0
    # An allocation is released once no pod has listed it for this long (covers a
    # kubelet that restarts and lists no pods for a moment).
    release_grace_s: PositiveSeconds = 60.0
    # Deadline of one PodResources call.
    pod_resources_timeout_s: PositiveSeconds = 5.0
    # A container's gpu-core and gpu-memory Allocate calls, adjacent and within this
    # window, are joined into one share on one card (rule: gpulet_allocator.core).
    share_join_window_s: PositiveSeconds = 5.0
    # Ask the collector (inventory) and the health service (state) this often until
    # they answer, so the start order of the services does not matter.
    request_retry_s: PositiveSeconds = 2.0
    # CUDA MPS limits of shares.
    mps: MpsSettings = MpsSettings()
    # CDI device names in Allocate answers.
    cdi: CdiSettings = CdiSettings()
    # The kubelet device plugin (`gpulet device-plugin`).
    plugin: PluginConfig = PluginConfig()
