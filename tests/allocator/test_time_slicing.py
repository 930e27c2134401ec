"""Time-slicing end to end (issue 27): the node label picks a config, kubelet sees it.

The real allocator and device plugin over a real nats-server, the fake kubelet's
``ListAndWatch`` and ``Allocate``, and the API server emulator holding the Node whose
label the allocator watches. A label switch changes the replicas kubelet sees with no
restart of anything, and what was allocated stays allocated; a faulty GPU's replicas
all turn ``Unhealthy``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import msgspec
import pytest

from gpulet_allocator import protocol as p
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_allocator.service.sharing import decode_configs
from gpulet_common import codec
from gpulet_common.codec import TOO_DEEP
from gpulet_common.messages import HeldRequest
from gpulet_common.settings import Settings
from gpulet_common.settings.allocator import HandshakeSettings
from gpulet_common.settings.sharing import (
    ReplicatedResource,
    SharingSettings,
    TimeSlicingConfig,
    TimeSlicingSettings,
)
from gpulet_common.untrusted import UntrustedDocumentError
from support import reference
from support.allocator_stack import CORE, GPU, NODE, Stack, allocator_stack, ids, rpc_error
from support.kube_emulator import KubeEmulator, cluster_with_node

pytestmark = pytest.mark.anyio

LABEL = "gpulet.io/sharing.config"


@pytest.fixture
async def emu(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with cluster_with_node(NODE, tmp_path / "kubeconfig") as emulator:
        yield emulator


def sliced_settings(settings: Settings, tmp_path: Path) -> Settings:
    time_slicing = TimeSlicingSettings(
        configs={
            "two": TimeSlicingConfig(resources=[ReplicatedResource(name=GPU, replicas=2)]),
            "four": TimeSlicingConfig(resources=[ReplicatedResource(name=GPU, replicas=4)]),
        }
    )
    # The node label is read with the allocator's kube settings (handshake's).
    handshake = HandshakeSettings(
        kubeconfig=str(tmp_path / "kubeconfig"), api_timeout_s=2.0, watch_timeout_s=5.0
    )
    allocator = msgspec.structs.replace(settings.allocator, handshake=handshake)
    return msgspec.structs.replace(
        settings, allocator=allocator, sharing=SharingSettings(time_slicing=time_slicing)
    )


def replicas_of(devices: list[dp.Device], uuids: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(uuids, 0)
    for d in devices:
        uuid, _, n = d.ID.partition("::")
        assert n.isdigit(), d.ID
        counts[uuid] += 1
    return counts


async def label(emu: KubeEmulator, value: str | None) -> None:
    emu.add_node(NODE, labels={LABEL: value} if value is not None else None)


async def wait_replicas(stack: Stack, uuids: list[str], n: int) -> None:
    await stack.kubelet.wait_devices(
        GPU, lambda d: len(d) == n * len(uuids) and all("::" in x.ID for x in d), timeout_s=10
    )
    assert replicas_of(stack.kubelet.devices(GPU), uuids) == dict.fromkeys(uuids, n)


@contextlib.asynccontextmanager
async def sliced_stack(
    settings: Settings, emu: KubeEmulator, config: str, replicas: int
) -> AsyncIterator[tuple[Stack, list[str]]]:
    """The stack on an 8-GPU node whose label picks ``config`` (``replicas`` each),
    once kubelet has the replicas; ``settings`` with the time-slicing configs."""
    inventory = reference.nvlink_pairs_8()
    uuids = [g.uuid for g in inventory.gpus]
    await label(emu, config)
    async with allocator_stack(settings, inventory=None, start_plugin=False) as stack:
        await stack.publish_inventory(inventory)
        await stack.wait_allocator_ready()
        await stack.start_plugin()
        await stack.kubelet.wait_registered(GPU, timeout_s=5)
        await wait_replicas(stack, uuids, replicas)
        yield stack, uuids


async def release_all(stack: Stack) -> None:
    for allocation in (await stack.state()).allocations:
        await stack.ask(
            p.ENDPOINT_RELEASE,
            p.ReleaseRequest(allocation_ids=[allocation.id]),
            p.RELEASE_REQUEST,
            p.RELEASE_REPLY,
        )


async def test_a_label_switch_changes_the_replicas_without_restart_or_loss(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    sliced = sliced_settings(settings, tmp_path)
    async with sliced_stack(sliced, emu, "two", 2) as (stack, uuids):
        g0 = uuids[0]
        allocator, plugin = stack.allocator, stack.plugin
        registrations = stack.kubelet.registration_count(GPU)
        # A time-sliced GPU is not offered for shares either.
        await stack.kubelet.wait_devices(CORE, lambda d: len(d) == 0, timeout_s=5)

        # A replica is given as its GPU: the same env and device node as the whole GPU.
        answer = await stack.kubelet.allocate(GPU, [[f"{g0}::1"]])
        [container] = answer.container_responses
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == g0
        minor = reference.nvlink_pairs_8().gpus[0].minor
        assert f"/dev/nvidia{minor}" in {d.container_path for d in container.devices}

        # Two -> four: more replicas, the same IDs for the first two, nothing restarted.
        await label(emu, "four")
        await wait_replicas(stack, uuids, 4)
        await stack.kubelet.allocate(GPU, [[f"{g0}::3"]])
        held = {tuple(a.gpus) for a in (await stack.state()).allocations}
        assert held == {(f"{g0}::1",), (f"{g0}::3",)}

        # Four -> two: replica 3 stays held (a kubelet retry gets its answer again) but
        # is no longer listed nor given to anyone new.
        await label(emu, "two")
        await wait_replicas(stack, uuids, 2)
        again = await stack.kubelet.allocate(GPU, [[f"{g0}::3"]])
        assert again.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == g0
        error = await rpc_error(stack.kubelet.allocate(GPU, [[f"{g0}::2"]]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        state = await stack.state()
        assert {tuple(a.gpus) for a in state.allocations} == held

        # No label (no time-slicing): whole GPUs again, but not the one whose replicas
        # are still held: listed Unhealthy, refused whole.
        await label(emu, None)
        await stack.kubelet.wait_devices(
            GPU,
            lambda d: (
                {x.ID: x.health for x in d}
                == {u: "Unhealthy" if u == g0 else "Healthy" for u in uuids}
            ),
            timeout_s=10,
        )
        error = await rpc_error(stack.kubelet.allocate(GPU, [[g0]]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "time-slicing replicas" in (error.details() or "")
        await release_all(stack)
        await stack.kubelet.wait_devices(
            GPU, lambda d: all(x.health == "Healthy" for x in d), timeout_s=10
        )
        await stack.kubelet.allocate(GPU, [[g0]])

        # Nothing was restarted: the same services, one registration.
        assert stack.allocator is allocator
        assert stack.plugin is plugin
        assert stack.kubelet.registration_count(GPU) == registrations


async def test_a_faulty_gpus_replicas_all_turn_unhealthy(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    sliced = sliced_settings(settings, tmp_path)
    async with sliced_stack(sliced, emu, "four", 4) as (stack, uuids):
        bad = uuids[5]
        # The reporter's long poll carries the same plan (GFD's sharing labels).
        held = await stack.ask(p.ENDPOINT_HELD, HeldRequest(), codec.HELD_REQUEST, codec.HELD_REPLY)
        assert held.replicas == dict.fromkeys(uuids, 4)

        await stack.publish_health(bad, healthy=False)
        await stack.kubelet.wait_devices(
            GPU,
            lambda d: (
                {x.ID for x in d if x.health == "Unhealthy"} == {f"{bad}::{n}" for n in range(4)}
            ),
            timeout_s=10,
        )
        assert len(ids(stack, GPU)) == 32
        error = await rpc_error(stack.kubelet.allocate(GPU, [[f"{bad}::0"]]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION

        await stack.publish_health(bad, healthy=True)
        await stack.kubelet.wait_devices(
            GPU, lambda d: all(x.health == "Healthy" for x in d), timeout_s=10
        )
        await stack.kubelet.allocate(GPU, [[f"{bad}::0"]])


async def test_a_configs_file_change_applies_without_restart_or_loss(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    """The configs in a file of their own (a mounted ConfigMap): rewritten, the replicas
    follow; a file that does not decode changes nothing and says why."""
    configs = tmp_path / "time-slicing.toml"

    def write(replicas: int, note: str = "") -> None:
        configs.write_text(
            f"# {note}\n[shared]\nresources = [{{ name = '{GPU}', replicas = {replicas} }}]\n"
        )

    write(2)
    base = sliced_settings(settings, tmp_path)
    time_slicing = msgspec.structs.replace(
        base.sharing.time_slicing, configs={}, configs_file=str(configs), configs_poll_s=0.05
    )
    with_file = msgspec.structs.replace(base, sharing=SharingSettings(time_slicing=time_slicing))
    async with sliced_stack(with_file, emu, "shared", 2) as (stack, uuids):
        g0 = uuids[0]
        await stack.kubelet.allocate(GPU, [[f"{g0}::1"]])
        allocator = stack.allocator
        assert allocator is not None
        write(3, "three replicas each")
        await wait_replicas(stack, uuids, 3)
        configs.write_text("[shared\nresources = 'not a list'\n")
        await stack.wait_for(lambda: allocator.sharing.file_problem != "", "the file refused")
        assert "not used" in allocator.sharing.file_problem
        assert len(ids(stack, GPU)) == 3 * len(uuids)
        # A 200k-deep array (400 KB, under the size bound): refused the same way, not a
        # RecursionError that ended the allocator's task group and all of gpulet run.
        configs.write_text("x = " + "[" * 200_000 + "]" * 200_000 + "\n")
        await stack.wait_for(
            lambda: "too deep" in allocator.sharing.file_problem, "the deep file refused"
        )
        assert len(ids(stack, GPU)) == 3 * len(uuids)
        write(4, "four")
        await wait_replicas(stack, uuids, 4)
        assert allocator.sharing.file_problem == ""
        held = [a.gpus for a in (await stack.state()).allocations]
        assert held == [[f"{g0}::1"]]
        assert stack.allocator is allocator


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_deep_configs_file_is_a_refusal_not_a_recursion_error(suffix: str) -> None:
    deep = "[" * 10_000 + "]" * 10_000
    text = f'{{"shared": {deep}}}' if suffix == ".json" else f"shared = {deep}\n"
    with pytest.raises(UntrustedDocumentError) as info:
        decode_configs(text.encode(), Path("configs" + suffix))
    assert info.value.reason == TOO_DEEP
    good = f"[shared]\nresources = [{{ name = '{GPU}', replicas = 2 }}]\n"
    assert decode_configs(good.encode(), Path("configs.toml"))["shared"].resources[0].replicas == 2
