"""A fake ``pynvml``: the same function names, return shapes and exceptions.

Why a module-shaped fake
------------------------
The NVML adapter receives the NVML module as a parameter. Handing it a
:class:`MockNvml` instead of ``pynvml`` runs *the adapter's real code* -- error
translation, unsupported-field caching, topology, events -- on a machine without a
GPU. For that to mean anything the fake must behave like the bindings:

* the same function names and arguments (``nvmlDeviceGetTotalEccErrors(h, type,
  counter)``) and return shapes (objects with ``.total/.free/.used``, ``.busId``,
  ``.gpu/.memory``; event data with ``.device/.eventType/.eventData``; ``str`` for
  text, as nvidia-ml-py 13 returns);
* the real exceptions: ``pynvml.NVMLError(code)``, which ``pynvml`` maps to its
  ``NVMLError_*`` subclass, so ``except pynvml.NVMLError_GpuIsLost`` works;
* the constants: every ``NVML_*`` / ``nvml*`` constant of ``pynvml`` is readable on
  the mock (``__getattr__``); functions the mock lacks raise ``AttributeError``, which
  the adapter treats like a driver without that function.

Pieces, one concern each
------------------------
:class:`MockNvml` is the sum of pieces over one core, like the adapter it stands in for:

* :mod:`.device` (:class:`~.device.MockCore`): the device model (one slot per GPU),
  time, the gate of every call, the timeline, and the mock's own API;
* :mod:`.identity`: init, system, enumeration, identity and topology functions;
* :mod:`.readings`: samples, field values and GPM;
* :mod:`.events`: event sets, registration, the wait, delivering events;
* :mod:`.faults`: what each fault does (the fault model; :mod:`.faultspec` checks them);
* :mod:`.mig`: MIG mode, GPU and compute instances, MIG device handles (on the
  identity and readings pieces, whose calls it extends to MIG handles; the tables
  come from the scenario, :mod:`.migspec`);
* :mod:`.latency`: the cost of each call on a real GPU, spent per call when asked;
* :mod:`.shapes`: the return shapes of ``pynvml``.

A new concern is a new piece beside these.

State and time
--------------
The node comes from a :class:`~gpulet_common.mock_nvml.scenario.Scenario`. Time is
seconds since the mock was created, read from an injectable clock (``time.monotonic``
by default, :class:`ManualClock` in tests). The fault timeline is evaluated lazily, at
every call, so a test that moves a manual clock sees the faults due by then; and
``nvmlEventSetWait_v2`` sleeps at most until the next timeline entry is due, so an
event from the timeline wakes a waiter on time.

GPUs are addressed by *slot*: their position in the scenario (hot-added GPUs take the
next slots). NVML indices are the positions among the GPUs currently present, so
they shift when a GPU disappears -- as they would after a re-enumeration. A GPU that is
lost (fault ``lost``, or ``lost_at_start`` in the scenario) stays counted by
``nvmlDeviceGetCount``, as on real NVML, and its calls fail with GPU_IS_LOST.

A GPU that comes back (``hot_add`` of a removed slot, ``reset`` after
``fall_off_bus``) and every GPU after ``nvml_vanish`` get a new handle: the old one
answers INVALID_ARGUMENT and the event registrations made with it are void, as a
handle of a previous enumeration is on real NVML. ``[system] init_failures`` and
``driver_loaded_file`` play a driver not loaded yet (nvmlInit: DRIVER_NOT_LOADED).

Live injection
--------------
Scenario timelines play faults at fixed times; demos and end-to-end tests also need
to break a GPU *now* ("inject XID 79 on GPU 3 and watch the Device CR turn
unhealthy"). :meth:`MockNvml.inject` takes a wire request
(:class:`~gpulet_common.messages.MockInjectRequest`, from ``gpulet.mock.inject.<node>``)
and applies the same :class:`~gpulet_common.mock_nvml.faultspec.FaultSpec` the timeline
uses, so a fault behaves identically whether scheduled or injected.

Request fields by fault (``gpu`` is the scenario slot, see above):

=================  ==============================================================
fault              value / duration_s
=================  ==============================================================
``xid``            value = XID number (required); gi and ci (timeline, or
                   :meth:`MockNvml.apply`): on that MIG device only
``ecc_sbe``        value = count (default 1)
``ecc_dbe``        value = count (default 1)
``temperature``    value = target C (absent: back to baseline); duration_s = hold
``lost``           duration_s = how long (absent: until ``reset``)
``fall_off_bus``   --  (XID 79, lost, GPU count drops; ``reset`` brings it back)
``remove``         --  (GPU count drops; ``hot_add`` with gpu brings it back)
``hot_add``        gpu absent: a new GPU; gpu = a removed slot: it comes back,
                   as a new device (new handle); value = 1: enumerated after
                   the others (a new NVML index)
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
``mig``            spec = the GPU's new ``[gpus.mig]`` table (timeline, or
                   :meth:`MockNvml.apply`: a bus request carries no spec)
=================  ==============================================================

Threading: one lock (a Condition) guards all state. No call sleeps while holding it:
a hung GPU blocks only the threads calling into that GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpulet_common.mock_nvml.device import ManualClock
from gpulet_common.mock_nvml.gpureset import MockResets
from gpulet_common.mock_nvml.latency import LatencyProfile
from gpulet_common.mock_nvml.mig import MockMig
from gpulet_common.mock_nvml.scenario import Scenario, load_scenario
from gpulet_common.mock_nvml.shapes import MockDeviceHandle, MockEventData, MockEventSet

__all__ = ["ManualClock", "MockDeviceHandle", "MockEventData", "MockEventSet", "MockNvml"]


class MockNvml(MockMig, MockResets):
    """A module-like fake of ``pynvml`` playing a scenario (see the module docstring)."""

    def __init__(
        self,
        scenario: Scenario | str | Path = "dgx-h100",
        *,
        clock: Callable[[], float] | None = None,
        jitter: bool | None = None,
        latency: str | None = None,
    ) -> None:
        loaded = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
        super().__init__(loaded, clock=clock, jitter=jitter)
        # Per-call latency (mock_nvml/latency.py): the scenario's unless given.
        self.latency = LatencyProfile(latency or loaded.system.latency_profile, loaded.seed)
        if self.latency.active:
            for name in dir(type(self)):
                if name.startswith("nvml") and callable(getattr(type(self), name)):
                    setattr(self, name, self.latency.wrap(name, getattr(self, name)))
