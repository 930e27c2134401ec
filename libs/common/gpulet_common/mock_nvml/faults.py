"""The mock NVML's fault model: what each fault does to the node.

A fault is a :class:`~gpulet_common.mock_nvml.faultspec.FaultSpec`, from the scenario's
timeline or injected live (:meth:`~gpulet_common.mock_nvml.device.MockCore.apply`):
the same code applies both, so a fault behaves identically whether scheduled or
injected. The module docstring of :mod:`gpulet_common.mock_nvml.mock` lists the faults
and their values.
"""

from __future__ import annotations

import math
from typing import Any, Final

from gpulet_common.mock_nvml.device import Link, Ramp, Slot
from gpulet_common.mock_nvml.events import EV_DBE, EV_SBE, EV_XID, MockEvents
from gpulet_common.mock_nvml.faultspec import ALL_FAULT_KINDS, FaultSpec, vanish_code
from gpulet_common.mock_nvml.recovery import EVENT_BIT as RECOVERY_EVENT
from gpulet_common.mock_nvml.scenario import fill_identity, hot_add_spec

_XID_FALLEN_OFF_BUS: Final = 79


class MockFaults(MockEvents):
    """Applies faults: :meth:`_apply` (the timeline and live injection)."""

    def _new_slot(self, overrides: dict[str, Any] | None) -> Slot:
        template = self._slots[0].spec
        spec = hot_add_spec(template, overrides)
        index = len(self._slots)
        used = {s.spec.bus_id for s in self._slots}
        minor = max((s.spec.minor or 0) for s in self._slots) + 1
        spec = fill_identity(
            spec, seed=self._scenario.seed, slot=index, used_buses=used, minor=minor
        )
        slot = Slot(index, spec, self._scenario.seed)
        slot.order = max(s.order for s in self._slots) + 1
        for other in self._slots:
            self._levels[(index, other.slot)] = self._default_level
            self._levels[(other.slot, index)] = self._default_level
        self._levels[(index, index)] = 0
        self._add_switch_links(slot)
        self._slots.append(slot)
        return slot

    def _apply(self, fault: FaultSpec, start: float) -> tuple[bool, str]:
        """Apply a checked fault as of mock time ``start`` (lock held)."""
        kind = fault.fault
        duration = fault.duration_s
        if kind == "nvml_vanish":
            code = vanish_code(fault)
            self._vanished_until = start + duration if duration is not None else math.inf
            self._vanish_code = code
            # The library is gone: whoever comes back must nvmlInit again, and gets
            # new handles (those of the previous initialisation are void).
            self._init_count = 0
            for slot in self._slots:
                self._renew_handle(slot)
            return True, f"NVML vanished (every call fails with NVML code {code})"
        if kind == "nvml_return":
            self._vanished_until = 0.0
            return True, "NVML is back (callers must nvmlInit again)"
        if kind == "hot_add":
            if fault.gpu is None:
                if not self._slots:
                    return False, "hot_add needs a GPU in the scenario to copy"
                slot = self._new_slot(fault.spec)
                self._reenumerate()
                return True, f"hot-added GPU {slot.slot} ({slot.spec.uuid}, {slot.spec.bus_id})"
            slot = self._slots[fault.gpu]
            if slot.present:
                return False, f"GPU {fault.gpu} is present already"
            slot.present, slot.fell_off, slot.lost_until = True, False, 0.0
            self._renew_handle(slot)
            where = ""
            if fault.value:
                slot.order = max(s.order for s in self._slots) + 1
                where = " enumerated after the others"
            self._reenumerate()
            index = self._enumerated.index(slot)
            return True, f"GPU {fault.gpu} ({slot.spec.uuid}) is back{where}, index {index}"
        assert fault.gpu is not None  # check_fault: every other kind names a GPU
        slot = self._slots[fault.gpu]
        name = f"GPU {slot.slot} ({slot.spec.uuid})"
        if kind == "reset":
            self.recovery.on_reset(slot.slot)
            return self._reset(slot, name)
        if not slot.present:
            return False, f"{name} is not present"
        if kind == "recovery_action":
            applied, detail = self.recovery.inject(slot.slot, fault.value)
            sent = self._emit(slot, RECOVERY_EVENT, 0) if applied else 0
            return applied, f"{detail} (event delivered to {sent} event sets)"
        spec = slot.spec
        count = int(fault.value) if fault.value is not None else 1
        if kind == "xid":
            xid = int(fault.value or 0)
            slot.xids.append(xid)
            instance = (fault.gi, fault.ci or 0) if fault.gi is not None else None
            delivered = self._emit(slot, EV_XID, xid, instance)
            where = f"MIG device gi={instance[0]} ci={instance[1]} of " if instance else ""
            return True, f"XID {xid} on {where}{name} (delivered to {delivered} event sets)"
        if kind in ("ecc_sbe", "ecc_dbe"):
            if not spec.ecc_enabled:
                return False, f"ECC is not enabled on {name}"
            kind_index = 0 if kind == "ecc_sbe" else 1
            slot.ecc_volatile[kind_index] += count
            slot.ecc_aggregate[kind_index] += count
            if kind == "ecc_dbe" and spec.retired_pages:
                slot.retired_pending = True
            self._emit(slot, EV_SBE if kind == "ecc_sbe" else EV_DBE, 0)
            return True, f"{count} {'single' if kind_index == 0 else 'double'}-bit ECC on {name}"
        if kind == "temperature":
            if fault.value is None:
                slot.ramp = None
                return True, f"{name} back to its baseline temperature"
            from_c = fault.from_c if fault.from_c is not None else slot.temperature(start)
            hold = duration if duration is not None else math.inf
            slot.ramp = Ramp(start, from_c, fault.value, fault.ramp_s, hold, fault.back_s)
            return (
                True,
                f"{name} temperature {from_c:g} -> {fault.value:g} C over {fault.ramp_s:g}s",
            )
        if kind == "lost":
            slot.lost_until = start + duration if duration is not None else math.inf
            self._announce_lost(slot)
            return True, f"{name} is lost" + (f" for {duration:g}s" if duration is not None else "")
        if kind == "fall_off_bus":
            slot.xids.append(_XID_FALLEN_OFF_BUS)
            self._emit(slot, EV_XID, _XID_FALLEN_OFF_BUS)
            self._announce_lost(slot)
            slot.lost_until = math.inf
            slot.present, slot.fell_off = False, True
            self._reenumerate()
            return True, f"{name} fell off the bus (XID 79; GPU count now {len(self._enumerated)})"
        if kind == "remove":
            slot.present = False
            self._reenumerate()
            return True, f"{name} removed (GPU count now {len(self._enumerated)})"
        if kind in ("remap_pending", "remap_failure"):
            if not spec.remapped_rows:
                return False, f"{name} ({spec.name}) does not support row remapping"
            if kind == "remap_pending":
                slot.remap_uncorrectable += count
                slot.remap_pending = True
                return (
                    True,
                    f"{count} row(s) remapped for uncorrectable errors on {name}, remap pending",
                )
            slot.remap_failure = True
            return True, f"row remapping failed on {name}"
        if kind == "hang":
            assert duration is not None  # check_fault requires it
            slot.hang_until = start + duration
            return True, f"{name} hangs for {duration:g}s"
        if kind == "pcie_replay":
            slot.pcie_replays += count
            return True, f"{count} PCIe replay(s) on {name} (counter now {slot.pcie_replays})"
        if kind == "nvlink_error":
            if not slot.links:
                return False, f"{name} has no NVLink"
            slot.nvlink_errors = [n + count for n in slot.nvlink_errors]
            return True, f"{count} NVLink CRC flit/data, replay and recovery error(s) on {name}"
        if kind in ("nvlink_down", "nvlink_up"):
            return self._nvlink_fault(slot, name, fault, start)
        if kind == "clock_event":
            slot.clock_events = int(fault.value or 0)
            slot.clock_events_until = start + duration if duration is not None else math.inf
            return True, f"{name} reports clock-event reasons {slot.clock_events:#x}" + (
                f" for {duration:g}s" if duration is not None else ""
            )
        more = self._apply_more(fault, start)
        if more is not None:
            return more
        return False, f"unknown fault {kind!r} (known: {', '.join(ALL_FAULT_KINDS)})"

    def _link_ends(self, slot: Slot, link: int) -> list[tuple[Slot, Link]]:
        """Both ends of one link: the k-th link from A to B is the k-th from B to A
        (as the scenario built them); a link into an NVSwitch has one end here."""
        nvlink = slot.links[link]
        if nvlink.peer is None:
            return [(slot, nvlink)]
        peer = self._slots[nvlink.peer]
        k = sum(1 for other in slot.links[:link] if other.peer == nvlink.peer)
        back = [other for other in peer.links if other.peer == slot.slot]
        return [(slot, nvlink), *((peer, end) for end in back[k : k + 1])]

    def _nvlink_fault(
        self, slot: Slot, name: str, fault: FaultSpec, start: float
    ) -> tuple[bool, str]:
        """nvlink_down / nvlink_up: one link (value) or all of the GPU's, both ends."""
        links = range(len(slot.links)) if fault.value is None else [int(fault.value)]
        if not slot.links:
            return False, f"{name} has no NVLinks"
        if fault.value is not None and not 0 <= int(fault.value) < len(slot.links):
            return False, f"{name} has NVLinks 0-{len(slot.links) - 1}, not {int(fault.value)}"
        down = fault.fault == "nvlink_down"
        duration = fault.duration_s
        until = (start + duration if duration is not None else math.inf) if down else 0.0
        for link in links:
            for owner, end in self._link_ends(slot, link):
                end.down_until = until
                if down:
                    # A link fails after recovery attempts: each end counts one.
                    owner.nvlink_errors[3] += 1
        which = "every NVLink" if fault.value is None else f"NVLink {int(fault.value)}"
        if not down:
            return True, f"{which} of {name} is up"
        return True, f"{which} of {name} is down" + (
            f" for {duration:g}s" if duration is not None else ""
        )

    def _reset(self, slot: Slot, name: str) -> tuple[bool, str]:
        if not slot.present and not slot.fell_off:
            return False, f"{name} was removed; hot_add brings it back"
        slot.ecc_volatile = [0, 0]
        slot.lost_keeps_handle = False
        # The PCIe and NVLink error counters start again from 0 too.
        slot.pcie_replays, slot.nvlink_errors = 0, [0, 0, 0, 0]
        slot.remap_pending = False
        slot.retired_pending = False
        slot.xids.clear()
        slot.lost_until = 0.0
        slot.hang_until = 0.0
        if slot.fell_off:
            slot.present, slot.fell_off = True, False
            self._renew_handle(slot)
            self._reenumerate()
        for event_set in self._event_sets:
            kept = [e for e in event_set.queue if getattr(e.device, "slot", None) != slot.slot]
            event_set.queue.clear()
            event_set.queue.extend(kept)
        return True, f"{name} reset"
