"""Live fault injection into a running mock NVML.

Why a controller
----------------
Scenario timelines play faults at fixed times; demos and end-to-end tests also need
to break a GPU *now* ("inject XID 79 on GPU 3 and watch the Device CR turn
unhealthy"). The lead wires :meth:`MockController.inject` to the NATS subject
``gpulet.mock.inject.<node>``; this module only turns a wire request
(:class:`~gpulet_common.messages.MockInjectRequest`) into the same
:class:`~gpulet_common.mock_nvml.scenario.FaultSpec` the timeline uses, so a fault
behaves identically whether scheduled or injected.

Request fields by fault (``gpu`` is the scenario slot, see :mod:`.mock`):

=================  ==============================================================
fault              value / duration_s
=================  ==============================================================
``xid``            value = XID number (required)
``ecc_sbe``        value = count (default 1)
``ecc_dbe``        value = count (default 1)
``temperature``    value = target C (absent: back to baseline); duration_s = hold
``lost``           duration_s = how long (absent: until ``reset``)
``fall_off_bus``   --  (XID 79, lost, GPU count drops; ``reset`` brings it back)
``remove``         --  (GPU count drops; ``hot_add`` with gpu brings it back)
``hot_add``        gpu absent: a new GPU; gpu = a removed slot: it comes back
``remap_pending``  value = rows (default 1)
``remap_failure``  --
``hang``           duration_s = seconds every call on the GPU blocks (required)
``clock_event``    value = clock-event reason bits (0x80 power brake; 0 ends it)
``nvlink_down``    value = the GPU's NVLink number (absent: all its NVLinks); both
                   ends of a link go down, each counting one NVLink recovery
                   error; duration_s = how long (absent: until up)
``nvlink_up``      value = the GPU's NVLink number (absent: all its NVLinks)
``nvml_vanish``    value = NVML code 12/9/4/1 (default 12); duration_s optional
``nvml_return``    --
``reset``          --  (clears volatile ECC, XIDs, pending remaps, lost, hang)
=================  ==============================================================
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gpulet_common.messages import MockInjectReply, MockInjectRequest
from gpulet_common.mock_nvml.scenario import FAULT_KINDS, FaultSpec

if TYPE_CHECKING:
    from gpulet_common.mock_nvml.mock import MockNvml

log = logging.getLogger("gpulet.mock_nvml")


class MockController:
    """Applies live faults to one :class:`~gpulet_common.mock_nvml.mock.MockNvml`."""

    def __init__(self, mock: MockNvml) -> None:
        self._mock = mock

    @property
    def faults(self) -> tuple[str, ...]:
        """The fault kinds :meth:`inject` accepts."""
        return FAULT_KINDS

    def inject(self, request: MockInjectRequest) -> MockInjectReply:
        """Apply the requested fault now; never raises for a bad request."""
        fault = FaultSpec(
            fault=request.fault,
            gpu=request.gpu,
            value=request.value,
            duration_s=request.duration_s,
        )
        applied, detail = self._mock.apply(fault)
        if applied:
            log.info("mock NVML fault injected: %s", detail)
        else:
            log.warning("mock NVML fault %r rejected: %s", request.fault, detail)
        return MockInjectReply(applied=applied, detail=detail)
