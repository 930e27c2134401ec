"""One answer to "may this card go whole?" on every path (issue 23, finding 3).

A card holding a fractional share cannot be handed out whole. Kubelet has no "busy"
state, so the whole-GPU resource lists such a card ``Unhealthy`` while it holds a
share (its share resources stay ``Healthy``); ``GetPreferredAllocation`` never offers
it, ``Allocate`` refuses it, and the answer comes from the one function behind them
all (:meth:`~gpulet_allocator.decide.engine.Ledger.refusal`).
"""

from __future__ import annotations

import anyio
import grpc
import pytest

from gpulet_allocator import protocol as p
from gpulet_allocator.decide.engine import Ledger, Owner
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_common.refusal import Refused
from gpulet_common.settings import Settings
from support import reference
from support.allocator_stack import CORE, GPU, MEM, allocator_stack, ids, rpc_error

pytestmark = pytest.mark.anyio


def whole_health(devices: list[dp.Device]) -> dict[str, str]:
    return {d.ID: d.health for d in devices}


async def test_a_shared_card_is_not_offered_whole_anywhere(settings: Settings) -> None:
    inventory = reference.nvlink_pairs_8()
    async with allocator_stack(settings, inventory=inventory) as stack:
        everything = ids(stack, GPU)
        assert len(everything) == 8
        cores = [d.ID for d in stack.kubelet.devices(CORE)][:30]
        memory = [d.ID for d in stack.kubelet.devices(MEM)][:8]
        answer = await stack.kubelet.allocate(CORE, [cores])
        await stack.kubelet.allocate(MEM, [memory])
        [shared] = answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"].split(",")

        # ListAndWatch: the whole-GPU device of the shared card goes Unhealthy (kubelet
        # stops counting it as allocatable); its share devices stay Healthy.
        await stack.kubelet.wait_devices(
            GPU, lambda d: whole_health(d).get(shared) == "Unhealthy", timeout_s=5
        )
        health = whole_health(stack.kubelet.devices(GPU))
        assert [u for u, h in health.items() if h != "Healthy"] == [shared]
        assert all(d.health == "Healthy" for d in stack.kubelet.devices(CORE))

        # GetPreferredAllocation of 8 out of 8 (kubelet's view lagging behind): refused
        # with the reason, never an answer that Allocate then refuses.
        error = await rpc_error(stack.kubelet.preferred(GPU, [(everything, [], 8)]))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert shared in (error.details() or "")
        assert "share" in (error.details() or "")
        # Fewer: never the shared card.
        [seven] = await stack.kubelet.preferred(GPU, [(everything, [], 7)])
        assert shared not in seven
        # Allocate refuses it for the same reason.
        error = await rpc_error(stack.kubelet.allocate(GPU, [[shared]]))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "share" in (error.details() or "")

        # The share released: the card may go whole again, and kubelet is told so.
        state = await stack.state()
        [allocation] = state.allocations
        await stack.ask(
            p.ENDPOINT_RELEASE,
            p.ReleaseRequest(allocation_ids=[allocation.id]),
            p.RELEASE_REQUEST,
            p.RELEASE_REPLY,
        )
        await stack.kubelet.wait_devices(
            GPU, lambda d: all(h == "Healthy" for h in whole_health(d).values()), timeout_s=5
        )
        [eight] = await stack.kubelet.preferred(GPU, [(everything, [], 8)])
        assert sorted(eight) == sorted(everything)


def test_the_ledger_gives_one_answer_for_every_path() -> None:
    ledger = Ledger(reference.pix_phb_7())
    u = list(ledger.topology.uuids)
    ledger.allocate_share(Owner(allocation_id="s"), 30, 4, device=u[0])
    ledger.allocate_whole(Owner(allocation_id="w"), devices=[u[1]])
    ledger.set_health(u[2], False)
    refusals = {x: ledger.refusal(x, whole=True) for x in u}
    assert {x for x, r in refusals.items() if r is not None} == {u[0], u[1], u[2]}
    assert ledger.free_whole() == [x for x in u if refusals[x] is None]
    for x in (u[0], u[1], u[2]):
        with pytest.raises(Refused) as err:
            ledger.allocate_whole(Owner(allocation_id=f"again-{x}"), devices=[x])
        expected = refusals[x]
        assert expected is not None
        assert (err.value.code, err.value.message) == (expected.code, expected.message)
    # The preference never names a card that cannot go whole; too few is a refusal.
    assert set(ledger.preferred(u, [], 4)) == set(u[3:])
    with pytest.raises(Refused) as err:
        ledger.preferred(u, [], 5)
    assert err.value.code == "insufficient_capacity"
    with pytest.raises(Refused) as err:
        ledger.preferred(u, [u[0]], 1)
    assert err.value.code == "insufficient_capacity"
    # A share may still go where shares are.
    assert ledger.refusal(u[0], whole=False) is None
    assert ledger.refusal(u[1], whole=False) is not None


async def test_withheld_long_polls_are_bounded(settings: Settings) -> None:
    """A flood of long polls does not pile up: past MAX_WAITING they are answered now."""
    from gpulet_allocator.service.withheld import MAX_WAITING

    async with allocator_stack(
        settings, inventory=reference.nvlink_pairs_8(), start_plugin=False
    ) as stack:
        first = await stack.ask(
            p.ENDPOINT_WITHHELD, p.WithheldRequest(), p.WITHHELD_REQUEST, p.WITHHELD_REPLY
        )
        assert first.withheld == {}
        wait = p.WithheldRequest(epoch=first.epoch, version=first.version, wait_s=30)
        answered = 0

        async def poll() -> None:
            nonlocal answered
            await stack.ask(p.ENDPOINT_WITHHELD, wait, p.WITHHELD_REQUEST, p.WITHHELD_REPLY)
            answered += 1

        with anyio.move_on_after(1.5):
            async with anyio.create_task_group() as tg:
                for _ in range(MAX_WAITING + 6):
                    tg.start_soon(poll)
        assert answered == 6
