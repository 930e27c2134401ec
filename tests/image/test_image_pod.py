"""The shipped image, for real: the DaemonSet's pod played by podman from ``make image``.

Opt-in, because it builds images and runs containers: ``IMAGE_TESTS=1`` (the
README's test command sets it; ``.ci/run`` installs podman, buildah, runc, catatonit
and debootstrap first). Without it every test here is skipped with that reason; with it,
a missing podman is a failure, not a skip. Marker ``image``: ``-m "not image"`` leaves
them out.

What runs, all for real (the only stand-in is the mock NVML the mock overlay selects):

1. ``scripts/image.sh build``, what ``make image`` runs: the gpulet image and the NATS
   sidecar image (layers cached, so an unchanged tree rebuilds in seconds).
2. kustomize renders ``deploy/kustomize/overlays/mock``; :mod:`support.kube_play` turns
   its DaemonSet into a Pod (the transform is documented there: Pod instead of
   DaemonSet, local images, host network with free ports, temporary directories for
   emptyDir/hostPath, Secret values inlined, the reporter offline); ``podman kube play``
   runs it with the rendered ConfigMaps.
3. Ready: every container's readinessProbe passes, run the way kubelet runs it (the
   NATS container's exec probe inside it with ``podman exec``, the sidecars' httpGet on
   their port). The time from ``kube play`` to that is one of the README's figures.

Then, through the running pod: each container's user, capabilities, no-new-privileges
and read-only root filesystem are the manifest's; the per-service NATS users reach only
their subjects (a forbidden publish and subscribe from inside each container are
permission violations, an allowed subscribe is not); ``gpulet mock inject --gpu 2 --xid
79`` from a container in the pod gives a health event that a plain NATS subscriber
sees, and the reporter's offline Device marks GPU 2 unhealthy; a real Prometheus
scrapes every sidecar's ``/metrics``; every container's RSS stays under its limit; and
the pod stops within its grace period with every container exiting 0.

A broken image (say, one built without the ``reporter`` extra) fails at step 3: the
container that cannot start is named with its exit code and the end of its log.
Figures (image size, time to ready, RSS per container) are printed and written to
``build/image-test-figures.json``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
import yaml

from gpulet_common import subjects
from gpulet_common.embedded_nats import free_port
from support.deploy import KUSTOMIZE, PROMETHEUS_DIR, ROOT, kustomize
from support.kube_play import (
    NATS_CLIENT_PORT,
    fixed_ports,
    host_dir_of,
    memory_bytes,
    only,
    pod_for_podman,
)
from support.podman import IMAGE, NATS_IMAGE, Podman, local, missing_tool
from support.waiting import wait_until

NODE = "podman-node-1"
POD_PREFIX = "gpulet-image-test-"
READY_TIMEOUT_S = 240.0
WAIT_TIMEOUT_S = 60.0
FIGURES = ROOT / "build" / "image-test-figures.json"
STATE_DIR = "/var/lib/gpulet"  # the containers' --state-dir


def _remove_stale_pods(podman: Podman) -> None:
    """Pods an earlier run left behind when it was killed (its pid is gone)."""
    for name in podman("pod", "ps", "--format", "{{.Name}}").split():
        pid = name.removeprefix(POD_PREFIX)
        if name.startswith(POD_PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            podman.run("pod", "rm", "--force", name, timeout=180)


# --- fixtures ------------------------------------------------------------------------


@dataclass
class Pod:
    podman: Podman
    name: str
    spec: dict[str, Any]  # the played Pod's spec
    ports: dict[int, int]  # the manifest's port -> the one on this host
    state_dir: Path  # the host directory behind the reporter's state directory
    metrics_ports: dict[str, int]  # sidecar -> its /metrics port on this host
    operator_password: str
    figures: dict[str, Any] = field(default_factory=dict)

    def container(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = next(c for c in self.spec["containers"] if c["name"] == name)
        return found

    def cname(self, container: str) -> str:
        """podman's name for a container of the pod."""
        return f"{self.name}-{container}"

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.ports[NATS_CLIENT_PORT]}"

    def env(self, container: str) -> dict[str, str]:
        return {e["name"]: e["value"] for e in self.container(container).get("env", [])}


