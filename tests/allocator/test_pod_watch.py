"""The allocator's pod watch and Event writer against the Kubernetes API emulator,
through gpulet's own client (gpulet_common.kubeapi): list + watch, resuming, 410 Gone,
API failures, hostile objects, and Events that never block the caller."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import pytest

from gpulet_allocator.decide.koordinator import ANNOTATION_DEVICE_ALLOCATED, PodBook, PodKey
from gpulet_allocator.service.pod_watch import EVENT_QUEUE, EVENT_REASON, EventWriter, PodWatch
from gpulet_common.kube import KubeConfig
from gpulet_common.kubeapi import KubeClient
from gpulet_common.settings.allocator import HandshakeSettings
from support.kube_emulator import EVENTS, PODS, KubeEmulator
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

NODE = "gpu-1"
SETTINGS = HandshakeSettings(enabled=True, api_timeout_s=2.0, watch_timeout_s=1.0)
DECISION = json.dumps({"gpu": [{"minor": 0}]})


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running(history_size=50) as emulator:
        yield emulator


@pytest.fixture
async def api(emu: KubeEmulator) -> AsyncIterator[KubeClient]:
    async with KubeClient(KubeConfig(emu.url)) as api_client:
        yield api_client


def names(book: PodBook) -> set[str]:
    return {p.key.name for p in book.pods.values()}


async def test_list_then_watch_follows_this_nodes_pods_only(
    emu: KubeEmulator, api: KubeClient
) -> None:
    emu.add_pod("before", node=NODE, annotations={ANNOTATION_DEVICE_ALLOCATED: DECISION})
    emu.add_pod("elsewhere", node="gpu-2")
    book = PodBook(NODE)
    watch = PodWatch(api, book, SETTINGS)
    async with anyio.create_task_group() as tg:
        await tg.start(watch.run)
        assert book.synced
        assert names(book) == {"before"}
        emu.add_pod("after", node=NODE)
        emu.add_pod("other", node="gpu-2")
        await wait_until(lambda: names(book) == {"before", "after"})
        emu.delete_object(PODS, "default/before")
        await wait_until(lambda: names(book) == {"after"})
        # Watches end after watch_timeout_s and resume from the last version seen:
        # nothing is listed again, and nothing is missed across the reopen.
        opened = watch.watches
        await wait_until(lambda: watch.watches > opened, timeout_s=5)
        emu.add_pod("late", node=NODE)
        await wait_until(lambda: "late" in names(book))
        assert watch.lists == 1
        tg.cancel_scope.cancel()


async def test_410_gone_and_api_failures_list_again_and_never_end_the_watch(
    emu: KubeEmulator, api: KubeClient
) -> None:
    book = PodBook(NODE)
    states: list[str] = []
    watch = PodWatch(api, book, SETTINGS, on_state=states.append)
    emu.faults.fail_next(2, 500, method="GET", path="/pods$")
    async with anyio.create_task_group() as tg:
        await tg.start(watch.run)  # serving (without pods) while the API fails
        await wait_until(lambda: book.synced, timeout_s=10)
        assert any("HTTP 500" in s for s in states)
        assert states[-1] == ""
        # The server forgets history faster than our watch reads it: 410 Gone, relist.
        # (Other nodes' pods move the history on; this watch sees none of them, so the
        # version it resumes from is the forgotten one set here.)
        lists = watch.lists
        for i in range(60):
            emu.add_pod(f"p{i}", node="gpu-2")
        watch.resource_version = "1"
        await wait_until(lambda: watch.lists > lists, timeout_s=10)
        emu.add_pod("mine", node=NODE)
        await wait_until(lambda: "mine" in names(book), timeout_s=10)
        # A pod object that is not a pod is skipped, not fatal.
        emu.put_object(PODS, {"metadata": {"name": "junk", "namespace": "x"}, "spec": "no"})
        emu.add_pod("still", node=NODE)
        await wait_until(lambda: "still" in names(book), timeout_s=10)
        tg.cancel_scope.cancel()


async def test_events_are_posted_deduplicated_and_never_block(
    emu: KubeEmulator, api: KubeClient
) -> None:
    created = emu.add_pod("doomed", node=NODE, namespace="ml")
    pod = PodKey("ml", "doomed", created["metadata"]["uid"])
    writer = EventWriter(api, NODE, SETTINGS)
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        writer.post(pod, "GPU minor 2 is unhealthy")
        writer.post(pod, "GPU minor 2 is unhealthy")  # the same: once
        writer.post(pod, "kubelet allocated minor 3")
        await wait_until(lambda: writer.sent == 2)
        events = sorted(e["message"] for e in emu.list_objects(EVENTS))
        assert events == ["GPU minor 2 is unhealthy", "kubelet allocated minor 3"]
        event = emu.list_objects(EVENTS)[0]
        assert event["reason"] == EVENT_REASON
        assert event["type"] == "Warning"
        assert event["involvedObject"]["uid"] == pod.uid
        assert event["source"]["host"] == NODE
        tg.cancel_scope.cancel()
    # Nobody draining the queue: posting still returns at once, the excess is dropped.
    stuck = EventWriter(api, NODE, SETTINGS)
    for i in range(EVENT_QUEUE + 10):
        stuck.post(pod, f"m{i}")
    assert stuck.dropped == 10
    # A failing API server is logged and counted, never raised.
    emu.faults.fail_next(1, 503, method="POST", path="/events$")
    failing = EventWriter(api, NODE, SETTINGS)
    async with anyio.create_task_group() as tg:
        tg.start_soon(failing.run)
        failing.post(pod, "x")
        await wait_until(lambda: failing.failed == 1)
        tg.cancel_scope.cancel()
