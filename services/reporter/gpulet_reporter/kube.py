"""Where the reporter writes: which API server, with which credentials, or none.

Order (``reporter.mode = "auto"``):

1. ``offline`` asked for, or the mock NVML backend in ``auto`` mode: no cluster. Mock
   GPUs must never reach a real cluster merely because the laptop running
   ``gpulet run --nvml mock`` has a kubeconfig; ``mode = "cluster"`` overrides this.
2. In-cluster: ``$KUBERNETES_SERVICE_HOST``/``PORT`` plus the service-account token,
   the DaemonSet case. The token file is re-read as it rotates (kubernetes-asyncio's
   refresh hook), so bound service-account tokens keep working.
3. A kubeconfig: ``reporter.kubeconfig``, else ``$KUBECONFIG`` (a path list, merged),
   else ``~/.kube/config``; ``reporter.kube_context`` picks a context.
4. None of these: no-cluster mode, said once at WARNING level with the reason.

A kubeconfig that exists but cannot be used (bad YAML, unknown context) is an
operator's mistake, not an absent cluster: in ``auto`` it is reported as the reason
for going offline, in ``cluster`` mode it is an error the service retries.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from gpulet_common.settings.reporter import ReporterSettings

log = logging.getLogger("gpulet.reporter.kube")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(Exception):
    """A configured cluster that cannot be used."""


@dataclass(frozen=True, slots=True)
class KubeTarget:
    """The outcome of the lookup: a client configuration, or why there is none."""

    configuration: Any | None
    # "in-cluster", "kubeconfig /path (context ctx)" or "" when offline.
    source: str
    server: str
    offline_reason: str = ""

    @property
    def offline(self) -> bool:
        return self.configuration is None


def kubeconfig_path(settings: ReporterSettings, env: Mapping[str, str]) -> str | None:
    """The kubeconfig to read (possibly an os.pathsep-separated list), or None."""
    if settings.kubeconfig:
        return settings.kubeconfig
    from_env = env.get("KUBECONFIG", "")
    if from_env:
        existing = [p for p in from_env.split(os.pathsep) if p and Path(p).expanduser().exists()]
        return os.pathsep.join(existing) if existing else None
    home = env.get("HOME")
    default = Path(home) / ".kube" / "config" if home else Path("~/.kube/config").expanduser()
    return str(default) if default.exists() else None


def _any_file(paths: str) -> bool:
    return any(Path(p).expanduser().is_file() for p in paths.split(os.pathsep) if p)


def in_cluster_available(env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> bool:
    return bool(
        env.get("KUBERNETES_SERVICE_HOST")
        and env.get("KUBERNETES_SERVICE_PORT")
        and (sa_dir / "token").is_file()
    )


def _in_cluster(env: Mapping[str, str], sa_dir: Path) -> Any:
    configuration = k8s_client.Configuration()
    load: Any = k8s_config.load_incluster_config  # untyped in kubernetes-asyncio
    load(
        client_configuration=configuration,
        token_filename=str(sa_dir / "token"),
        cert_filename=str(sa_dir / "ca.crt"),
        environ=dict(env),
    )
    return configuration


async def _from_kubeconfig(path: str, context: str) -> Any:
    configuration = k8s_client.Configuration()
    await k8s_config.load_kube_config(
        config_file=path,
        context=context or None,
        client_configuration=configuration,
        # Never rewrite the user's kubeconfig (token refreshes would).
        persist_config=False,
    )
    return configuration


async def load_target(
    settings: ReporterSettings,
    *,
    nvml_backend: str = "nvml",
    env: Mapping[str, str] | None = None,
    sa_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeTarget:
    """Find the API server to write to; raises :class:`KubeConfigError` only in
    ``cluster`` mode (in ``auto`` every failure becomes an offline reason)."""
    env = os.environ if env is None else env
    if settings.mode == "offline":
        return KubeTarget(None, "", "", "reporter.mode is offline")
    if settings.mode == "auto" and nvml_backend == "mock":
        return KubeTarget(
            None, "", "", "mock NVML backend (set reporter.mode=cluster to write mock GPUs)"
        )
    problems: list[str] = []
    if in_cluster_available(env, sa_dir):
        try:
            configuration = _in_cluster(env, sa_dir)
        except (k8s_config.ConfigException, OSError) as exc:
            problems.append(f"in-cluster config unusable: {exc}")
        else:
            return KubeTarget(configuration, "in-cluster", str(configuration.host))
    path = kubeconfig_path(settings, env)
    if path is not None and not _any_file(path):
        problems.append(f"kubeconfig {path} not found")
    elif path is not None:
        try:
            configuration = await _from_kubeconfig(path, settings.kube_context)
        except (
            k8s_config.ConfigException,
            yaml.YAMLError,
            OSError,
            ValueError,
            KeyError,
            TypeError,
        ) as exc:
            problems.append(f"kubeconfig {path} unusable: {type(exc).__name__}: {exc}")
        else:
            source = f"kubeconfig {path}"
            if settings.kube_context:
                source += f" (context {settings.kube_context})"
            return KubeTarget(configuration, source, str(configuration.host))
    if not problems:
        problems.append("not in a cluster and no kubeconfig found")
    reason = "; ".join(problems)
    if settings.mode == "cluster":
        raise KubeConfigError(reason)
    return KubeTarget(None, "", "", reason)
