"""The watched claim reader (``dra.claim_cache``): the node's allocated claims from a
watch, a GET on a miss, never an answer a GET would not give.

Against the API emulator with the real client: the cache's hits and the emulator's
request log show whether a claim was read from memory or by a GET.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from gpulet_allocator.kubelet.dra.claim_cache import WatchedClaimReader
from gpulet_allocator.kubelet.dra.claims import KubeClaimReader
from gpulet_common.kube import KubeConfig
from gpulet_common.kubeapi import KubeClient
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import RESOURCE_CLAIMS, add_claim, enable_dra
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

DRIVER = "gpu.gpulet.io"
NODE = "node-a"
GETS = r"/namespaces/default/resourceclaims/"


def claim(
    emu: KubeEmulator, name: str, *, pool: str = NODE, driver: str = DRIVER
) -> dict[str, Any]:
    result = {"request": "gpu", "driver": driver, "pool": pool, "device": "gpu-0"}
    return add_claim(
        emu,
        {
            "metadata": {"name": name, "namespace": "default"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [result]}}},
        },
    )


def uid_of(obj: dict[str, Any]) -> str:
    return str(obj["metadata"]["uid"])


def gets(emu: KubeEmulator) -> int:
    return len(emu.stats.matching("GET", GETS))


@asynccontextmanager
async def watched(emu: KubeEmulator) -> AsyncIterator[WatchedClaimReader]:
    async with (
        KubeClient(KubeConfig(emu.url)) as api,
        anyio.create_task_group() as tg,
    ):
        reader = WatchedClaimReader(
            api, KubeClaimReader(api, timeout_s=5), driver=DRIVER, pool=NODE
        )
        await tg.start(reader.run)
        yield reader
        tg.cancel_scope.cancel()


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running() as emulator:
        enable_dra(emulator)
        yield emulator


async def test_the_nodes_claims_are_read_from_the_watch(emu: KubeEmulator) -> None:
    before = claim(emu, "before")
    claim(emu, "elsewhere", pool="node-b")
    claim(emu, "theirs", driver="gpu.nvidia.com")
    async with watched(emu) as reader:
        # One that existed before the watch, one allocated after it opened.
        await wait_until(lambda: len(reader) == 1, timeout_s=10, what="the first claims")
        after = claim(emu, "after")
        await wait_until(lambda: len(reader) == 2, timeout_s=10, what="the new claim")
        gets_before = gets(emu)
        assert await reader.get_claim("default", "before", uid_of(before)) == before
        assert await reader.get_claim("default", "after", uid_of(after)) == after
        assert (reader.hits, gets(emu)) == (2, gets_before)
        # Claims of another node or driver are not kept: a GET reads them.
        theirs = await reader.get_claim("default", "theirs", "x")
        assert theirs is not None
        assert theirs["metadata"]["name"] == "theirs"
        assert (reader.misses, gets(emu)) == (1, gets_before + 1)


async def test_a_miss_or_another_uid_is_a_get(emu: KubeEmulator) -> None:
    async with watched(emu) as reader:
        await wait_until(lambda: reader.watches == 1, timeout_s=10, what="the watch")
        kept = claim(emu, "kept")
        await wait_until(lambda: len(reader) == 1, timeout_s=10, what="the claim")
        # kubelet names another UID (the claim was deleted and created again): a GET,
        # whose answer the plugin then checks.
        got = await reader.get_claim("default", "kept", "another-uid")
        assert got == kept
        assert (reader.hits, gets(emu)) == (0, 1)
        assert await reader.get_claim("default", "missing", "u") is None
        assert gets(emu) == 2
        # A deleted claim leaves the cache.
        assert emu.delete_object(RESOURCE_CLAIMS, "default/kept")
        await wait_until(lambda: len(reader) == 0, timeout_s=10, what="the deletion")


async def test_hostile_lines_are_counted_and_an_error_event_reopens(emu: KubeEmulator) -> None:
    async with KubeClient(KubeConfig(emu.url)) as api:
        reader = WatchedClaimReader(
            api, KubeClaimReader(api, timeout_s=5), driver=DRIVER, pool=NODE
        )
        for line in (b"not json", b"[]", b'{"type": "ADDED"}', b'{"object": {"metadata": 3}}'):
            reader.on_line(line)
        assert (reader.bad_lines, len(reader)) == (4, 0)
        with pytest.raises(ValueError, match="too old"):
            reader.on_line(b'{"type": "ERROR", "object": {"message": "too old resource version"}}')


def _deep_claim_line(name: str, depth: int) -> bytes:
    """An ADDED event of a claim allocated here whose opaque parameters nest ``depth``
    deep: what any user who can create a ResourceClaim can send (kube-apiserver
    accepts 2,000 levels)."""
    head = (
        b'{"type": "ADDED", "object": {"metadata": {"namespace": "default", "name": "'
        + name.encode()
        + b'", "uid": "u-deep"}, "spec": {"devices": {"config": [{"opaque": '
        b'{"driver": "gpu.gpulet.io", "parameters": {"p": '
    )
    allocated = (
        b'"status": {"allocation": {"devices": {"results": [{"request": "gpu", '
        b'"driver": "gpu.gpulet.io", "pool": "node-a", "device": "gpu-0"}]}}}'
    )
    return head + b"[" * depth + b"]" * depth + b"}}}]}}, " + allocated + b"}}"


@pytest.mark.parametrize("depth", [2_000, 10_000])
async def test_a_claim_nested_deep_is_skipped_and_the_watch_goes_on(
    emu: KubeEmulator, depth: int
) -> None:
    """A deep claim costs only itself: the line is a bad line (not a RecursionError
    that ends the watch and the plugin), the claims before and after it stay cached,
    and its own Prepare reads it by a GET."""
    async with KubeClient(KubeConfig(emu.url)) as api:
        reader = WatchedClaimReader(
            api, KubeClaimReader(api, timeout_s=5), driver=DRIVER, pool=NODE
        )
        good = {
            "type": "ADDED",
            "object": {
                "metadata": {"namespace": "default", "name": "good", "uid": "u1"},
                "status": {
                    "allocation": {"devices": {"results": [{"driver": DRIVER, "pool": NODE}]}}
                },
            },
        }
        reader.on_line(json.dumps(good).encode())
        reader.on_line(_deep_claim_line("deep", depth))
        good["object"]["metadata"]["name"] = "later"  # type: ignore[index]
        reader.on_line(json.dumps(good).encode())
        assert (reader.bad_lines, len(reader)) == (1, 2)
        assert await reader.get_claim("default", "good", "u1") is not None
        # The deep claim is a miss: a GET (the emulator has no such claim: None).
        assert await reader.get_claim("default", "deep", "u-deep") is None
        assert (reader.hits, reader.misses) == (1, 1)
