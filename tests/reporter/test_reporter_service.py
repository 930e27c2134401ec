"""The reporter end to end: a real nats-server, the Kubernetes API emulator over HTTP
and the unmodified kubernetes-asyncio client.

Timings are scaled down (quiet window 50 ms, maximum delay 200 ms) except where a test
is about the real defaults. Inputs are published on the bus by the test, standing in
for the collector (inventories) and the health service (each GPU's state in the
``gpu_health`` KV bucket, :mod:`support.health_kv`).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bus import Delivery
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import Inventory, InventoryRequest
from gpulet_reporter import desired as d
from gpulet_reporter import labels as lb
from support.health_kv import gpu_health, put_health
from support.kube_emulator import KubeEmulator
from support.reporter_harness import (
    HeldClock,
    RunningReporter,
    fast_settings,
    gpu_uuid,
    koordlet_foreign_devices,
    make_inventory,
    running_reporter,
    wait_until,
)

pytestmark = pytest.mark.anyio

NODE = "gpu-node-1"
DEVICES = "devices"
NODES = "nodes"


@pytest.fixture
async def emu(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running(token="t0ken") as emulator:
        emulator.add_node(NODE, labels={"team": "ml", "nvidia.com/gpu.family": "hopper"})
        emulator.write_kubeconfig(tmp_path / "kubeconfig")
        yield emulator


def _device(emu: KubeEmulator) -> dict[str, Any]:
    obj = emu.get_object(DEVICES, NODE)
    assert obj is not None
    return obj


def _node(emu: KubeEmulator) -> dict[str, Any]:
    obj = emu.get_object(NODES, NODE)
    assert obj is not None
    return obj


def _node_labels(emu: KubeEmulator) -> dict[str, str]:
    labels: dict[str, str] = _node(emu)["metadata"].get("labels") or {}
    return labels


def _health_of(emu: KubeEmulator) -> dict[str, bool]:
    obj = emu.get_object(DEVICES, NODE)
    if obj is None:
        return {}
    return {e["id"]: e["health"] for e in obj["spec"]["devices"]}


def _device_writes(emu: KubeEmulator) -> int:
    return emu.stats.writes_to(DEVICES, NODE)


def _total_writes(emu: KubeEmulator) -> int:
    return emu.stats.total_writes()


async def _publish_inventory(r: RunningReporter, inventory: Inventory) -> None:
    await r.bus.publish(subjects.inventory(NODE), inventory, codec.INVENTORY)


async def _publish_health(r: RunningReporter, uuid: str, *, healthy: bool, **kw: Any) -> None:
    """The GPU's state as the health service writes it after a fault (or with none)."""
    await put_health(r.bus, NODE, gpu_health(uuid, healthy=healthy, **kw))


async def _converged(r: RunningReporter, emu: KubeEmulator) -> None:
    """Wait until the reporter has nothing pending, the emulator holds the intent and
    the write loop is back waiting (no request of it in flight)."""

    def done() -> bool:
        loop = r.service.loop
        return (
            loop is not None
            and r.service.desired is not None
            and loop.applied == r.service.desired
            and not r.service.debouncer.pending
            and not r.service.metrics.pending
            and loop.waiting
        )

    await wait_until(done, within=10)


