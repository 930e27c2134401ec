"""A corrupt allocation checkpoint fails closed (issue 12, "Checkpoints fail closed").

* the corrupt file is kept under a unique name, never overwritten by a later one;
* kubelet's PodResources rebuilds the record when it can, and those GPUs are not handed
  out again;
* otherwise Allocate is refused (``checkpoint_lost``, saying why and what ends it),
  ``/readyz`` says not ready and why, and ``gpulet allocator reset --confirm`` (over
  NATS, as the deploy's operator may) accepts the loss.

Real nats-server, the real allocator and device plugin, the fake kubelet (device plugin
and PodResources gRPC), the real ``/readyz`` HTTP endpoint and the real ``gpulet`` CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import grpc
import msgspec
import pytest

from gpulet_allocator import protocol as p
from gpulet_allocator.cli import format_state
from gpulet_allocator.service import checkpoint_path
from gpulet_allocator.state.checkpoint import CheckpointFile, read_state
from gpulet_common.bus import Refused
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.settings import Settings
from gpulet_common.statefile import CORRUPT_SUFFIX
from gpulet_common.telemetry import serve_http
from support import reference
from support.allocator_stack import (
    CORE,
    GPU,
    MEM,
    Stack,
    allocator_stack,
    dev_root_with,
    eventually,
    make_settings,
)
from support.fake_kubelet import FakeContainer, FakePod

pytestmark = pytest.mark.anyio

CORRUPT = b'{"version": 1, "allocations": [{"type": "what'


def settings_for(
    nats: EmbeddedNats, tmp_path: Path, plugin_dir: Path, *, pod_resources: bool = True
) -> Settings:
    return make_settings(
        nats.url,
        tmp_path / "state",
        plugin_dir,
        dev_root_with(tmp_path / "dev", 8),
        pod_resources_socket=plugin_dir / "pod-resources.sock" if pod_resources else None,
    )


def corrupt_checkpoint(settings: Settings, content: bytes = CORRUPT) -> Path:
    path = checkpoint_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def copies(path: Path) -> dict[str, bytes]:
    return {c.name: c.read_bytes() for c in path.parent.glob(f"{path.name}{CORRUPT_SUFFIX}-*")}


async def readyz(port: int) -> tuple[int, dict[str, Any]]:
    def get() -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    return await anyio.to_thread.run_sync(get)


def stored(settings: Settings) -> dict[str, Any]:
    # The state on disk: the snapshot and its journal.
    data: dict[str, Any] = msgspec.to_builtins(read_state(checkpoint_path(settings))[0])
    return data


async def allocate_refusal(stack: Stack, ids: list[str]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stack.kubelet.allocate(GPU, [ids])
    return refused.value.details() or ""


# --- the file ---------------------------------------------------------------------------


def test_each_corrupt_checkpoint_is_kept_under_its_own_name(tmp_path: Path) -> None:
    path = tmp_path / "allocator" / "allocations.json"
    path.parent.mkdir()
    store = CheckpointFile(path)
    first, second = CORRUPT, b"\x00\x01 not json at all"

    path.write_bytes(first)
    loaded = store.load()
    assert loaded.status == "corrupt"
    assert loaded.corrupt_copy is not None
    assert loaded.corrupt_copy.read_bytes() == first
    assert loaded.state.lost
    assert loaded.corrupt_copy.name in loaded.state.lost
    # The file itself now says the record is lost: a restart does not forget it, and
    # reading it again makes no new copy.
    again = store.load()
    assert again.status == "lost"
    assert again.state.lost == loaded.state.lost
    assert list(copies(path).values()) == [first]

    # A second corruption (within the same second, the worst case for names).
    path.write_bytes(second)
    later = store.load()
    assert later.status == "corrupt"
    assert later.corrupt_copy not in (None, loaded.corrupt_copy)
    kept = copies(path)
    assert sorted(kept.values()) == sorted([first, second]), kept
    assert loaded.corrupt_copy.read_bytes() == first  # not overwritten

    # Hostile nesting (refused before msgspec would raise RecursionError) is one more
    # corrupt file.
    third = b'{"version": 1, "allocations": ' + b"[" * 20000 + b"]" * 20000 + b"}"
    path.write_bytes(third)
    deep = store.load()
    assert deep.status == "corrupt"
    assert "nesting deeper" in deep.detail
    assert sorted(copies(path).values()) == sorted([first, second, third])


# --- the service ------------------------------------------------------------------------


async def test_pod_resources_rebuilds_a_corrupt_record_and_its_gpus_stay_taken(
    nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path
) -> None:
    settings = settings_for(nats_server, tmp_path, plugin_dir)
    inventory = reference.nvlink_pairs_8()
    uuids = [g.uuid for g in inventory.gpus]
    path = corrupt_checkpoint(settings)
    # Pods that kubelet says hold GPUs, allocated before the checkpoint was lost.
    pods = [
        FakePod("trainer", containers=[FakeContainer("main", {GPU: uuids[:2]})]),
        FakePod("eval", "ml", [FakeContainer("worker", {GPU: [uuids[5]]})]),
    ]
    async with allocator_stack(
        settings, inventory=inventory, pod_resources=True, pods=pods
    ) as stack:
        assert stack.allocator is not None
        assert len(copies(path)) == 1
        started = anyio.current_time()

        async def rebuilt() -> bool:
            return (await stack.state()).ready

        await eventually(rebuilt, "the record to be rebuilt from PodResources")
        print(
            f"FIGURES lost record rebuilt from PodResources {anyio.current_time() - started:.2f} s "
            f"after start (release_grace_s {settings.allocator.release_grace_s:g} s, "
            f"release_interval_s {settings.allocator.release_interval_s:g} s)"
        )
        state = await stack.state()
        assert state.lost == ""
        held = {
            a.id: (set(a.gpus), {f"{g.pod}/{g.container}" for g in a.grants})
            for a in state.allocations
        }
        assert sorted(held.values(), key=lambda v: sorted(v[0])) == sorted(
            [
                ({uuids[0], uuids[1]}, {"default/trainer/main"}),
                ({uuids[5]}, {"ml/eval/worker"}),
            ],
            key=lambda v: sorted(v[0]),
        )
        # The marker is gone from the file: the rebuilt record is the record.
        assert stored(settings)["lost"] == ""
        assert len(stored(settings)["allocations"]) == 2
        assert stack.status.get("allocator").state == "ready"  # type: ignore[union-attr]

        # Those GPUs are not handed out again; the others are.
        # (Other device sets than the pods' own: the same set is a retry of that
        # container's Allocate, which gets its recorded answer.)
        for taken in ([uuids[1]], [uuids[5], uuids[6]]):
            details = await allocate_refusal(stack, taken)
            assert "insufficient_capacity" in details
            assert "is allocated whole" in details
        answer = await stack.kubelet.allocate(GPU, [[uuids[2]]])
        assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == uuids[2]
        # A kubelet retry of the trainer's Allocate gets the same allocation back.
        retry = await stack.kubelet.allocate(GPU, [uuids[:2]])
        ids = {a.id for a in state.allocations}
        assert retry.container_responses[0].annotations["gpulet.io/allocation"] in ids


async def test_without_pod_resources_allocate_is_refused_until_reset_confirm(
    nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path
) -> None:
    settings = settings_for(nats_server, tmp_path, plugin_dir, pod_resources=False)
    inventory = reference.nvlink_pairs_8()
    uuids = [g.uuid for g in inventory.gpus]
    path = corrupt_checkpoint(settings)
    async with (
        allocator_stack(settings, inventory=inventory) as stack,
        anyio.create_task_group() as tg,
    ):
        port = await tg.start(serve_http, "127.0.0.1", 0, stack.status)

        # Refused, precisely: why, and what ends it.
        details = await allocate_refusal(stack, [uuids[0]])
        assert "checkpoint_lost" in details
        assert str(path) in details
        assert "was corrupt" in details
        assert "PodResources" in details
        assert "does not exist" in details
        assert f"gpulet allocator reset --confirm --node {stack.node}" in details
        batch = await stack.ask(
            p.ENDPOINT_ALLOCATE_BATCH,
            p.AllocateBatchRequest(
                calls=[p.AllocateRequest(resource=GPU, containers=[[uuids[1]]])]
            ),
            p.ALLOCATE_BATCH_REQUEST,
            p.ALLOCATE_BATCH_REPLY,
        )
        [outcome] = batch.outcomes
        assert outcome.error is not None
        assert outcome.error.code == "checkpoint_lost"

        # /readyz: not ready, and why.
        code, body = await readyz(port)
        assert code == 503
        assert body["ready"] is False
        component = body["components"]["allocator"]
        assert component["state"] == "blocked"
        assert "was corrupt" in component["detail"]
        assert "reset --confirm" in component["detail"]
        state = await stack.state()
        assert not state.ready
        assert "was corrupt" in state.lost
        assert "NOT READY (the record of this node's allocations is lost:" in format_state(state)

        # A restart does not forget the loss (the marker is on disk).
        await stack.stop_allocator()
        await stack.start_allocator()
        assert "checkpoint_lost" in await allocate_refusal(stack, [uuids[0]])
        assert len(copies(path)) == 1

        # The operator's command: without --confirm it is one line and exit 2.
        unconfirmed = await gpulet_cli(stack, "allocator", "reset")
        assert unconfirmed.returncode == 2, unconfirmed
        assert len(unconfirmed.stderr.decode().strip().splitlines()) == 1
        assert "--confirm" in unconfirmed.stderr.decode()
        assert "checkpoint_lost" in await allocate_refusal(stack, [uuids[0]])

        confirmed = await gpulet_cli(
            stack, "allocator", "reset", "--confirm", "--requested-by", "alice"
        )
        assert confirmed.returncode == 0, confirmed
        assert "alice accepted the loss" in confirmed.stdout.decode()

        answer = await stack.kubelet.allocate(GPU, [[uuids[0]]])
        assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == uuids[0]
        code, body = await readyz(port)
        assert code == 200, body
        assert body["components"]["allocator"]["state"] == "ready"
        assert stored(settings)["lost"] == ""
        assert len(stored(settings)["allocations"]) == 1

        again = await gpulet_cli(stack, "allocator", "reset", "--confirm", "--json")
        assert again.returncode == 0, again
        reply = json.loads(again.stdout)
        assert reply["accepted"] is False
        assert "nothing to reset" in reply["detail"]
        tg.cancel_scope.cancel()


async def test_shares_block_the_rebuild_and_reset_keeps_what_was_rebuilt(
    nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path
) -> None:
    settings = settings_for(nats_server, tmp_path, plugin_dir)
    inventory = reference.nvlink_pairs_8()
    uuids = [g.uuid for g in inventory.gpus]
    corrupt_checkpoint(settings)
    cores = [f"{uuids[7]}::core-{n}" for n in range(30)]
    memory = [f"{uuids[7]}::mem-{n}" for n in range(4)]
    pods = [
        FakePod("trainer", containers=[FakeContainer("main", {GPU: uuids[:2]})]),
        FakePod("notebook", "lab", [FakeContainer("jupyter", {CORE: cores, MEM: memory})]),
    ]
    async with allocator_stack(
        settings, inventory=inventory, pod_resources=True, pods=pods
    ) as stack:
        assert stack.allocator is not None

        async def adopted() -> bool:
            return len((await stack.state()).allocations) == 1

        await eventually(adopted, "the whole-GPU pod to be adopted")
        # Well past release_grace_s: a share's card is unknown, so it stays refused.
        await anyio.sleep(3 * settings.allocator.release_grace_s)
        details = await allocate_refusal(stack, [uuids[3]])
        assert "checkpoint_lost" in details
        assert "lab/notebook/jupyter" in details
        assert "shares" in details

        reply = await stack.ask(
            p.ENDPOINT_RESET,
            p.ResetRequest(confirm=True, requested_by="test"),
            p.RESET_REQUEST,
            p.RESET_REPLY,
        )
        assert reply.accepted
        assert [set(a.gpus) for a in reply.allocations] == [{uuids[0], uuids[1]}]
        assert "insufficient_capacity" in await allocate_refusal(stack, [uuids[0]])
        await stack.kubelet.allocate(GPU, [[uuids[3]]])


async def test_reset_needs_confirm_over_nats_too(
    nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path
) -> None:
    settings = settings_for(nats_server, tmp_path, plugin_dir, pod_resources=False)
    corrupt_checkpoint(settings)
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        with pytest.raises(Refused) as refused:
            await stack.ask(p.ENDPOINT_RESET, p.ResetRequest(), p.RESET_REQUEST, p.RESET_REPLY)
        assert refused.value.code == "invalid_request"
        assert not (await stack.state()).ready


async def gpulet_cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULET_")}
    command = [
        sys.executable,
        "-m",
        "gpulet",
        *args,
        "--node",
        stack.node,
        "--nats",
        stack.settings.nats.url,
    ]
    with anyio.fail_after(30):
        return await anyio.run_process(command, env=env, check=False)
