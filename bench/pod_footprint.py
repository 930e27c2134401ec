"""What one node's pod costs in sidecar mode: RSS and idle CPU of each process, and the sum.

Method
------
The pod as deploy/ runs it (deploy/kustomize/base/daemonset.yaml): a nats-server with
deploy/nats/node.conf and the mock variant of auth.conf, then one process per service,
``gpulet serve collector|health|reporter|allocator|device-plugin``, each with its own
NATS user, the DaemonSet's arguments (``--state-dir``, ``--metrics-port``) and the
mock NVML (scenario dgx-h100, 8 GPUs) for the services that read GPUs. A fake kubelet
(tests/support/fake_kubelet.py, in this process, not counted) takes the device
plugin's registration and answers the allocator's PodResources calls (the collector asks
the allocator which pods hold which GPU). The reporter runs offline (no API
server here), which changes what it does, not what it imports. ``--dra`` sets
``dra.mode = "both"``: the allocator then runs the DRA kubelet plugin (its gRPC
sockets, its claim reader against an API emulator in this process, not counted).

After ``--settle`` seconds (the issue's figure: 25 s), each process's RSS is read from
/proc (VmRSS), then its CPU time over ``--idle`` seconds of doing nothing but its
periodic work (the collector samples 8 GPUs every second): % of one core.

The figures lean on the mock NVML: with a real driver, libnvidia-ml adds its own
mappings to the collector's and the health service's RSS. ``--nvml real`` runs the
collector and the health service on the real driver instead (on a GPU machine), which
measures exactly that.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _util import rss_mb, table

from gpulet_common.embedded_nats import EmbeddedNats, free_port
from support.deploy import NATS_USERS, inbox_prefix, node_config, password_variable
from support.fake_kubelet import running_fake_kubelet
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import enable_dra

NODE = "bench-node"
# service -> extra arguments, as the DaemonSet's containers (with the mock overlay) run them.
SIDECARS: dict[str, list[str]] = {
    "collector": ["--nvml", "mock:dgx-h100"],
    "health": ["--nvml", "mock:dgx-h100"],
    "reporter": ["--set", "reporter.mode=offline"],
    "allocator": [],
    "device-plugin": [],
}
# The pod budget: under NVIDIA's device plugin + GFD + dcgm-exporter (about 0.4-0.5 GB)
# while doing more, with kubernetes-asyncio in the reporter and the allocator.
TARGETS_MB = {"collector": 60.0, "pod": 380.0}
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def _password(user: str) -> str:
    return f"bench-{user}"


def _env(user: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULET_")}
    env.update(
        {
            "NODE_NAME": NODE,
            "GPULET_NATS__USER": user,
            "GPULET_NATS__PASSWORD": _password(user),
            "GPULET_NATS__INBOX_PREFIX": inbox_prefix(user),
            **extra,
        }
    )
    return env


def sidecars(nvml: str) -> dict[str, list[str]]:
    """The sidecars' arguments; ``nvml == "real"``: the GPU readers on the real driver."""
    if nvml == "mock":
        return SIDECARS
    return {
        name: ["--nvml", "nvml"] if "--nvml" in extra else extra for name, extra in SIDECARS.items()
    }


