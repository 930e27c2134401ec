"""gpulet as kubelet runs it (issue 35, test 6): the DaemonSet's pod of
``deploy/kustomize/overlays/mock``, from the image ``make image`` builds, on the real
node (support.node: kubelet v1.37.2, containerd v2.4.2).

What runs, for real:

1. ``scripts/image.sh build`` (what ``make image`` runs; layers cached), then
   ``podman save`` of both images (gpulet and the NATS sidecar) as docker archives,
   both before the real node's machine-wide lock is taken; then imported into the
   node's containerd, namespace ``k8s.io`` (``ctr images import``).
2. ``kubectl kustomize deploy/kustomize/overlays/mock``: every object but the
   DaemonSet (Namespace, CRD, ServiceAccount, RBAC, ConfigMaps, Secret, admission
   policy) is applied to the real API server, in its namespace, and the Node gets the
   label the overlay asks for (``gpulet.io/mock-gpus=true``).
3. The DaemonSet's pod: the tests' control plane runs no DaemonSet controller (one
   would stamp pods onto every other test's Nodes), so :func:`stamp_pod` makes the
   Pod the way the controller does: the template's metadata and spec, ``generateName``
   ``gpulet-``, the node affinity on ``metadata.name`` and the daemon tolerations the
   controller adds, and ``spec.nodeName`` (what the scheduler would then bind). The
   real kubelet admits it, and containerd runs the init container and all six
   containers under the manifest's users, capabilities and read-only roots.

What the test node forces, and only that, is changed (:func:`for_test_node`):

- images: ``gpulet`` stays ``localhost/gpulet:dev``; ``nats:*`` becomes the NATS
  sidecar image ``make image`` builds (``localhost/gpulet-nats:dev``); every container
  ``imagePullPolicy: Never`` (no registry can be reached);
- hostPaths: ``/var/lib/kubelet/pod-resources`` becomes the kubelet's under its
  ``--root-dir`` (kubelet serves PodResources there, not under /var/lib/kubelet), and
  the state directory ``/var/lib/gpulet`` one under the node's temporary root (nothing
  else on the machine may meet it). ``/var/lib/kubelet/device-plugins`` stays: kubelet
  fixes that directory whatever ``--root-dir`` says. ``/dev/kmsg`` stays the host's;
- network: ``hostNetwork: true``, and ``KUBERNETES_SERVICE_HOST``/``PORT`` naming the
  API server (127.0.0.1 and its port). The tests' kube-apiserver listens on 127.0.0.1
  only and no kube-proxy serves the ``kubernetes`` Service's ClusterIP, so a pod on
  the CNI bridge could not reach it; on a cluster the rendered pod reaches it by the
  Service. On the host's network the fixed ports (NATS' 4222 and 8222, the sidecars'
  metrics ports 5678-5682) may be taken on a shared machine, so each becomes a free one
  in arguments, probes and ``ports`` alike (``support.kube_play.use_ports``, the podman
  pod test's rule).

Checked:

- every container of the pod starts: the init container exits 0, then each of the six
  (collector, health, nats, reporter, allocator, device-plugin) is running and ready by
  its own readinessProbe, which kubelet runs;
- the hostPath mounts that containerd made (``crictl inspect``) are the real ones:
  the device-plugin container's ``/var/lib/kubelet/device-plugins`` is kubelet's
  directory, the allocator's ``/var/lib/kubelet/pod-resources`` the kubelet's under its
  root (its ``kubelet.sock`` is a socket there), the state (mounted by ``subPath``:
  kubelet's ``volume-subpaths`` bind) the directory under the node's root;
- the pod's device plugin registers with the real kubelet: the Node's capacity and
  allocatable show ``nvidia.com/gpu: 8`` (dgx-h100, the overlay's scenario), and the
  plugin's socket is in kubelet's directory;
- the pod's reporter, in cluster mode with the token kubelet projected for it (the
  RBAC and the node-restriction policy applied for real), writes the node's Device
  with its 8 GPUs;
- a pod asking ``nvidia.com/gpu: 1`` is then admitted and runs with one GPU of that
  Device in ``NVIDIA_VISIBLE_DEVICES``: kubelet's Allocate was answered by the pod's
  plugin.

A mutant overlay without the device-plugins mount leaves allocatable without
``nvidia.com/gpu`` (the pod is still Ready) and fails the mount, registration and
GPU-pod tests; a reporter that does not write to the cluster fails the Device test; a
container that cannot start fails the module with its name, exit code and log.

Opt-in like the image tests (``IMAGE_TESTS=1``, marker ``image``): it needs podman and
the image build.
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from gpulet_allocator.kubelet.deviceplugin.server import socket_name
from gpulet_common.embedded_nats import free_port
from support.control_plane_fixtures import unique_name
from support.deploy import KUSTOMIZE, kustomize
from support.gpulet_on_kube import must_apply
from support.kube_play import fixed_ports, use_ports
from support.node import Pods, RealNode, pod_manifest
from support.node_gpulet import env_of
from support.node_parts import DEVICE_PLUGIN_DIR
from support.podman import (
    IMAGE,
    NATS_IMAGE,
    SKIP_REASON,
    Podman,
    build_images,
    enabled,
    local,
    missing_tool,
)
from support.waiting import wait_until

BUILD_TIMEOUT_S = 1800  # from scratch: debootstrap and every wheel, on a busy machine
READY_TIMEOUT_S = 240.0
GPU = "nvidia.com/gpu"
MOCK_LABEL = "gpulet.io/mock-gpus"
NAMESPACE = "gpulet-system"
KUBELET_DIR = "/var/lib/kubelet"
STATE_DIR = "/var/lib/gpulet"
DEVICES = "/apis/scheduling.koordinator.sh/v1alpha1/devices"
SERVICES = ("collector", "health", "nats", "reporter", "allocator", "device-plugin")

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.image,
    pytest.mark.slow,
    pytest.mark.timeout(BUILD_TIMEOUT_S + 900),
    *([] if enabled() else [pytest.mark.skip(reason=SKIP_REASON)]),
]

JsonObj = dict[str, Any]

# What the DaemonSet controller adds to every daemon pod (k8s.io/kubernetes
# pkg/controller/daemon/util: AddOrUpdateDaemonPodTolerations), network-unavailable
# for host-network pods only.
DAEMON_TOLERATIONS = (
    ("node.kubernetes.io/not-ready", "NoExecute"),
    ("node.kubernetes.io/unreachable", "NoExecute"),
    ("node.kubernetes.io/disk-pressure", "NoSchedule"),
    ("node.kubernetes.io/memory-pressure", "NoSchedule"),
    ("node.kubernetes.io/pid-pressure", "NoSchedule"),
    ("node.kubernetes.io/unschedulable", "NoSchedule"),
)
HOST_NETWORK_TOLERATION = ("node.kubernetes.io/network-unavailable", "NoSchedule")


def stamp_pod(daemonset: Mapping[str, Any], node: str) -> JsonObj:
    """The Pod the DaemonSet controller makes of ``daemonset`` for ``node``."""
    template = copy.deepcopy(daemonset["spec"]["template"])
    spec: JsonObj = template["spec"]
    spec["affinity"] = {
        **(spec.get("affinity") or {}),
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            }
        },
    }
    tolerations = list(DAEMON_TOLERATIONS)
    if spec.get("hostNetwork"):
        tolerations.append(HOST_NETWORK_TOLERATION)
    have = {(t.get("key"), t.get("effect")) for t in spec.get("tolerations", [])}
    spec["tolerations"] = list(spec.get("tolerations", [])) + [
        {"key": key, "operator": "Exists", "effect": effect}
        for key, effect in tolerations
        if (key, effect) not in have
    ]
    spec["nodeName"] = node
    metadata = template.get("metadata", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{daemonset['metadata']['name']}-",
            "namespace": daemonset["metadata"]["namespace"],
            "labels": {**metadata.get("labels", {}), "pod-template-generation": "1"},
            "annotations": dict(metadata.get("annotations", {})),
        },
        "spec": spec,
    }


def for_test_node(
    daemonset: Mapping[str, Any], node: RealNode, state_dir: Path, api_port: int
) -> JsonObj:
    """``daemonset`` with what the test node forces changed (the module's docstring
    says what and why); everything else as rendered."""
    changed = copy.deepcopy(dict(daemonset))
    spec: JsonObj = changed["spec"]["template"]["spec"]
    for container in spec.get("initContainers", []) + spec["containers"]:
        repo = container["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1]
        container["image"] = {"gpulet": local(IMAGE), "nats": local(NATS_IMAGE)}[repo]
        container["imagePullPolicy"] = "Never"
    host_paths = {
        f"{KUBELET_DIR}/pod-resources": str(node.kubelet_root / "pod-resources"),
        STATE_DIR: str(state_dir),
    }
    for volume in spec.get("volumes", []):
        path = volume.get("hostPath", {}).get("path")
        if path in host_paths:
            volume["hostPath"]["path"] = host_paths[path]
    spec["hostNetwork"] = True
    ports = {p: free_port("0.0.0.0") for p in fixed_ports(spec)}
    for container in spec.get("initContainers", []) + spec["containers"]:
        use_ports(container, ports, nats_server=container["name"] == "nats")
        for port in container.get("ports", []):
            port["containerPort"] = ports[port["containerPort"]]
    in_cluster = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)},
    ]
    for container in spec["containers"]:
        container["env"] = [*container.get("env", []), *in_cluster]
    return changed


def only(objects: list[JsonObj], kind: str) -> JsonObj:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s rendered"
    return found[0]


# --- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def image_archives(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The images ``make image`` builds, saved as docker archives: before the real
    node's machine-wide lock is taken (autouse, so first), so that a cold build never
    keeps the other node modules waiting."""
    for tool in ("podman", "kubectl"):
        if problem := missing_tool(tool):
            pytest.fail(problem)
    podman = Podman()
    work = tmp_path_factory.mktemp("images")
    build_images(podman, work / "build.log", BUILD_TIMEOUT_S)
    archives = {}
    for image in (IMAGE, NATS_IMAGE):
        archive = work / f"{image.replace(':', '_').replace('/', '_')}.tar"
        podman("save", "--format", "docker-archive", "-o", str(archive), local(image), timeout=600)
        archives[local(image)] = archive
    yield archives
    for archive in archives.values():
        archive.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def imported(real_node: RealNode, image_archives: dict[str, Path]) -> list[str]:
    """Those images in the node's containerd (namespace ``k8s.io``)."""
    for archive in image_archives.values():
        real_node.ctr("images", "import", str(archive), timeout_s=600)
    listed = real_node.ctr("images", "ls", "-q").split()
    for name in image_archives:
        assert name in listed, f"{name} not in the node's containerd:\n{listed}"
    return list(image_archives)


