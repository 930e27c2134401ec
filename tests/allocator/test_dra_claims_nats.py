"""DRA claims in the one ledger, through the real path: a real nats-server, the real
allocator service, the real device plugin and each of the DRA kubelet plugin's
decision cores: the allocator's own, in process
(:class:`~gpulet_allocator.service.claims.LocalClaimCore`, ``dra.plugin_host``
``allocator``, the default), and the NATS-backed one
(:class:`~gpulet_allocator.kubelet.dra.nats_core.NatsDecisionCore`, ``device-plugin``).

The guarantee under test: whichever adapter asks first, a GPU never has two owners;
and both cores give the same answers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import grpc
import pytest

from gpulet_allocator import protocol as p
from gpulet_allocator.kubelet.dra.contract import ClaimDevice, DecisionCore, Reservation
from gpulet_allocator.kubelet.dra.nats_core import NatsDecisionCore
from gpulet_allocator.state.checkpoint import read_state
from gpulet_common import subjects
from gpulet_common.bus import Delivery
from gpulet_common.dra.devices import device_name
from gpulet_common.messages import Inventory
from gpulet_common.nvml.loader import open_mock
from gpulet_common.refusal import Refused
from gpulet_common.settings import Settings
from support.allocator_stack import CORE, GPU, NODE, Stack, allocator_stack, ids, rpc_error

pytestmark = pytest.mark.anyio

GIB = 1024**3
UID_A = "11111111-aaaa-4aaa-8aaa-000000000001"
UID_B = "22222222-bbbb-4bbb-8bbb-000000000002"
UID_C = "33333333-cccc-4ccc-8ccc-000000000003"


def mock_inventory() -> Inventory:
    adapter = open_mock("nvlink-pairs-8gpu")
    try:
        return adapter.inventory(NODE, 1)
    finally:
        adapter.shutdown()


def names(inventory: Inventory) -> dict[str, str]:
    """GPU UUID → the device's DRA name."""
    return {g.uuid: device_name(g) for g in inventory.gpus}


def whole(device: str) -> ClaimDevice:
    return ClaimDevice(NODE, device, ("gpu",))


def share(device: str, cores: int, memory_gib: int) -> ClaimDevice:
    return ClaimDevice(NODE, device, ("gpu",), cores, memory_gib * GIB)


def core_of(stack: Stack) -> NatsDecisionCore:
    return NatsDecisionCore(stack.bus, NODE, timeout_s=2.0)


class InProcess:
    """The running allocator's :class:`LocalClaimCore`, looked up at each call (a
    restarted allocator is a new service)."""

    def __init__(self, stack: Stack) -> None:
        self._stack = stack

    def _core(self) -> DecisionCore:
        assert self._stack.allocator is not None
        return self._stack.allocator.claim_core

    async def reserve_claim(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        *,
        namespace: str = "",
        name: str = "",
    ) -> Reservation:
        return await self._core().reserve_claim(claim_uid, devices, namespace=namespace, name=name)

    async def release_claim(self, claim_uid: str) -> bool:
        return await self._core().release_claim(claim_uid)


