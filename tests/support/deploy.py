"""Shared helpers of the deploy tests: where the shipped files are, and NATS users."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NATS_DIR = DEPLOY / "nats"
KUSTOMIZE = DEPLOY / "kustomize"
PROMETHEUS_DIR = DEPLOY / "prometheus"
COMPOSE_FILE = ROOT / "docker-compose.yml"
# The oldest Kubernetes gpulet supports (docs/deploy.md, "Prerequisites": a pod's
# ServiceAccount token carries its node's name, which the node restriction policy
# checks); the manifests are validated against its schemas and the newest known.
MIN_KUBERNETES = "1.32.0"

# Every user of deploy/nats/auth.conf, with the service it belongs to.
NATS_USERS = ("collector", "health", "reporter", "allocator", "device-plugin", "alerts", "operator")


def inbox_prefix(user: str) -> str:
    """``user``'s reply inbox prefix (nats.inbox_prefix): the only inboxes it may read."""
    return f"_INBOX.{user}"


def password_variable(user: str) -> str:
    """The environment variable that holds ``user``'s password in auth.conf."""
    return "GPULET_NATS_" + user.upper().replace("-", "_") + "_PASSWORD"


def password_for(user: str) -> str:
    return f"pw-{user}-for-tests"


def set_passwords(monkeypatch: pytest.MonkeyPatch, users: tuple[str, ...] = NATS_USERS) -> None:
    # nats-server reads the passwords from its environment, which it inherits from us.
    for user in users:
        monkeypatch.setenv(password_variable(user), password_for(user))


def node_config(tmp_path: Path, *, mock: bool) -> Path:
    """node.conf next to the auth.conf a deployment would mount beside it.

    docker-compose and the mock overlay mount mock/auth.conf as auth.conf; the
    production DaemonSet mounts auth.conf itself. A copy in ``tmp_path`` does the same.
    """
    conf_dir = tmp_path / "nats-conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(NATS_DIR / "node.conf", conf_dir / "node.conf")
    shutil.copy(NATS_DIR / "leaf.conf", conf_dir / "leaf.conf")
    auth = NATS_DIR / "mock" / "auth.conf" if mock else NATS_DIR / "auth.conf"
    shutil.copy(auth, conf_dir / "auth.conf")
    return conf_dir / "node.conf"


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """Every object ``kubectl kustomize directory`` renders (skips without kubectl)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: the kustomize builds need `kubectl kustomize`")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


NO_PROMETHEUS = (
    "needs the Debian package `prometheus` (promtool and prometheus); "
    ".ci/run installs it: apt-get install -y prometheus"
)


def prometheus_tool(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``; skips the test with the install hint."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found: {NO_PROMETHEUS}")
    return path


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s; nothing if it already exited."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def start_prometheus(
    directory: Path, metrics_port: int, web_port: int, *, rule_files: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """A real Prometheus on 127.0.0.1:``web_port`` scraping gpulet every second.

    Its config, TSDB and log live in ``directory``; ``rule_files`` are names of files
    already there. Returns the process (stop it with :func:`stop_process`) and its log.
    """
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "gpulet",
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
            }
        ],
    }
    if rule_files:
        config["rule_files"] = rule_files
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = directory / "prometheus.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [
                prometheus_tool("prometheus"),
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{web_port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return server, log
