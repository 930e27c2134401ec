"""NVLink rules: a link that was up went down.

Input: the collector's inventory (``gpu.inventory.<node>``), whose GPUs list the NVLinks
up (``nvlinks_up``) and those the collector saw up before that are down now
(``nvlinks_down``), re-read on its slow period (``collector.nvlink_state_period_s``, at
once when the GPU's NVLink error counters move). The health service's own GPU scans
carry no link state and are not this rule's input.

* **Down**: each link in ``nvlinks_down`` raises ``nvlink_down:<link>`` (kind
  ``nvlink_down``, a warning: the GPU still computes, but the pairs that used the link
  are slower, and the allocator no longer counts it). The reason names the peers that
  lost links, from the inventory's topology.
* **Up**: the condition ends (``recovered``) when the link is listed up again. A link
  in neither list -- the collector restarted and never saw it up -- is not taken as
  recovered: the warning stays until the link is seen up or an operator clears it
  (``gpulet health clear --gpu N --condition nvlink_down:<link>``).

Not sticky, and a GPU reset observed does not end it: link state is read, not inferred.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from gpulet_common.messages import GpuInfo
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Family, where
from gpulet_health.state import Condition, GpuState

KIND: Final = "nvlink_down"
PREFIX: Final = KIND + ":"


def condition_of(link: int) -> str:
    return f"{PREFIX}{link}"


def _peers(info: GpuInfo) -> str:
    lost = [p for p in info.topology if p.nvlinks_down]
    if not lost:
        return ""
    parts = [
        f"GPU {p.peer_index} has {p.nvlinks} of {p.nvlinks + p.nvlinks_down} NVLinks up"
        for p in sorted(lost, key=lambda p: p.peer_index)
    ]
    return "; " + ", ".join(parts)


class NvLink(Family):
    name = "nvlink"

    def observe(self, gpu: GpuState, info: GpuInfo, now: float) -> Iterable[Emit]:
        """The GPU as the collector's inventory describes it."""
        out: list[Emit] = []
        # A link listed both up and down (a confused sender) counts as down.
        down = set(info.nvlinks_down)
        up = set(info.nvlinks_up) - down
        for link in sorted(down):
            cond = Condition(
                condition=condition_of(link),
                kind=KIND,
                severity="warning",
                reason=f"NVLink {link} of {where(gpu)} is down{_peers(info)}",
                action="operator_check",
                since=now,
                observed_value=float(link),
                message=(
                    "the allocator no longer counts this link; check the NVLink bridge, "
                    "cable or NVSwitch (the kernel log usually has an XID 74); a GPU reset "
                    "or a reboot retrains the link"
                ),
            )
            out += self.kit.raise_(gpu, cond, now)
        for name in [c for c in gpu.conditions if c.startswith(PREFIX)]:
            link_id = name[len(PREFIX) :]
            if link_id.isdigit() and int(link_id) in up:
                out += self.kit.end(gpu, name, now, f"NVLink {link_id} of {where(gpu)} is up again")
        return out
