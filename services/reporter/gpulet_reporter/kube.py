"""Where the reporter writes: which API server, with which credentials, or none.

Order (``reporter.mode = "auto"``):

1. ``offline`` asked for, or the mock NVML backend in ``auto`` mode: no cluster. Mock
   GPUs must never reach a real cluster merely because the laptop running
   ``gpulet run --nvml mock`` has a kubeconfig; ``mode = "cluster"`` overrides this.
2. In-cluster: ``$KUBERNETES_SERVICE_HOST``/``PORT`` plus the service-account token,
   the DaemonSet case. The token file is re-read as it rotates (every minute), so
   bound service-account tokens keep working.
3. A kubeconfig: ``reporter.kubeconfig``, else ``$KUBECONFIG`` (a path list, merged),
   else ``~/.kube/config``; ``reporter.kube_context`` picks a context.
4. None of these: no-cluster mode, said once at WARNING level with the reason.

A kubeconfig that exists but cannot be used (bad YAML, unknown context) is an
operator's mistake, not an absent cluster: in ``auto`` it is reported as the reason
for going offline, in ``cluster`` mode it is an error the service retries.

The lookup of each source is :mod:`gpulet_common.kube`, shared with the allocator;
this module adds the reporter's order and its offline rules.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpulet_common.kube import (
    SERVICE_ACCOUNT_DIR,
    KubeConfig,
    KubeConfigError,
    from_kubeconfig,
    in_cluster,
    in_cluster_available,
    kubeconfig_path,
)
from gpulet_common.settings.reporter import ReporterSettings

__all__ = ["SERVICE_ACCOUNT_DIR", "KubeConfigError", "KubeTarget", "load_target"]

log = logging.getLogger("gpulet.reporter.kube")


@dataclass(frozen=True, slots=True)
class KubeTarget:
    """The outcome of the lookup: a client configuration, or why there is none."""

    configuration: KubeConfig | None
    # "in-cluster", "kubeconfig /path (context ctx)" or "" when offline.
    source: str
    server: str
    offline_reason: str = ""

    @property
    def offline(self) -> bool:
        return self.configuration is None


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
            configuration = in_cluster(env, sa_dir)
        except KubeConfigError as exc:
            problems.append(str(exc))
        else:
            return KubeTarget(configuration, "in-cluster", str(configuration.host))
    path = kubeconfig_path(settings.kubeconfig, env)
    if path is not None:
        try:
            configuration = await from_kubeconfig(path, settings.kube_context)
        except KubeConfigError as exc:
            problems.append(str(exc))
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