async def measure(
    settle_s: float, idle_s: float, nvml: str = "mock", dra: bool = False
) -> list[tuple[str, float, float, int]]:
    for user in NATS_USERS:  # nats-server reads them from its environment
        os.environ[password_variable(user)] = _password(user)
    with tempfile.TemporaryDirectory(prefix="gpl-pod-") as tmp:
        root = Path(tmp)
        plugin_dir = root / "device-plugins"
        plugin_dir.mkdir()
        state = root / "state"
        logs = root / "logs"
        logs.mkdir()
        socket_env = {
            "GPULET_ALLOCATOR__PLUGIN__PLUGIN_DIR": f"{plugin_dir}/",
            "GPULET_ALLOCATOR__POD_RESOURCES_SOCKET": str(root / "pod-resources.sock"),
        }
        config = node_config(root, mock=True)
        processes: dict[str, subprocess.Popen[bytes]] = {}
        async with (
            EmbeddedNats(state_dir=root / "nats", config_file=config) as server,
            running_fake_kubelet(plugin_dir, pod_resources_socket=root / "pod-resources.sock"),
            KubeEmulator.running() as emu,
        ):
            if dra:
                # dra.mode both, the DRA kubelet plugin in the allocator (the default
                # plugin_host) serving its sockets and reading claims from the emulator.
                enable_dra(emu)
                socket_env |= {
                    "GPULET_DRA__MODE": "both",
                    "GPULET_DRA__KUBECONFIG": str(emu.write_kubeconfig(root / "kubeconfig")),
                    "GPULET_DRA__CDI_DIR": str(root / "cdi"),
                    "GPULET_DRA__PLUGINS_REGISTRY": str(root / "registry"),
                    "GPULET_DRA__PLUGINS_DIR": str(root / "plugins"),
                }
            try:
                for name, extra in sidecars(nvml).items():
                    command = [
                        sys.executable,
                        "-m",
                        "gpulet",
                        "serve",
                        name,
                        "--nats",
                        server.url,
                        "--state-dir",
                        str(state),
                        "--metrics-port",
                        str(free_port()),
                        *extra,
                    ]
                    with (logs / f"{name}.log").open("wb") as out:
                        processes[name] = subprocess.Popen(  # noqa: ASYNC220 - started, not waited on
                            command,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            env=_env(name, socket_env),
                        )
                await anyio.sleep(settle_s)
                pids = {name: p.pid for name, p in processes.items()}
                assert server.pid is not None
                pids["nats-server"] = server.pid
                for name, process in processes.items():
                    if process.poll() is not None:
                        raise SystemExit(
                            f"{name} exited: {(logs / f'{name}.log').read_text()[-2000:]}"
                        )
                rss = {name: rss_mb(pid) for name, pid in pids.items()}
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                started = time.monotonic()
                await anyio.sleep(idle_s)
                elapsed = time.monotonic() - started
                return [
                    (
                        name,
                        rss[name],
                        100 * (cpu_seconds(pid) - before[name]) / elapsed,
                        threads(pid),
                    )
                    for name, pid in pids.items()
                ]
            finally:
                for process in processes.values():
                    process.terminate()
                for process in processes.values():
                    try:
                        process.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=25.0, help="seconds before measuring")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of CPU measured")
    parser.add_argument(
        "--dra",
        action="store_true",
        help="dra.mode both: the DRA kubelet plugin in the allocator, claims in the API emulator",
    )
    parser.add_argument(
        "--nvml",
        default="mock",
        choices=["mock", "real"],
        help="'real': the collector and the health service on the real driver",
    )
    args = parser.parse_args()
    rows = anyio.run(measure, args.settle, args.idle, args.nvml, args.dra)
    nvml_words = "mock NVML (dgx-h100)" if args.nvml == "mock" else "the real NVML driver"
    total_rss = sum(r for _, r, _, _ in rows)
    total_cpu = sum(c for _, _, c, _ in rows)
    load = os.getloadavg()[0]
    print(
        table(
            f"One node's pod in sidecar mode, {nvml_words}"
            f"{', dra.mode both' if args.dra else ''}, after {args.settle:g} s "
            f"(load average {load:.1f} on {os.cpu_count()} cores)",
            ["process", "RSS MB", "idle CPU % of a core", "threads"],
            [(n, f"{r:.1f}", f"{c:.1f}", str(t)) for n, r, c, t in rows]
            + [("sum", f"{total_rss:.1f}", f"{total_cpu:.1f}", str(sum(t for *_, t in rows)))],
        )
    )
    collector = next(r for n, r, _, _ in rows if n == "collector")
    print(
        f"targets: collector < {TARGETS_MB['collector']:g} MB "
        f"({'met' if collector < TARGETS_MB['collector'] else 'NOT met'}), "
        f"pod < {TARGETS_MB['pod']:g} MB ({'met' if total_rss < TARGETS_MB['pod'] else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
