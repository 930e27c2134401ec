"""Pod start on a real node: pod created -> its container running with a GPU, through
gpulet's device plugin and through gpulet's DRA driver, and the share of that time
that gpulet's own call (Allocate or NodePrepareResources) takes, as kubelet timed it.

Method
------
The real node of the tests (``tests/support/node.py``): a real etcd, kube-apiserver,
kube-scheduler and kube-controller-manager (resourceclaim controller), kubelet v1.37.2,
containerd v2.4.2 and Debian's runc, all on this machine; ``gpulet run`` on the mock
NVML (8 GPUs, ``dra.mode=both``) serves the kubelet's device-plugin and DRA APIs. Each
path runs ``--pods`` pods one after another, each asking for one GPU:

- **device plugin**: ``resources.limits: nvidia.com/gpu: 1`` and ``nodeName`` set (no
  scheduler in the path, as a DaemonSet-less bare pod would be);
- **DRA**: a ResourceClaimTemplate of class ``gpu.gpulet.io`` and a nodeSelector: the
  controller makes the claim, the scheduler allocates it and binds the pod, kubelet
  calls Prepare, containerd applies the CDI spec.

The clock starts before the pod's POST and stops when the API server first shows its
container ``running`` (polled every 20 ms, so figures carry up to 20 ms of polling).
The pod is then deleted and gone before the next one. gpulet's share: kubelet's own
histograms, read from its ``/metrics`` through the API server's node proxy before and
after each path: ``kubelet_device_plugin_alloc_duration_seconds`` (the Allocate call,
as kubelet timed it) and ``dra_operations_duration_seconds{operation_name=
"PrepareResources"}`` (all of kubelet's Prepare step, gpulet's gRPC call inside it); the
mean of each over the path's pods, against the mean pod start.

The GPUs are the mock NVML's; nothing else in the path is mocked. The containers are
busybox on overlayfs: a CUDA image would add its own unpack and start time.

Run (root, after ``scripts/k8s-bins.sh``): ``python bench/node.py [--pods 20] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _util import mean, percentile, table

from support.control_plane import ControlPlane
from support.node import Pods, RealNode, exclusive, pod_manifest
from support.node_gpulet import (
    apply_device_classes,
    claimed_pod,
    devices,
    dra_registered,
    dra_settings,
    start_agent,
)
from support.waiting import wait_until

GPU = "nvidia.com/gpu"


def histogram(metrics: str, name: str, label: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram's series whose labels contain ``label``."""
    total = count = 0.0
    for line in metrics.splitlines():
        if line.startswith(f"{name}_sum") and label in line:
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count") and label in line:
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def kubelet_metrics(node: RealNode) -> str:
    resp = node.plane.request("GET", f"/api/v1/nodes/{node.name}/proxy/metrics")
    assert resp.ok, resp.raw[:500]
    return resp.raw.decode()


def time_pod(pods: Pods, create: Any) -> float:
    t0 = time.monotonic()
    name = create()
    deadline = t0 + 120
    while not pods.running(name):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not run:\n{pods.why(name)}")
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    pods.delete(name)
    while pods.get(name) is not None:
        if time.monotonic() > deadline + 60:
            raise RuntimeError(f"{name} was not deleted")
        time.sleep(0.1)
    return elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="bench-node-"))
    root = Path(tempfile.mkdtemp(prefix="gn", dir="/tmp"))
    plane = ControlPlane(base / "k8s")
    plane.start()
    agent = None
    node: RealNode | None = None
    try:
        plane.start_scheduler()
        plane.start_controller_manager(["resourceclaim-controller", "serviceaccount-controller"])
        apply_device_classes(plane)
        with exclusive():
            node = RealNode(plane, "bench-node", root)
            node.start()
            kubeconfig = plane.write_kubeconfig(base / "kubeconfig")
            (base / "agent").mkdir()
            agent = start_agent(
                node,
                base / "agent",
                *dra_settings("both", kubeconfig),
            )
            ready, started = node, agent
            anyio.run(
                lambda: wait_until(
                    lambda: (
                        ready.allocatable(GPU) == "8"
                        and len(devices(ready)) == 8
                        and dra_registered(started)
                    ),
                    timeout_s=60,
                    interval_s=0.2,
                )
            )
            plane.create_namespace("bench")
            pods = Pods(plane, "bench")
            results: dict[str, Any] = {}
            paths = {
                "device plugin": (
                    lambda: _dp_pod(pods, ready),
                    "kubelet_device_plugin_alloc_duration_seconds",
                    f'resource_name="{GPU}"',
                ),
                "DRA": (
                    lambda: claimed_pod(ready, pods, "gpu.gpulet.io", "true"),
                    "dra_operations_duration_seconds",
                    'operation_name="PrepareResources"',
                ),
            }
            for path, (create, metric, label) in paths.items():
                time_pod(pods, create)  # warm-up: the first pod of a path pays for caches
                s0, c0 = histogram(kubelet_metrics(ready), metric, label)
                starts = [time_pod(pods, create) for _ in range(args.pods)]
                s1, c1 = histogram(kubelet_metrics(ready), metric, label)
                calls = c1 - c0
                results[path] = {
                    "pods": len(starts),
                    "p50_ms": percentile(starts, 50) * 1000,
                    "p99_ms": percentile(starts, 99) * 1000,
                    "mean_ms": mean(starts) * 1000,
                    "gpulet_calls": calls,
                    "gpulet_mean_ms": (s1 - s0) / calls * 1000 if calls else float("nan"),
                }
            return results
    finally:
        if agent is not None:
            agent.stop()
        if node is not None:
            node.stop()
        plane.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def _dp_pod(pods: Pods, node: RealNode) -> str:
    name = f"dp-{time.monotonic_ns()}"
    pods.create(pod_manifest(name, node.name, script="true", limits={GPU: "1"}))
    return name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=20, help="pods per path")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    results = run(args)
    rows = [
        [
            path,
            r["pods"],
            f"{r['p50_ms']:.0f}",
            f"{r['p99_ms']:.0f}",
            f"{r['gpulet_mean_ms']:.1f}",
            f"{100 * r['gpulet_mean_ms'] / r['mean_ms']:.1f} %",
        ]
        for path, r in results.items()
    ]
    print(
        table(
            "Pod created -> container running with 1 GPU (real kubelet and containerd)",
            ["path", "pods", "p50 ms", "p99 ms", "gpulet call ms (kubelet's mean)", "share"],
            rows,
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
