"""Escalation reaches the Node: a GPU that remediation by reset escalated (its machine
``escalated`` in the ``gpulet_heal`` KV, overlaid by the node view) sets the condition
``GpuletNeedsReboot`` and the taint ``gpulet.io/needs-reboot:NoSchedule``, whatever the
taint policy; both go when it is back. A real nats-server, the reporter, the Kubernetes
API emulator (real ``nodes/status`` semantics); the health service stood in for by its
KV entries and a state responder, as in test_node_condition.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, Delivery
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.heal import HEAL_KV_BUCKET, HEAL_RECORD, HealRecord, heal_key
from gpulet_common.messages import HealthState, HealthStateRequest
from gpulet_reporter import node_health as nh
from support.health_harness import NODE
from support.health_kv import gpu_health, put_health
from support.kube_emulator import NODES, KubeEmulator
from support.reporter_harness import fast_settings, gpu_uuid, make_inventory, running_reporter
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

REBOOT_TAINT = {"key": nh.REBOOT_TAINT, "effect": "NoSchedule"}


@pytest.fixture
async def emu(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running(token="t0ken") as emulator:
        node = emulator.add_node(NODE)
        node["spec"] = {"taints": [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]}
        emulator.put_object(NODES, node)
        emulator.write_kubeconfig(tmp_path / "kubeconfig")
        yield emulator


async def _serve_state(bus: Bus, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    async def answer(_request: Delivery[HealthStateRequest]) -> HealthState:
        return HealthState(node=NODE)

    await bus.serve(
        subjects.health_state(NODE),
        answer,
        codec.HEALTH_STATE_REQUEST,
        codec.HEALTH_STATE,
        task_status=task_status,
    )


def node_of(emu: KubeEmulator) -> dict[str, Any]:
    obj = emu.get_object(NODES, NODE)
    assert obj is not None
    return obj


def reboot_condition(emu: KubeEmulator) -> dict[str, Any] | None:
    return nh.find_condition(node_of(emu), nh.REBOOT_CONDITION)


def reboot_tainted(emu: KubeEmulator) -> bool:
    return REBOOT_TAINT in (node_of(emu)["spec"].get("taints") or [])


async def test_an_escalated_gpu_sets_needs_reboot_and_its_taint_until_back(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    settings = fast_settings(
        kubeconfig=str(tmp_path / "kubeconfig"),
        node_condition=True,
        node_labels=False,
        health_probe_interval_s=0.1,
        health_stale_after_s=10.0,
        taint_policy="none",
    )
    gpu = gpu_uuid(NODE, 1)
    async with (
        running_reporter(nats_server.url, tmp_path, NODE, settings) as r,
        anyio.create_task_group() as responder,
    ):
        await responder.start(_serve_state, r.bus)
        await r.bus.publish(subjects.inventory(NODE), make_inventory(NODE, 2), codec.INVENTORY)
        await put_health(r.bus, NODE, gpu_health(gpu, healthy=True, xid=None))
        await wait_until(
            lambda: (nh.find_condition(node_of(emu)) or {}).get("status") == "True",
            timeout_s=15,
            what="GpuletGPUHealthy True",
        )
        # A healthy node never gets the reboot condition written at all.
        assert reboot_condition(emu) is None
        kv = await r.bus.key_value(HEAL_KV_BUCKET)
        record = HealRecord(
            gpu_uuid=gpu, state="escalated", detail="the reset failed: NVML Error 999"
        )
        revision = await kv.put(heal_key(NODE, gpu), HEAL_RECORD.encode(record))
        await wait_until(lambda: reboot_tainted(emu), timeout_s=15, what="needs-reboot taint")
        cond = reboot_condition(emu)
        assert cond is not None
        assert (cond["status"], cond["reason"]) == ("True", "GPUNeedsReboot")
        assert f"GPU 1 {gpu}: the reset failed: NVML Error 999" in cond["message"]
        healthy = nh.find_condition(node_of(emu))
        assert healthy is not None
        assert "remediation:needs_reboot: the reset failed" in healthy["message"]
        # Policy "none": the gpu-unhealthy taint is not set; the foreign taint kept.
        taints = node_of(emu)["spec"]["taints"]
        assert {"key": nh.TAINT_KEY, "effect": "NoSchedule"} not in taints
        assert taints[0]["key"] == "dedicated"
        # Back in service (an operator cleared it after a reboot): both go.
        record.state = "returned"
        await kv.update(heal_key(NODE, gpu), HEAL_RECORD.encode(record), last=revision)
        await wait_until(lambda: not reboot_tainted(emu), timeout_s=15, what="taint removed")
        await wait_until(
            lambda: (reboot_condition(emu) or {}).get("status") == "False",
            timeout_s=15,
            what="GpuletNeedsReboot False",
        )
        assert node_of(emu)["spec"]["taints"][0]["key"] == "dedicated"
        responder.cancel_scope.cancel()
