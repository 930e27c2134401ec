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

import re
from typing import Annotated, Literal

import msgspec

from gpulet_common.settings.collector import POD_RESOURCES_SOCKET

Positive = Annotated[float, msgspec.Meta(gt=0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]


# A Kubernetes extended resource name is `<domain>/<name>` (kubelet rejects a device
# plugin registering anything else): the domain a DNS-1123 subdomain outside
# kubernetes.io, the name a qualified-name segment of at most 63 characters.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_EXTENDED_RESOURCE_NAME = re.compile(
    rf"{_DNS_LABEL}(\.{_DNS_LABEL})*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
# Kubernetes builds "requests.<name>" from an extended resource name for quotas, and
# that must still be a DNS-1123 subdomain of at most 253 characters.
_MAX_DOMAIN_CHARS = 253 - len("requests.")
_MAX_NAME_CHARS = 63


def check_extended_resource_name(name: str) -> None:
    """ValueError unless ``name`` is a valid Kubernetes extended resource name."""
    if not _EXTENDED_RESOURCE_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a Kubernetes extended resource name: expected "
            "<domain>/<name>, e.g. example.com/gpu (lower-case domain; name of letters, "
            "digits, '-', '_', '.')"
        )
    domain, _, short = name.partition("/")
    if len(domain) > _MAX_DOMAIN_CHARS:
        raise ValueError(f"{name!r}: the domain is over {_MAX_DOMAIN_CHARS} characters")
    if len(short) > _MAX_NAME_CHARS:
        raise ValueError(f"{name!r}: the name after '/' is over {_MAX_NAME_CHARS} characters")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise ValueError(f"{name!r}: the kubernetes.io domain is reserved for native resources")


class ResourceNames(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Kubelet resource names; configurable so two plugins can coexist on a node.

    Each must be a Kubernetes extended resource name (``vendor.example/name``), and
    the three must differ.
    """

    # Whole GPUs; device IDs are GPU UUIDs.
    gpu: str = "nvidia.com/gpu"
    # Core units of a share, 100 per GPU; device IDs <uuid>::core-<n>.
    core: str = "gpulet.io/gpu-core"
    # Memory units of a share, 256 MiB each; device IDs <uuid>::mem-<n>.
    memory: str = "gpulet.io/gpu-memory"

    def __post_init__(self) -> None:
        for name in (self.gpu, self.core, self.memory):
            check_extended_resource_name(name)
        if len({self.gpu, self.core, self.memory}) != 3:
            raise ValueError(
                f"gpu, core and memory must be distinct, not {self.gpu!r}, {self.core!r}, "
                f"{self.memory!r}"
            )


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
    # Which share resources: "gpulet" (resources.core / resources.memory) or
    # "koordinator": koordinator.sh/gpu-core and koordinator.sh/gpu-memory-ratio, placed
    # where koord-scheduler's device-allocated annotation says (needs handshake.enabled).
    profile: Literal["gpulet", "koordinator"] = "gpulet"
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
    # Where those device files appear in the container (empty: host_dev). Set only where
    # the node's device files are not in the host's /dev, as a mock dev root whose
    # <root>/nvidia3 must be /dev/nvidia3 in the container (docs/testing.md, the real node).
    container_dev: str = ""
    # Hand kubelet device specs for /dev/nvidiaN and the control devices that exist.
    pass_device_specs: bool = True
    # The driver's MIG capability files (gpu<minor>/mig/gi<g>[/ci<c>]/access): a MIG
    # device also gets the /dev/nvidia-caps/nvidia-cap<n> nodes they name, where it exists.
    mig_capabilities_root: str = "/proc/driver/nvidia/capabilities"


class MpsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a share is limited inside the container (CUDA MPS client variables)."""

    # Set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (core units) and
    # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (memory units) for shares.
    enabled: bool = True
    # Host directory of the MPS control daemon's pipes. When set, it is mounted at the
    # same path in share containers and CUDA_MPS_PIPE_DIRECTORY points there (a daemon
    # run by someone else; gpulet then runs none).
    pipe_directory: str = ""
    # Run and supervise an MPS control daemon (nvidia-cuda-mps-control) per GPU that
    # holds shares, stopped when its last share goes (docs/dra.md, "Shares enforced
    # with MPS"). Ignored when pipe_directory is set.
    daemons: bool = True
    # Where each GPU's daemon keeps its pipe and log directories (<root>/<GPU UUID>/pipe
    # and /log). Empty: /run/gpulet/mps with the real NVML, <state_dir>/mps with the mock.
    root_directory: str = ""
    # The control daemon's binary. Empty: nvidia-cuda-mps-control (looked up in PATH)
    # with the real NVML, the mock control daemon with the mock NVML.
    control_binary: str = ""


class CdiSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Container Device Interface names in the Allocate response (CRI field)."""

    # Add CDI device names (Kubernetes 1.28+ with a CDI-enabled container runtime).
    enabled: bool = False
    # "<kind>=<device>", e.g. nvidia.com/gpu=GPU-... (nvidia-ctk's spec).
    kind: str = "nvidia.com/gpu"
    # Name devices by UUID or by index, matching `nvidia-ctk cdi generate
    # --device-name-strategy`.
    device_name: Literal["uuid", "index"] = "uuid"


class HandshakeSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Following koord-scheduler's device decisions (docs/koordinator.md)."""

    # Watch this node's pods and honour their scheduling.koordinator.sh/device-allocated
    # annotation in Allocate and GetPreferredAllocation.
    enabled: bool = False
    # Kubeconfig outside a cluster; empty: in-cluster, else $KUBECONFIG, else ~/.kube/config.
    kubeconfig: str = ""
    # Context of that kubeconfig; empty: its current context.
    kube_context: str = ""
    # Post a Kubernetes Event on a pod whose decision is refused.
    events: bool = True
    # Deadline of one API request (list, event create).
    api_timeout_s: PositiveSeconds = 10.0
    # A watch is reopened (from the last resourceVersion) after this long.
    watch_timeout_s: PositiveSeconds = 300.0


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
    # How often PodResources is asked at least, for which container holds which GPU
    # (the ``pods`` endpoint: the collector's pod labels follow allocations this fast).
    pods_poll_s: PositiveSeconds = 10.0
    # An allocation is released once no pod has listed it for this long (covers a
    # kubelet that restarts and lists no pods for a moment).
    release_grace_s: PositiveSeconds = 60.0
    # Deadline of one PodResources call.
    pod_resources_timeout_s: PositiveSeconds = 5.0
    # A container's gpu-core and gpu-memory Allocate calls, adjacent and within this
    # window, are joined into one share on one card (rule: gpulet_allocator.decide.joining).
    share_join_window_s: PositiveSeconds = 5.0
    # Ask the collector (inventory) and the health service (state) this often until
    # they answer, so the start order of the services does not matter.
    request_retry_s: PositiveSeconds = 2.0
    # NVIDIA's --mig-strategy: "none" (no MIG device offered), "single" (MIG devices as
    # resources.gpu, if the layout is valid by NVIDIA's rules) or "mixed"
    # (nvidia.com/mig-<profile> per profile). A MIG-enabled GPU is never offered whole.
    mig_strategy: Literal["none", "single", "mixed"] = "none"
    # CUDA MPS limits of shares.
    mps: MpsSettings = MpsSettings()
    # CDI device names in Allocate answers.
    cdi: CdiSettings = CdiSettings()
    # The kubelet device plugin (`gpulet device-plugin`).
    plugin: PluginConfig = PluginConfig()
    # koord-scheduler's device decisions.
    handshake: HandshakeSettings = HandshakeSettings()
