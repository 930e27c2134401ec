"""The ``[dra]`` section: the driver name, the mode, taints and sharing.

A msgspec Struct like every other settings section; fields only get added, each with
a default. Read by the reporter (the ResourceSlice publisher) and the allocator (or, with
``plugin_host = "device-plugin"``, the device-plugin sidecar) for the DRA kubelet
plugin; docs/dra.md says how to turn it on.

* ``mode``: ``device-plugin`` (DRA off: no slices, no kubelet plugin), ``dra`` (slices
  and the kubelet plugin, no device plugin), ``both`` (a migration: both adapters over
  one ledger; a GPU the device plugin holds is tainted ``NoSchedule`` in the slice).
* ``unhealthy_effect``: the taint effect of a fault that makes a GPU unhealthy
  (``NoSchedule`` by default; ``NoExecute`` also evicts the pods using it).
* ``plugin_host``: which service runs the DRA kubelet plugin: ``allocator`` (the
  default: in the allocator's process, deciding in its ledger directly) or
  ``device-plugin`` (beside the device plugin, deciding over NATS); docs/dra.md.
* ``sharing``: offer each GPU for sharing through consumable capacity (cores in percent
  and memory, ``allowMultipleAllocations``).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from gpulet_common.settings.kube_writer import KubeWriterSettings, PositiveSeconds

DEFAULT_DRIVER: Final = "gpu.gpulet.io"
DEFAULT_CDI_DIR: Final = "/var/run/cdi"
DEFAULT_PLUGINS_REGISTRY: Final = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGINS_DIR: Final = "/var/lib/kubelet/plugins"

Mode = Literal["device-plugin", "dra", "both"]
PluginHost = Literal["allocator", "device-plugin"]
Effect = Literal["NoSchedule", "NoExecute"]


class DraSettings(KubeWriterSettings, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The kubeconfig, debounce, API timeout and back-off of the slice writer and the
    claim reads are KubeWriterSettings' (settings/kube_writer.py)."""

    # Which kubelet API serves the GPUs: `device-plugin` (DRA off), `dra` (ResourceSlices
    # and the DRA kubelet plugin, no device plugin) or `both` (a migration: both over one
    # ledger; a GPU the device plugin holds is tainted NoSchedule in the slice).
    mode: Mode = "device-plugin"
    # Which service runs the DRA kubelet plugin: `allocator` (in the allocator's
    # process: Prepare decides in the ledger directly, no NATS hop) or `device-plugin`
    # (beside the device plugin, deciding over NATS). Its mounts go to that container.
    plugin_host: PluginHost = "allocator"
    # The DRA driver name: a DNS subdomain of at most 63 characters.
    driver: str = DEFAULT_DRIVER
    # The taint effect of a fault that makes a GPU unhealthy (`NoExecute` also evicts
    # the pods using it).
    unhealthy_effect: Effect = "NoSchedule"
    # Offer each GPU for sharing through consumable capacity (cores in percent and
    # memory, allowMultipleAllocations).
    sharing: bool = True
    # Smallest share of memory a claim may ask for, in bytes (the requestPolicy step).
    memory_step_bytes: Annotated[int, msgspec.Meta(gt=0)] = 1024**3
    # Where Prepare writes each claim's CDI spec (the container runtime reads it).
    cdi_dir: str = DEFAULT_CDI_DIR
    # kubelet's plugin registry: the registration socket `<driver>-reg.sock` goes here.
    plugins_registry: str = DEFAULT_PLUGINS_REGISTRY
    # The DRA socket goes to `<plugins_dir>/<driver>/dra.sock`.
    plugins_dir: str = DEFAULT_PLUGINS_DIR
    # Prepare reads claims from a watch of the ResourceClaims allocated to this node
    # instead of a GET each (a GET on a miss). Faster Prepare, but every node then
    # watches every claim of the cluster.
    claim_cache: bool = False
    # The DRA kubelet plugin's checkpoint of prepared claims (empty:
    # <plugins_dir>/<driver>/checkpoint.json, beside its socket).
    checkpoint_path: str = ""
    # A watch on the node's slices repairs a deletion (kubelet deletes a node's slices
    # when it starts) or an edit within the debounce; the slices are also re-listed
    # this often, which repairs them even when the watch is down.
    resync_s: PositiveSeconds = 60.0
    # The server-side timeout of one watch of the node's slices.
    watch_timeout_s: PositiveSeconds = 300.0
    # The field manager of gpulet's server-side applies of ResourceSlices.
    field_manager: str = "gpulet-dra"
    # How often the prepared claims are checked with the API server; one it no longer
    # knows is unprepared (its GPUs released). Claims of an earlier boot: at start.
    sweep_interval_s: PositiveSeconds = 600.0
    # Give containers the driver's user space through the CDI specs (libraries found by
    # driver version through the ldcache, binaries, firmware, IPC sockets; docs/dra.md).
    driver_files: bool = True
    # Where the driver is installed, as the host sees it: `/` for a driver on the host,
    # `/run/nvidia/driver` for the GPU operator's driver container. Empty: `/` with the
    # real NVML, a mock driver root under the state directory with the mock NVML.
    driver_root: str = ""
    # Where gpulet sees that root, when it is not at the same path (the host's `/`
    # mounted at `/host`). Empty: the same path.
    driver_root_seen: str = ""
    # The host path of the NVIDIA Container Toolkit's `nvidia-cdi-hook`, for the
    # create-symlinks and update-ldcache hooks. Empty: looked for under the driver root
    # (`usr/bin`, `usr/local/nvidia/toolkit`); none found: no hooks.
    cdi_hook_path: str = ""

    @property
    def serves_dra(self) -> bool:
        return self.mode in ("dra", "both")

    def plugin_runs_in(self, service: PluginHost) -> bool:
        """Whether ``service`` runs the DRA kubelet plugin."""
        return self.serves_dra and self.plugin_host == service
