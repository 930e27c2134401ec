"""The fake kubelet against the real one (issue 35, test 7): the same scripted sequence
runs against both, and a device plugin that records every call it gets
(support.recording_plugin) says what each kubelet asked, in order.

The script: the plugin registers (``pre_start_required`` and
``get_preferred_allocation_available`` set, 4 devices); a container asks for 2 devices
(the real kubelet: a pod with that limit, admitted and started; the fake: its
:meth:`FakeKubelet.admit`, which is what the project's tests call a pod's admission).

The real kubelet's calls are checked against what kubelet's device manager is known to
do (:data:`REAL`), so a kubelet upgrade that changes them fails here; the fake's are
checked equal to the real ones. The differences that remain are listed in
docs/testing.md ("The fake kubelet against the real one").
"""

from __future__ import annotations

import pytest

from support.control_plane_fixtures import unique_name
from support.fake_kubelet import running_fake_kubelet
from support.node import Pods, RealNode, pod_manifest
from support.node_gpulet import env_of, wait_logged, wait_running
from support.node_parts import DEVICE_PLUGIN_DIR
from support.recording_plugin import ENV, recording_plugin
from support.waiting import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

RESOURCE = "example.gpulet.io/recorded"
# What kubelet v1.37.2's device manager asks, in order, for one container of a new pod
# asking for 2 of 4 devices.
REAL = [
    ("GetDevicePluginOptions", ""),
    ("ListAndWatch", ""),
    (
        "GetPreferredAllocation",
        "size=2 available=['dev-0', 'dev-1', 'dev-2', 'dev-3'] must=[]",
    ),
    ("Allocate", "devices=['dev-0', 'dev-1']"),
    ("PreStartContainer", "devices=['dev-0', 'dev-1']"),
]


async def test_the_real_kubelet_asks_what_its_device_manager_is_known_to_ask(
    real_node: RealNode, pods: Pods
) -> None:
    async with recording_plugin(DEVICE_PLUGIN_DIR, RESOURCE) as plugin:
        await plugin.wait_for("ListAndWatch")
        await wait_until(
            lambda: real_node.allocatable(RESOURCE) == "4", timeout_s=60, interval_s=0.2
        )
        name = unique_name("rec")
        pods.create(
            pod_manifest(name, real_node.name, script="env; echo ---", limits={RESOURCE: "2"})
        )
        await wait_running(pods, name)
        log = await wait_logged(pods, name, marker="RECORDED")
        assert env_of(log)[ENV] == "dev-0,dev-1"
        assert plugin.calls == REAL, plugin.calls
        pods.delete(name)


async def test_the_fake_kubelet_asks_the_same(tmp_path_factory: pytest.TempPathFactory) -> None:
    plugin_dir = tmp_path_factory.mktemp("fake-kubelet")
    async with (
        running_fake_kubelet(plugin_dir) as fake,
        recording_plugin(plugin_dir, RESOURCE) as plugin,
    ):
        await fake.wait_devices(RESOURCE, lambda devices: len(devices) == 4)
        answer = await fake.admit(RESOURCE, 2)
        assert dict(answer.container_responses[0].envs)[ENV] == "dev-0,dev-1"
    assert plugin.calls == REAL, plugin.calls
