"""Pod attribution: DCGM_FI_* metrics carry the pod, namespace and container of a GPU.

A fake kubelet serves the real ``v1.PodResourcesLister`` on a unix socket; the
allocator polls it and answers its ``pods`` endpoint, which the collector (mock NVML,
real nats-server, both services in one runtime as in ``gpulet run``) follows; the
collector serves ``/metrics`` over HTTP, which the test scrapes like Prometheus would.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from nats.aio.msg import Msg

from gpulet_allocator.protocol import core_device_id, memory_device_id
from gpulet_allocator.service.nats import AllocatorService
from gpulet_allocator.service.podresources import pod_holders
from gpulet_allocator.service.withheld import MAX_PODS_REPLY_BYTES, pods_reply
from gpulet_collector.pods import STATUS_NAME, PodAttribution, holders_of
from gpulet_collector.service import CollectorService
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.messages import PodHolder, PodsReply
from gpulet_common.telemetry import StatusBoard, serve_http
from support.agent import agent_settings, mock_adapter, runtime_for
from support.exposition import parse
from support.fake_kubelet import FakeContainer, FakePod, running_fake_kubelet

pytestmark = pytest.mark.anyio

Holders = dict[str, set[tuple[str, str, str]]]


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
        body: bytes = answer.read()
    return body.decode()


async def scrape(port: int) -> str:
    # /metrics is served by this event loop: fetch it from a thread.
    return await anyio.to_thread.run_sync(_get, port)


async def wait_for_holders(port: int, expected: Holders, what: str) -> None:
    """Scrape until the holders are as expected (bounded: 5 s)."""
    found: Holders = {}
    for _ in range(250):
        found = holders_in(await scrape(port))
        if found == expected:
            return
        await anyio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}: last scrape gave {found}")


def holders_in(text: str, metric: str = "DCGM_FI_DEV_GPU_TEMP") -> Holders:
    """gpu index -> {(namespace, pod, container)} of one metric; () for unheld GPUs."""
    found: Holders = {}
    for name, labels, _ in parse(text)[1]:
        if name != metric:
            continue
        held = found.setdefault(labels["gpu"], set())
        if "pod" in labels:
            held.add((labels["namespace"], labels["pod"], labels["container"]))
    return found


async def test_pod_labels_follow_the_allocations(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    socket = tmp_path / "pod-resources.sock"
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        overrides=[
            "collector.sample_period_s=0.05",
            "collector.pod_resources_poll_s=0.05",
            "allocator.pods_poll_s=0.05",
            f"allocator.pod_resources_socket={socket}",
        ],
    )
    adapter, _mock = mock_adapter("dgx-h100")
    uuids = [adapter.uuid_of(i) for i in range(8)]
    (tmp_path / "device-plugins").mkdir()
    pod_a = FakePod(
        name="trainer-a",
        namespace="ml",
        containers=[FakeContainer("main", {"nvidia.com/gpu": [uuids[1], uuids[2]]})],
    )
    pod_b = FakePod(
        name="notebook-b",
        namespace="research",
        containers=[
            FakeContainer(
                "jupyter",
                {
                    "gpulet.io/gpu-core": [core_device_id(uuids[3], n) for n in range(30)],
                    "gpulet.io/gpu-memory": [memory_device_id(uuids[3], n) for n in range(8)],
                },
            )
        ],
    )
    async with (
        runtime_for(settings, adapter=adapter) as rt,
        running_fake_kubelet(
            tmp_path / "device-plugins", pod_resources_socket=socket, pods=[pod_a, pod_b]
        ) as kubelet,
        anyio.create_task_group() as tg,
    ):
        port = await tg.start(serve_http, "127.0.0.1", 0, rt.status)
        await tg.start(CollectorService(rt).run)
        await tg.start(AllocatorService(rt).run)

        expected: Holders = {str(i): set() for i in range(8)}
        expected["1"] = expected["2"] = {("ml", "trainer-a", "main")}
        expected["3"] = {("research", "notebook-b", "jupyter")}
        await wait_for_holders(port, expected, "pod A on GPUs 1-2, B on GPU 3")
        # Every DCGM_FI_* series of a held GPU carries the labels, not only one metric.
        text = await scrape(port)
        assert holders_in(text, "DCGM_FI_DEV_FB_USED") == expected
        assert holders_in(text, "DCGM_FI_DEV_POWER_USAGE") == expected

        # Allocations change: A goes away, C shares GPU 3 with B (one series per pod).
        pod_c = FakePod(
            name="server-c",
            containers=[
                FakeContainer("infer", {"gpulet.io/gpu-core": [core_device_id(uuids[3], 99)]})
            ],
        )
        kubelet.pods = [pod_b, pod_c]
        expected = {str(i): set() for i in range(8)}
        expected["3"] = {
            ("research", "notebook-b", "jupyter"),
            ("default", "server-c", "infer"),
        }
        await wait_for_holders(port, expected, "A gone, B and C on GPU 3")
        assert (
            sum(
                1
                for line in (await scrape(port)).splitlines()
                if line.startswith('DCGM_FI_DEV_GPU_TEMP{gpu="3"')
            )
            == 2
        )

        # The pods end: no GPU is held any more.
        kubelet.pods = []
        await wait_for_holders(port, {str(i): set() for i in range(8)}, "no holders")
        tg.cancel_scope.cancel()


def test_device_ids_of_any_resource_name_their_device() -> None:
    """The allocator's side: every resource's device IDs, shares and replicas under
    their GPU; junk IDs are left out."""
    response = pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name="p",
                namespace="n",
                containers=[
                    pr.ContainerResources(
                        name="c",
                        devices=[
                            pr.ContainerDevices(
                                resource_name="nvidia.com/gpu",
                                # NVIDIA's time-slicing replica IDs, a stranger, junk.
                                device_ids=["GPU-a::1", "GPU-a::0", "GPU-zzz", "", "::x"],
                            )
                        ],
                    )
                ],
            )
        ]
    )
    holders = pod_holders(response)
    assert sorted(holders) == ["GPU-a", "GPU-zzz"]
    [held] = holders["GPU-a"]
    assert (held.namespace, held.pod, held.container) == ("n", "p", "c")
    assert (held.resource, held.device_ids) == ("nvidia.com/gpu", ["GPU-a::0", "GPU-a::1"])


def test_devices_the_node_lacks_are_ignored() -> None:
    """The collector's side: only what its inventory has, each container once."""
    c = PodHolder(namespace="n", pod="p", container="c")
    reply = PodsReply(
        epoch="e", version=1, holders={"GPU-a": [c, c], "GPU-zzz": [c], "MIG-b": [], "": [c]}
    )
    holders = holders_of(reply, {"GPU-a", "GPU-b", "MIG-b"})
    assert list(holders) == ["GPU-a"]
    assert [(h.namespace, h.pod, h.container) for h in holders["GPU-a"]] == [("n", "p", "c")]


