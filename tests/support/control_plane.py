"""A real Kubernetes control plane for the tests: etcd, kube-apiserver and, on request,
kube-scheduler and kube-controller-manager, as child processes on 127.0.0.1.

Why: the API emulator (support.kube_emulator) was written by the team that wrote the
reporter, so where both misread the real server the tests agree with the mistake. This is
the envtest pattern instead: the real binaries, built from k8s.io/kubernetes and
go.etcd.io/etcd at the versions pinned in tools/k8s/ by ``scripts/k8s-bins.sh`` into a
cache outside the repository. The emulator keeps what a real server cannot easily do
(429s, dropped connections, faults before or after a commit).

What the server is, and why each part:

- etcd with ``--unsafe-no-fsync`` and its data in the plane's temporary directory;
- kube-apiserver with real authentication: a token file (``Credentials`` below: an
  admin in ``system:masters``, the scheduler and controller manager under their own
  user names, and any user a test adds before the start, such as the agent's
  ServiceAccount) and a ServiceAccount signing key (EC P-256, made here with openssl), so
  TokenRequest issues real bound tokens; a serving certificate for 127.0.0.1 signed by a
  CA of the plane's, so clients verify TLS as they do in a cluster;
- ``--authorization-mode=Node,RBAC``: the deploy's RBAC decides, not a stand-in;
- client certificates of the plane's CA, NodeRestriction, and a client certificate of
  the server's own for kubelets: the real node of tests/node joins as a kubelet does;
- readiness is ``/readyz`` answering 200, then the bootstrap ClusterRoles present;
- an audit log (JSON lines, metadata level, every request of every user but the control
  plane's own components): the real server's count of what a client asked, including
  the no-op writes that leave an object's resourceVersion alone (:meth:`ControlPlane.audit`).

Ports: every port is picked free just before the start, and a start that fails because a
port was taken meanwhile is retried with new ports (bounded), so parallel sessions on one
machine never share a server.

Processes stop with SIGTERM (SIGKILL after a bounded wait); their output is in
``<workdir>/<name>.log``, and the tail of it is in every start failure.

The fixtures that use this live in ``support.control_plane_fixtures``.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_BINS = ROOT / "scripts" / "k8s-bins.sh"
# A directory holding prebuilt binaries, used instead of the build cache when set.
BIN_DIR_ENV = "GPULET_K8S_BIN_DIR"
SERVICE_CIDR = "10.96.0.0/16"
ISSUER = "https://kubernetes.default.svc.cluster.local"
_PORT_RETRIES = 3
# Everything the tests' clients ask, at metadata level; not the control plane's own
# components, whose leases and lists would drown it.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [
        {
            "level": "None",
            "users": [
                "system:kube-scheduler",
                "system:kube-controller-manager",
                "system:apiserver",
            ],
        },
        {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
        {"level": "None", "nonResourceURLs": ["/readyz", "/healthz", "/livez"]},
        {"level": "Metadata"},
    ],
}


class MissingBinaries(RuntimeError):
    """The control plane's binaries are not built."""


def binary_paths() -> dict[str, Path]:
    """Where ``scripts/k8s-bins.sh`` puts each binary (built or not)."""
    override = os.environ.get(BIN_DIR_ENV)
    names = (
        "etcd",
        "kube-apiserver",
        "kube-scheduler",
        "kube-controller-manager",
        "helm",
        "kubelet",  # and the real node's (tests/support/node_parts.py)
        "containerd",
        "containerd-shim-runc-v2",
        "ctr",
        "crictl",
    )
    if override:
        return {name: Path(override) / name for name in names}
    out = subprocess.run(
        ["bash", str(K8S_BINS), "--paths"], check=True, capture_output=True, text=True
    ).stdout
    return {
        name: Path(path) for name, _, path in (line.partition("=") for line in out.splitlines())
    }


