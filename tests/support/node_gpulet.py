"""gpulet on the real node (support.node): the agent started for it, its ledger, and
what a pod's container printed (its env and ``ls -l`` of its device nodes)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from support.agent_process import GPULET, Agent
from support.control_plane import ControlPlane
from support.control_plane_fixtures import unique_name
from support.node import Pods, RealNode, pod_manifest
from support.waiting import wait_until

DRIVER = "gpu.gpulet.io"
RESOURCE = "/apis/resource.k8s.io/v1"
ROOT = Path(__file__).resolve().parents[2]
DEVICE_CLASSES = ROOT / "deploy" / "kustomize" / "components" / "dra" / "deviceclasses.yaml"

_CHAR = re.compile(r"^c\S+\s+\d+\s+\S+\s+\S+\s+(\d+),\s+(\d+)\s.*\s(/dev/\S+)$")


def start_agent(node: RealNode, workdir: Path, *extra: str) -> Agent:
    """``gpulet run`` on the mock NVML (8 V100s in NVLink pairs), serving ``node``'s
    kubelet, its device nodes under the node's mock dev root; kubelet's PodResources
    is asked every second and a pod gone for 10 s frees its GPUs. (A grace of 1 s freed
    allocations that a loaded kubelet had answered but not listed yet: 3 failures in 8
    runs of test_node_device_plugin; production's grace is 60 s.)"""
    return Agent(
        workdir,
        "--nvml",
        "mock:nvlink-pairs-8gpu",
        *node.gpulet_settings(),
        "--set",
        "allocator.release_interval_s=1",
        "--set",
        "allocator.release_grace_s=10",
        "--set",
        "allocator.pods_poll_s=1",
        *extra,
        node=node.name,
    )


def dra_settings(mode: str, kubeconfig: Path) -> list[str]:
    """``--set`` arguments of DRA ``mode``: the slices are the reporter's to publish, so it
    runs against the cluster with ``kubeconfig`` (the admin's)."""
    sets = {
        "dra.mode": mode,
        "dra.kubeconfig": str(kubeconfig),
        "dra.quiet_window_s": "0.05",
        "reporter.mode": "cluster",
        "reporter.kubeconfig": str(kubeconfig),
        "reporter.request_retry_s": "0.2",
    }
    return [arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]


def gpulet_cli(agent: Agent, *args: str) -> str:
    """``gpulet <args>`` for the agent's node over its NATS; its stdout."""
    proc = subprocess.run(
        [*GPULET, *args, "--node", agent.node, "--nats", agent.nats_url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, f"gpulet {' '.join(args)}: {proc.stderr[-2000:]}"
    return proc.stdout


def ledger(agent: Agent) -> dict[str, Any]:
    """The allocator's state (``gpulet allocator state --json``) over the agent's NATS."""
    state: dict[str, Any] = json.loads(gpulet_cli(agent, "allocator", "state", "--json"))
    return state


def env_of(log: str) -> dict[str, str]:
    head = log.split("---", 1)[0]
    return dict(line.split("=", 1) for line in head.splitlines() if "=" in line)


def char_devices(log: str) -> dict[str, tuple[int, int]]:
    """``ls -l`` lines of character devices: path -> (major, minor)."""
    out = {}
    for line in log.split("---", 1)[1].splitlines():
        found = _CHAR.match(line.strip())
        if found:
            out[found.group(3)] = (int(found.group(1)), int(found.group(2)))
    return out


async def wait_running(pods: Pods, name: str, timeout_s: float = 90) -> None:
    try:
        await wait_until(
            lambda: pods.running(name), timeout_s=timeout_s, interval_s=0.2, what=f"{name} running"
        )
    except AssertionError:
        print(pods.why(name))
        raise


async def wait_logged(pods: Pods, name: str, marker: str = "nvidiactl") -> str:
    """The container's output once it has printed ``---`` and ``marker``."""
    try:
        await wait_until(
            lambda: "---" in pods.log(name) and marker in pods.log(name),
            timeout_s=30,
            interval_s=0.2,
            what=f"{name}'s output",
        )
    except AssertionError:
        print(f"{name}'s output so far:\n{pods.log(name)}")
        raise
    return pods.log(name)


def apply_device_classes(plane: ControlPlane) -> None:
    """deploy/'s DeviceClasses, as they are."""
    for obj in yaml.safe_load_all(DEVICE_CLASSES.read_text()):
        resp = plane.apply(obj)
        assert resp.ok, resp.raw[:1000]


def devices(node: RealNode) -> dict[str, dict[str, Any]]:
    body = node.plane.must(
        "GET",
        f"{RESOURCE}/resourceslices",
        query={"fieldSelector": f"spec.nodeName={node.name},spec.driver={DRIVER}"},
    )
    return {d["name"]: d for s in body["items"] for d in s["spec"].get("devices", [])}


def claimed_pod(node: RealNode, pods: Pods, device_class: str, script: str) -> str:
    """A pod on ``node`` with one claim of ``device_class`` from a template."""
    template = unique_name("tpl")
    node.plane.must(
        "POST",
        f"{RESOURCE}/namespaces/{pods.ns}/resourceclaimtemplates",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": template},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]
                    }
                }
            },
        },
    )
    name = unique_name("dra")
    manifest = pod_manifest(
        name,
        None,
        script=script,
        claims=[{"name": "gpu", "resourceClaimTemplateName": template}],
    )
    manifest["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node.name}
    pods.create(manifest)
    return name


def claim_of(node: RealNode, pods: Pods, name: str) -> dict[str, Any]:
    pod = pods.get(name)
    assert pod is not None
    statuses = pod.get("status", {}).get("resourceClaimStatuses") or []
    claim_name = statuses[0]["resourceClaimName"]
    claim: dict[str, Any] = node.plane.must(
        "GET", f"{RESOURCE}/namespaces/{pods.ns}/resourceclaims/{claim_name}"
    )
    return claim


async def wait_slice_tainted(node: RealNode, uuid: str) -> str:
    """The device of GPU ``uuid`` in the node's slice, once it carries a taint (in mode
    ``both``, a GPU the device plugin holds: without it the scheduler may give a claim
    the GPU a device-plugin pod already has, and Prepare refuses it)."""

    def device() -> str | None:
        for name, d in devices(node).items():
            if d["attributes"]["uuid"]["string"] == uuid and d.get("taints"):
                return name
        return None

    await wait_until(
        lambda: device() is not None, timeout_s=30, interval_s=0.2, what=f"{uuid} tainted"
    )
    found = device()
    assert found is not None
    return found


def dra_registered(agent: Agent) -> bool:
    """kubelet has taken gpulet's DRA driver (NotifyRegistrationStatus said so): a claim
    prepared before that fails the pod's start, and kubelet retries it only after a
    back-off of up to a minute and more."""
    return "kubelet registered DRA driver" in agent.output()