@pytest.fixture(scope="module")
def daemon_pod(real_node: RealNode, imported: list[str]) -> Iterator[JsonObj]:
    """The DaemonSet's pod on the real node, every container ready."""
    plane = real_node.plane
    objects = kustomize(KUSTOMIZE / "overlays" / "mock")
    daemonset = only(objects, "DaemonSet")
    rest = [o for o in objects if o["kind"] != "DaemonSet"]
    must_apply(plane, rest)
    plane.must(
        "PATCH",
        f"/api/v1/nodes/{real_node.name}",
        {"metadata": {"labels": {MOCK_LABEL: "true"}}},
        content_type="application/merge-patch+json",
    )
    state_dir = real_node.root / "gpulet-state"
    manifest = stamp_pod(for_test_node(daemonset, real_node, state_dir, plane.port), real_node.name)
    pods = Pods(plane, NAMESPACE)
    created = pods.create(manifest)
    name = created["metadata"]["name"]
    try:
        _wait_ready(real_node, pods, name)
        pod = pods.get(name)
        assert pod is not None
        yield pod
    finally:
        print(f"\n--- pod {name}:\n{pods.why(name)}")
        pods.delete(name)
        _wait_gone(pods, name)


def _container_problem(pod: JsonObj) -> str | None:
    """A container that ended or cannot start, named with why."""
    status = pod.get("status", {})
    for s in status.get("initContainerStatuses") or []:
        done = (s.get("state") or {}).get("terminated")
        if done and done.get("exitCode") != 0:
            return f"init container {s['name']}: {json.dumps(done)}"
    for s in status.get("containerStatuses") or []:
        state = s.get("state") or {}
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in {
            "ErrImageNeverPull",
            "CreateContainerError",
            "CreateContainerConfigError",
            "CrashLoopBackOff",
        }:
            return f"{s['name']}: {json.dumps(waiting)} last {json.dumps(s.get('lastState'))}"
        if s.get("restartCount", 0) > 0:
            return f"{s['name']} restarted: {json.dumps(s.get('lastState'))}"
    return None