@pytest.fixture(params=["in-process", "nats"])
def which_core(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.asynccontextmanager
async def claims_stack(
    settings: Settings, which: str
) -> AsyncIterator[tuple[Stack, DecisionCore, dict[str, str], Inventory]]:
    """The real allocator and device plugin on the mock's 8 GPUs, the decision core
    ``which`` names, and the GPUs' DRA names by UUID."""
    inventory = mock_inventory()
    async with allocator_stack(settings, inventory=inventory) as stack:
        core: DecisionCore = InProcess(stack) if which == "in-process" else core_of(stack)
        yield stack, core, names(inventory), inventory


async def refused(call: object) -> Refused:
    with pytest.raises(Refused) as info:
        await call  # type: ignore[misc]
    return info.value


async def test_a_gpu_held_by_the_device_plugin_is_refused_to_a_claim_and_back(
    settings: Settings, which_core: str
) -> None:
    async with claims_stack(settings, which_core) as (stack, core, dra, _inventory):
        gpus = ids(stack, GPU)
        # The device plugin first: a claim for the same GPU is refused.
        await stack.kubelet.allocate(GPU, [[gpus[0]]])
        error = await refused(core.reserve_claim(UID_A, [whole(dra[gpus[0]])]))
        assert error.code == "insufficient_capacity"
        assert gpus[0] in error.message
        # The holder as it is: the device plugin's allocation (kubelet's Allocate names
        # no pod), never a made-up "pod whole-… container ''".
        assert "is allocated whole to the device plugin's allocation " in error.message
        assert "container ''" not in error.message
        # ... and so is a share of it.
        error = await refused(core.reserve_claim(UID_A, [share(dra[gpus[0]], 30, 20)]))
        assert error.code == "insufficient_capacity"
        # A refusal left nothing reserved: the claim's other GPU is free.
        error = await refused(core.reserve_claim(UID_A, [whole(dra[gpus[1]]), whole(dra[gpus[0]])]))
        assert error.code == "insufficient_capacity"
        assert not [a for a in (await stack.state()).allocations if a.id == UID_A]

        # The claim first: the device plugin is refused that GPU.
        reservation = await core.reserve_claim(UID_A, [whole(dra[gpus[1]])])
        [device] = reservation.devices
        assert (device.uuid, device.device, device.cores) == (gpus[1], dra[gpus[1]], None)
        assert reservation.allocation == UID_A
        error_rpc = await rpc_error(stack.kubelet.allocate(GPU, [[gpus[1]]]))
        assert error_rpc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert UID_A in (error_rpc.details() or "")
        # ... and kubelet stops counting it as a whole GPU (withheld: Unhealthy).
        await stack.kubelet.wait_devices(
            GPU,
            lambda ds: any(gpus[1] == d.ID and d.health == "Unhealthy" for d in ds),
            timeout_s=5,
        )
        # Another claim is refused it too.
        error = await refused(core.reserve_claim(UID_B, [whole(dra[gpus[1]])]))
        assert error.code == "insufficient_capacity"
        assert UID_A in error.message


async def test_reserve_is_idempotent_and_release_frees_the_gpu(
    settings: Settings, which_core: str
) -> None:
    async with claims_stack(settings, which_core) as (stack, core, dra, _inventory):
        gpus = ids(stack, GPU)
        want = [whole(dra[gpus[2]]), whole(dra[gpus[3]])]
        first = await core.reserve_claim(UID_A, want)
        again = await core.reserve_claim(UID_A, list(reversed(want)))
        assert again == first
        state = await stack.state()
        [held] = [a for a in state.allocations if a.id == UID_A]
        assert sorted(held.gpus) == sorted(gpus[2:4])
        # The same claim asking for other devices is refused, and keeps what it had.
        error = await refused(core.reserve_claim(UID_A, [whole(dra[gpus[4]])]))
        assert error.code == "invalid_request"
        assert await core.reserve_claim(UID_A, want) == first

        assert await core.release_claim(UID_A) is True
        assert await core.release_claim(UID_A) is False
        assert not [a for a in (await stack.state()).allocations if a.id == UID_A]
        # Free again, for the device plugin.
        await stack.kubelet.wait_devices(
            GPU,
            lambda ds: all(d.health == "Healthy" for d in ds if d.ID in gpus[2:4]),
            timeout_s=5,
        )
        response = await stack.kubelet.allocate(GPU, [[gpus[2]]])
        assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == gpus[2]


async def test_claim_shares_add_up_and_keep_the_card_from_going_whole(
    settings: Settings, which_core: str
) -> None:
    async with claims_stack(settings, which_core) as (stack, core, dra, inventory):
        card_gib = inventory.gpus[0].memory_total_bytes // GIB
        gpu = ids(stack, GPU)[5]
        a = await core.reserve_claim(UID_A, [share(dra[gpu], 30, 8)])
        assert (a.devices[0].cores, a.devices[0].memory_mib) == (30, 8 * 1024)
        await core.reserve_claim(UID_B, [share(dra[gpu], 30, 8)])
        # More memory than is left on the card.
        error = await refused(core.reserve_claim(UID_C, [share(dra[gpu], 10, card_gib - 15)]))
        assert error.code == "insufficient_capacity"
        # 100 % of the cores is the whole GPU: refused, the card holds shares.
        error = await refused(core.reserve_claim(UID_C, [share(dra[gpu], 100, 10)]))
        assert error.code == "insufficient_capacity"
        error_rpc = await rpc_error(stack.kubelet.allocate(GPU, [[gpu]]))
        assert "insufficient_capacity" in (error_rpc.details() or "")


async def test_a_card_never_holds_shares_of_both_adapters(
    settings: Settings, which_core: str
) -> None:
    async with claims_stack(settings, which_core) as (stack, core, dra, _inventory):
        await stack.kubelet.allocate(CORE, [ids(stack, CORE)[:40]])
        [plugin_share] = [a for a in (await stack.state()).allocations if a.kind == "share"]
        [card] = plugin_share.gpus
        error = await refused(core.reserve_claim(UID_A, [share(dra[card], 20, 4)]))
        assert error.code == "insufficient_capacity"
        assert plugin_share.id in error.message
        # Another card takes the claim's share.
        other = next(u for u in dra if u != card)
        await core.reserve_claim(UID_A, [share(dra[other], 20, 4)])


async def test_a_device_plugin_share_never_lands_beside_a_claims_share(
    settings: Settings, which_core: str
) -> None:
    async with claims_stack(settings, which_core) as (stack, core, dra, _inventory):
        card = ids(stack, GPU)[3]
        await core.reserve_claim(UID_A, [share(dra[card], 20, 4)])

        async def plugin_share_card(first: int, count: int) -> str:
            before = {a.id for a in (await stack.state()).allocations}
            await stack.kubelet.allocate(CORE, [ids(stack, CORE)[first : first + count]])
            state = await stack.state()
            [placed] = [a for a in state.allocations if a.id not in before]
            assert placed.kind == "share"
            [where] = placed.gpus
            return where

        # Best fit alone would pack the device plugin's share on the claim's card.
        first = await plugin_share_card(0, 40)
        assert first != card
        # After an allocator restart the claim is marked again: a share too big for
        # the first card (60 % free) would best-fit on the claim's (80 % free).
        await stack.stop_allocator()
        await stack.start_allocator()
        await stack.wait_allocator_ready()
        assert await plugin_share_card(40, 70) not in (card, first)


async def test_unknown_and_unhealthy_devices_are_refused(
    settings: Settings, which_core: str
) -> None:
    async with claims_stack(settings, which_core) as (stack, core, dra, inventory):
        error = await refused(core.reserve_claim(UID_A, [whole("gpu-99")]))
        assert error.code == "unknown_device"
        sick = inventory.gpus[6].uuid
        await stack.publish_health(sick, healthy=False)
        await stack.wait_for(
            lambda: (
                stack.allocator is not None and not stack.allocator.core.ledger.device(sick).healthy
            ),
            "the allocator to see the fault",
        )
        error = await refused(core.reserve_claim(UID_A, [whole(dra[sick])]))
        assert error.code == "unhealthy_device"


async def test_claims_survive_an_allocator_restart(settings: Settings, which_core: str) -> None:
    async with claims_stack(settings, which_core) as (stack, core, dra, _inventory):
        gpus = ids(stack, GPU)
        whole_claim = await core.reserve_claim(UID_A, [whole(dra[gpus[0]])])
        share_claim = await core.reserve_claim(UID_B, [share(dra[gpus[1]], 40, 8)])
        before = await stack.state()

        await stack.stop_allocator()
        await stack.start_allocator()
        await stack.wait_allocator_ready()

        after = await stack.state()
        assert after.allocations == before.allocations
        on_disk, _ = read_state(Path(after.checkpoint))  # the snapshot and its journal
        assert sorted(c.uid for c in on_disk.claims) == [UID_A, UID_B]
        # The same claims again get the same reservations; the GPUs stay theirs.
        assert await core.reserve_claim(UID_A, [whole(dra[gpus[0]])]) == whole_claim
        assert await core.reserve_claim(UID_B, [share(dra[gpus[1]], 40, 8)]) == share_claim
        error_rpc = await rpc_error(stack.kubelet.allocate(GPU, [[gpus[0]]]))
        assert UID_A in (error_rpc.details() or "")
        # Unprepare after the restart releases by the UID alone.
        assert await core.release_claim(UID_B) is True
        assert await core.release_claim(UID_B) is False


async def test_a_reply_for_another_claim_is_malformed(settings: Settings) -> None:
    inventory = mock_inventory()
    async with allocator_stack(settings, inventory=inventory, start_allocator=False) as stack:
        # A forged allocator answering for another claim and device.
        async def forged(_request: Delivery[p.ReserveClaimRequest]) -> p.ReserveClaimReply:
            return p.ReserveClaimReply(
                claim_uid=UID_B,
                allocation=UID_B,
                devices=[p.ReservedClaimDevice(device="gpu-7", uuid="GPU-x", minor=7)],
            )

        async with anyio.create_task_group() as tg:
            await tg.start(
                functools.partial(
                    stack.bus.serve,
                    subjects.allocator_endpoint(NODE, p.ENDPOINT_RESERVE_CLAIM),
                    forged,
                    p.RESERVE_CLAIM_REQUEST,
                    p.RESERVE_CLAIM_REPLY,
                )
            )
            error = await refused(core_of(stack).reserve_claim(UID_A, [whole("gpu-0")]))
            assert error.code == "malformed_reply"
            tg.cancel_scope.cancel()


async def test_a_reservation_the_checkpoint_cannot_hold_is_undone_and_refused(
    settings: Settings, which_core: str
) -> None:
    async with claims_stack(settings, which_core) as (stack, core, dra, _inventory):
        gpus = ids(stack, GPU)
        # The checkpoint's directory replaced by a file (as root, a mode would not
        # stop the writes): every write fails.
        directory = Path(settings.state_dir) / "allocator"
        aside = directory.with_name("allocator.aside")
        directory.rename(aside)
        directory.write_text("not a directory")
        error = await refused(core.reserve_claim(UID_A, [whole(dra[gpus[0]])]))
        assert error.code == "checkpoint_failed"
        assert "nothing was allocated" in error.message
        assert not [a for a in (await stack.state()).allocations if a.id == UID_A]

        directory.unlink()
        aside.rename(directory)
        reservation = await core.reserve_claim(UID_A, [whole(dra[gpus[0]])])
        assert [d.uuid for d in reservation.devices] == [gpus[0]]
        on_disk, _ = read_state(Path((await stack.state()).checkpoint))
        assert [c.uid for c in on_disk.claims] == [UID_A]


async def test_the_ledger_records_which_claim_holds_a_gpu(
    settings: Settings, which_core: str
) -> None:
    async with claims_stack(settings, which_core) as (stack, core, dra, _inventory):
        gpu = ids(stack, GPU)[2]
        await core.reserve_claim(UID_A, [whole(dra[gpu])], namespace="team-a", name="train")
        on_disk, _ = read_state(Path((await stack.state()).checkpoint))
        [record] = on_disk.claims
        assert (record.uid, record.namespace, record.name) == (UID_A, "team-a", "train")
        # ... and the device plugin's refusal names it.
        error_rpc = await rpc_error(stack.kubelet.allocate(GPU, [[gpu]]))
        assert f"is allocated whole to claim team-a/train ({UID_A})" in (error_rpc.details() or "")
