"""``[sharing]``: how whole GPUs are shared beyond gpulet's own shares (issue 27).

``sharing.time_slicing`` is NVIDIA's time-slicing (``sharing.timeSlicing`` of the
k8s-device-plugin's config file), with named configs that a node picks through a node
label, the way NVIDIA's config manager reads ``nvidia.com/device-plugin.config``:

.. code-block:: toml

    [sharing.time_slicing]
    node_label = "gpulet.io/sharing.config"   # or "nvidia.com/device-plugin.config"
    default_config = "none"

    [sharing.time_slicing.configs.inference]
    fail_requests_greater_than_one = true
    resources = [{ name = "nvidia.com/gpu", replicas = 4 }]
    gpus = [{ gpu = "0", replicas = 2 }, { gpu = "NVIDIA H100 80GB HBM3", replicas = 8 }]

The rules (which GPU gets how many replicas, what a change does to what is held) are
:mod:`gpulet_allocator.timeslicing`'s; docs/mig.md tells them.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

# A replica is a kubelet device: bounded so that a typo cannot list a million of them.
Replicas = Annotated[int, msgspec.Meta(ge=1, le=128)]


class ReplicatedResource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # The resource whose GPUs are replicated: the whole-GPU one
    # (allocator.plugin.resources.gpu); any other name is ignored, and said so.
    name: str = "nvidia.com/gpu"
    # How many replicas each GPU is offered as (1: not time-sliced).
    replicas: Replicas = 1


class GpuReplicas(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Which GPU: its index ("0"), UUID ("GPU-...") or product, as NVML names it
    # ("NVIDIA H100 80GB HBM3") or as GFD's label does ("NVIDIA-H100-80GB-HBM3").
    gpu: str
    # How many replicas that GPU is offered as (1: not time-sliced).
    replicas: Replicas = 1


class TimeSlicingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # NVIDIA's sharing.timeSlicing.resources: replicas of every GPU of a resource.
    resources: list[ReplicatedResource] = []
    # Per-GPU overrides (NVIDIA's #1786): a UUID beats an index, an index a product.
    gpus: list[GpuReplicas] = []
    # NVIDIA's failRequestsGreaterThanOne: refuse a container asking for more than one
    # replica (two replicas of one GPU are no more GPU than one).
    fail_requests_greater_than_one: bool = False


class TimeSlicingSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # The node label whose value names the config in force (read and watched by the
    # allocator through allocator.handshake's kubeconfig and timeouts: a change applies
    # without a restart). Set it to "nvidia.com/device-plugin.config" to share
    # NVIDIA's labels.
    node_label: str = "gpulet.io/sharing.config"
    # The config of a node without the label; "" or "none": no time-slicing.
    default_config: str = ""
    # The named configs (TOML: [sharing.time_slicing.configs.<name>]), each with
    # resources = [{name, replicas}], gpus = [{gpu = index, UUID or product, replicas}]
    # and fail_requests_greater_than_one (docs/mig.md, "Time-slicing").
    configs: dict[str, TimeSlicingConfig] = {}
    # More named configs in a file of their own (TOML, or JSON when it ends in .json;
    # one table per config, e.g. a mounted ConfigMap), re-read when it changes: a
    # change applies without a restart. Its configs win over `configs` of the same
    # name; a file that does not load keeps the configs in force, and says why.
    configs_file: str = ""
    # How often configs_file is checked for a change (size, mtime), and, where the
    # agent may not list/watch Nodes (the base RBAC; components/time-slicing grants it),
    # how often the allocator GETs its Node to read node_label; in seconds.
    configs_poll_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0

    @property
    def enabled(self) -> bool:
        """Whether any config may exist (else the node label is not even read)."""
        return bool(self.configs or self.configs_file)


class SharingSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # NVIDIA's time-slicing replicas, per node config (see docs/mig.md).
    time_slicing: TimeSlicingSettings = msgspec.field(default_factory=TimeSlicingSettings)