def _wait_ready(node: RealNode, pods: Pods, name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        pod = pods.get(name)
        assert pod is not None, f"pod {name} went away"
        if problem := _container_problem(pod):
            raise AssertionError(
                f"the DaemonSet's pod did not start: {problem}\n{_logs(node, name)}"
            )
        conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
        if conds.get("Ready") == "True":
            return
        time.sleep(0.5)
    raise AssertionError(
        f"not ready after {READY_TIMEOUT_S} s:\n{pods.why(name)}\n{_logs(node, name)}"
    )


def _wait_gone(pods: Pods, name: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pods.get(name) is not None and time.monotonic() < deadline:
        time.sleep(0.5)


def _containers(node: RealNode, pod_name: str) -> dict[str, JsonObj]:
    """crictl's inspection of each container of ``pod_name``, by container name."""
    listed = json.loads(
        node.crictl("ps", "-a", "-o", "json", "--label", f"io.kubernetes.pod.name={pod_name}")
    )
    out: dict[str, JsonObj] = {}
    for c in listed.get("containers", []):
        info: JsonObj = json.loads(node.crictl("inspect", c["id"]))
        out[c["metadata"]["name"]] = info
    return out


def _logs(node: RealNode, pod_name: str) -> str:
    parts = []
    try:
        for cname, info in _containers(node, pod_name).items():
            cid = info["status"]["id"]
            proc = subprocess.run(
                [*node._crictl(), "logs", "--tail", "15", cid],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            parts.append(f"--- {cname}:\n{(proc.stdout + proc.stderr)[-2000:]}")
    except (RuntimeError, subprocess.SubprocessError, ValueError) as exc:
        parts.append(f"(no container logs: {exc})")
    return "\n".join(parts)


def _mounts(info: Mapping[str, Any]) -> dict[str, str]:
    """containerPath -> hostPath of a container's mounts, as containerd made them."""
    return {m["containerPath"]: m["hostPath"] for m in info["status"].get("mounts", [])}


# --- the tests -----------------------------------------------------------------------


def test_every_container_of_the_daemonset_pod_starts_and_is_ready(
    real_node: RealNode, daemon_pod: JsonObj
) -> None:
    status = daemon_pod["status"]
    init = {s["name"]: s for s in status.get("initContainerStatuses") or []}
    assert init["state-dirs"]["state"]["terminated"]["exitCode"] == 0
    ready = {s["name"]: (s["ready"], "running" in s["state"]) for s in status["containerStatuses"]}
    assert ready == dict.fromkeys(SERVICES, (True, True)), ready
    # Every one ran under containerd on this node, from the images imported.
    infos = _containers(real_node, daemon_pod["metadata"]["name"])
    assert set(SERVICES) <= set(infos), sorted(infos)
    images = {infos[n]["status"]["image"]["image"] for n in SERVICES}
    assert images == {local(IMAGE), local(NATS_IMAGE)}, images


def test_the_hostpath_mounts_are_the_real_ones_under_kubelet(
    real_node: RealNode, daemon_pod: JsonObj
) -> None:
    infos = _containers(real_node, daemon_pod["metadata"]["name"])
    plugin = _mounts(infos["device-plugin"])
    assert plugin.get(str(DEVICE_PLUGIN_DIR)) == str(DEVICE_PLUGIN_DIR), plugin
    allocator = _mounts(infos["allocator"])
    resources = real_node.pod_resources_socket.parent
    assert allocator.get(f"{KUBELET_DIR}/pod-resources") == str(resources), allocator
    assert real_node.pod_resources_socket.is_socket()
    # The state volume is mounted by subPath: kubelet binds the subdirectory under its
    # own pod directory (volume-subpaths) and containerd mounts that, so the mount is
    # kubelet's and its directory is the one under the node's root (same inode).
    state = real_node.root / "gpulet-state"
    subpaths = real_node.kubelet_root / "pods" / daemon_pod["metadata"]["uid"] / "volume-subpaths"
    wanted = {STATE_DIR: state / "state", f"{STATE_DIR}/allocator": state / "allocator"}
    for name in ("collector", "health", "reporter", "allocator", "device-plugin"):
        for inside, host in _mounts(infos[name]).items():
            if inside not in wanted:
                continue
            assert Path(host).is_relative_to(subpaths / "state" / name), (name, host)
            assert _same_file(Path(host), wanted[inside]), (name, inside, host)
    assert f"{STATE_DIR}/allocator" in _mounts(infos["allocator"])


def _same_file(a: Path, b: Path) -> bool:
    sa, sb = a.stat(), b.stat()
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


async def test_the_pods_device_plugin_registers_eight_gpus_with_kubelet(
    real_node: RealNode, daemon_pod: JsonObj
) -> None:
    await wait_until(
        lambda: real_node.allocatable(GPU) == "8",
        timeout_s=90,
        interval_s=0.5,
        what="nvidia.com/gpu: 8 in the Node's allocatable, from the pod's device plugin",
    )
    assert real_node.capacity(GPU) == "8"
    sockets = [p.name for p in DEVICE_PLUGIN_DIR.iterdir() if p.is_socket()]
    assert socket_name("gpulet", GPU) in sockets, sockets


def _device_gpus(real_node: RealNode) -> list[str]:
    """The GPU ids of the node's Device (Koordinator's CRD, written by the reporter)."""
    resp = real_node.plane.request("GET", f"{DEVICES}/{real_node.name}")
    if not resp.ok:
        return []
    entries = resp.body.get("spec", {}).get("devices") or []
    return [str(d.get("id")) for d in entries if d.get("type") == "gpu"]


async def test_the_pods_reporter_writes_the_nodes_device_with_its_own_token(
    real_node: RealNode, daemon_pod: JsonObj
) -> None:
    # In cluster mode, through the projected token kubelet issued for the pod, the RBAC
    # and the node-restriction policy applied above: the node's own Device, 8 GPUs.
    await wait_until(
        lambda: len(_device_gpus(real_node)) == 8,
        timeout_s=90,
        interval_s=0.5,
        what=f"the Device {real_node.name} with 8 GPUs from the pod's reporter",
    )
    fields = real_node.plane.must("GET", f"{DEVICES}/{real_node.name}")["metadata"]
    managers = {m.get("manager") for m in fields.get("managedFields") or []}
    assert "gpulet-tests" not in managers, managers


async def test_a_gpu_pod_gets_a_gpu_from_the_pods_plugin(
    real_node: RealNode, daemon_pod: JsonObj, pods: Pods
) -> None:
    await wait_until(lambda: real_node.allocatable(GPU) == "8", timeout_s=90, interval_s=0.5)
    # The GPU ids the pod's reporter published, to check the pod's GPU against.
    await wait_until(lambda: len(_device_gpus(real_node)) == 8, timeout_s=90, interval_s=0.5)
    name = unique_name("ds-gpu")
    pods.create(pod_manifest(name, real_node.name, limits={GPU: "1"}))
    try:
        await wait_until(
            lambda: pods.running(name) or pods.phase(name) == "Failed",
            timeout_s=120,
            interval_s=0.5,
            what=f"GPU pod {name} running",
        )
        assert pods.running(name), pods.why(name)
        env = env_of(pods.log(name))
        visible = env.get("NVIDIA_VISIBLE_DEVICES", "").split(",")
        assert len(visible) == 1, env
        assert visible[0] in _device_gpus(real_node), (visible, _device_gpus(real_node))
    finally:
        pods.delete(name, grace_s=0)