def _probe(pod: Pod, container: str, probe: dict[str, Any]) -> tuple[bool, str]:
    """Run one probe of the manifest the way kubelet would: (passed, detail)."""
    if "httpGet" in probe:
        get = probe["httpGet"]
        url = f"http://127.0.0.1:{get['port']}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1)) as reply:
                return 200 <= reply.status < 400, f"{url}: {reply.status}"
        except urllib.error.HTTPError as exc:
            return False, f"{url}: {exc.code} {exc.read()[:500]!r}"
        except (urllib.error.URLError, OSError) as exc:
            return False, f"{url}: {exc}"
    command = probe["exec"]["command"]
    result = pod.podman.run("exec", pod.cname(container), *command, timeout=30)
    return result.returncode == 0, f"{command}: rc {result.returncode} {result.stderr[-300:]}"


def _broken_containers(pod: Pod) -> list[str]:
    """Containers that exited or restarted, with their exit code and log."""
    broken = []
    for c in pod.spec["containers"]:
        state = pod.podman.inspect(pod.cname(c["name"]))
        status = state["State"]["Status"]
        restarts = state.get("RestartCount", 0)
        if status != "running" or restarts:
            broken.append(
                f"container {c['name']} is {status} (exit code {state['State']['ExitCode']}, "
                f"{restarts} restarts); its log ends:\n{pod.podman.logs(pod.cname(c['name']))}"
            )
    return broken


@pytest.fixture(scope="module")
def pod(
    podman: Podman, images: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pod]:
    if problem := missing_tool("kubectl"):
        pytest.fail(problem)
    _remove_stale_pods(podman)
    root = tmp_path_factory.mktemp("pod")
    objects = kustomize(KUSTOMIZE / "overlays" / "mock")
    daemonset = only(objects, "DaemonSet")
    ports = {p: free_port("0.0.0.0") for p in fixed_ports(daemonset["spec"]["template"]["spec"])}

    def volume_dir(kind: str, name: str) -> Path:
        path = root / "volumes" / name
        path.mkdir(parents=True)
        path.chmod(0o777 if kind == "emptyDir" else 0o755)
        return path

    name = f"{POD_PREFIX}{os.getpid()}"
    documents = pod_for_podman(
        objects,
        pod_name=name,
        node_name=NODE,
        images={"gpulet": local(IMAGE), "nats": local(NATS_IMAGE)},
        ports=ports,
        volume_dir=volume_dir,
    )
    played = root / "pod.yaml"
    played.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    secret = only(objects, "Secret", "gpulet-nats-users")
    info = Pod(
        podman=podman,
        name=name,
        spec=documents[-1]["spec"],
        ports=ports,
        state_dir=host_dir_of(documents[-1]["spec"], "reporter", STATE_DIR),
        metrics_ports={
            c["name"]: ports[p["containerPort"]]
            for c in daemonset["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
            if p["name"].startswith("m-")
        },
        operator_password=base64.b64decode(secret["data"]["operator"]).decode(),
    )
    try:
        started = time.monotonic()
        podman("kube", "play", str(played), timeout=300)
        pending = {c["name"]: c["readinessProbe"] for c in info.spec["containers"]}
        details: dict[str, str] = {}
        deadline = started + READY_TIMEOUT_S
        while pending and time.monotonic() < deadline:
            broken = _broken_containers(info)
            assert not broken, "the pod did not start:\n" + "\n".join(broken)
            for container, probe in list(pending.items()):
                ok, details[container] = _probe(info, container, probe)
                if ok:
                    del pending[container]
            if pending:
                time.sleep(0.5)
        assert not pending, f"not ready after {READY_TIMEOUT_S} s: " + "; ".join(
            f"{c}: {details.get(c)}\n{podman.logs(info.cname(c))}" for c in pending
        )
        info.figures["ready_s"] = round(time.monotonic() - started, 1)
        info.figures.update(images)
        yield info
    finally:
        podman.run("pod", "rm", "--force", name, timeout=180)
        # kube play keeps each ConfigMap as a volume of that name.
        for config_map in documents[:-1]:
            podman.run("volume", "rm", "--force", config_map["metadata"]["name"])
        if info.figures:
            FIGURES.parent.mkdir(parents=True, exist_ok=True)
            FIGURES.write_text(json.dumps(info.figures, indent=2) + "\n")
            print(f"\nimage test figures: {json.dumps(info.figures, indent=2)}")


# --- the tests -----------------------------------------------------------------------


def _proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (ln.partition(":") for ln in lines)}