async def test_devices_health_changes_and_recovery_reach_the_device(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    settings = fast_settings(kubeconfig=str(tmp_path / "kubeconfig"))
    async with running_reporter(nats_server.url, tmp_path, NODE, settings) as r:
        await _publish_inventory(r, make_inventory(NODE))
        await wait_until(lambda: len(_health_of(emu)) == 8)
        device = _device(emu)
        node = emu.get_object(NODES, NODE)
        assert node is not None
        owner = device["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == (
            "Node",
            NODE,
            node["metadata"]["uid"],
        )
        assert device["metadata"]["labels"] == {
            lb.LABEL_GPU_MODEL: "H100-80GB-HBM3",
            lb.LABEL_GPU_VENDOR: "nvidia",
            lb.LABEL_GPU_DRIVER: "550.54.15",
        }
        assert all(_health_of(emu).values())
        await _converged(r, emu)
        labels = _node_labels(emu)
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert labels["node.koordinator.sh/gpu-model"] == "H100-80GB-HBM3"

        # A GPU fails.
        bad = gpu_uuid(NODE, 3)
        await _publish_health(r, bad, healthy=False)
        await wait_until(lambda: _health_of(emu).get(bad) is False)
        entry = next(e for e in _device(emu)["spec"]["devices"] if e["id"] == bad)
        cond = entry["conditions"][0]
        assert (cond["status"], cond["reason"], cond["message"]) == (
            "False",
            "Xid79",
            "GPU has fallen off the bus",
        )
        failed_at = cond["lastTransitionTime"]

        # A worse fault on the same GPU: its reason shows, the transition time stays.
        await anyio.sleep(1.05)  # metav1.Time has second precision
        await _publish_health(
            r, bad, healthy=False, reason="Xid48", xid=48, message="DBE", severity="fatal"
        )
        await wait_until(
            lambda: (
                next(e for e in _device(emu)["spec"]["devices"] if e["id"] == bad)["conditions"][0][
                    "reason"
                ]
                == "Xid48"
            )
        )
        entry = next(e for e in _device(emu)["spec"]["devices"] if e["id"] == bad)
        assert entry["conditions"][0]["lastTransitionTime"] == failed_at

        # It recovers.
        await _publish_health(r, bad, healthy=True)
        await wait_until(lambda: _health_of(emu).get(bad) is True)
        entry = next(e for e in _device(emu)["spec"]["devices"] if e["id"] == bad)
        assert entry["conditions"][0]["reason"] == "Recovered"
        assert entry["conditions"][0]["lastTransitionTime"] != failed_at

        # A GPU disappears from the inventory: it leaves the Device.
        await _publish_inventory(r, make_inventory(NODE, 7, generation=2))
        await wait_until(lambda: len(_health_of(emu)) == 7)
        await _converged(r, emu)
        assert _node_labels(emu)["nvidia.com/gpu.count"] == "7"
        assert r.probe.value("gpulet.reporter.writes", object="device") >= 5


async def test_a_burst_of_50_events_is_exactly_one_write(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    """50 events inside one quiet window are one write. The debouncer's clock stands
    still while they arrive (a loaded machine may take longer than the window to deliver
    them, which would make it two bursts); once the service has folded all 50 into its
    intent, the clock moves past the window: one release, one write, then the loop is
    idle with nothing pending, so no second write can follow."""
    clock = HeldClock()
    settings = fast_settings(
        kubeconfig=str(tmp_path / "kubeconfig"), quiet_window_s=0.2, max_delay_s=2.0
    )
    async with running_reporter(nats_server.url, tmp_path, NODE, settings, clock=clock) as r:
        await _publish_inventory(r, make_inventory(NODE))
        await wait_until(lambda: r.service.debouncer.pending, within=10)
        clock.advance(settings.max_delay_s)
        await _converged(r, emu)
        before = _total_writes(emu)
        submitted = r.service.debouncer.submitted
        # 50 events: every GPU fails, some twice, some recover, in one burst.
        expected: dict[str, str | None] = {}
        for i in range(50):
            uuid = gpu_uuid(NODE, i % 8)
            healthy = i >= 40 and i % 8 == 0
            expected[uuid] = None if healthy else f"Xid{40 + i}"
            await _publish_health(r, uuid, healthy=healthy, reason=f"Xid{40 + i}")
        await r.bus.flush()

        def folded() -> bool:
            """The view holds each GPU's last state: every event reached the intent."""
            got: dict[str, str | None] = {}
            for uuid in expected:
                health = r.service.view.health(uuid)
                if health is None:
                    return False
                got[uuid] = None if health.healthy else health.conditions[0].reason
            return got == expected

        await wait_until(folded, within=10)
        # The burst's changes of the intent (a repeated fault keeps its first text) all
        # reached the debouncer, and wait in it.
        assert r.service.debouncer.submitted - submitted >= 8
        assert r.service.debouncer.pending
        assert _total_writes(emu) == before  # held: nothing released yet
        clock.advance(settings.quiet_window_s)
        await wait_until(lambda: _total_writes(emu) > before, within=10)
        await _converged(r, emu)
        assert _total_writes(emu) - before == 1
        assert _device_writes(emu) == 2  # the create, then the burst
        health = _health_of(emu)
        assert health[gpu_uuid(NODE, 0)] is True
        assert [health[gpu_uuid(NODE, i)] for i in range(1, 8)] == [False] * 7


async def test_unhealthy_reaches_the_api_within_the_maximum_delay(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    """Real default timings (500 ms quiet window, 2 s maximum delay), on the debouncer's
    clock, which the test moves: a fault arriving in a stream of changes every 250 ms
    (never quiet) is not written before 2 s and is written at 2 s; a lone fault is
    written at 500 ms, not before. Each change has reached the service's intent before
    the clock moves on, so a loaded machine changes nothing of what is measured. The
    steps are binary fractions, so they add up to the due time exactly (ten steps of
    0.2 s could end one ulp short of it, and nothing would ever be due)."""
    clock = HeldClock()
    settings = fast_settings(
        kubeconfig=str(tmp_path / "kubeconfig"), quiet_window_s=0.5, max_delay_s=2.0
    )
    async with running_reporter(nats_server.url, tmp_path, NODE, settings, clock=clock) as r:

        async def fold(uuid: str, *, healthy: bool) -> None:
            """Publish a GPU's state and wait until the service's view holds it."""
            await _publish_health(r, uuid, healthy=healthy)
            await wait_until(lambda: r.service.view.healthy(uuid) is healthy, within=10)

        await _publish_inventory(r, make_inventory(NODE))
        await wait_until(lambda: r.service.debouncer.pending, within=10)
        clock.advance(settings.max_delay_s)
        await _converged(r, emu)
        bad = gpu_uuid(NODE, 5)
        start = clock()
        await fold(bad, healthy=False)
        # GPU 1 flaps every 250 ms: the inputs are never quiet for 500 ms.
        for i in range(7):
            clock.advance(0.25)
            await fold(gpu_uuid(NODE, 1), healthy=i % 2 == 1)
            assert _health_of(emu).get(bad) is True, clock() - start
        clock.advance(0.25)
        assert clock() - start == settings.max_delay_s
        await wait_until(lambda: _health_of(emu).get(bad) is False, within=10)
        await _converged(r, emu)

        # A lone fault is written after the quiet window.
        other = gpu_uuid(NODE, 6)
        await fold(other, healthy=False)
        clock.advance(0.375)
        await anyio.sleep(0.2)  # the loop has its chance to write early (it must not)
        assert _health_of(emu).get(other) is True
        clock.advance(0.125)
        await wait_until(lambda: _health_of(emu).get(other) is False, within=10)


async def test_steady_state_makes_no_writes(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    """60 s of steady state, time-compressed 20x: the 1 Hz inputs (republished
    inventory, health states rewritten unchanged, a warning on a healthy GPU) arrive
    every 50 ms, at least 60 cycles and until the periodic reconcile (every 0.5 s instead
    of every 5 minutes) has run 6 times. What is simulated is the rate; the inputs, the
    bus, the HTTP requests and the comparisons are the real ones. Expect zero writes, and
    only the reconciles' reads: exactly two GETs (the Node, the Device) per reconcile
    the write loop counted, whatever the machine's load made of the real time."""
    settings = fast_settings(
        kubeconfig=str(tmp_path / "kubeconfig"),
        quiet_window_s=0.025,
        max_delay_s=0.1,
        reconcile_interval_s=0.5,
    )
    inventory = make_inventory(NODE)
    bad = gpu_uuid(NODE, 2)
    fault = gpu_health(bad, healthy=False)
    async with running_reporter(nats_server.url, tmp_path, NODE, settings) as r:
        await _publish_inventory(r, inventory)
        await put_health(r.bus, NODE, fault)
        await wait_until(lambda: _health_of(emu).get(bad) is False)
        await _converged(r, emu)
        loop = r.service.loop
        assert loop is not None
        # Measured between two moments the loop waits: every reconcile counted has
        # finished its reads, and none is half done.
        before_writes = _total_writes(emu)
        log_start = len(emu.stats.log)
        reconciles = loop.reconciles
        cycles = 0
        while cycles < 60 or loop.reconciles - reconciles < 6:
            assert cycles < 1200, "6 reconciles never came"
            await _publish_inventory(r, inventory)
            # The same state written again (a repeat keeps its condition's text), a
            # warning on a healthy GPU: nothing the Device shows changes.
            await put_health(r.bus, NODE, fault)
            await _publish_health(
                r,
                gpu_uuid(NODE, 0),
                healthy=True,
                kind="thermal_slowdown",
                severity="warning",
                condition="thermal",
            )
            await anyio.sleep(0.05)
            cycles += 1
        await _converged(r, emu)
        counted = loop.reconciles - reconciles
        assert _total_writes(emu) == before_writes
        new = list(emu.stats.log)[log_start:]
        assert {rec.method for rec in new} <= {"GET"}
        assert len(new) == 2 * counted, (len(new), counted)
        assert r.probe.value("gpulet.reporter.write_failures") == 0


async def test_faults_on_30_percent_of_calls_converge_without_losing_updates(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    settings = fast_settings(kubeconfig=str(tmp_path / "kubeconfig"))
    rule = emu.faults.fail_ratio(0.3, (409, 429, 500), seed=11, retry_after=0)
    async with running_reporter(nats_server.url, tmp_path, NODE, settings) as r:
        await _publish_inventory(r, make_inventory(NODE))
        expected = {gpu_uuid(NODE, i): True for i in range(8)}
        # 24 changes, spaced so that many become separate writes, each hitting faults.
        for step in range(24):
            uuid = gpu_uuid(NODE, step % 8)
            healthy = step % 3 == 2
            expected[uuid] = healthy
            await _publish_health(r, uuid, healthy=healthy, reason=f"Xid{step + 1}")
            await anyio.sleep(0.08)
        await _converged(r, emu)
        assert _health_of(emu) == expected
        # The last reason of each GPU is what the API holds.
        stored = _device(emu)
        desired = r.service.desired
        assert desired is not None
        rendered = d.render_device(
            desired,
            stored,
            node_uid=_node(emu)["metadata"]["uid"],
            now=time.time(),
        )
        assert not d.device_differs(rendered, stored)
        assert rule.fired >= 5
        statuses = {rec.status for rec in emu.stats.log if rec.fault}
        assert statuses <= {409, 429, 500}
        assert r.probe.value("gpulet.reporter.write_failures") > 0
        assert r.probe.value("gpulet.reporter.retries") > 0
        emu.faults.clear()


async def test_retry_after_is_honoured(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    settings = fast_settings(kubeconfig=str(tmp_path / "kubeconfig"))
    async with running_reporter(nats_server.url, tmp_path, NODE, settings) as r:
        await _publish_inventory(r, make_inventory(NODE))
        await _converged(r, emu)
        emu.faults.fail_next(1, 429, method="PUT", retry_after=1)
        bad = gpu_uuid(NODE, 0)
        start = time.monotonic()
        await _publish_health(r, bad, healthy=False)
        await wait_until(lambda: _health_of(emu).get(bad) is False, within=5)
        assert time.monotonic() - start >= 1.0
        assert r.probe.value("gpulet.reporter.write_failures", reason="429") == 1


async def test_transient_errors_on_reads_retry_quickly_and_4xx_slowly(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    """Only a permanent-looking error (403, 422) waits the maximum back-off (30 s here)."""
    settings = fast_settings(kubeconfig=str(tmp_path / "kubeconfig"), backoff_max_s=30.0)
    emu.faults.fail_next(1, 409, method="GET", path="/devices/")
    emu.faults.fail_next(1, 504, method="GET", path="/devices/")
    async with running_reporter(nats_server.url, tmp_path, NODE, settings) as r:
        await _publish_inventory(r, make_inventory(NODE))
        # Well within the 30 s a permanent-looking error would wait: both were retried
        # on the short back-off, however long a loaded machine took for the rest.
        await wait_until(lambda: emu.get_object(DEVICES, NODE) is not None, within=10)
        for reason in ("conflict", "5xx"):
            assert r.probe.value("gpulet.reporter.write_failures", reason=reason) == 1
        await _converged(r, emu)
        emu.faults.fail_next(1, 403, method="PUT")
        await _publish_health(r, gpu_uuid(NODE, 0), healthy=False)
        await wait_until(lambda: r.probe.value("gpulet.reporter.write_failures", reason="4xx") == 1)
        await anyio.sleep(0.5)
        assert _health_of(emu)[gpu_uuid(NODE, 0)] is True  # still waiting out the back-off
        status = r.runtime.status.get("reporter")
        assert status is not None
        assert status.state == "degraded"
        assert "403" in status.detail


async def test_a_restart_converges_without_a_needless_write(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    settings = fast_settings(kubeconfig=str(tmp_path / "kubeconfig"))
    inventory = make_inventory(NODE)
    bad = gpu_uuid(NODE, 4)
    async with running_reporter(nats_server.url, tmp_path, NODE, settings) as first:
        await _publish_inventory(first, inventory)
        await _publish_health(first, bad, healthy=False)
        await wait_until(lambda: _health_of(emu).get(bad) is False)
        await _converged(first, emu)
    writes = _total_writes(emu)
    device_rv = _device(emu)["metadata"]["resourceVersion"]

    # The second reporter starts after the collector and the health service: it asks
    # for the inventory, reads the health state from the KV bucket, and finds the API
    # already up to date.
    asked: list[str] = []
    async with running_reporter(nats_server.url, tmp_path / "second", NODE, settings) as second:

        async def answer_inventory(_req: Delivery[InventoryRequest]) -> Inventory:
            asked.append("inventory")
            return inventory

        async with anyio.create_task_group() as tg:
            await tg.start(
                second.bus.serve,
                subjects.inventory_request(NODE),
                answer_inventory,
                codec.INVENTORY_REQUEST,
                codec.INVENTORY,
            )
            await wait_until(lambda: second.service.inventory is not None, within=5)
            await _converged(second, emu)
            await anyio.sleep(0.4)  # twice the maximum delay: nothing else comes
            tg.cancel_scope.cancel()
        assert "inventory" in asked
        assert second.service.view.health(bad) is not None
        assert _total_writes(emu) == writes
        assert _device(emu)["metadata"]["resourceVersion"] == device_rv
        assert second.service.metrics.writes_total == 0
        assert second.service.metrics.unchanged_total >= 1


async def test_labels_of_other_owners_survive_and_ours_are_removed_when_unwanted(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    kubeconfig = str(tmp_path / "kubeconfig")
    async with running_reporter(
        nats_server.url, tmp_path, NODE, fast_settings(kubeconfig=kubeconfig)
    ) as r:
        await _publish_inventory(r, make_inventory(NODE))
        await _converged(r, emu)
        labels = _node_labels(emu)
        assert labels["team"] == "ml"
        assert labels["nvidia.com/gpu.family"] == "hopper"
        assert labels["nvidia.com/gpu.count"] == "8"
        # Someone else adds a label meanwhile; a driver without a version string.
        node = emu.get_object(NODES, NODE)
        assert node is not None
        node["metadata"]["labels"]["owner/other"] = "keep-me"
        emu.put_object(NODES, node)
        await _publish_inventory(r, make_inventory(NODE, driver=None, generation=2))
        await wait_until(lambda: lb.LABEL_GPU_DRIVER not in _node_labels(emu))
        await _converged(r, emu)
    labels = _node_labels(emu)
    assert "nvidia.com/cuda.driver-version.full" not in labels
    assert labels["team"] == "ml"
    assert labels["owner/other"] == "keep-me"
    assert labels["nvidia.com/gpu.family"] == "hopper"

    # Restarted with GFD labels switched off: our nvidia.com/* keys go, GFD's own stays.
    async with running_reporter(
        nats_server.url,
        tmp_path / "b",
        NODE,
        fast_settings(kubeconfig=kubeconfig, gfd_labels=False),
    ) as r:
        await _publish_inventory(r, make_inventory(NODE, driver=None, generation=2))
        await wait_until(lambda: "nvidia.com/gpu.count" not in _node_labels(emu))
        await _converged(r, emu)
    node = emu.get_object(NODES, NODE)
    assert node is not None
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.family"] == "hopper"
    assert labels["owner/other"] == "keep-me"
    assert labels[lb.LABEL_GPU_MODEL] == "H100-80GB-HBM3"
    assert not [k for k in labels if k.startswith("nvidia.com/") and k != "nvidia.com/gpu.family"]
    assert node["metadata"]["annotations"][lb.MANAGED_LABELS_ANNOTATION] == ",".join(
        sorted([lb.LABEL_GPU_MODEL, lb.LABEL_GPU_VENDOR])
    )


async def test_drift_is_corrected_by_the_periodic_reconcile(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    settings = fast_settings(kubeconfig=str(tmp_path / "kubeconfig"), reconcile_interval_s=0.3)
    async with running_reporter(nats_server.url, tmp_path, NODE, settings) as r:
        await _publish_inventory(r, make_inventory(NODE))
        bad = gpu_uuid(NODE, 1)
        await _publish_health(r, bad, healthy=False)
        await wait_until(lambda: _health_of(emu).get(bad) is False)
        # Someone "fixes" the GPU by hand and adds a label of their own.
        edited = _device(emu)
        for entry in edited["spec"]["devices"]:
            entry["health"] = True
        edited["metadata"]["labels"]["edited/by"] = "admin"
        emu.put_object(DEVICES, edited)
        await wait_until(lambda: _health_of(emu).get(bad) is False, within=3)
        assert _device(emu)["metadata"]["labels"]["edited/by"] == "admin"
        # Someone deletes it: it comes back.
        emu.delete_object(DEVICES, NODE)
        await wait_until(lambda: _health_of(emu).get(bad) is False, within=3)


async def test_a_missing_node_gets_its_owner_reference_once_it_exists(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with KubeEmulator.running() as emu:
        kubeconfig = emu.write_kubeconfig(tmp_path / "kubeconfig")
        settings = fast_settings(kubeconfig=str(kubeconfig), reconcile_interval_s=0.3)
        async with running_reporter(nats_server.url, tmp_path, NODE, settings) as r:
            await _publish_inventory(r, make_inventory(NODE))
            await wait_until(lambda: emu.get_object(DEVICES, NODE) is not None)
            assert "ownerReferences" not in _device(emu)["metadata"]
            emu.add_node(NODE)
            await wait_until(
                lambda: bool(_device(emu)["metadata"].get("ownerReferences")), within=3
            )
            await _converged(r, emu)
            assert "node.koordinator.sh/gpu-model" in _node_labels(emu)


async def test_foreign_device_entries_survive_100_writes_and_a_concurrent_koordlet(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    """A Device koordlet already holds (an rdma NIC with vfGroups, an fpga) keeps those
    entries byte for byte through 100 gpulet writes (GPU 3's health flips each time).
    Halfway, koordlet rewrites its rdma entry behind the reporter's back: the reporter's
    next PUT carries a stale resourceVersion, gets 409, re-reads, and koordlet's change
    survives too."""
    foreign = koordlet_foreign_devices()
    emu.put_object(
        DEVICES,
        {
            "apiVersion": d.API_VERSION,
            "kind": d.KIND,
            "metadata": {"name": NODE, "labels": {"koordlet/owned": "yes"}},
            "spec": {"devices": foreign},
        },
    )
    settings = fast_settings(
        kubeconfig=str(tmp_path / "kubeconfig"), quiet_window_s=0.005, max_delay_s=0.02
    )
    flipping = gpu_uuid(NODE, 3)

    def foreign_entries() -> list[dict[str, Any]]:
        return [e for e in _device(emu)["spec"]["devices"] if e.get("type") != "gpu"]

    async with running_reporter(nats_server.url, tmp_path, NODE, settings) as r:
        await _publish_inventory(r, make_inventory(NODE))
        await wait_until(lambda: len(_health_of(emu)) == 8 + len(foreign))
        await _converged(r, emu)
        assert foreign_entries() == foreign
        assert _device(emu)["metadata"]["labels"]["koordlet/owned"] == "yes"
        writes_before = _device_writes(emu)
        for i in range(100):
            if i == 50:
                # koordlet found a new VF; it writes the whole object, as it does.
                current = _device(emu)
                rdma = next(e for e in current["spec"]["devices"] if e["type"] == "rdma")
                rdma["vfGroups"][1]["vfs"].append({"minor": 3, "busID": "0000:1f:00.5"})
                foreign[0] = copy.deepcopy(rdma)
                emu.put_object(DEVICES, current)
            healthy = i % 2 == 1
            await _publish_health(r, flipping, healthy=healthy, reason=f"Xid{i}")

            def flipped(want: bool = healthy) -> bool:
                return _health_of(emu).get(flipping) is want

            await wait_until(flipped, within=10)
            # Compared as JSON text: byte for byte, key order included.
            assert json.dumps(foreign_entries()) == json.dumps(foreign), i
        await _converged(r, emu)
        assert _device_writes(emu) - writes_before >= 100
        assert r.probe.value("gpulet.reporter.conflicts") >= 1
        assert foreign_entries() == foreign
        assert len(foreign[0]["vfGroups"][1]["vfs"]) == 2
