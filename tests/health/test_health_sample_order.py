"""Sample batches in the collector's order: late ones cannot make a lost GPU flap.

After a NATS outage, batches taken before it arrive after newer ones. A GPU that went
lost meanwhile answered in those old batches, and the health service took each of
them as "the GPU is back": lost / recovered / added / lost again, once per late
batch (the hardening issue measured 50 events in 10 s). The service now orders
batches by the collector's ``seq`` and ``boot_id`` (:mod:`gpulet_common.ordering`),
never by their timestamps.

The test plays the collector itself (a real nats-server, the real health service on
the mock NVML): the newest batch says GPU 1 is lost, then twenty old batches in which
it answers arrive interleaved with twenty newer lost ones. Then a restarted collector
(a new ``boot_id``) is believed from its first batch; and a sample of a lost GPU never
ends the loss by itself (it may predate it): the health service's own scan does.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import GpuSample, SampleBatch
from support.health_harness import HealthNode, health_node
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

LOST = 1
BOOT = "collector-1"


def _batch(
    h: HealthNode, seq: int, *, lost: bool, boot: str = BOOT, at: float = 0.0
) -> SampleBatch:
    at = at or time.time()
    samples = [
        GpuSample(uuid=h.uuid(i), index=i, timestamp=at, error="lost")
        if lost and i == LOST
        else GpuSample(uuid=h.uuid(i), index=i, timestamp=at, temperature_c=40)
        for i in range(5)
    ]
    return SampleBatch(node=h.node, timestamp=at, samples=samples, seq=seq, boot_id=boot)


def _flips(h: HealthNode) -> float:
    """Events that would say GPU 1 came back (whatever GPU they are on: none may)."""
    return h.probe.value("gpulet.health.events", kind="gpu_added") + h.probe.value(
        "gpulet.health.events", kind="recovered"
    )


async def test_late_batches_after_an_outage_do_not_make_a_lost_gpu_flap(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path, collector=False) as h:
        bus = h.runtime.bus
        h.inject("lost", gpu=LOST)
        await h.log.wait_for(lambda e: e.gpu_uuid == h.uuid(LOST) and e.kind == "gpu_removed")
        flips_before = _flips(h)
        before_outage = time.time() - 30  # when the late batches were taken

        # The newest batch the service sees says GPU 1 is lost ...
        await bus.publish(subjects.samples(h.node), _batch(h, 100, lost=True), codec.SAMPLES)
        # ... then what an outage leaves: old batches (GPU 1 answered) arriving late,
        # interleaved with newer ones.
        for i in range(20):
            old = _batch(h, 1 + i, lost=False, at=before_outage + i)
            await bus.publish(subjects.samples(h.node), old, codec.SAMPLES)
            await bus.publish(
                subjects.samples(h.node), _batch(h, 101 + i, lost=True), codec.SAMPLES
            )
        await bus.flush()
        await wait_until(
            lambda: h.probe.value("gpulet.health.samples_late") >= 20 or _flips(h) > flips_before,
            what="the 20 late batches to be dropped",
        )
        assert _flips(h) - flips_before == 0, "GPU 1 flapped:\n" + h.log.dump()
        assert h.probe.value("gpulet.health.samples_late") == 20
        gpu = h.service.engine.gpus[h.uuid(LOST)]
        assert (gpu.present, gpu.healthy) == (False, False)

        # A restarted collector (a new boot) is believed from its first batch, though
        # its seq starts again: here it says GPU 2 is lost, and GPU 2 goes lost.
        restarted = _batch(h, 1, lost=False, boot="collector-2")
        restarted.samples[2] = GpuSample(
            uuid=h.uuid(2), index=2, timestamp=restarted.timestamp, error="lost"
        )
        await bus.publish(subjects.samples(h.node), restarted, codec.SAMPLES)
        await bus.flush()
        await h.log.wait_for(lambda e: e.gpu_uuid == h.uuid(2) and e.kind == "gpu_lost")
        assert h.probe.value("gpulet.health.samples_late") == 20
        # Its sample of GPU 1 did not bring GPU 1 back: a sample may have been read
        # before the loss was seen; only the health service's own scan ends a loss.
        assert _flips(h) - flips_before == 0, "GPU 1 came back on a sample:\n" + h.log.dump()
        assert not h.service.engine.gpus[h.uuid(LOST)].present
        # Reset in the mock, GPU 1 answers NVML again: the next batch asks for a scan,
        # and the scan brings it back.
        h.inject("reset", gpu=LOST)
        await bus.publish(
            subjects.samples(h.node), _batch(h, 2, lost=False, boot="collector-2"), codec.SAMPLES
        )
        await h.log.wait_for(lambda e: e.gpu_uuid == h.uuid(LOST) and e.kind == "gpu_added")
        assert h.service.engine.gpus[h.uuid(LOST)].present