def require_binaries(*names: str) -> dict[str, Path]:
    """The paths of ``names``; :class:`MissingBinaries` names the ones not built."""
    paths = binary_paths()
    missing = [n for n in names if not os.access(paths.get(n, Path("/nonexistent")), os.X_OK)]
    if missing:
        raise MissingBinaries(
            f"the real control plane's binaries are not built: {', '.join(missing)} "
            f"(expected in {', '.join(str(paths.get(n)) for n in missing)}). "
            f"Build them with `scripts/k8s-bins.sh` (make test does this when they are missing)."
        )
    return {n: paths[n] for n in names}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(target: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1 and localhost, and the ServiceAccount
    signing key pair, all EC P-256 (fast to make)."""
    target.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *ec, "-keyout", str(target / "ca.key"), "-out", str(target / "ca.crt"),
        "-days", "2", "-subj", "/CN=gpulet-test-ca",
    )  # fmt: skip
    _openssl(
        "req", *ec, "-keyout", str(target / "serving.key"), "-out", str(target / "serving.csr"),
        "-subj", "/CN=kube-apiserver",
    )  # fmt: skip
    (target / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", str(target / "serving.csr"), "-CA", str(target / "ca.crt"),
        "-CAkey", str(target / "ca.key"), "-CAcreateserial", "-days", "2",
        "-extfile", str(target / "san.ext"), "-out", str(target / "serving.crt"),
    )  # fmt: skip
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-out", str(target / "sa.key"),
    )  # fmt: skip
    _openssl("pkey", "-in", str(target / "sa.key"), "-pubout", "-out", str(target / "sa.pub"))
    # The API server's client certificate for kubelets (logs, exec): a real node's
    # kubelet authenticates the server by it (tests/support/node.py).
    sign_client_cert(target, "kubelet-client", "kube-apiserver-kubelet-client", "system:masters")


def sign_client_cert(pki: Path, name: str, user: str, group: str) -> tuple[Path, Path]:
    """``<pki>/<name>.crt`` and ``.key``: a client certificate of the plane's CA for
    ``user`` in ``group`` (CN and O, as kube-apiserver's --client-ca-file reads them)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    key, csr, crt = pki / f"{name}.key", pki / f"{name}.csr", pki / f"{name}.crt"
    _openssl("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/O={group}/CN={user}")
    (pki / f"{name}.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
        "-CAcreateserial", "-days", "2", "-extfile", str(pki / f"{name}.ext"), "-out", str(crt),
    )  # fmt: skip
    return crt, key


@dataclass(frozen=True)
class Credentials:
    """A user of the token file: ``token,user,uid,"group1,group2"``."""

    user: str
    groups: tuple[str, ...] = ()
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    def csv_line(self) -> str:
        groups = ",".join(self.groups)
        return f'{self.token},{self.user},{self.user},"{groups}"'


ADMIN = "admin"
SCHEDULER = "system:kube-scheduler"
CONTROLLER_MANAGER = "system:kube-controller-manager"


def service_account_user(namespace: str, name: str) -> Credentials:
    """The token-file twin of a ServiceAccount: the user name and groups its tokens carry."""
    return Credentials(
        user=f"system:serviceaccount:{namespace}:{name}",
        groups=("system:serviceaccounts", f"system:serviceaccounts:{namespace}"),
    )


@dataclass
class Response:
    status: int
    body: Any
    raw: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class Process:
    """A child process with its output in ``<workdir>/<name>.log``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        workdir: Path,
        env: Mapping[str, str] | None = None,
        *,
        append: bool = False,  # a restarted process adds to its log
    ) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("ab" if append else "wb")
        self.proc = subprocess.Popen(
            list(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=None if env is None else dict(env),
        )

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._log.close()


def _port_taken(log: str) -> bool:
    return "address already in use" in log.lower()


class ControlPlane:
    """etcd and kube-apiserver (and later the scheduler and controller manager)."""

    def __init__(
        self,
        workdir: Path,
        *,
        users: Sequence[Credentials] = (),
        apiserver_args: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.pki = workdir / "pki"
        self.bins = require_binaries("etcd", "kube-apiserver")
        self.admin = Credentials(ADMIN, ("system:masters",))
        self.scheduler_user = Credentials(SCHEDULER)
        # The controllers run under the controller manager's own user
        # (--use-service-account-credentials=false, which starts faster than one
        # ServiceAccount per controller); the bootstrap role of that user covers only
        # the per-controller setup, so it gets system:masters.
        self.controller_manager_user = Credentials(CONTROLLER_MANAGER, ("system:masters",))
        self.users: dict[str, Credentials] = {
            c.user: c
            for c in (self.admin, self.scheduler_user, self.controller_manager_user, *users)
        }
        self.apiserver_args = list(apiserver_args)
        self.port = 0
        self.etcd: Process | None = None
        self.apiserver: Process | None = None
        self.others: list[Process] = []
        self.started_in_s = 0.0
        self._ssl = ssl.create_default_context()

    # ------------------------------------------------------------------ start and stop

    def start(self, timeout_s: float = 90.0) -> None:
        t0 = time.monotonic()
        make_pki(self.pki)
        self._ssl = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        (self.workdir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        (self.workdir / "tokens.csv").write_text(
            "".join(c.csv_line() + "\n" for c in self.users.values())
        )
        deadline = t0 + timeout_s
        self._start_etcd(deadline)
        self._start_apiserver(deadline)
        self.started_in_s = time.monotonic() - t0

    def _start_etcd(self, deadline: float) -> None:
        for attempt in range(_PORT_RETRIES):
            client, peer = free_port(), free_port()
            data = self.workdir / f"etcd-data-{attempt}"
            self.etcd_url = f"http://127.0.0.1:{client}"
            etcd = Process(
                "etcd",
                [
                    str(self.bins["etcd"]),
                    "--name=test",
                    f"--data-dir={data}",
                    f"--listen-client-urls={self.etcd_url}",
                    f"--advertise-client-urls={self.etcd_url}",
                    f"--listen-peer-urls=http://127.0.0.1:{peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                    f"--initial-cluster=test=http://127.0.0.1:{peer}",
                    "--unsafe-no-fsync",
                    "--log-level=warn",
                ],
                self.workdir,
            )
            while time.monotonic() < deadline and etcd.alive():
                if self._http_ok(f"{self.etcd_url}/health"):
                    self.etcd = etcd
                    return
                time.sleep(0.05)
            etcd.stop()
            if not _port_taken(etcd.tail()):
                break
        raise RuntimeError(f"etcd did not start:\n{etcd.tail()}")

    def _start_apiserver(self, deadline: float) -> None:
        assert self.etcd is not None
        for _attempt in range(_PORT_RETRIES):
            self.port = free_port()
            apiserver = Process(
                "kube-apiserver",
                [
                    str(self.bins["kube-apiserver"]),
                    f"--etcd-servers={self.etcd_url}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={self.port}",
                    f"--cert-dir={self.workdir / 'apiserver-certs'}",
                    f"--tls-cert-file={self.pki / 'serving.crt'}",
                    f"--tls-private-key-file={self.pki / 'serving.key'}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    f"--service-account-issuer={ISSUER}",
                    f"--service-account-key-file={self.pki / 'sa.pub'}",
                    f"--service-account-signing-key-file={self.pki / 'sa.key'}",
                    f"--api-audiences={ISSUER}",
                    f"--token-auth-file={self.workdir / 'tokens.csv'}",
                    "--authorization-mode=Node,RBAC",
                    # Real nodes (tests/support/node.py): kubelets authenticate with
                    # client certificates of the plane's CA (system:node:<name>), the
                    # Node authorizer and NodeRestriction limit them to their own node,
                    # and the server reaches a kubelet at its InternalIP with its own
                    # client certificate.
                    f"--client-ca-file={self.pki / 'ca.crt'}",
                    "--enable-admission-plugins=NodeRestriction",
                    f"--kubelet-client-certificate={self.pki / 'kubelet-client.crt'}",
                    f"--kubelet-client-key={self.pki / 'kubelet-client.key'}",
                    "--kubelet-preferred-address-types=InternalIP",
                    f"--audit-policy-file={self.workdir / 'audit-policy.yaml'}",
                    f"--audit-log-path={self.audit_log}",
                    "--audit-log-format=json",
                    "--audit-log-mode=blocking",
                    "--allow-privileged=true",
                    # The kubernetes Service's endpoints would be 127.0.0.1, which the
                    # lease reconciler refuses (loopback); nothing here needs them.
                    "--endpoint-reconciler-type=none",
                    "--enable-priority-and-fairness=false",
                    "--profiling=false",
                    "--v=1",
                    *self.apiserver_args,
                ],
                self.workdir,
            )
            while time.monotonic() < deadline and apiserver.alive():
                if self._ready():
                    self.apiserver = apiserver
                    return
                time.sleep(0.1)
            apiserver.stop()
            if not _port_taken(apiserver.tail()):
                break
        raise RuntimeError(f"kube-apiserver did not become ready:\n{apiserver.tail()}")

    def _ready(self) -> bool:
        with suppress(OSError, http.client.HTTPException):
            if self.request("GET", "/readyz").status != 200:
                return False
            # The bootstrap ClusterRoles: RBAC-based tests need them.
            return (
                self.request(
                    "GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles/system:kube-scheduler"
                ).status
                == 200
            )
        return False

    def _http_ok(self, url: str) -> bool:
        with suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status) == 200
        return False

    def stop(self) -> None:
        for proc in reversed(self.others):
            proc.stop()
        self.others.clear()
        if self.apiserver is not None:
            self.apiserver.stop()
        if self.etcd is not None:
            self.etcd.stop()

    # ------------------------------------------------------------------ scheduler, kcm

    def start_scheduler(self, timeout_s: float = 60.0, extra: Sequence[str] = ()) -> Process:
        binary = require_binaries("kube-scheduler")["kube-scheduler"]
        kubeconfig = self.write_kubeconfig(
            self.workdir / "scheduler.kubeconfig", self.scheduler_user
        )
        proc = Process(
            "kube-scheduler",
            [
                str(binary),
                f"--kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                "--v=1",
                *extra,
            ],
            self.workdir,
        )
        self.others.append(proc)
        self._wait_alive(proc, timeout_s, lambda: "Starting Kubernetes Scheduler" in proc.tail(200))
        return proc

    def start_controller_manager(
        self,
        controllers: Sequence[str],
        timeout_s: float = 60.0,
        extra: Sequence[str] = (),
    ) -> Process:
        binary = require_binaries("kube-controller-manager")["kube-controller-manager"]
        kubeconfig = self.write_kubeconfig(
            self.workdir / "controller-manager.kubeconfig", self.controller_manager_user
        )
        proc = Process(
            "kube-controller-manager",
            [
                str(binary),
                f"--kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                f"--controllers={','.join(controllers)}",
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={self.pki / 'ca.crt'}",
                "--use-service-account-credentials=false",
                "--v=1",
                *extra,
            ],
            self.workdir,
        )
        self.others.append(proc)
        # Running: the serviceaccount controller has made the default namespace's
        # default ServiceAccount.
        self._wait_alive(
            proc,
            timeout_s,
            lambda: (
                self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default").status
                == 200
            ),
        )
        return proc

    def _wait_alive(self, proc: Process, timeout_s: float, started: Any) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            if started():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{proc.name} did not start within {timeout_s}s:\n{proc.tail()}")

    # ------------------------------------------------------------------ clients

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def audit(
        self,
        *,
        user: str | None = None,
        resource: str | None = None,
        name: str | None = None,
        verbs: Sequence[str] | None = None,
        since: int = 0,
    ) -> list[dict[str, Any]]:
        """The audit events (completed requests) that match, from line ``since`` of the
        log on (:meth:`audit_mark` gives the current end)."""
        out = []
        with self.audit_log.open() as log:
            for number, line in enumerate(log):
                if number < since or not line.strip():
                    continue
                event = json.loads(line)
                ref = event.get("objectRef") or {}
                resource_of = ref.get("resource", "") + (
                    f"/{ref['subresource']}" if ref.get("subresource") else ""
                )
                if (
                    (user is None or event["user"].get("username") == user)
                    and (resource is None or resource_of == resource)
                    and (name is None or ref.get("name") == name)
                    and (verbs is None or event.get("verb") in verbs)
                ):
                    out.append(event)
        return out

    def audit_mark(self) -> int:
        """The number of lines in the audit log now."""
        with self.audit_log.open() as log:
            return sum(1 for _ in log)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def kubeconfig(self, user: Credentials | None = None) -> dict[str, Any]:
        cred = user or self.admin
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority": str(self.pki / "ca.crt"),
                    },
                }
            ],
            "users": [{"name": cred.user, "user": {"token": cred.token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": cred.user}}],
            "current-context": "test",
        }

    def write_kubeconfig(self, path: Path, user: Credentials | None = None) -> Path:
        path.write_text(yaml.safe_dump(self.kubeconfig(user), sort_keys=False))
        return path

    def write_token_kubeconfig(self, path: Path, token: str, name: str = "token") -> Path:
        """A kubeconfig for a bearer token the server issued (TokenRequest)."""
        return self.write_kubeconfig(path, Credentials(name, token=token))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
        query: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        raw: bytes | None = None,
    ) -> Response:
        """One HTTPS request as ``token``'s user (admin by default); JSON in and out.
        ``raw``: the body's bytes as they are (a document ``json`` cannot write)."""
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.port, context=self._ssl, timeout=timeout_s
        )
        try:
            payload = (
                raw if raw is not None else None if body is None else json.dumps(body).encode()
            )
            headers = {
                "Authorization": f"Bearer {token or self.admin.token}",
                "Accept": "application/json",
            }
            if payload is not None:
                headers["Content-Type"] = content_type
            target = path + (f"?{urlencode(query)}" if query else "")
            conn.request(method, target, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        parsed: Any = None
        if raw:
            with suppress(ValueError, RecursionError):  # a deep body: kept raw
                parsed = json.loads(raw)
        return Response(resp.status, parsed, raw)

    def must(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """:meth:`request` that fails on any status but 2xx and returns the body."""
        resp = self.request(method, path, body, **kw)
        if not resp.ok:
            raise AssertionError(f"{method} {path} -> {resp.status}: {resp.raw[:2000]!r}")
        return resp.body

    def apply(
        self,
        obj: Mapping[str, Any],
        *,
        manager: str = "gpulet-tests",
        token: str | None = None,
        dry_run: bool = False,
    ) -> Response:
        """Server-side apply of one object (force: tests own what they apply); with
        ``dry_run`` the server validates and admits it but stores nothing."""
        query = {"fieldManager": manager, "force": "true"}
        if dry_run:
            query["dryRun"] = "All"
        return self.request(
            "PATCH",
            object_path(obj),
            obj,
            token=token,
            content_type="application/apply-patch+yaml",
            query=query,
        )

    def token_for(
        self,
        namespace: str,
        service_account: str,
        *,
        pod: Mapping[str, Any] | None = None,
        seconds: int = 3600,
    ) -> str:
        """A real token of the ServiceAccount from TokenRequest, bound to ``pod`` when given
        (then it carries the pod's node name, as a projected token in that pod would)."""
        spec: dict[str, Any] = {"audiences": [ISSUER], "expirationSeconds": seconds}
        if pod is not None:
            spec["boundObjectRef"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            }
        body = self.must(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        token: str = body["status"]["token"]
        return token

    # ------------------------------------------------------------------ test objects

    def create_namespace(self, name: str) -> None:
        self.must("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        # The default ServiceAccount, which the controller manager would make: the
        # ServiceAccount admission plugin refuses pods without it.
        resp = self.request(
            "POST", f"/api/v1/namespaces/{name}/serviceaccounts", {"metadata": {"name": "default"}}
        )
        if resp.status not in (201, 409):
            raise AssertionError(f"default ServiceAccount in {name}: {resp.status} {resp.raw!r}")

    def add_node(
        self, name: str, *, labels: Mapping[str, str] | None = None, ready: bool = True
    ) -> dict[str, Any]:
        """A Node as kubelet registers one, Ready with allocatable cpu, memory and pods,
        and (when ready) without the not-ready taint, so the scheduler can place pods."""
        node = self.must(
            "POST",
            "/api/v1/nodes",
            {"metadata": {"name": name, "labels": dict(labels or {})}},
        )
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "110"}
        status = {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": _now(),
                    "lastTransitionTime": _now(),
                }
            ],
        }
        result: dict[str, Any] = self.must(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            {"status": status},
            content_type="application/merge-patch+json",
        )
        assert result["metadata"]["uid"] == node["metadata"]["uid"]
        if ready:
            # The TaintNodesByCondition admission plugin gives every new Node the
            # node.kubernetes.io/not-ready taint; the node lifecycle controller (not run
            # here) would lift it once the Node is Ready, as it is now.
            result = self.must(
                "PATCH",
                f"/api/v1/nodes/{name}",
                {"spec": {"taints": None}},
                content_type="application/merge-patch+json",
            )
        return result


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


CLUSTER_KINDS = {
    "Namespace",
    "Node",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "Device",
    "DeviceClass",
    "ResourceSlice",
    "PriorityClass",
}


def object_path(obj: Mapping[str, Any]) -> str:
    """The REST path of ``obj`` (its kind's plural is the lower-cased kind plus "s", or
    the irregular ones named here)."""
    api_version: str = obj["apiVersion"]
    kind: str = obj["kind"]
    meta = obj["metadata"]
    plural = {
        "PodDisruptionBudget": "poddisruptionbudgets",
        "NetworkPolicy": "networkpolicies",
        "PriorityClass": "priorityclasses",
        "DeviceClass": "deviceclasses",
        "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    }.get(kind, kind.lower() + "s")
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if kind not in CLUSTER_KINDS:
        base += f"/namespaces/{meta.get('namespace', 'default')}"
    return f"{base}/{plural}/{meta['name']}"


@contextmanager
def running(
    workdir: Path,
    *,
    users: Sequence[Credentials] = (),
    apiserver_args: Sequence[str] = (),
) -> Iterator[ControlPlane]:
    plane = ControlPlane(workdir, users=users, apiserver_args=apiserver_args)
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


__all__ = [
    "ADMIN",
    "ControlPlane",
    "Credentials",
    "MissingBinaries",
    "Process",
    "Response",
    "binary_paths",
    "object_path",
    "require_binaries",
    "running",
    "service_account_user",
    "sign_client_cert",
]
