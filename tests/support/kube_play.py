"""The DaemonSet's pod as ``podman kube play`` runs it, for tests/image/test_image_pod.py.

Podman 4.3 plays Pods and Deployments, not DaemonSets, and it has no API server, no
kubelet and no cluster network. :func:`pod_for_podman` turns the DaemonSet that
kustomize renders into one Pod, changing only what podman or this machine cannot take
as it is. Everything the image test is about stays as rendered: every container's
command and arguments, environment, probes, resources and securityContext (users,
read-only root filesystem, dropped capabilities, no privilege escalation), the pod's
securityContext and grace period, the NATS configuration (the ConfigMaps are played
with the pod) and the per-service NATS users and passwords.

The transform, step by step (each step names why):

1. ``kind: DaemonSet`` -> ``kind: Pod`` named by the test, with the template's labels
   and annotations (podman plays no DaemonSets).
2. Images: ``gpulet`` and ``nats`` (the names in the base, before the overlay's
   ``images:`` rewrite, and after it) -> the images ``make image`` built.
3. Network: ``hostNetwork: true``: podman's pod networks need a CNI bridge (iptables)
   that this machine class does not allow. The pod then shares the host's ports, so
   every fixed port becomes a free one the test picks: NATS' client port (4222, in
   node.conf: NATS gets ``--port``, the gpulet containers ``GPULET_NATS__URL``), its
   monitoring port (``--http_port``) and the sidecars' metrics ports
   (``--metrics-port``), in arguments and probes alike. The containers' ``ports``
   lists go: podman 4.3 turns them into port mappings, which a pod on the host's
   network cannot have (in Kubernetes they only document the ports).
4. Volumes: ``emptyDir`` and directory ``hostPath`` volumes -> directories under the
   test's temporary directory (generic: whatever directory the manifest names). An
   emptyDir is made the way kubelet makes one (mode 0777, so root without capabilities
   can write to it too); a hostPath directory the way kubelet's ``DirectoryOrCreate``
   makes one (root's, 0755). A hostPath of another type (a device such as /dev/kmsg, a
   file, a socket) stays the host's. A ``projected`` volume (a service-account token)
   -> an empty directory: there is no API server to issue a token. A mount with a
   ``subPath`` of such a volume gets a volume of its own for that subdirectory:
   podman 4.3 ignores ``subPath`` on hostPath volumes.
5. Environment: ``secretKeyRef`` -> the value from the rendered Secret (podman 4.3
   turns a played Secret into a podman secret but cannot read it back for ``env``);
   ``fieldRef: spec.nodeName`` -> the node name the test gives (podman knows no nodes).
6. The reporter: ``GPULET_REPORTER__MODE=offline``: without an API server it writes the
   Device it would apply into its state directory, where the test reads it.

7. Init containers, if the manifest has any, get steps 2, 3 and 5 too, and the pod
   ``restartPolicy: OnFailure``: podman 4.3 restarts a finished init container under
   the DaemonSet's ``Always`` and then fails to remove it.

Nothing else changes. Fields podman does not use (nodeSelector, tolerations,
priorityClassName, serviceAccountName) stay in the spec and are ignored by it.
"""

from __future__ import annotations

import base64
import copy
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

JsonObj = dict[str, Any]

NATS_CLIENT_PORT = 4222  # deploy/nats/node.conf `port`
_DIRECTORY_TYPES = ("", "Directory", "DirectoryOrCreate")
_PORT_ARG = re.compile(r"^(--[a-z_-]*port=)(\d+)$")
_URL_PORT = re.compile(r"(127\.0\.0\.1|localhost):(\d+)")
MEMORY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ("192Mi", "1G", "1048576") in bytes."""
    for unit, factor in MEMORY_UNITS.items():
        if quantity.endswith(unit):
            return int(float(quantity[: -len(unit)]) * factor)
    return int(quantity)


def only(objects: list[JsonObj], kind: str, name: str | None = None) -> JsonObj:
    """The one rendered object of ``kind`` (whose name starts with ``name``)."""
    found = [
        o
        for o in objects
        if o["kind"] == kind and (name is None or o["metadata"]["name"].startswith(name))
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def fixed_ports(spec: JsonObj) -> set[int]:
    """Every port the pod listens on: NATS' client port and what the manifest names."""
    ports = {NATS_CLIENT_PORT}
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        ports.update(p["containerPort"] for p in c.get("ports", []))
        for arg in c.get("args", []):
            if m := _PORT_ARG.match(arg):
                ports.add(int(m.group(2)))
    return ports


def _remap_probe(probe: JsonObj, ports: Mapping[int, int]) -> None:
    if "httpGet" in probe:
        probe["httpGet"]["port"] = ports[int(probe["httpGet"]["port"])]
    if "exec" in probe:
        probe["exec"]["command"] = [
            _URL_PORT.sub(lambda m: f"{m.group(1)}:{ports[int(m.group(2))]}", part)
            for part in probe["exec"]["command"]
        ]


def _set_env(container: JsonObj, name: str, value: str) -> None:
    env = [e for e in container.get("env", []) if e["name"] != name]
    container["env"] = [*env, {"name": name, "value": value}]


