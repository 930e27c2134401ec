"""The NVLink-down rule (issue 15): on the engine, and through the running services."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import GpuInfo, HealthEvent, PeerLink
from gpulet_common.mock_nvml.scenario import SCENARIO_DIR
from gpulet_common.settings.health import HealthSettings
from gpulet_health.rules import RuleEngine
from support.health_harness import HealthNode, health_node

NODE = "n1"
T0 = 1_700_000_000.0


def info(index: int, up: list[int], down: list[int], peers_down: int = 0) -> GpuInfo:
    peer = 1 - index
    return GpuInfo(
        uuid=f"GPU-{index}",
        index=index,
        nvlinks_up=up,
        nvlinks_down=down,
        topology=[
            PeerLink(
                peer_uuid=f"GPU-{peer}",
                peer_index=peer,
                level=10,
                nvlinks=4 - peers_down,
                nvlinks_down=peers_down,
            )
        ],
    )


def engine() -> RuleEngine:
    e = RuleEngine(NODE, HealthSettings())
    e.observe_inventory([GpuInfo(uuid="GPU-0", index=0), GpuInfo(uuid="GPU-1", index=1)], T0)
    return e


def summary(events: list[HealthEvent]) -> list[tuple[str, str, str, bool]]:
    return [(e.kind, e.condition, e.severity, e.healthy) for e in events]


def test_a_link_down_warns_once_and_recovers_when_up() -> None:
    e = engine()
    assert e.observe_nvlinks([info(0, [0, 1, 2, 3], []), info(1, [0, 1, 2, 3], [])], T0) == []

    events = e.observe_nvlinks([info(0, [0, 2, 3], [1], 1), info(1, [0, 2, 3], [1], 1)], T0 + 1)
    assert summary(events) == [
        ("nvlink_down", "nvlink_down:1", "warning", True),
        ("nvlink_down", "nvlink_down:1", "warning", True),
    ]
    assert events[0].gpu_uuid == "GPU-0"
    assert events[0].action == "operator_check"
    assert "NVLink 1 of GPU 0 is down" in events[0].reason
    assert "GPU 1 has 3 of 4 NVLinks up" in events[0].reason
    assert e.gpus["GPU-0"].healthy  # a warning: the GPU still serves

    # The same inventory again (a republish): nothing new.
    assert e.observe_nvlinks([info(0, [0, 2, 3], [1], 1)], T0 + 2) == []

    # In neither list (the collector restarted, never saw it up): not taken as back.
    assert e.observe_nvlinks([info(0, [0, 2, 3], [])], T0 + 3) == []
    assert "nvlink_down:1" in e.gpus["GPU-0"].conditions

    ended = e.observe_nvlinks([info(0, [0, 1, 2, 3], [])], T0 + 4)
    assert summary(ended) == [("recovered", "nvlink_down:1", "info", True)]
    assert ended[0].condition_kind == "nvlink_down"
    assert "NVLink 1 of GPU 0 is up again" in ended[0].reason
    assert "nvlink_down:1" in e.gpus["GPU-1"].conditions  # GPU 1 not told yet


def test_a_link_listed_both_up_and_down_counts_as_down() -> None:
    e = engine()
    e.observe_nvlinks([info(0, [0], [0])], T0)
    assert "nvlink_down:0" in e.gpus["GPU-0"].conditions
    assert e.observe_nvlinks([info(0, [0], [0])], T0 + 1) == []  # not taken as back
    assert "nvlink_down:0" in e.gpus["GPU-0"].conditions


def test_gpus_the_engine_does_not_know_are_left_to_the_scans() -> None:
    e = engine()
    stranger = GpuInfo(uuid="GPU-9", index=9, nvlinks_down=[0])
    assert e.observe_nvlinks([stranger], T0) == []
    assert "GPU-9" not in e.gpus


def test_an_operator_clears_a_link_that_stays_unknown() -> None:
    e = engine()
    e.observe_nvlinks([info(0, [0], [1])], T0)
    _, cleared = e.clear("0", "nvlink_down:1", T0 + 1)
    assert summary(cleared) == [("cleared", "nvlink_down:1", "info", True)]


# --- through the running collector and health service -----------------------------------


def on(h: HealthNode, slot: int, kind: str, condition: str):  # type: ignore[no-untyped-def]
    uuid = h.uuid(slot)

    def pred(e: HealthEvent) -> bool:
        return e.gpu_uuid == uuid and e.kind == kind and e.condition == condition

    return pred


@pytest.mark.anyio
async def test_nvlink_down_warns_and_recovers_through_the_services(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(
        nats_server.url,
        tmp_path,
        scenario=SCENARIO_DIR / "dgx-h100.toml",
        overrides=["collector.slow_period_s=0.1", "collector.nvlink_state_period_s=0.3"],
    ) as h:
        h.inject("nvlink_down", gpu=2, value=3)  # a link into the NVSwitch fabric
        [warn] = await h.log.wait_for(on(h, 2, "nvlink_down", "nvlink_down:3"), within=10)
        assert (warn.severity, warn.healthy) == ("warning", True)
        assert "NVLink 3 of GPU 2 is down" in warn.reason
        assert "has 17 of 18 NVLinks up" in warn.reason
        h.inject("nvlink_up", gpu=2, value=3)
        [end] = await h.log.wait_for(on(h, 2, "recovered", "nvlink_down:3"), within=10)
        assert end.healthy
        assert not h.log.where(lambda e: e.kind == "nvlink_down" and e.gpu_uuid != h.uuid(2))
