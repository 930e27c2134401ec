"""The ResourceSlice publisher against the API emulator (resource.k8s.io/v1 added by
support.kube_emulator_dra, which validates every slice as the server would).

The real-server version of these tests (kube-apiserver and kube-scheduler at 1.37)
comes with the control-plane fixture of issue 25.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import msgspec
import pytest

from gpulet_common.kube import KubeConfig
from gpulet_common.kubeapi import KubeApiError, KubeClient, api_path
from gpulet_common.messages import ActiveCondition, GpuHealth, Inventory
from gpulet_common.nodeview import NodeChange, NodeView
from gpulet_common.settings.dra import DraSettings
from gpulet_reporter.slices.publisher import SlicePublisher
from gpulet_reporter.slices.writer import SliceInput
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import RESOURCE_SLICES, dra_emulator, slices
from support.reporter_harness import make_inventory
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

NODE = "node-a"
FAST = DraSettings(mode="dra", quiet_window_s=0.02, max_delay_s=0.1, backoff_base_s=0.02)


def fault(uuid: str, xid: int = 79) -> GpuHealth:
    return GpuHealth(
        gpu_uuid=uuid,
        healthy=False,
        conditions=[
            ActiveCondition(
                condition=f"xid:{xid}", kind="xid", severity="fatal", reason="Xid", since=1.0
            )
        ],
    )


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with dra_emulator(NODE) as emulator:
        yield emulator


@asynccontextmanager
async def publishing(
    emu: KubeEmulator, settings: DraSettings = FAST
) -> AsyncIterator[SlicePublisher]:
    async with (
        KubeClient(KubeConfig(emu.url)) as api,
        anyio.create_task_group() as tg,
    ):
        publisher = SlicePublisher(api, NODE, settings)
        tg.start_soon(publisher.run)
        try:
            yield publisher
        finally:
            tg.cancel_scope.cancel()


def slice_writes(emu: KubeEmulator) -> int:
    return emu.stats.total_writes(RESOURCE_SLICES) + sum(
        n for (p, _), n in emu.stats.deletes.items() if p == RESOURCE_SLICES
    )


def devices(emu: KubeEmulator) -> dict[str, dict[str, object]]:
    return {d["name"]: d for s in slices(emu) for d in s["spec"]["devices"]}


def generation(emu: KubeEmulator) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in slices(emu)}


async def published(emu: KubeEmulator, count: int) -> None:
    await wait_until(lambda: len(devices(emu)) == count, what=f"{count} devices published")


async def test_publishes_the_pool_then_writes_nothing_at_rest(emu: KubeEmulator) -> None:
    inventory = make_inventory(NODE, 8)
    async with publishing(emu) as pub:
        pub.submit(SliceInput(inventory))
        await published(emu, 8)
        (body,) = slices(emu)
        owner = body["metadata"]["ownerReferences"][0]
        node = emu.get_object("nodes", NODE)
        assert node is not None
        assert (owner["kind"], owner["uid"]) == ("Node", node["metadata"]["uid"])
        writes = slice_writes(emu)
        # The same facts again, a fresh but equal input, and a reconcile: no write.
        for _ in range(5):
            pub.submit(SliceInput(inventory))
            pub.submit(SliceInput(make_inventory(NODE, 8, generation=2)))
        await pub.writer.refresh()
        pub.debouncer.submit(SliceInput(inventory))
        await wait_until(lambda: pub.writer.listed and not pub.debouncer.pending, what="re-read")
        await anyio.sleep(0.3)
        assert slice_writes(emu) == writes


async def test_a_fault_taints_and_recovery_untaints_with_a_rising_generation(
    emu: KubeEmulator,
) -> None:
    inventory = make_inventory(NODE, 2)
    uuid = inventory.gpus[1].uuid
    async with publishing(emu) as pub:
        pub.submit(SliceInput(inventory))
        await published(emu, 2)
        assert generation(emu) == {1}
        pub.submit(SliceInput(inventory, {uuid: fault(uuid)}))
        await wait_until(lambda: "taints" in devices(emu)["gpu-1"], what="taint")
        taint = devices(emu)["gpu-1"]["taints"][0]  # type: ignore[index]
        assert (taint["key"], taint["value"], taint["effect"]) == (
            "gpu.gpulet.io/xid",
            "79",
            "NoSchedule",
        )
        assert generation(emu) == {2}
        pub.submit(SliceInput(inventory))
        await wait_until(lambda: "taints" not in devices(emu)["gpu-1"], what="taint removed")
        assert generation(emu) == {3}


async def test_a_slice_deleted_by_someone_else_comes_back(emu: KubeEmulator) -> None:
    async with publishing(emu) as pub:
        pub.submit(SliceInput(make_inventory(NODE, 4)))
        await published(emu, 4)
        (body,) = slices(emu)
        before = body["metadata"]["uid"]
        # kubelet deletes the node's slices when it starts.
        assert emu.delete_object(RESOURCE_SLICES, body["metadata"]["name"])
        with anyio.fail_after(3):  # the debounce (0.1 s) plus a round trip
            await wait_until(lambda: len(slices(emu)) == 1, timeout_s=3, what="slice back")
        assert slices(emu)[0]["metadata"]["uid"] != before
        assert pub.repairs >= 1


async def test_an_edited_slice_is_put_back(emu: KubeEmulator) -> None:
    async with publishing(emu) as pub:
        pub.submit(SliceInput(make_inventory(NODE, 1)))
        await published(emu, 1)
        (body,) = slices(emu)
        edited = msgspec.json.decode(msgspec.json.encode(body))
        edited["spec"]["devices"][0]["attributes"]["productName"] = {"string": "forged"}
        emu.put_object(RESOURCE_SLICES, edited)
        await wait_until(
            lambda: devices(emu)["gpu-0"]["attributes"]["productName"]["string"] != "forged",  # type: ignore[index]
            what="edit reverted",
        )


async def test_gpus_that_come_and_go_reshape_the_pool(emu: KubeEmulator) -> None:
    async with publishing(emu) as pub:
        pub.submit(SliceInput(make_inventory(NODE, 130)))
        await published(emu, 130)
        assert len(slices(emu)) == 2
        pub.submit(SliceInput(make_inventory(NODE, 3)))
        await wait_until(lambda: len(slices(emu)) == 1, what="surplus slice deleted")
        assert len(devices(emu)) == 3
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices(emu)} == {1}
        pub.submit(SliceInput(make_inventory(NODE, 0)))
        await wait_until(lambda: not slices(emu), what="no GPU, no slice")


async def test_a_restart_with_the_same_facts_writes_nothing(emu: KubeEmulator) -> None:
    inventory = make_inventory(NODE, 4)
    uuid = inventory.gpus[0].uuid
    facts = SliceInput(inventory, {uuid: fault(uuid)})
    async with publishing(emu) as pub:
        pub.submit(facts)
        await published(emu, 4)
    writes = slice_writes(emu)
    stamp = devices(emu)["gpu-0"]["taints"]
    async with publishing(emu) as again:
        again.submit(facts)
        await wait_until(lambda: again.writer.pool is not None, what="second publisher applied")
    assert slice_writes(emu) == writes
    assert devices(emu)["gpu-0"]["taints"] == stamp


async def test_failed_publishes_are_retried(emu: KubeEmulator) -> None:
    emu.faults.fail_next(3, 500, method="POST", path="resourceslices")
    emu.faults.fail_next(1, 429, method="GET", path="resourceslices", retry_after=0)
    async with publishing(emu) as pub:
        pub.submit(SliceInput(make_inventory(NODE, 2)))
        await published(emu, 2)
        assert pub.metrics.failures_total >= 3
        # The 429 met the watch (its GET came first): it reopened, and still repairs.
        (body,) = slices(emu)
        emu.delete_object(RESOURCE_SLICES, body["metadata"]["name"])
        await wait_until(lambda: len(slices(emu)) == 1, timeout_s=5, what="slice back")


async def test_other_nodes_and_drivers_are_never_touched(emu: KubeEmulator) -> None:
    async with publishing(emu) as pub:
        pub.submit(SliceInput(make_inventory("node-b", 2)))  # wrong node: refused
        other = SliceInput(make_inventory(NODE, 1))
        pub.submit(other)
        await published(emu, 1)
    async with publishing(emu, msgspec.structs.replace(FAST, driver="gpu.other.io")) as pub:
        pub.submit(SliceInput(make_inventory(NODE, 2)))
        await wait_until(lambda: len(slices(emu)) == 2, what="the second driver's pool")
    drivers = sorted(s["spec"]["driver"] for s in slices(emu))
    assert drivers == ["gpu.gpulet.io", "gpu.other.io"]


async def test_an_invalid_pool_is_never_written(emu: KubeEmulator) -> None:
    inventory = make_inventory(NODE, 2)
    twin = msgspec.structs.replace(inventory.gpus[1], minor=0)
    bad = msgspec.structs.replace(inventory, gpus=[inventory.gpus[0], twin])
    async with publishing(emu) as pub:
        pub.submit(SliceInput(bad))
        await wait_until(lambda: pub.metrics.failures_total >= 1, what="refused")
        assert slices(emu) == []
        pub.submit(SliceInput(inventory))
        await published(emu, 2)


async def test_the_emulator_refuses_what_the_server_would(emu: KubeEmulator) -> None:
    """The emulator's DRA validation is what makes the tests above mean something."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "bad"},
        "spec": {
            "driver": "gpu.gpulet.io",
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "GPU_0"}],
        },
    }
    async with KubeClient(KubeConfig(emu.url)) as api:
        with pytest.raises(KubeApiError) as refused:
            await api.create(api_path("resource.k8s.io", "v1", "resourceslices"), body, timeout_s=5)
        assert refused.value.status == 422
        body["spec"]["devices"] = [{"name": "gpu-0", "unknownField": 1}]  # type: ignore[index]
        with pytest.raises(KubeApiError) as unknown:
            await api.create(api_path("resource.k8s.io", "v1", "resourceslices"), body, timeout_s=5)
        assert unknown.value.status == 422
        assert slices(emu) == []