def use_ports(container: JsonObj, ports: Mapping[int, int], *, nats_server: bool) -> None:
    """Step 3 for one container on the host's network: every fixed port of
    :func:`fixed_ports` in its arguments and probes becomes ``ports[port]``; the NATS
    server (``nats_server``) gets ``--port``, any other container ``GPULET_NATS__URL``.
    Its ``ports`` list is the caller's."""
    c = container
    c["args"] = [
        f"{m.group(1)}{ports[int(m.group(2))]}" if (m := _PORT_ARG.match(a)) else a
        for a in c.get("args", [])
    ]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in c:
            _remap_probe(c[probe], ports)
    if nats_server:
        c["args"].append(f"--port={ports[NATS_CLIENT_PORT]}")
    else:
        _set_env(c, "GPULET_NATS__URL", f"nats://127.0.0.1:{ports[NATS_CLIENT_PORT]}")


def pod_for_podman(
    objects: list[JsonObj],
    *,
    pod_name: str,
    node_name: str,
    images: Mapping[str, str],
    ports: Mapping[int, int],
    volume_dir: Callable[[str, str], Path],
) -> list[JsonObj]:
    """The documents to give ``podman kube play``: the rendered ConfigMaps and the Pod.

    ``images`` maps the manifest's image names (``gpulet``, ``nats``) to local ones;
    ``ports`` maps every port of :func:`fixed_ports` to a free one; ``volume_dir(kind,
    name)`` makes the host directory for the pod volume ``name`` of ``kind``
    (``emptyDir``, ``hostPath``, ``projected``) and returns its path.
    """
    daemonset = only(objects, "DaemonSet")
    template = copy.deepcopy(daemonset["spec"]["template"])
    spec: JsonObj = template["spec"]
    secrets = {s["metadata"]["name"]: s for s in objects if s["kind"] == "Secret"}

    # 1. A Pod. 3. On the host's network.
    pod: JsonObj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "labels": template["metadata"].get("labels", {}),
            "annotations": template["metadata"].get("annotations", {}),
        },
        "spec": spec,
    }
    spec["hostNetwork"] = True
    if spec.get("initContainers"):
        # 7. podman 4.3 gives init containers the pod's restartPolicy: with Always it
        # restarts one that finished, then fails to remove it ("cannot remove container
        # ... as it is running"). OnFailure runs them once; it differs from Always only
        # for a service that exits 0, which the test counts as broken anyway.
        spec["restartPolicy"] = "OnFailure"

    # 4. Volumes.
    made: dict[str, Path] = {}
    for volume in spec["volumes"]:
        if volume.get("hostPath", {}).get("type", "") not in _DIRECTORY_TYPES:
            continue  # a device, file or socket of the node
        for kind in ("emptyDir", "hostPath", "projected"):
            if kind in volume:
                del volume[kind]
                made[volume["name"]] = volume_dir(kind, volume["name"])
                volume["hostPath"] = {"path": str(made[volume["name"]]), "type": "Directory"}
                break
    # podman 4.3 mounts a hostPath volume's root whatever the mount's subPath: a mount
    # with a subPath gets a volume of its own, that subdirectory (made like kubelet
    # makes a missing subPath: root's, 0755).
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        for mount in c.get("volumeMounts", []):
            sub = mount.pop("subPath", "")
            if not sub or mount["name"] not in made:
                continue
            name = f"{mount['name']}-{re.sub(r'[^a-z0-9-]', '-', sub.lower())}"
            if not any(v["name"] == name for v in spec["volumes"]):
                path = made[mount["name"]] / sub
                path.mkdir(mode=0o755, parents=True, exist_ok=True)
                spec["volumes"].append(
                    {"name": name, "hostPath": {"path": str(path), "type": "Directory"}}
                )
            mount["name"] = name

    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        # 2. Images (the overlay's rewrite keeps the name's last path segment).
        base_name = c["image"].rsplit("/", 1)[-1].split(":", 1)[0]
        c["image"] = images[base_name]
        # 3. Ports.
        use_ports(c, ports, nats_server=base_name == "nats" and c in spec["containers"])
        c.pop("ports", None)
        # 5. Environment.
        for e in c.get("env", []):
            source = e.get("valueFrom", {})
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                data = secrets[ref["name"]]["data"][ref["key"]]
                e.pop("valueFrom")
                e["value"] = base64.b64decode(data).decode()
            elif source.get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                e.pop("valueFrom")
                e["value"] = node_name
        # 6. The reporter, offline.
        if c["name"] == "reporter":
            _set_env(c, "GPULET_REPORTER__MODE", "offline")

    config_maps = [o for o in objects if o["kind"] == "ConfigMap"]
    return [*config_maps, pod]


def host_dir_of(spec: JsonObj, container: str, mount_path: str) -> Path:
    """The host directory behind ``mount_path`` in ``container`` of the played Pod."""
    c = next(c for c in spec["containers"] if c["name"] == container)
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == mount_path)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    return Path(volume["hostPath"]["path"]) / str(mount.get("subPath", ""))
