"""The one rate-limited log: a flood gives a bounded number of lines and an exact count.

Issue 23, finding 5: every message nats-py dropped as a slow consumer was logged as
its own WARNING (80,000 lines in a 20 s flood).
"""

from __future__ import annotations

import logging

import anyio
import pytest

from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.settings.nats import NatsSettings
from support.metrics import MetricsProbe
from support.waiting import wait_until


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_at_most_the_limit_per_interval_and_the_suppressed_count_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = MetricsProbe()
    clock = _Clock()
    limiter = RateLimitedLog(
        logging.getLogger("test.flood"),
        per_interval=2,
        interval_s=10.0,
        counter=probe.meter.create_counter("flood"),
        attributes={"kind": "x"},
        clock=clock,
    )
    with caplog.at_level(logging.INFO, logger="test.flood"):
        for i in range(10_000):
            limiter.warning("dropped %d", i)
        assert len(caplog.records) == 2
        clock.now = 10.0
        limiter.error("after the window")
    assert len(caplog.records) == 3
    assert caplog.records[-1].levelno == logging.ERROR
    assert "9998 similar messages suppressed in the last 10s" in caplog.records[-1].getMessage()
    assert limiter.count == 10_001
    assert limiter.suppressed_total == 9998
    assert probe.value("flood", kind="x") == 10_001


@pytest.mark.anyio
async def test_a_slow_consumer_flood_logs_a_bounded_number_of_lines(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    probe = MetricsProbe()
    limit, published = 10, 3000
    settings = NatsSettings(url=nats_server.url, pending_msgs_limit=limit)
    with caplog.at_level(logging.WARNING, logger="gpulet.bus"):
        async with (
            Bus.connect(settings, meter=probe.meter) as slow,
            Bus.connect(NatsSettings(url=nats_server.url)) as sender,
        ):
            # A subscriber that never reads: nats-py keeps `limit` messages and drops
            # (and reports) every other one.
            sub = await slow.client.subscribe("flood", pending_msgs_limit=limit)
            await slow.client.flush()
            for _ in range(published):
                await sender.client.publish("flood", b"x")
            await sender.client.flush()
            await wait_until(
                lambda: (
                    probe.value("gpulet.bus.errors", error="SlowConsumerError") >= published - limit
                ),
                timeout_s=10,
                what="every drop counted",
            )
            await anyio.sleep(0.1)  # nothing more may come
            await sub.unsubscribe()
    assert probe.value("gpulet.bus.errors", error="SlowConsumerError") == published - limit
    lines = [r for r in caplog.records if "SlowConsumerError" in r.getMessage()]
    assert 1 <= len(lines) <= 2, len(lines)
