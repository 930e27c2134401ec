"""Where the Kubernetes API server is: the pod's service account, or a kubeconfig.

One lookup for every service that talks to the API server (the reporter writes the
Device CR, node labels and condition; the allocator watches its node's pods, reads
claims, evicts). Each service decides what an absent cluster means to it and in which
order it tries the sources; this module only finds a source or says why not. The
reading itself is kubernetes-asyncio's: its ``Configuration``, its in-cluster loader
and its kubeconfig loader, so TLS, client certificates, tokens, ``exec`` credential
plugins, OIDC and proxies work as they do for every other client of that library.

* **In-cluster**: ``$KUBERNETES_SERVICE_HOST``/``PORT`` plus the service-account token,
  the DaemonSet case. The library re-reads the token file every minute
  (``refresh_api_key_hook``), so bound service-account tokens keep working as the
  kubelet rotates them. gpulet wraps that hook (:func:`_steady_token`): a read that
  fails mid-rotation keeps the token read last instead of failing the request, and
  the token is stripped of the line break a file may end with.
* **A kubeconfig**: the path a setting names, else ``$KUBECONFIG`` (a path list; the
  files that exist are merged as kubectl merges them: the first file that names a
  cluster, user or context wins), else ``~/.kube/config``. A context picks one
  cluster. Relative paths are relative to the kubeconfig that holds them. A user with
  an ``exec`` plugin runs it, and again when the credential it gave expires. The file
  is never written.

A kubeconfig is untrusted input like any other file: it is read through
:func:`gpulet_common.untrusted.yaml_document` (at most :data:`MAX_KUBECONFIG` bytes,
no YAML aliases, bounded depth) before the library sees it as a dict.

Either way the result is a :class:`KubeConfig`, which
:class:`~gpulet_common.kubeapi.KubeClient` connects with. Every failure, whatever the
reading raised, is a :class:`KubeConfigError` whose text is the reason an operator
reads. Only the processes that talk to the API server (reporter, allocator, CLI) import
this module, and with it kubernetes-asyncio -- without the library's generated models,
which gpulet never uses (:mod:`gpulet_common.kube_lazy`).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final, cast

import anyio

from gpulet_common import kube_lazy
from gpulet_common.untrusted import UntrustedDocumentError, yaml_document

kube_lazy.prepare()  # before the library's first import: no generated models (~36 MB)

from kubernetes_asyncio.client.api_client import ApiClient as ApiClient  # noqa: E402
from kubernetes_asyncio.client.configuration import Configuration  # noqa: E402
from kubernetes_asyncio.config import kube_config  # noqa: E402
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader  # noqa: E402

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MAX_KUBECONFIG: Final = 4 << 20

log = logging.getLogger("gpulet.kube")

RefreshHook = Callable[[Configuration], Awaitable[None] | None]


class KubeConfigError(Exception):
    """No usable cluster configuration; the message says why."""


class KubeConfig:
    """A kubernetes-asyncio ``Configuration`` and where it came from.

    ``KubeConfig(host, token=...)`` makes a plain one (tests, benches, the emulator);
    :func:`in_cluster` and :func:`from_kubeconfig` make the real ones.
    """

    __slots__ = ("configuration", "source")

    def __init__(
        self,
        host: str = "",
        *,
        token: str = "",
        configuration: Configuration | None = None,
        source: str = "",
    ) -> None:
        if configuration is None:
            configuration = Configuration(host=host.rstrip("/"))
            if token:
                configuration.api_key["BearerToken"] = f"Bearer {token}"
        self.configuration: Configuration = configuration
        self.source = source or "explicit"

    @property
    def host(self) -> str:
        return str(self.configuration.host)

    @property
    def token(self) -> str:
        """The bearer token in force now ("" for none)."""
        value = str(self.configuration.api_key.get("BearerToken") or "")
        return value.removeprefix("Bearer ").strip()

    def __repr__(self) -> str:
        return f"KubeConfig({self.host!r}, source={self.source!r})"


def _steady_token(hook: RefreshHook | None) -> RefreshHook:
    """``hook`` (the library's token refresh), made safe for a long-lived service: a
    failed refresh keeps the token in force (logged once per failure streak), and the
    token never carries surrounding whitespace into a header."""
    failing = False

    async def refresh(configuration: Configuration) -> None:
        nonlocal failing
        before = configuration.api_key.get("BearerToken")
        try:
            if hook is not None:
                result = hook(configuration)
                if isinstance(result, Awaitable):
                    await result
        except Exception as exc:  # the library's ConfigException, OSError, ...
            if before:
                configuration.api_key["BearerToken"] = before
            if not failing:
                log.warning("token refresh failed, keeping the token in force: %s", exc)
            failing = True
        else:
            failing = False
        value = configuration.api_key.get("BearerToken")
        if isinstance(value, str) and value != value.strip():
            configuration.api_key["BearerToken"] = value.strip()

    return refresh


def in_cluster_available(env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> bool:
    """The process runs in a pod with a service-account token."""
    return bool(
        env.get("KUBERNETES_SERVICE_HOST")
        and env.get("KUBERNETES_SERVICE_PORT")
        and (sa_dir / "token").is_file()
    )


def in_cluster(env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """The in-cluster configuration (blocking file reads: call off the loop)."""
    configuration = Configuration()
    loader = InClusterConfigLoader(
        token_filename=str(sa_dir / "token"),
        cert_filename=str(sa_dir / "ca.crt"),
        environ=dict(env),
    )
    try:
        loader.load_and_set(configuration)
        if not configuration.api_key.get("BearerToken", "").removeprefix("Bearer ").strip():
            raise ValueError(f"{sa_dir / 'token'} is empty")  # noqa: TRY301
    except Exception as exc:  # the library's ConfigException, OSError, ValueError
        raise KubeConfigError(f"in-cluster config unusable: {exc}") from exc
    library_hook = cast("RefreshHook | None", configuration.refresh_api_key_hook)
    configuration.refresh_api_key_hook = _steady_token(library_hook)
    configuration.api_key["BearerToken"] = configuration.api_key["BearerToken"].strip()
    return KubeConfig(configuration=configuration, source="in-cluster")


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


class _BoundedMerger(kube_config.KubeConfigMerger):
    """The library's merge of a kubeconfig path list, reading each file through the
    bounded YAML reader instead of an unbounded ``yaml.safe_load``."""

    def load_config(self, path: str) -> None:
        with open(path, "rb") as file:
            raw = file.read(MAX_KUBECONFIG + 1)
        config = yaml_document(raw, max_bytes=MAX_KUBECONFIG, what=f"kubeconfig {path}")
        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise TypeError(f"{path} is not a kubeconfig mapping")
        if self.config_merged is None:
            merged = {**config, "clusters": [], "contexts": [], "users": []}
            self.config_merged = kube_config.ConfigNode(path, merged, path)
        for item in ("clusters", "contexts", "users"):
            entries = config.get(item) or []
            if not isinstance(entries, list):
                raise TypeError(f"{item} of {path} is not a list")
            self._merge(item, [e for e in entries if isinstance(e, dict) and "name" in e], path)
        if "current-context" in config and not self.config_merged.value.get("current-context"):
            # kubectl: the first file that sets current-context wins.
            self.config_merged.value["current-context"] = config["current-context"]
        self.config_files[path] = config


def _exec_refresh(loader: Any) -> RefreshHook:
    """Run the ``exec`` plugin again once the credential it gave has expired (a
    credential without an expiry is kept for the process's life, as kubectl does)."""

    async def refresh(configuration: Configuration) -> None:
        expiry = getattr(loader, "exec_plugin_expiry", None)
        if not isinstance(expiry, datetime.datetime) or not kube_config._is_expired(expiry):
            return
        await loader.load_from_exec_plugin()
        if getattr(loader, "token", None):
            configuration.api_key["BearerToken"] = loader.token

    return refresh


async def from_kubeconfig(path: str, context: str = "") -> KubeConfig:
    """The configuration of ``path`` (a file or a path list) and ``context``."""
    files = [p for p in path.split(os.pathsep) if p]
    if not await anyio.to_thread.run_sync(
        lambda: any(Path(p).expanduser().is_file() for p in files)
    ):
        raise KubeConfigError(f"kubeconfig {path} not found")
    configuration = Configuration()
    try:
        merger = await anyio.to_thread.run_sync(_BoundedMerger, path)
        if merger.config is None:
            raise ValueError("no kubeconfig file could be read")  # noqa: TRY301
        loader = kube_config.KubeConfigLoader(
            config_dict=merger.config, config_base_path=None, active_context=context or None
        )
        await loader.load_and_set(configuration)
    except UntrustedDocumentError as exc:
        raise KubeConfigError(f"kubeconfig {path} unusable: {exc}") from exc
    except Exception as exc:  # the library's ConfigException, shapes, base64, files, exec
        raise KubeConfigError(f"kubeconfig {path} unusable: {type(exc).__name__}: {exc}") from exc
    if not str(configuration.host).startswith(("https://", "http://")):
        raise KubeConfigError(f"kubeconfig {path} unusable: no http(s) server")
    hook = _exec_refresh(loader) if "exec" in (loader._user or {}) else None
    configuration.refresh_api_key_hook = _steady_token(hook)
    where = f"kubeconfig {path}" + (f" (context {context})" if context else "")
    return KubeConfig(configuration=configuration, source=where)


async def lookup(
    kubeconfig: str,
    context: str = "",
    env: Mapping[str, str] | None = None,
    sa_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeConfig:
    """In-cluster when the pod has a token and no ``kubeconfig`` is set, else a
    kubeconfig: ``kubeconfig``, ``$KUBECONFIG``, ``~/.kube/config`` (the allocator's
    and the DRA plugin's order). Raises :class:`KubeConfigError` with the reason."""
    env = dict(os.environ) if env is None else env
    if not kubeconfig and await anyio.to_thread.run_sync(in_cluster_available, env, sa_dir):
        return await anyio.to_thread.run_sync(in_cluster, env, sa_dir)
    path = await anyio.to_thread.run_sync(kubeconfig_path, kubeconfig, env)
    if path is None:
        raise KubeConfigError("not in a cluster and no kubeconfig found")
    return await from_kubeconfig(path, context)
