"""The DRA claim cache against the real kube-apiserver: a ResourceClaim whose opaque
parameters nest 2,000 deep is accepted by the API server (201), and costs the cache
that one claim -- a bad line, the watch goes on -- and a GET of it is one claim's
failure, never a ``RecursionError`` that stops the plugin.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from gpulet_allocator.kubelet.dra.claim_cache import WatchedClaimReader
from gpulet_allocator.kubelet.dra.claims import KubeClaimReader
from gpulet_allocator.kubelet.dra.contract import ClaimReadError
from gpulet_common.kube import from_kubeconfig
from gpulet_common.kubeapi import KubeClient
from support.control_plane import ControlPlane
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

DRIVER = "gpu.gpulet.io"
DEPTH = 2_000


def deep_claim(name: str) -> bytes:
    """A claim any user who may create claims can send: its parameters nest DEPTH deep."""
    head = json.dumps(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}],
                    "config": [
                        {"opaque": {"driver": DRIVER, "parameters": {"p": "HOLE"}}},
                    ],
                }
            },
        }
    ).encode()
    return head.replace(b'"HOLE"', b"[" * DEPTH + b"]" * DEPTH)


async def test_a_claim_nested_2000_deep_is_skipped_and_the_watch_goes_on(
    kube_api: ControlPlane, kube_namespace: str, tmp_path: Path
) -> None:
    path = f"/apis/resource.k8s.io/v1/namespaces/{kube_namespace}/resourceclaims"
    created = kube_api.request("POST", path, raw=deep_claim("deep-1"))
    assert created.status == 201, created.raw[:300]
    config = await from_kubeconfig(str(kube_api.write_kubeconfig(tmp_path / "admin.kubeconfig")))
    async with KubeClient(config) as api, anyio.create_task_group() as tg:
        reader = WatchedClaimReader(
            api, KubeClaimReader(api, timeout_s=10), driver=DRIVER, pool="node-a"
        )
        await tg.start(reader.run)
        # The claim that existed before the watch (its first list of events)...
        await wait_until(lambda: reader.bad_lines >= 1, timeout_s=30, what="the first claim")
        # ...and one created while it runs: the same watch reads it.
        assert kube_api.request("POST", path, raw=deep_claim("deep-2")).status == 201
        await wait_until(lambda: reader.bad_lines >= 2, timeout_s=30, what="the second claim")
        assert reader.watches == 1
        # Its Prepare reads it by a GET: that claim's error alone.
        with pytest.raises(ClaimReadError):
            await reader.get_claim(kube_namespace, "deep-1", "some-uid")
        tg.cancel_scope.cancel()
