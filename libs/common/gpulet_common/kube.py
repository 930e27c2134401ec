"""Where the Kubernetes API server is: the pod's service account, or a kubeconfig.

One lookup for every service that talks to the API server (the reporter writes the
Device CR, node labels and condition; the allocator watches its node's pods under the
Koordinator profile). Each service decides what an absent cluster means to it and in
which order it tries the sources; this module only finds a source or says why not:

* **In-cluster**: ``$KUBERNETES_SERVICE_HOST``/``PORT`` plus the service-account
  token, the DaemonSet case. The token file is re-read as it rotates (every minute,
  by :class:`~gpulet_common.kubeapi.KubeClient`), so bound service-account tokens keep
  working.
* **A kubeconfig**: the path a setting names, else ``$KUBECONFIG`` (a path list; the
  files that exist are merged as kubectl merges them: the first file that names a
  cluster, user or context wins, and the first ``current-context`` set), else
  ``~/.kube/config``. A context picks one cluster. Understood: a server with a CA
  file or CA data, ``insecure-skip-tls-verify`` and ``tls-server-name``; a user with a
  token, a token file, client certificate and key (files or data) or a username and
  password. A user that needs an ``exec`` credential plugin or an ``auth-provider`` is
  refused with that reason (gpulet runs no plugins). Relative paths are relative to the
  kubeconfig that holds them. The file is never written.

Either way the result is a :class:`KubeConfig`, which
:class:`~gpulet_common.kubeapi.KubeClient` connects with. PyYAML is imported only to
read a kubeconfig, so an in-cluster process never loads it.

Every failure, whatever the reading raised, is a :class:`KubeConfigError` whose text is
the reason an operator reads.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MAX_KUBECONFIG: Final = 4 << 20


class KubeConfigError(Exception):
    """No usable cluster configuration; the message says why."""


@dataclass(frozen=True, slots=True)
class KubeConfig:
    """Where the API server is and how to prove who we are (see the module docstring)."""

    host: str
    ca_file: str = ""
    ca_data: bytes = b""
    cert_file: str = ""
    key_file: str = ""
    cert_data: bytes = b""
    key_data: bytes = b""
    token: str = ""
    token_file: str = ""
    username: str = ""
    password: str = ""
    insecure: bool = False
    tls_server_name: str = ""

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context to reach ``host`` with (blocking file reads; raises OSError
        or ssl.SSLError on a bad CA or key)."""
        context = ssl.create_default_context(
            cafile=self.ca_file or None, cadata=self.ca_data.decode() if self.ca_data else None
        )
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_file or self.cert_data:
            _load_client_cert(context, self)
        return context


def _load_client_cert(context: ssl.SSLContext, config: KubeConfig) -> None:
    if not config.cert_data and not config.key_data:
        context.load_cert_chain(config.cert_file, config.key_file or None)
        return
    # ssl reads certificates from files only: data goes through a private directory.
    with tempfile.TemporaryDirectory(prefix="gpulet-kube-") as tmp:
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert.write_bytes(config.cert_data or Path(config.cert_file).read_bytes())
        key.write_bytes(config.key_data or Path(config.key_file).read_bytes())
        context.load_cert_chain(str(cert), str(key))