def test_every_probe_of_the_manifest_passes(pod: Pod) -> None:
    failed = []
    for c in pod.spec["containers"]:
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            ok, detail = _probe(pod, c["name"], c[kind])
            if not ok:
                failed.append(f"{c['name']} {kind}: {detail}")
    assert failed == []


def test_containers_run_with_the_manifests_privileges(pod: Pod) -> None:
    """Users, capabilities, no-new-privileges, seccomp and a read-only root filesystem,
    seen on the running processes and tried from inside, not read from podman's config."""
    pod_context = pod.spec["securityContext"]
    for c in pod.spec["containers"]:
        context = {**pod_context, **c["securityContext"]}
        state = pod.podman.inspect(pod.cname(c["name"]))
        status = _proc_status(state["State"]["Pid"])
        uid, gid = context["runAsUser"], context["runAsGroup"]
        assert status["Uid"].split() == [str(uid)] * 4, (c["name"], status["Uid"])
        assert status["Gid"].split() == [str(gid)] * 4, (c["name"], status["Gid"])
        assert context["capabilities"]["drop"] == ["ALL"]
        for capability_set in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[capability_set], 16) == 0, (c["name"], capability_set)
        assert context["allowPrivilegeEscalation"] is False
        assert status["NoNewPrivs"] == "1", c["name"]
        assert status["Seccomp"] == "2", c["name"]  # filtering: RuntimeDefault
        assert context["readOnlyRootFilesystem"] is True
        # Root without capabilities could write to /, which root owns, were it writable.
        tried = pod.podman.run(
            "exec", pod.cname(c["name"]), "touch", "/written-by-the-image-test", timeout=30
        )
        assert tried.returncode != 0, f"{c['name']} could write to its root filesystem"
        assert "Read-only file system" in tried.stderr, (c["name"], tried.stderr)
    assert {
        c["name"]: c["securityContext"].get("runAsUser", 65532) for c in pod.spec["containers"]
    } == {
        "nats": 65532,
        "collector": 65532,
        "health": 65532,
        "reporter": 65532,
        "allocator": 0,
        "device-plugin": 0,
    }


# Run inside a container of the pod with its own NATS user, password and inbox prefix:
# each (action, subject) in argv[1], then the server's answer (permission violations).
_PERMISSION_PROBE = """
import asyncio, json, os, sys
import nats

async def main():
    errors = []
    async def on_error(exc):
        errors.append(str(exc))
    nc = await nats.connect(
        os.environ["GPULET_NATS__URL"],
        user=os.environ["GPULET_NATS__USER"],
        password=os.environ["GPULET_NATS__PASSWORD"],
        inbox_prefix=os.environ["GPULET_NATS__INBOX_PREFIX"],
        error_cb=on_error,
        allow_reconnect=False,
        name="image-test-permissions",
    )
    answers = []
    for action, subject in json.loads(sys.argv[1]):
        before = len(errors)
        if action == "publish":
            await nc.publish(subject, b"{}")
        else:
            await nc.subscribe(subject)
        for _ in range(20):
            await nc.flush(timeout=5)
            if len(errors) > before:
                break
            await asyncio.sleep(0.05)
        answers.append(errors[before:])
    await nc.close()
    print(json.dumps(answers))

asyncio.run(main())
"""

# Per service user: what it may subscribe to, and a publish and a subscribe it may not
# do (deploy/nats/mock/auth.conf): only the health service publishes health events,
# only the operator injects faults, nobody reads another user's replies, and the
# consumers of GPU state do not read the health events.
_ALLOWED_AND_FORBIDDEN = {
    "collector": ("gpulet.inventory.request.*", "gpu.health.{node}", "_INBOX.>"),
    "health": ("gpu.samples.*", "gpulet.mock.inject.{node}", "_INBOX.reporter.>"),
    # The consumers read the gpu_health bucket, never the health events.
    "reporter": ("gpu.inventory.*", "gpu.health.{node}", "gpu.health.*"),
    "allocator": ("gpu.inventory.*", "gpu.health.{node}", "_INBOX.device-plugin.>"),
    "device-plugin": ("gpu.inventory.*", "gpulet.health.clear.{node}", "gpu.health.*"),
}


