"""Every rule from one mock NVML scenario timeline, through the real service."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent
from support.health_harness import SCENARIOS, health_node

pytestmark = pytest.mark.anyio


async def test_timeline_trips_every_rule(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    overrides = ["health.ecc.sbe_rate_per_hour=600", "health.ecc.sbe_window_s=60"]
    async with health_node(
        nats_server.url, tmp_path, overrides=overrides, scenario=SCENARIOS / "health-timeline.toml"
    ) as h:
        gpu = [h.uuid(i) for i in range(5)]

        def seen(slot: int, kind: str, condition: str | None = None) -> list[HealthEvent]:
            return h.log.where(
                lambda e: (
                    e.gpu_uuid == gpu[slot]
                    and e.kind == kind
                    and (condition is None or e.condition == condition)
                )
            )

        # The last entries: GPU 2 reset (remap applied), GPU 1 back, the new GPU.
        await h.log.wait_for(
            lambda e: e.kind == "recovered" and e.condition == "remap_pending", within=8
        )
        await h.log.wait_for(lambda e: e.kind == "gpu_added" and e.gpu_uuid == gpu[1], within=3)
        await h.log.wait_for(lambda e: e.kind == "recovered" and e.condition == "thermal", count=2)

        [app] = seen(1, "xid")
        assert app.healthy
        assert app.xid == 13
        [fatal] = seen(0, "xid")
        assert not fatal.healthy
        assert fatal.action == "reboot"
        [dbe] = seen(1, "ecc_uncorrectable")
        assert dbe.action == "reset_gpu"
        [sbe] = seen(2, "ecc_correctable_rate")
        assert sbe.healthy
        assert sbe.severity == "warning"
        [pending] = seen(2, "remap_pending")
        assert pending.action == "reset_gpu"
        [failure] = seen(0, "remap_failure")
        assert failure.action == "hardware_inspection"
        assert len(seen(3, "thermal")) == 1
        assert len(seen(3, "recovered", "thermal")) == 1
        # The oscillation: one raise, one recovery, nothing in between.
        assert len(seen(4, "thermal")) == 1, h.log.dump()
        assert len(seen(4, "recovered", "thermal")) == 1
        # Lost and back: removed too, and the return ended the sticky DBE (a reset).
        assert len(seen(1, "gpu_lost")) == 1
        assert len(seen(1, "gpu_removed")) == 1
        ends = {e.condition for e in seen(1, "recovered")}
        assert {"lost", "removed", "ecc_uncorrectable"} <= ends
        added = h.log.where(lambda e: e.kind == "gpu_added" and e.gpu_uuid not in gpu)
        assert len(added) == 1
        # GPU 0 stays unhealthy: fatal XID (sticky) and a failed remap.
        state = {g.gpu_uuid: g for g in h.service.engine.state(0.0).gpus}
        assert {c.condition for c in state[gpu[0]].conditions} == {"xid:79", "remap_failure"}
        assert state[gpu[1]].healthy
        assert state[gpu[2]].healthy  # the SBE warning leaves it healthy