def in_cluster_available(env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> bool:
    """The process runs in a pod with a service-account token."""
    return bool(
        env.get("KUBERNETES_SERVICE_HOST")
        and env.get("KUBERNETES_SERVICE_PORT")
        and (sa_dir / "token").is_file()
    )


def in_cluster(env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """The in-cluster configuration (blocking file reads: call off the loop)."""
    try:
        return _in_cluster(env, sa_dir)
    except (OSError, ValueError) as exc:
        raise KubeConfigError(f"in-cluster config unusable: {exc}") from exc


def _in_cluster(env: Mapping[str, str], sa_dir: Path) -> KubeConfig:
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    token_file, ca_file = sa_dir / "token", sa_dir / "ca.crt"
    if not host or not port:
        raise ValueError("KUBERNETES_SERVICE_HOST or _PORT is not set")
    token = token_file.read_text(encoding="utf-8", errors="replace")[: 1 << 16].strip()
    if not token:
        raise ValueError(f"{token_file} is empty")
    if not ca_file.is_file():
        raise ValueError(f"{ca_file} does not exist")
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address
    return KubeConfig(
        f"https://{host}:{port}", ca_file=str(ca_file), token=token, token_file=str(token_file)
    )


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


async def from_kubeconfig(path: str, context: str = "") -> KubeConfig:
    """The configuration of ``path`` (a file or a path list) and ``context``."""
    if not await anyio.to_thread.run_sync(_any_file, path):
        raise KubeConfigError(f"kubeconfig {path} not found")
    try:
        return await anyio.to_thread.run_sync(read_kubeconfig, path, context)
    except Exception as exc:  # YAML, shapes, base64, files: one error with the reason
        raise KubeConfigError(f"kubeconfig {path} unusable: {type(exc).__name__}: {exc}") from exc


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


def read_kubeconfig(path: str, context: str = "") -> KubeConfig:
    """Merge the files of ``path`` and resolve ``context`` (blocking; raises
    ValueError or whatever reading raised: :func:`from_kubeconfig` maps it)."""
    import yaml  # only here: an in-cluster process never needs it

    named: dict[str, dict[str, tuple[dict[str, Any], Path]]] = {
        "clusters": {},
        "users": {},
        "contexts": {},
    }
    current = ""
    for file in (Path(p).expanduser() for p in path.split(os.pathsep) if p):
        if not file.is_file():
            continue
        with file.open("rb") as raw:
            doc = yaml.safe_load(raw.read(MAX_KUBECONFIG))
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise TypeError(f"{file} is not a kubeconfig mapping")
        current = current or str(doc.get("current-context") or "")
        for section, items in named.items():
            for entry in doc.get(section) or []:
                if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                    body = entry.get(section[:-1]) or {}
                    if not isinstance(body, dict):
                        raise TypeError(f"{section} entry {entry['name']!r} is not a mapping")
                    items.setdefault(entry["name"], (body, file.parent))
    name = context or current
    if not name or name not in named["contexts"]:
        raise ValueError(f"context {name!r} not found" if name else "no current-context")
    ctx, _ = named["contexts"][name]
    cluster_name, user_name = str(ctx.get("cluster") or ""), str(ctx.get("user") or "")
    if cluster_name not in named["clusters"]:
        raise ValueError(f"cluster {cluster_name!r} of context {name!r} not found")
    cluster, cluster_dir = named["clusters"][cluster_name]
    user, user_dir = named["users"].get(user_name, ({}, cluster_dir))
    for unsupported in ("exec", "auth-provider"):
        if user.get(unsupported):
            raise ValueError(f"user {user_name!r} needs an {unsupported} plugin (unsupported)")
    server = str(cluster.get("server") or "")
    if not server.startswith(("https://", "http://")):
        raise ValueError(f"cluster {cluster_name!r} has no http(s) server")
    return KubeConfig(
        server,
        ca_file=_file(cluster, "certificate-authority", cluster_dir),
        ca_data=_data(cluster, "certificate-authority-data"),
        cert_file=_file(user, "client-certificate", user_dir),
        key_file=_file(user, "client-key", user_dir),
        cert_data=_data(user, "client-certificate-data"),
        key_data=_data(user, "client-key-data"),
        token=str(user.get("token") or ""),
        token_file=_file(user, "tokenFile", user_dir),
        username=str(user.get("username") or ""),
        password=str(user.get("password") or ""),
        insecure=cluster.get("insecure-skip-tls-verify") is True,
        tls_server_name=str(cluster.get("tls-server-name") or ""),
    )


def _file(section: Mapping[str, Any], key: str, base: Path) -> str:
    value = section.get(key)
    if not value:
        return ""
    return str(base / Path(str(value)).expanduser())  # an absolute path stays itself


def _data(section: Mapping[str, Any], key: str) -> bytes:
    value = section.get(key)
    return base64.b64decode(str(value), validate=True) if value else b""