def test_each_service_user_reaches_only_its_subjects_from_inside_the_pod(pod: Pod) -> None:
    for container, (allowed, forbidden_pub, forbidden_sub) in _ALLOWED_AND_FORBIDDEN.items():
        token = subjects.token(NODE)
        steps = [
            ("subscribe", allowed),
            ("publish", forbidden_pub.format(node=token)),
            ("subscribe", forbidden_sub),
        ]
        result = pod.podman.run(
            "exec", pod.cname(container), "python3", "-c", _PERMISSION_PROBE, json.dumps(steps)
        )
        assert result.returncode == 0, (container, result.stderr[-2000:])
        allowed_errors, pub_errors, sub_errors = json.loads(result.stdout)
        assert allowed_errors == [], (container, allowed)
        assert len(pub_errors) == 1, (container, steps[1], pub_errors)
        assert "permissions violation for publish" in pub_errors[0].lower(), pub_errors
        assert len(sub_errors) == 1, (container, steps[2], sub_errors)
        assert "permissions violation for subscription" in sub_errors[0].lower(), sub_errors


@pytest.mark.anyio
async def test_injected_xid_reaches_a_subscriber_and_the_reporters_device(pod: Pod) -> None:
    nc = await nats.connect(
        pod.nats_url,
        user="operator",
        password=pod.operator_password,
        inbox_prefix="_INBOX.operator",
        allow_reconnect=False,
        name="image-test-subscriber",
    )
    try:
        events = await nc.subscribe(subjects.health(NODE))
        await nc.flush()
        # `gpulet mock inject` from a container in the pod, as the operator user.
        injected = await anyio.to_thread.run_sync(
            lambda: pod.podman.run(
                "run", "--rm", "--pod", pod.name, "--read-only", "--cap-drop", "ALL",
                "--env", f"NODE_NAME={NODE}",
                "--env", f"GPULET_NATS__URL={pod.nats_url}",
                "--env", "GPULET_NATS__USER=operator",
                "--env", "GPULET_NATS__INBOX_PREFIX=_INBOX.operator",
                "--env", f"GPULET_NATS__PASSWORD={pod.operator_password}",
                local(IMAGE), "mock", "inject", "--gpu", "2", "--xid", "79",
            )
        )  # fmt: skip
        assert injected.returncode == 0, injected.stdout + injected.stderr
        assert json.loads(injected.stdout.splitlines()[-1])["applied"] is True
        event: dict[str, Any] = {}
        with anyio.fail_after(WAIT_TIMEOUT_S):
            while not (event.get("gpu_index") == 2 and event.get("xid") == 79):
                event = json.loads((await events.next_msg(timeout=WAIT_TIMEOUT_S)).data)
        assert event["node"] == NODE
        assert event["healthy"] is False
        assert event["kind"] == "xid"
    finally:
        await nc.close()

    device_file = pod.state_dir / "reporter" / f"device-{NODE}.json"

    def gpu2_health() -> object:
        try:
            devices = json.loads(device_file.read_text())["spec"]["devices"]
        except (OSError, ValueError, KeyError):
            return None
        return next((d.get("health") for d in devices if d.get("minor") == 2), None)

    await wait_until(
        lambda: gpu2_health() is False,
        timeout_s=WAIT_TIMEOUT_S,
        interval_s=0.2,
        what=f"GPU 2 unhealthy in the reporter's {device_file.name}",
    )
    device = json.loads(device_file.read_text())
    assert device["kind"] == "Device"
    assert device["metadata"]["name"] == NODE
    assert [d["health"] for d in device["spec"]["devices"]].count(False) == 1