async def test_server_defaults_are_no_difference(emu: KubeEmulator) -> None:
    """A server that writes fields back at their zero value (bindsToNode: false,
    taints: []) or a quantity in another form must not cost a write per resync."""
    async with publishing(emu) as pub:
        pub.submit(SliceInput(make_inventory(NODE, 1)))
        await published(emu, 1)
        (body,) = slices(emu)
        device = body["spec"]["devices"][0]
        device["bindsToNode"] = False
        device["taints"] = []
        device["capacity"]["memory"]["value"] = "85899345920"  # 80Gi in bytes
        await wait_until(lambda: pub.watches >= 1 and not pub.debouncer.pending, what="watch")
        writes = slice_writes(emu)
        repairs = pub.repairs
        stored = emu.put_object(RESOURCE_SLICES, body)
        name, version = stored["metadata"]["name"], stored["metadata"]["resourceVersion"]
        # The watch sees an equal slice: held as observed, no re-read, no write.
        await wait_until(
            lambda: pub.writer.observed[name]["metadata"]["resourceVersion"] == version,
            what="the edit observed",
        )
        assert pub.repairs == repairs
        await pub.writer.refresh()
        pub.debouncer.submit(SliceInput(make_inventory(NODE, 1)))
        await wait_until(lambda: pub.writer.listed and not pub.debouncer.pending, what="again")
        assert slice_writes(emu) == writes
        assert slices(emu)[0]["spec"]["devices"][0]["bindsToNode"] is False


