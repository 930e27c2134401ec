"""Each sidecar imports only what its service uses.

The DaemonSet runs one ``gpulet serve <service>`` process per service, and every module
a process imports is resident for its whole life: kubernetes-asyncio alone is ~40 MB,
aiohttp ~25 MB, grpc ~8 MB, NVML's bindings and the mock ~3 MB. The reporter and the
allocator talk to the API server and carry the Kubernetes client; the collector, the
health service and the device plugin never do. The collector's pod
labels once took grpc into it (it asked kubelet's PodResources itself); it now asks the
allocator, the node's one reader of PodResources. Each case runs the real
CLI dispatch (``gpulet.cli.main``) in a fresh interpreter, with the arguments the
DaemonSet gives that container (``--nvml mock`` only to the two that read GPUs, as the
mock overlay does), up to the point where the services would start (``anyio.run`` is
replaced), then lists what was imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Never in any sidecar: the other commands' code, the fleet's hub side, optional extras.
EVERY = {
    "gpulet.tools",
    "gpulet.fleet",
    "gpulet_common.fleet",
    "gpulet_alerting",
    "opentelemetry.exporter.otlp",
    "nkeys",
    "jsonschema",
}
# The Kubernetes client (kubernetes-asyncio, with aiohttp and PyYAML under it): only in
# the processes that talk to the API server.
KUBERNETES = {
    "gpulet_common.kube",
    "gpulet_common.kubeapi",
    "kubernetes_asyncio",
    "aiohttp",
    "yaml",
}
# kubernetes-asyncio's generated models and API classes (~36 MB), which gpulet never
# uses: kept out of the processes that do import the client (gpulet_common.kube_lazy).
K8S_MODELS = {"kubernetes_asyncio.client.models.v1_pod", "kubernetes_asyncio.client.api"}
GRPC = {"grpc", "google.protobuf"}
NVML = {"pynvml", "gpulet_common.nvml.adapter", "gpulet_common.mock_nvml"}
SERVICES = {"gpulet_collector", "gpulet_health", "gpulet_reporter", "gpulet_allocator"}

# service -> what its process must not import
FORBIDDEN: dict[str, set[str]] = {
    # The collector's pod labels come from the allocator's `pods` endpoint: no gRPC.
    "collector": EVERY | KUBERNETES | GRPC | (SERVICES - {"gpulet_collector"}),
    "health": EVERY | KUBERNETES | GRPC | (SERVICES - {"gpulet_health"}),
    "reporter": EVERY | GRPC | NVML | K8S_MODELS | (SERVICES - {"gpulet_reporter"}),
    "allocator": EVERY | NVML | K8S_MODELS | (SERVICES - {"gpulet_allocator"}),
    "device-plugin": EVERY | KUBERNETES | NVML | (SERVICES - {"gpulet_allocator"}),
}
# What must be there (the probe sees imports, and the service really uses these).
REQUIRED: dict[str, set[str]] = {
    "collector": {"pynvml"},
    "health": {"pynvml"},
    "reporter": {"gpulet_common.kubeapi", "kubernetes_asyncio"},
    "allocator": {"gpulet_common.kubeapi", "kubernetes_asyncio", "grpc"},
    "device-plugin": {"grpc"},
}
READS_GPUS = {"collector", "health"}

PROBE = """
import json, sys
import anyio
from gpulet import cli

anyio.run = lambda *args, **kwargs: None  # stop where the services would start
try:
    cli.main(sys.argv[2:])
except SystemExit as exit:
    assert not exit.code, exit.code
watched = json.loads(sys.argv[1])
print(json.dumps(sorted(m for m in watched if sys.modules.get(m) is not None)))
"""


@pytest.mark.parametrize("service", sorted(FORBIDDEN))
def test_a_sidecar_imports_only_what_its_service_uses(service: str, tmp_path: Path) -> None:
    own = "gpulet_allocator" if service == "device-plugin" else f"gpulet_{service}"
    watched = sorted(FORBIDDEN[service] | REQUIRED[service] | {own})
    argv = ["serve", service, "--state-dir", str(tmp_path)]
    argv += ["--nvml", "mock"] if service in READS_GPUS else []
    argv += ["--nats", "nats://127.0.0.1:1", "--metrics-port", "0"]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(watched), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    imported = set(json.loads(result.stdout))
    assert imported & FORBIDDEN[service] == set()
    assert imported >= REQUIRED[service] | {own}  # the probe does see imports


def test_a_websocket_nats_url_keeps_aiohttp(tmp_path: Path) -> None:
    # nats-py needs aiohttp for ws:// and wss://: then it is not kept out.
    argv = ["serve", "collector", "--nvml", "mock", "--state-dir", str(tmp_path)]
    argv += ["--nats", "ws://127.0.0.1:1", "--metrics-port", "0"]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(["aiohttp"]), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["aiohttp"]