async def test_no_allocator_or_a_bad_reply_never_ends_the_attribution(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """No allocator: no labels, and the status says why; a reply that cannot be read
    keeps the last holders; a good one after it is used."""
    settings = agent_settings(nats_server.url, tmp_path)
    updates: list[dict[str, Any]] = []
    status = StatusBoard()
    subject = subjects.allocator_endpoint("node-1", subjects.ALLOCATOR_PODS_ENDPOINT)
    held = PodHolder(namespace="n", pod="p", container="c", device_ids=["GPU-a"])
    good = codec.PODS_REPLY.encode(
        PodsReply(epoch="e", version=1, holders={"GPU-a": [held]}, source="ok")
    )
    answers = [b"{not json", msgspec.json.encode({"epoch": "e", "version": "x"}), good]
    async with Bus.connect(settings.nats, max_initial_attempts=3) as bus:
        attribution = PodAttribution(bus, "node-1", 0.05, lambda: {"GPU-a"}, updates.append, status)
        assert await attribution.ask() is False  # nobody answers
        said = status.get(STATUS_NAME)
        assert said is not None
        assert said.state == "ready"
        assert "allocator does not answer" in said.detail
        assert updates == []  # nothing was held, nothing changes

        async def answer(msg: Msg) -> None:
            await msg.respond(answers.pop(0) if answers else good)

        await bus.client.subscribe(subject, cb=answer)
        await bus.client.flush()
        assert await attribution.ask() is False  # not JSON
        assert await attribution.ask() is False  # not the schema
        said = status.get(STATUS_NAME)
        assert said is not None
        assert "asking the allocator failed" in said.detail
        assert updates == []
        assert await attribution.ask() is True
        assert [{u: [h.pod for h in hs] for u, hs in update.items()} for update in updates] == [
            {"GPU-a": ["p"]}
        ]
        said = status.get(STATUS_NAME)
        assert said is not None
        assert said.detail.startswith("pod labels from the allocator")


def test_a_pods_reply_always_fits_one_nats_message() -> None:
    """Many shares (100 IDs each): the reply leaves the IDs out, keeps holders and counts."""
    ids = [f"GPU-{g}::core-{n}" for g in range(8) for n in range(64)]
    holders = {
        f"GPU-{g}": [
            PodHolder(
                namespace="n",
                pod=f"pod-{k}",
                container="c",
                device_ids=ids[g * 64 : (g + 1) * 64],
                device_count=100,
            )
            for k in range(200)
        ]
        for g in range(8)
    }
    data = pods_reply("e", 3, (holders, "ok"))
    assert len(data) <= MAX_PODS_REPLY_BYTES
    reply = codec.PODS_REPLY.decode(data)
    assert sum(len(h) for h in reply.holders.values()) == 1600
    assert {(h.device_ids == [], h.device_count) for hs in reply.holders.values() for h in hs} == {
        (True, 100)
    }
    small = codec.PODS_REPLY.decode(pods_reply("e", 3, ({"GPU-0": holders["GPU-0"][:1]}, "ok")))
    assert small.holders["GPU-0"][0].device_ids == ids[:64]