def test_prometheus_scrapes_every_sidecar(pod: Pod, tmp_path: Path) -> None:
    if problem := missing_tool("prometheus"):
        pytest.fail(problem)
    prometheus = str(shutil.which("prometheus"))
    sidecars = pod.metrics_ports
    assert set(sidecars) == set(_ALLOWED_AND_FORBIDDEN)
    config = {
        "global": {"scrape_interval": "1s"},
        "rule_files": ["gpulet-rules.yaml"],
        "scrape_configs": [
            {
                "job_name": "gpulet",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{port}"], "labels": {"container": name}}
                    for name, port in sidecars.items()
                ],
            }
        ],
    }
    shutil.copy(PROMETHEUS_DIR / "gpulet-rules.yaml", tmp_path / "gpulet-rules.yaml")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    web = f"127.0.0.1:{free_port()}"
    log = tmp_path / "prometheus.log"

    def get(path: str, **query: str) -> Any:
        url = f"http://{web}{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.loads(reply.read())["data"]

    with log.open("wb") as out:
        server = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address={web}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        up: dict[str, str] = {}
        temperatures: list[Any] = []
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                up = {
                    r["metric"]["container"]: r["value"][1]
                    for r in get("/api/v1/query", query='up{job="gpulet"}')["result"]
                }
                temperatures = get("/api/v1/query", query="gpulet_gpu_temperature_celsius")[
                    "result"
                ]
            except (urllib.error.URLError, OSError, KeyError, ValueError):
                pass
            if up == dict.fromkeys(sidecars, "1") and len(temperatures) == 8:
                break
            time.sleep(0.5)
        targets = get("/api/v1/targets")["activeTargets"]
        samples = get("/api/v1/query", query='scrape_samples_scraped{job="gpulet"}')["result"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert up == dict.fromkeys(sidecars, "1"), (up, targets)
    assert sorted(
        (t["labels"]["container"], t["health"], t["lastError"]) for t in targets
    ) == sorted((name, "up", "") for name in sidecars)
    assert all(float(s["value"][1]) > 0 for s in samples), samples
    assert sorted(int(t["metric"]["gpu"]) for t in temperatures) == list(range(8))
    assert {t["metric"]["Hostname"] for t in temperatures} == {NODE}


def _rss_bytes(pid: int) -> int:
    """Resident memory of every process in the container's memory cgroup."""
    cgroup = next(
        line.split(":", 2)[2]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if line.split(":", 2)[1] in ("memory", "")
    )
    procs_file = Path("/sys/fs/cgroup/memory" + cgroup + "/cgroup.procs")
    if not procs_file.exists():
        procs_file = Path("/sys/fs/cgroup" + cgroup + "/cgroup.procs")
    pids = [int(p) for p in procs_file.read_text().split()] if procs_file.exists() else [pid]
    total = 0
    for p in pids:
        rss = _proc_status(p).get("VmRSS", "0 kB").split()[0]
        total += int(rss) * 1024
    return total


def test_every_container_stays_under_its_memory_limit(pod: Pod) -> None:
    rss: dict[str, float] = {}
    over = []
    for c in pod.spec["containers"]:
        state = pod.podman.inspect(pod.cname(c["name"]))
        limit = memory_bytes(c["resources"]["limits"]["memory"])
        assert state["HostConfig"]["Memory"] == limit, c["name"]  # podman enforces it
        assert state["State"]["OOMKilled"] is False, c["name"]
        used = _rss_bytes(state["State"]["Pid"])
        rss[c["name"]] = round(used / 2**20, 1)
        if used >= limit:
            over.append(
                f"{c['name']}: {used / 2**20:.0f} MiB >= limit {c['resources']['limits']['memory']}"
            )
    pod.figures["rss_mib"] = rss
    assert over == []
    assert not _broken_containers(pod)


def test_pod_stops_cleanly_within_its_grace_period(pod: Pod) -> None:
    """Last: kubelet's stop, SIGTERM then SIGKILL after terminationGracePeriodSeconds."""
    grace = int(pod.spec["terminationGracePeriodSeconds"])
    started = time.monotonic()
    pod.podman("pod", "stop", "--time", str(grace), pod.name, timeout=grace + 60)
    took = time.monotonic() - started
    pod.figures["stop_s"] = round(took, 1)
    exits = {
        c["name"]: pod.podman.inspect(pod.cname(c["name"]))["State"]["ExitCode"]
        for c in pod.spec["containers"]
    }
    assert exits == dict.fromkeys(exits, 0), {
        n: (code, pod.podman.logs(pod.cname(n))) for n, code in exits.items() if code
    }
    assert took < grace, f"the pod took {took:.1f} s to stop (grace period {grace} s)"