async def test_watch_lines_are_decoded_totally(emu: KubeEmulator) -> None:
    async with KubeClient(KubeConfig(emu.url)) as api:
        publisher = SlicePublisher(api, NODE, FAST)
    other = {"metadata": {"name": "s"}, "spec": {"nodeName": "other"}}
    lines = [
        b"not json",
        b"[]",
        b'{"type": "ADDED"}',
        b'{"type": "ADDED", "object": []}',
        b'{"type": "DELETED", "object": {"metadata": "x", "spec": 1}}',
        b'{"type": "MODIFIED", "object": {"metadata": {"name": 5}}}',
        json.dumps({"type": "MODIFIED", "object": other}).encode(),
        b'{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}',
        b"\xff\xfe",
    ]
    for line in lines:
        publisher._on_line(line)
    assert publisher.repairs == 0
    assert publisher.bad_lines == 5
    # Ours, unknown to the writer: a repair.
    publisher._on_line(
        b'{"type": "ADDED", "object": {"metadata": {"name": "s", "resourceVersion": "3"},'
        b' "spec": {"nodeName": "node-a", "driver": "gpu.gpulet.io"}}}'
    )
    assert publisher.repairs == 1


async def test_time_sliced_gpus_are_tainted_and_untainted_as_the_plan_changes(
    emu: KubeEmulator,
) -> None:
    """The allocator's ``held`` reply names each GPU's replicas; the publisher taints
    the time-sliced ones (any mode) and lifts the taint when the config drops them."""
    inventory = make_inventory(NODE, 2)
    uuid = inventory.gpus[0].uuid
    async with publishing(emu) as pub:
        pub.submit(SliceInput(inventory))
        await published(emu, 2)
        pub.set_held((), {uuid: 4})
        await wait_until(lambda: "taints" in devices(emu)["gpu-0"], what="time-sliced taint")
        taint = devices(emu)["gpu-0"]["taints"][0]  # type: ignore[index]
        assert (taint["key"], taint["value"]) == ("gpu.gpulet.io/time-sliced", "4")
        assert "taints" not in devices(emu)["gpu-1"]
        pub.set_held((), {})
        await wait_until(lambda: "taints" not in devices(emu)["gpu-0"], what="taint lifted")


