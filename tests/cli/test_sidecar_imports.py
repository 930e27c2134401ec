"""Each sidecar imports only what its service uses.

The DaemonSet runs one ``gpulet serve <service>`` process per service, and every module
a process imports is resident for its whole life: the Kubernetes client alone is
~60 MB, aiohttp ~11 MB, grpc ~20 MB. Each case runs the real CLI dispatch
(``gpulet.cli.main``) in a fresh interpreter up to the point where the services would
start (``anyio.run`` is replaced), then lists what was imported.
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
}
KUBERNETES = {"kubernetes_asyncio", "aiohttp", "yaml", "jsonschema", "gpulet_common.kube"}
GRPC = {"grpc", "google.protobuf"}
SERVICES = {"gpulet_collector", "gpulet_health", "gpulet_reporter", "gpulet_allocator"}

# service -> what its process must not import
FORBIDDEN: dict[str, set[str]] = {
    "collector": EVERY | KUBERNETES | (SERVICES - {"gpulet_collector"}),
    "health": EVERY | KUBERNETES | GRPC | (SERVICES - {"gpulet_health"}),
    "reporter": EVERY | GRPC | (SERVICES - {"gpulet_reporter"}),
    "allocator": EVERY | (SERVICES - {"gpulet_allocator"}),
    "device-plugin": EVERY | KUBERNETES | (SERVICES - {"gpulet_allocator"}),
}

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
    watched = sorted(FORBIDDEN[service] | {own})
    argv = ["serve", service, "--nvml", "mock", "--state-dir", str(tmp_path)]
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
    assert own in imported  # the probe sees imports: the service's own package is there


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
