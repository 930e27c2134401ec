"""Every health event names the boot it happened in (issue 28): ``node_boot_id``.

The boot ID is read from ``GPULET_BOOT_ID_PATH`` here (the kernel's
``/proc/sys/kernel/random/boot_id`` otherwise).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulet_common import codec
from gpulet_common.bootid import BOOT_ID_PATH_ENV
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent
from support.health_harness import health_node, on

pytestmark = pytest.mark.anyio

BOOT = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9"


async def test_every_health_event_carries_the_node_boot_id(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "boot_id"
    path.write_text(BOOT + "\n")
    monkeypatch.setenv(BOOT_ID_PATH_ENV, str(path))
    async with health_node(nats_server.url, tmp_path) as h:
        h.inject("xid", gpu=0, value=79)
        h.inject("xid", gpu=1, value=13)
        h.inject("lost", gpu=2)
        await h.log.wait_for(on(h, 0, "xid"))
        await h.log.wait_for(on(h, 1, "xid"))
        await h.log.wait_for(on(h, 2, "gpu_lost"))
        h.inject("reset", gpu=2)
        await h.log.wait_for(on(h, 2, "gpu_added"))
        events = h.log.where(lambda e: True)
        assert len({e.kind for e in events}) >= 4
        assert {e.node_boot_id for e in events} == {BOOT}


def test_an_event_from_an_older_service_decodes_with_an_empty_boot_id() -> None:
    old = (
        b'{"schema_version":1,"event_id":"e","node":"n","gpu_uuid":"GPU-1","kind":"xid",'
        b'"severity":"fatal","healthy":false,"reason":"r","observed_at":1.0}'
    )
    event = codec.HEALTH_EVENT.decode(old)
    assert isinstance(event, HealthEvent)
    assert event.node_boot_id == ""
