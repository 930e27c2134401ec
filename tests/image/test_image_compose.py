"""docker-compose.yml under podman-compose (Debian's package), without k3s.

Opt-in like every image test (``IMAGE_TESTS=1``). The compose file runs as
shipped but for what this machine class cannot give it, changed by
:func:`compose_for_podman`:

* no k3s, and so none of what needs it: ``k3s`` and ``k3s-setup`` (their image is on
  no registry reachable here), the ``reporter`` (its kubeconfig comes from
  ``k3s-setup``) and the ``device-plugin`` (it registers with k3s's kubelet);
* the images: ``make image``'s, through the file's own variables ``GPULET_IMAGE`` and
  ``GPULET_NATS_IMAGE`` (``nats:2.14-alpine`` is on no reachable registry);
* no ports published on the host: 4222 and 5678 may be taken on a shared machine;
* the bind mounts of ``./deploy/...`` by absolute path (the file is written elsewhere).

Then: every service runs (read-only root filesystem, no capabilities, uid 65532);
samples flow from the collector to the ``samples`` container through NATS with the
per-service users; ``podman-compose run --rm tools gpulet mock inject --gpu 2 --xid 79``
is applied, and ``gpulet alerts`` prints the XID 79 event of GPU 2 from the stream.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.deploy import COMPOSE_FILE, ROOT
from support.podman import IMAGE, NATS_IMAGE, Podman, local, missing_tool

WITHOUT_K3S = ("k3s", "k3s-setup", "reporter", "device-plugin")
STARTED = ("nats", "collector", "health", "allocator", "alerts", "samples")
TIMEOUT_S = 120.0


def compose_for_podman(compose: dict[str, Any]) -> dict[str, Any]:
    """The compose file as podman-compose runs it here (see the module's docstring)."""
    out = copy.deepcopy(compose)
    services: dict[str, Any] = out["services"]
    for name in WITHOUT_K3S:
        del services[name]
    for service in services.values():
        service.pop("ports", None)
        service["volumes"] = [
            f"{ROOT / v[2:].partition(':')[0]}:{v.partition(':')[2]}" if v.startswith("./") else v
            for v in service.get("volumes", [])
        ]
    return out


class Compose:
    def __init__(self, podman: Podman, file: Path, project: str) -> None:
        self.podman, self.file, self.project = podman, file, project
        self.env = {
            **podman.env,
            "GPULET_IMAGE": local(IMAGE),
            "GPULET_NATS_IMAGE": local(NATS_IMAGE),
        }

    def __call__(self, *args: str, timeout: float = 300) -> str:
        result = subprocess.run(
            ["podman-compose", "-f", str(self.file), "-p", self.project, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            check=False,
        )
        assert result.returncode == 0, (
            f"podman-compose {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        )
        return result.stdout

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"


@pytest.fixture(scope="module")
def compose(
    podman: Podman, images: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Compose]:
    if problem := missing_tool("podman-compose"):
        pytest.fail(problem)
    file = tmp_path_factory.mktemp("compose") / "docker-compose.yml"
    shipped = yaml.safe_load(COMPOSE_FILE.read_text())
    file.write_text(yaml.safe_dump(compose_for_podman(shipped)))
    runner = Compose(podman, file, f"gpulet-compose-test-{os.getpid()}")
    try:
        runner("up", "-d", *STARTED)
        yield runner
    finally:
        try:
            runner("down", "-v", timeout=300)
        finally:
            podman.run("network", "rm", "--force", f"{runner.project}_default")


def _wait_for_line(compose: Compose, service: str, wanted: str) -> dict[str, Any]:
    """The first JSON line of ``service``'s log that contains ``wanted``."""
    deadline = time.monotonic() + TIMEOUT_S
    log = ""
    while time.monotonic() < deadline:
        result = compose.podman.run("logs", compose.container(service), timeout=30)
        log = result.stdout + result.stderr
        for line in log.splitlines():
            if wanted in line and line.startswith("{"):
                found: dict[str, Any] = json.loads(line)
                return found
        time.sleep(0.5)
    raise AssertionError(f"no {wanted!r} in {service}'s log after {TIMEOUT_S} s:\n{log[-3000:]}")


def test_the_services_run_with_compose_privileges(compose: Compose) -> None:
    # Samples reach the `samples` container: nats, the collector and their users work.
    line = _wait_for_line(compose, "samples", '"gpu.samples.gpu-node-1"')
    assert len(line["data"]["samples"]) == 8
    for service in STARTED:
        state = compose.podman.inspect(compose.container(service))
        assert state["State"]["Status"] == "running", (
            service,
            compose.podman.logs(compose.container(service)),
        )
        assert state["HostConfig"]["ReadonlyRootfs"] is True, service
        status = Path(f"/proc/{state['State']['Pid']}/status").read_text()
        assert "\nCapEff:\t0000000000000000\n" in status, service
        assert "\nUid:\t65532\t65532\t65532\t65532\n" in status, service


def test_mock_inject_through_the_tools_service_reaches_gpulet_alerts(compose: Compose) -> None:
    _wait_for_line(compose, "samples", '"gpu.samples.gpu-node-1"')
    out = compose("run", "--rm", "tools", "gpulet", "mock", "inject", "--gpu", "2", "--xid", "79")
    reply = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
    assert reply["applied"] is True, reply
    event = _wait_for_line(compose, "alerts", '"xid":79')
    assert (event["gpu_index"], event["healthy"], event["node"]) == (2, False, "gpu-node-1")