async def test_a_repair_never_holds_back_a_pending_write(emu: KubeEmulator) -> None:
    """A watch reopens every watch_timeout_s, and each reopen re-lists; with a fault
    waiting out the quiet window, submitting the same input again restarted the window
    (the bench saw a taint 0.95 s after the fault instead of 0.52 s)."""
    async with KubeClient(KubeConfig(emu.url)) as api:
        publisher = SlicePublisher(api, NODE, DraSettings(quiet_window_s=0.5, max_delay_s=2))
    inventory = make_inventory(NODE, 2)
    publisher.submit(SliceInput(inventory))
    due = publisher.debouncer.due_at()
    assert due is not None
    publisher._repair("a watch opened")  # the pending write will re-list: no resubmit
    assert publisher.debouncer.due_at() == due
    assert publisher.debouncer.submitted == 1
    assert not publisher.writer.listed
    # Nothing pending: a repair starts a write of the last input.
    assert publisher.debouncer.take_now() is not None
    publisher._repair("a watch opened")
    assert publisher.debouncer.pending
    assert publisher.repairs == 2


async def test_taints_not_known_yet_are_kept_as_the_server_holds_them(
    emu: KubeEmulator,
) -> None:
    """After a restart the held set and the health state are not known at first: a
    write then keeps the device-plugin and fault taints the API server holds (a new
    fact is still published), and drops them only once the fact says so."""
    inventory = make_inventory(NODE, 3)
    held_uuid, faulty = inventory.gpus[0].uuid, inventory.gpus[1].uuid
    both = msgspec.structs.replace(FAST, mode="both")
    async with publishing(emu, both) as pub:
        pub.submit(SliceInput(inventory, {faulty: fault(faulty)}, frozenset({held_uuid})))
        await wait_until(
            lambda: len(devices(emu)) == 3 and "taints" in devices(emu)["gpu-1"],
            what="both taints",
        )
        assert "taints" in devices(emu)["gpu-0"]
    # A new agent: nothing known of the holdings or health, and a new fault on gpu-2.
    third = inventory.gpus[2].uuid
    unknown = SliceInput(inventory, {third: fault(third, 48)}, held_known=False, health_known=False)
    async with publishing(emu, both) as pub:
        pub.submit(unknown)
        await wait_until(lambda: "taints" in devices(emu)["gpu-2"], what="the new fault")
        keys = {
            n: [t["key"] for t in d.get("taints", [])]  # type: ignore[attr-defined]
            for n, d in devices(emu).items()
        }
        assert keys["gpu-0"] == ["gpu.gpulet.io/device-plugin"]
        assert keys["gpu-1"] == ["gpu.gpulet.io/xid"]
        # Known now: nothing held, gpu-1 healthy again.
        pub.submit(SliceInput(inventory, {third: fault(third, 48)}))
        await wait_until(
            lambda: "taints" not in devices(emu)["gpu-0"] and "taints" not in devices(emu)["gpu-1"],
            what="the taints lowered once known",
        )


class _View:
    """What the publisher reads of a NodeView: an inventory, the health map, and when
    the health service's state and remediation's quarantines were first read."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.health_seen = anyio.Event()
        self.heal_seen = anyio.Event()
        self.listeners: list[Any] = []

    def healths(self) -> dict[str, GpuHealth]:
        return {}

    def listen(self, listener: Any) -> None:
        self.listeners.append(listener)


async def test_fault_taints_are_kept_until_remediations_quarantines_are_read_too(
    emu: KubeEmulator,
) -> None:
    """A GPU in remediation is quarantined by its machine's record (gpulet_heal), while
    its health state may already read healthy (a verified reset clears it): after a
    restart, the health state alone must not lower its taint before the records are
    read."""
    view = _View(make_inventory(NODE, 2))
    publisher = SlicePublisher(KubeClient(KubeConfig(emu.url)), NODE, FAST, await_health=True)
    publisher.attach(cast(NodeView, view))
    view.health_seen.set()
    view.listeners[0](NodeChange())
    assert publisher.last is not None
    assert not publisher.last.health_known  # the quarantines are not read yet
    view.heal_seen.set()
    view.listeners[0](NodeChange())
    assert publisher.last.health_known
