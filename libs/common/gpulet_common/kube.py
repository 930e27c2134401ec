"""Where the Kubernetes API server is: the pod's service account, or a kubeconfig.

One lookup for every service that talks to the API server (the reporter writes the
Device CR, node labels and condition; the allocator watches its node's pods under the
Koordinator profile). Each service decides what an absent cluster means to it and in
which order it tries the sources; this module only finds a source or says why not:

* **In-cluster**: ``$KUBERNETES_SERVICE_HOST``/``PORT`` plus the service-account
  token, the DaemonSet case. The token file is re-read as it rotates
  (kubernetes-asyncio's refresh hook), so bound service-account tokens keep working.
* **A kubeconfig**: the path a setting names, else ``$KUBECONFIG`` (a path list; the
  files that exist are merged), else ``~/.kube/config``. A context picks one cluster.
  The file is never rewritten (token refreshes would).

Every failure, whatever the loader raised, is a :class:`KubeConfigError` whose text is
the reason an operator reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import anyio
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(Exception):
    """No usable cluster configuration; the message says why."""


def in_cluster_available(env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> bool:
    """The process runs in a pod with a service-account token."""
    return bool(
        env.get("KUBERNETES_SERVICE_HOST")
        and env.get("KUBERNETES_SERVICE_PORT")
        and (sa_dir / "token").is_file()
    )


def in_cluster(env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Any:
    """The in-cluster client configuration (blocking file reads: call off the loop)."""
    configuration = k8s_client.Configuration()
    load: Any = k8s_config.load_incluster_config  # untyped in kubernetes-asyncio
    try:
        load(
            client_configuration=configuration,
            token_filename=str(sa_dir / "token"),
            cert_filename=str(sa_dir / "ca.crt"),
            environ=dict(env),
        )
    except Exception as exc:  # the loader raises many types on a bad token or CA
        raise KubeConfigError(f"in-cluster config unusable: {exc}") from exc
    return configuration


def kubeconfig_path(explicit: str, env: Mapping[str, str]) -> str | None:
    """The kubeconfig to read (possibly an os.pathsep-separated list), or None."""
    if explicit:
        return explicit
    from_env = env.get("KUBECONFIG", "")
    if from_env:
        existing = [p for p in from_env.split(os.pathsep) if p and Path(p).expanduser().exists()]
        return os.pathsep.join(existing) if existing else None
    home = env.get("HOME")
    default = Path(home) / ".kube" / "config" if home else Path("~/.kube/config").expanduser()
    return str(default) if default.exists() else None


def _any_file(paths: str) -> bool:
    return any(Path(p).expanduser().is_file() for p in paths.split(os.pathsep) if p)


async def from_kubeconfig(path: str, context: str = "") -> Any:
    """The client configuration of ``path`` (a file or a path list) and ``context``."""
    if not await anyio.to_thread.run_sync(_any_file, path):
        raise KubeConfigError(f"kubeconfig {path} not found")
    configuration = k8s_client.Configuration()
    try:
        await k8s_config.load_kube_config(
            config_file=path,
            context=context or None,
            client_configuration=configuration,
            persist_config=False,
        )
    except Exception as exc:  # the loader raises many types on a bad file
        raise KubeConfigError(f"kubeconfig {path} unusable: {type(exc).__name__}: {exc}") from exc
    return configuration
