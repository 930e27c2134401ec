"""The collector: inventory and periodic samples."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

# kubelet's PodResources socket (the collector's pod labels, the allocator's release).
POD_RESOURCES_SOCKET: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"


class CollectorSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Seconds between two sample batches (koordlet: 3 s, dcgm-exporter: 30 s).
    sample_period_s: Annotated[float, msgspec.Meta(ge=0.01, le=3600)] = 1.0
    # Threads for NVML calls; one hung GPU holds one thread, never the others.
    worker_threads: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    # Seconds between unsolicited inventory republishes, so a consumer that starts late
    # learns the GPUs without asking. 0 disables; changes are always published at once.
    inventory_republish_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # Seconds between two reads of the slow fields (energy, PCIe replays, NVLink
    # counters, memory temperature, GPM activity, aggregate ECC): one
    # nvmlDeviceGetFieldValues batch costs ~5 ms of CPU per GPU on a real H100 every
    # time, so it is not read every period (30 s is dcgm-exporter's default interval).
    # Samples in between repeat the last values (see slow_fields_at).
    slow_period_s: Annotated[float, msgspec.Meta(ge=0.01, le=3600)] = 30.0
    # Seconds between two reads of a GPU's NVLink link state (nvmlDeviceGetNvLinkState,
    # one call per link seen up: 18 on an H100 SXM), made on a slow read. A slow read
    # whose NVLink error counters (CRC, replay, recovery) moved re-reads it at once: a
    # failing link usually goes through replays and recovery before it is down.
    # 0: at every slow read.
    nvlink_state_period_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 300.0
    # Export dcgm-exporter's DCGM_FI_* metrics on /metrics beside the gpulet_* ones.
    dcgm_metrics: bool = True
    # Add pod/namespace/container labels to the DCGM_FI_* metrics of GPUs that a
    # container holds (as dcgm-exporter does), from the allocator's `pods` endpoint:
    # the allocator reads kubelet's PodResources (allocator.pods_poll_s).
    pod_labels: bool = True
    # No longer read: the allocator alone asks kubelet (allocator.pod_resources_socket).
    # Kept so that existing configuration files still load.
    pod_resources_socket: str = POD_RESOURCES_SOCKET
    # The longest wait before the allocator's `pods` endpoint is asked again when it
    # did not answer (0.5 s, doubling up to this); while it answers, labels follow
    # each change at once.
    pod_resources_poll_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
