"""A real Kubernetes node for the tests: containerd and a kubelet joined to the real
control plane (support.control_plane) as a real node.

Why: every kubelet-facing claim of gpulet was proven against the project's own fake
kubelets, and no container ever ran. Here the kubelet is k8s.io/kubernetes' own
(v1.37.2), containers run under containerd 2.x and Debian's runc, and a pod's
container really gets its devices, env and CDI edits.

How it joins (as a node of a real cluster does):

- a client certificate of the plane's CA for ``system:node:<name>`` in
  ``system:nodes``, so the Node authorizer and NodeRestriction (on in the plane) limit
  it to its own Node, pods and claims;
- its serving port on this machine's own address (:func:`node_parts.node_ip`: the
  kubelet refuses a loopback node IP), which kube-apiserver reaches by the Node's
  InternalIP, with its own client certificate, for logs and exec; the kubelet
  authenticates that by the plane's CA and authorizes it with a SubjectAccessReview;
- once the Node is Ready, the ``node.kubernetes.io/not-ready`` taint (put on by the
  TaintNodesByCondition admission) is removed by the test's admin: the node lifecycle
  controller, whose job it is, is not run by the tests' controller manager (it would
  mark the other tests' kubelet-less Nodes unreachable).

Everything lives under one short temporary root (unix socket paths are limited to 107
bytes): containerd's root, state, sockets and config; the kubelet's ``--root-dir`` (so
its ``plugins_registry``, ``plugins`` and ``pod-resources`` are there); the CNI config and
IPAM data; the CDI spec dir; the mock device nodes (``<root>/dev``). Only what upstream
fixes is outside it (``node_parts.HostState``): the device-plugin socket dir
``/var/lib/kubelet/device-plugins``, a few sysctls, the ``kubepods`` cgroups. So one
real kubelet runs on a machine at a time: :func:`exclusive` is a machine-wide lock.

Every setting and why it is there: docs/testing.md ("The real node").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import yaml

from support.control_plane import ControlPlane, Process, free_port, sign_client_cert
from support.node_parts import (
    DEVICE_PLUGIN_DIR,
    LOCK_FILE,
    TEST_IMAGE,
    HostState,
    cni_conflist,
    containerd_config,
    file_lock,
    image_archives,
    kubelet_config,
    make_mock_devices,
    node_binaries,
    node_ip,
    unmount_under,
)


@contextmanager
def exclusive(timeout_s: float = 900.0) -> Iterator[None]:
    """The machine-wide lock of the one real kubelet (waits at most ``timeout_s``)."""
    import fcntl

    LOCK_FILE.touch(exist_ok=True)
    with LOCK_FILE.open("a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() > deadline:
                    msg = f"another real node held {LOCK_FILE} for {timeout_s}s"
                    raise TimeoutError(msg) from exc
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str, *procs: Process) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.tail(40)}")
        if predicate():
            return
        time.sleep(0.1)
    tails = "\n".join(f"--- {p.name}:\n{p.tail(40)}" for p in procs)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}\n{tails}")


class RealNode:
    """containerd and a kubelet for Node ``name`` of ``plane``, rooted at ``root``."""

    def __init__(self, plane: ControlPlane, name: str, root: Path) -> None:
        self.plane = plane
        self.name = name
        self.root = root
        self.bins = node_binaries()
        self.ip = node_ip()
        self.kubelet_root = root / "kubelet"
        self.cdi_dir = root / "cdi"
        self.dev_root = root / "dev"
        self.socket = root / "containerd.sock"
        self.host = HostState()
        self.containerd: Process | None = None
        self.kubelet: Process | None = None
        self.kubelet_port = 0

    # ------------------------------------------------------------------ paths for gpulet

    @property
    def plugins_registry(self) -> Path:
        return self.kubelet_root / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.kubelet_root / "plugins"

    @property
    def pod_resources_socket(self) -> Path:
        return self.kubelet_root / "pod-resources" / "kubelet.sock"

    device_plugin_dir = DEVICE_PLUGIN_DIR

    def gpulet_settings(self) -> list[str]:
        """``--set`` arguments that point gpulet at this node's kubelet and devices."""
        dev = str(self.dev_root)
        sets = {
            "allocator.plugin.plugin_dir": f"{DEVICE_PLUGIN_DIR}/",
            "allocator.plugin.dev_root": dev,
            "allocator.plugin.host_dev": dev,
            "allocator.plugin.container_dev": "/dev",
            "allocator.pod_resources_socket": str(self.pod_resources_socket),
            "dra.cdi_dir": str(self.cdi_dir),
            "dra.plugins_registry": str(self.plugins_registry),
            "dra.plugins_dir": str(self.plugins_dir),
        }
        return [arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]

    # ------------------------------------------------------------------ start and stop

    def start(self, timeout_s: float = 120.0) -> None:
        t0 = time.monotonic()
        archives = image_archives()
        for sub in ("cni/net.d", "pod-logs", "volume-plugins", "kubelet", "cdi", "pki"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        make_mock_devices(self.dev_root)
        (self.root / "containerd.toml").write_text(containerd_config(self.root, self.cdi_dir))
        (self.root / "cni/net.d/10-gpulet.conflist").write_text(json.dumps(cni_conflist(self.root)))
        self._write_kubelet_files()
        self.host.save()
        self.start_containerd(timeout_s)
        for image, archive in archives.items():
            self.ctr("images", "import", str(archive))
            assert image in self.ctr("images", "ls", "-q"), f"{image} not imported"
        self.start_kubelet(timeout_s)
        # The node lifecycle controller's part (not run here): lift not-ready.
        self.plane.must(
            "PATCH",
            f"/api/v1/nodes/{self.name}",
            {"spec": {"taints": None}},
            content_type="application/merge-patch+json",
        )
        self.started_in_s = time.monotonic() - t0

    def _write_kubelet_files(self) -> None:
        pki = self.plane.pki
        user = f"system:node:{self.name}"
        crt, key = sign_client_cert(pki, f"node-{self.name}", user, "system:nodes")
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {
                        "server": self.plane.url,
                        "certificate-authority": str(pki / "ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": "node",
                    "user": {"client-certificate": str(crt), "client-key": str(key)},
                }
            ],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "node"}}],
            "current-context": "test",
        }
        (self.root / "kubelet.kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        self.kubelet_port = free_port()
        config = kubelet_config(
            self.root,
            ip=self.ip,
            port=self.kubelet_port,
            healthz_port=free_port(),
            ca_file=pki / "ca.crt",
        )
        (self.root / "kubelet.yaml").write_text(yaml.safe_dump(config))

    def start_containerd(self, timeout_s: float = 60.0) -> None:
        self.containerd = Process(
            "containerd",
            [str(self.bins["containerd"]), f"--config={self.root / 'containerd.toml'}"],
            self.root,
            env={**os.environ, "PATH": f"{self.bins['containerd'].parent}:{os.environ['PATH']}"},
            append=True,
        )
        _wait(self._containerd_up, timeout_s, "containerd's CRI", self.containerd)

    def _containerd_up(self) -> bool:
        if not self.socket.exists():
            return False
        proc = subprocess.run(
            [*self._crictl(), "info"], capture_output=True, text=True, timeout=10, check=False
        )
        return proc.returncode == 0

    def start_kubelet(self, timeout_s: float = 90.0) -> None:
        self.kubelet = Process(
            "kubelet",
            [
                str(self.bins["kubelet"]),
                f"--config={self.root / 'kubelet.yaml'}",
                f"--kubeconfig={self.root / 'kubelet.kubeconfig'}",
                f"--root-dir={self.kubelet_root}",
                f"--cert-dir={self.root / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.ip}",
                "--v=2",
            ],
            self.root,
            append=True,
        )
        _wait(self.ready, timeout_s, f"Node {self.name} Ready", self.kubelet)

    def stop_kubelet(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
            self.kubelet = None

    def restart_kubelet(self, timeout_s: float = 90.0) -> None:
        self.stop_kubelet()
        self.start_kubelet(timeout_s)

    def stop_containerd(self) -> None:
        if self.containerd is not None:
            self.containerd.stop()
            self.containerd = None

    def restart_containerd(self, timeout_s: float = 60.0) -> None:
        self.stop_containerd()
        self.start_containerd(timeout_s)

    def stop(self) -> None:
        """Everything the node started, and what it left on the host, goes."""
        self.stop_kubelet()
        if self.containerd is not None and self.containerd.alive():
            with suppress(subprocess.SubprocessError, OSError):
                self.crictl("rmp", "--all", "--force", timeout_s=60)
        self.stop_containerd()
        self._kill_leftover_shims()
        unmount_under(self.root)
        self.host.restore()

    def _kill_leftover_shims(self) -> None:
        """The shims of this node's containerd (their command line names its socket)."""
        marker = str(self.socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                if b"containerd-shim" in cmdline and marker in cmdline:
                    os.kill(int(entry.name), signal.SIGKILL)

    # ------------------------------------------------------------------ inspection

    def _crictl(self) -> list[str]:
        endpoint = f"unix://{self.socket}"
        return [
            str(self.bins["crictl"]),
            f"--runtime-endpoint={endpoint}",
            f"--image-endpoint={endpoint}",
            "--timeout=10s",
        ]

    def crictl(self, *args: str, timeout_s: float = 30.0) -> str:
        proc = subprocess.run(
            [*self._crictl(), *args], capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode != 0:
            raise RuntimeError(f"crictl {' '.join(args)}: {proc.stderr[-2000:]}")
        return proc.stdout

    def ctr(self, *args: str, timeout_s: float = 60.0) -> str:
        proc = subprocess.run(
            [str(self.bins["ctr"]), f"--address={self.socket}", "--namespace=k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {proc.stderr[-2000:]}")
        return proc.stdout

    def node(self) -> dict[str, Any]:
        node: dict[str, Any] = self.plane.must("GET", f"/api/v1/nodes/{self.name}")
        return node

    def ready(self) -> bool:
        resp = self.plane.request("GET", f"/api/v1/nodes/{self.name}")
        if resp.status != 200:
            return False
        conds = resp.body.get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def allocatable(self, resource: str) -> str | None:
        value: str | None = self.node().get("status", {}).get("allocatable", {}).get(resource)
        return value

    def capacity(self, resource: str) -> str | None:
        value: str | None = self.node().get("status", {}).get("capacity", {}).get(resource)
        return value

    def logs(self, tail: int = 40) -> str:
        procs = [p for p in (self.containerd, self.kubelet) if p is not None]
        return "\n".join(f"--- {p.name}:\n{p.tail(tail)}" for p in procs)


# ---------------------------------------------------------------------- pods


# Prints what the test reads, then waits for SIGTERM (the shell is PID 1, which ignores
# signals it does not trap: without the trap every delete would wait out the grace period).
def pod_command(script: str) -> list[str]:
    wait = "trap 'exit 0' TERM; while true; do sleep 3600 & wait; done"
    return ["/bin/sh", "-c", f"{script}; {wait}"]


def pod_manifest(
    name: str,
    node: str | None,
    *,
    script: str = "env",
    limits: Mapping[str, str] | None = None,
    claims: Sequence[Mapping[str, str]] = (),
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "app",
        "image": TEST_IMAGE,
        "imagePullPolicy": "Never",
        "command": pod_command(script),
    }
    if limits:
        container["resources"] = {"limits": dict(limits)}
    spec: dict[str, Any] = {
        "containers": [container],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 5,
    }
    if node is not None:
        spec["nodeName"] = node
    if claims:
        spec["resourceClaims"] = [dict(c) for c in claims]
        container.setdefault("resources", {})["claims"] = [{"name": c["name"]} for c in claims]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


class Pods:
    """Pods of one namespace on the real node, through the API server."""

    def __init__(self, plane: ControlPlane, namespace: str) -> None:
        self.plane = plane
        self.ns = namespace

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        pod: dict[str, Any] = self.plane.must(
            "POST", f"/api/v1/namespaces/{self.ns}/pods", dict(manifest)
        )
        return pod

    def get(self, name: str) -> dict[str, Any] | None:
        resp = self.plane.request("GET", f"/api/v1/namespaces/{self.ns}/pods/{name}")
        if resp.status == 404:
            return None
        assert resp.ok, resp.raw[:500]
        pod: dict[str, Any] = resp.body
        return pod

    def phase(self, name: str) -> str:
        pod = self.get(name)
        return "Gone" if pod is None else str(pod.get("status", {}).get("phase", ""))

    def running(self, name: str) -> bool:
        pod = self.get(name)
        if pod is None:
            return False
        statuses = pod.get("status", {}).get("containerStatuses") or []
        return bool(statuses) and all("running" in (s.get("state") or {}) for s in statuses)

    def why(self, name: str) -> str:
        pod = self.get(name)
        if pod is None:
            return "gone"
        status = pod.get("status", {})
        events = self.plane.must(
            "GET",
            f"/api/v1/namespaces/{self.ns}/events",
            query={"fieldSelector": f"involvedObject.name={name}"},
        )
        said = [f"{e.get('reason')}: {e.get('message')}" for e in events.get("items", [])]
        return json.dumps(
            {
                "phase": status.get("phase"),
                "conditions": status.get("conditions"),
                "containers": status.get("containerStatuses"),
                "events": said[-10:],
            },
            indent=1,
        )[:4000]

    def log(self, name: str) -> str:
        resp = self.plane.request(
            "GET", f"/api/v1/namespaces/{self.ns}/pods/{name}/log", query={"container": "app"}
        )
        assert resp.ok, f"log of {name}: {resp.status} {resp.raw[:500]!r}"
        return resp.raw.decode(errors="replace")

    def delete(self, name: str, grace_s: int | None = None) -> None:
        query = {} if grace_s is None else {"gracePeriodSeconds": str(grace_s)}
        resp = self.plane.request(
            "DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}", query=query
        )
        assert resp.status in (200, 202, 404), resp.raw[:500]


__all__ = ["Pods", "RealNode", "exclusive", "file_lock", "pod_command", "pod_manifest"]
