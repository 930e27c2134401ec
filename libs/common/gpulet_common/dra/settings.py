"""What an operator chooses about DRA: the driver name, the mode, taints and sharing.

A msgspec Struct like every other settings section (``gpulet_common.settings``), kept
beside the DRA model until the lead wires it into the config file as ``[dra]``; fields
only get added, each with a default.

* ``mode``: ``device-plugin`` (DRA off: no slices, no kubelet plugin), ``dra`` (slices
  and the kubelet plugin, no device plugin), ``both`` (a migration: both adapters over
  one ledger; a GPU the device plugin holds is tainted ``NoSchedule`` in the slice).
* ``unhealthy_effect``: the taint effect of a fault that makes a GPU unhealthy
  (``NoSchedule`` by default; ``NoExecute`` also evicts the pods using it).
* ``sharing``: offer each GPU for sharing through consumable capacity (cores in percent
  and memory, ``allowMultipleAllocations``).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

DEFAULT_DRIVER: Final = "gpu.gpulet.io"
DEFAULT_CDI_DIR: Final = "/var/run/cdi"
DEFAULT_PLUGINS_REGISTRY: Final = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGINS_DIR: Final = "/var/lib/kubelet/plugins"

Mode = Literal["device-plugin", "dra", "both"]
Effect = Literal["NoSchedule", "NoExecute"]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class DraSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    mode: Mode = "device-plugin"
    # The DRA driver name: a DNS subdomain of at most 63 characters.
    driver: str = DEFAULT_DRIVER
    unhealthy_effect: Effect = "NoSchedule"
    sharing: bool = True
    # Smallest share of memory a claim may ask for, in bytes (the requestPolicy step).
    memory_step_bytes: Annotated[int, msgspec.Meta(gt=0)] = 1024**3
    cdi_dir: str = DEFAULT_CDI_DIR
    plugins_registry: str = DEFAULT_PLUGINS_REGISTRY
    plugins_dir: str = DEFAULT_PLUGINS_DIR
    # The slice writer's debounce, as the reporter's Device writer.
    quiet_window_s: Seconds = 0.5
    max_delay_s: Seconds = 2.0
    # A watch on the node's slices repairs a deletion (kubelet deletes a node's slices
    # when it starts) or an edit within the debounce; the slices are also re-listed
    # this often, which repairs them even when the watch is down.
    resync_s: PositiveSeconds = 60.0
    watch_timeout_s: PositiveSeconds = 300.0
    api_timeout_s: PositiveSeconds = 10.0
    backoff_base_s: PositiveSeconds = 0.2
    backoff_max_s: PositiveSeconds = 30.0
    field_manager: str = "gpulet-dra"

    @property
    def serves_dra(self) -> bool:
        return self.mode in ("dra", "both")
