"""Remediation in the running allocator service: the ``remediation`` endpoint and
``gpulet health remediate --dry-run`` as an operator runs it (a real nats-server, the
allocator's own NodeView of the ``gpu_health`` bucket, kubelet's PodResources from the
fake kubelet). No API server here: the plan says so, and nothing is evicted; the
evictions themselves are tests/kube/test_remediation_real.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from gpulet_allocator import protocol as p
from gpulet_common.nvml.loader import open_mock
from gpulet_common.remediation import REMEDIATION_PLAN, REMEDIATION_REQUEST, RemediationRequest
from gpulet_common.settings import Settings
from gpulet_common.settings.remediation import RemediationSettings
from support.allocator_stack import NODE, allocator_stack
from support.fake_kubelet import FakeContainer, FakePod
from support.health_kv import gpu_health, put_health

pytestmark = pytest.mark.anyio

GPU = "nvidia.com/gpu"


async def test_the_dry_run_shows_the_pods_of_the_failed_gpu(
    settings: Settings, tmp_path: Path
) -> None:
    adapter = open_mock("nvlink-pairs-8gpu")
    try:
        inventory = adapter.inventory(NODE, 1)
    finally:
        adapter.shutdown()
    u0, u1 = inventory.gpus[0].uuid, inventory.gpus[1].uuid
    settings = msgspec.structs.replace(
        settings,
        remediation=RemediationSettings(mode="evict"),
        allocator=msgspec.structs.replace(
            settings.allocator,
            pod_resources_socket=str(tmp_path / "pr.sock"),
            # No API server: a kubeconfig that is not there.
            handshake=msgspec.structs.replace(
                settings.allocator.handshake, kubeconfig=str(tmp_path / "missing.kubeconfig")
            ),
        ),
    )
    pods = [
        FakePod("train", "ml", [FakeContainer("main", {GPU: [u0]})]),
        FakePod("other", "ml", [FakeContainer("main", {GPU: [u1]})]),
    ]
    async with allocator_stack(
        settings, inventory=inventory, pods=pods, pod_resources=True, start_plugin=False
    ) as stack:
        allocator = stack.allocator
        assert allocator is not None
        xid79 = gpu_health(u0, healthy=False, severity="fatal", action="reboot", index=0)
        await put_health(stack.bus, NODE, xid79)
        await stack.wait_for(lambda: not allocator.view.healthy(u0), "the fault in the view")
        plan = await stack.ask(
            p.ENDPOINT_REMEDIATION, RemediationRequest(), REMEDIATION_REQUEST, REMEDIATION_PLAN
        )
        assert plan.mode == "evict"
        (gpu,) = plan.gpus
        assert (gpu.gpu_uuid, gpu.condition, gpu.mnemonic, gpu.bucket) == (
            u0,
            "xid:79",
            "GPU_HAS_FALLEN_OFF_THE_BUS",
            "RESTART_BM",
        )
        assert [(x.namespace, x.name, x.via, x.state) for x in gpu.pods] == [
            ("ml", "train", ["podresources"], "planned")
        ]
        assert plan.problems == ["no API server: pods found only by the ledger and PodResources"]
        assert not plan.breaker.open
        assert plan.breaker.node_gpus == 8
        assert plan.breaker.limit == 4

        where = ["--nats", settings.nats.url, "--node", NODE]
        result = await anyio.run_process(
            [sys.executable, "-m", "gpulet", "health", "remediate", "--dry-run", *where],
            check=False,
        )
        out = result.stdout.decode()
        assert result.returncode == 0, result.stderr.decode()
        assert "remediation.mode = evict" in out
        assert "circuit breaker: closed" in out
        assert "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS [RESTART_BM]" in out
        assert "pod ml/train (via podresources): planned" in out
        assert "ml/other" not in out
        result = await anyio.run_process(
            [sys.executable, "-m", "gpulet", "health", "remediate", "--json", "--dry-run", *where],
            check=False,
        )
        assert json.loads(result.stdout)["gpus"][0]["pods"][0]["name"] == "train"
        # Without --dry-run it refuses: remediation acts by itself.
        result = await anyio.run_process(
            [sys.executable, "-m", "gpulet", "health", "remediate", *where], check=False
        )
        assert result.returncode == 2
        assert b"--dry-run" in result.stderr
