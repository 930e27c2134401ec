"""Helpers of the fault tests (tests/faults): what the stream holds, what the Device says,
and services run as their own processes.

* :func:`read_stream` replays the whole ``GPU_HEALTH`` stream with an ordered consumer:
  the ground truth of "was this event lost".
* :func:`device_view` and :func:`device_matches` read the node's Device from the
  Kubernetes API emulator and compare it with a health state (the health service's
  own view), GPU by GPU.
* :class:`Sidecars` starts ``python -m gpulet serve <service>`` processes, kills them with
  SIGKILL, restarts them and always stops them in the end, like kubelet would.

Every wait here is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from nats.js.api import DeliverPolicy

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.messages import UNHEALTHY_SEVERITIES, HealthEvent, HealthState
from gpulet_common.settings.nats import NatsSettings
from support.kube_emulator import KubeEmulator

DEVICES = "devices"


# --- the health stream ------------------------------------------------------------------


async def read_stream(url: str, *, within: float = 15.0) -> list[HealthEvent]:
    """Every event the ``GPU_HEALTH`` stream holds, oldest first."""
    async with Bus.connect(
        NatsSettings(url=url), name="fault-audit", max_initial_attempts=20
    ) as bus:
        js = bus.jetstream
        info = await js.stream_info(subjects.HEALTH_STREAM)
        want = int(info.state.messages)
        events: list[HealthEvent] = []
        if want == 0:
            return events
        sub = await js.subscribe(
            subjects.HEALTH_WILDCARD,
            stream=subjects.HEALTH_STREAM,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        try:
            with anyio.move_on_after(within):
                async for msg in sub.messages:
                    events.append(codec.HEALTH_EVENT.decode(msg.data))
                    if len(events) >= want:
                        break
        finally:
            await sub.unsubscribe()
        return events


def duplicates(events: Sequence[HealthEvent]) -> list[str]:
    seen: set[str] = set()
    dup: list[str] = []
    for event in events:
        if event.event_id in seen:
            dup.append(event.event_id)
        seen.add(event.event_id)
    return dup


# --- the Device -------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuOnDevice:
    health: bool
    reason: str


def device_view(emu: KubeEmulator, node: str) -> dict[str, GpuOnDevice]:
    """uuid -> (health, condition reason) of the node's Device; {} while there is none."""
    obj = emu.get_object(DEVICES, node)
    if obj is None:
        return {}
    out: dict[str, GpuOnDevice] = {}
    for entry in obj.get("spec", {}).get("devices", []):
        conditions = entry.get("conditions") or [{}]
        out[entry["id"]] = GpuOnDevice(bool(entry["health"]), str(conditions[0].get("reason", "")))
    return out


def reason_candidates(state: HealthState) -> dict[str, set[str]]:
    """For each unhealthy GPU, the Device reasons that correctly explain it: one per
    active critical/fatal condition (``Xid79``, ``Thermal``...), or any if none."""
    from gpulet_reporter.health_view import reason_for

    out: dict[str, set[str]] = {}
    for gpu in state.gpus:
        if gpu.healthy and gpu.present:
            continue
        out[gpu.gpu_uuid] = {
            reason_for(xid=None, condition=c.condition, kind=c.kind, text=c.reason, healthy=False)
            for c in gpu.conditions
            if c.severity in UNHEALTHY_SEVERITIES
        }
    return out


def device_mismatches(emu: KubeEmulator, node: str, state: HealthState) -> list[str]:
    """How the Device differs from ``state`` (empty: it reflects it)."""
    seen = device_view(emu, node)
    if not seen:
        return ["no Device yet"]
    reasons = reason_candidates(state)
    problems: list[str] = []
    for gpu in state.gpus:
        want = gpu.healthy and gpu.present
        got = seen.get(gpu.gpu_uuid)
        if got is None:
            problems.append(f"GPU {gpu.gpu_index} ({gpu.gpu_uuid}) missing from the Device")
            continue
        if got.health != want:
            problems.append(f"GPU {gpu.gpu_index}: Device health {got.health}, state {want}")
        elif not want and reasons.get(gpu.gpu_uuid) and got.reason not in reasons[gpu.gpu_uuid]:
            problems.append(
                f"GPU {gpu.gpu_index}: Device reason {got.reason}, "
                f"expected one of {sorted(reasons[gpu.gpu_uuid])}"
            )
    return problems


def healthy_map(state: HealthState) -> dict[str, bool]:
    return {g.gpu_uuid: g.healthy and g.present for g in state.gpus}


# --- services as processes ----------------------------------------------------------------


def service_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment without any GPULET_ setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULET_")}
    env.pop("KUBECONFIG", None)
    env.update(extra or {})
    return env


@dataclass
class Sidecar:
    name: str
    command: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    history: list[tuple[str, float]] = field(default_factory=list)

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, f"{self.name} runs"
        with self.log.open("ab") as out:
            out.write(f"\n===== start #{self.starts + 1} at {time.time():.3f}\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        self.starts += 1
        self.history.append(("start", time.monotonic()))

    def kill(self) -> None:
        """SIGKILL, and reap it: nothing of the process survives, no clean-up ran."""
        process = self.process
        assert process is not None, f"{self.name} was never started"
        assert process.poll() is None, f"{self.name} is not running"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        self.kills += 1
        self.history.append(("kill", time.monotonic()))

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def tail(self, chars: int = 3000) -> str:
        if not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-chars:]


class Sidecars:
    """``python -m gpulet serve <service>`` processes; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, logs: Path, common: Sequence[str], env: Mapping[str, str]) -> None:
        self.logs = logs
        self.common = list(common)
        self.env = dict(env)
        self.by_name: dict[str, Sidecar] = {}

    def add(self, name: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> Sidecar:
        command = [sys.executable, "-m", "gpulet", "serve", name, *self.common, *args]
        sidecar = Sidecar(name, command, {**self.env, **(env or {})}, self.logs / f"{name}.log")
        self.by_name[name] = sidecar
        return sidecar

    def __getitem__(self, name: str) -> Sidecar:
        return self.by_name[name]

    def stop_all(self) -> None:
        for sidecar in self.by_name.values():
            if sidecar.running and sidecar.process is not None:
                sidecar.process.terminate()
        for sidecar in self.by_name.values():
            sidecar.stop()

    def dump(self) -> str:
        return "\n".join(f"==== {s.name}\n{s.tail()}" for s in self.by_name.values())


@contextmanager
def running_sidecars(
    logs: Path, common: Sequence[str], env: Mapping[str, str]
) -> Iterator[Sidecars]:
    sidecars = Sidecars(logs, common, env)
    try:
        yield sidecars
    finally:
        sidecars.stop_all()


async def readyz(port: int) -> dict[str, Any]:
    """A service process's ``/readyz`` body (its status board)."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http,
        http.get(f"http://127.0.0.1:{port}/readyz") as response,
    ):
        body: dict[str, Any] = json.loads(await response.text())
        return body


async def component_state(port: int, name: str) -> str:
    """``"<state>: <detail>"`` of one component of a service process, or "unreachable"."""
    try:
        body = await readyz(port)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return "unreachable"
    state = body.get("components", {}).get(name, {})
    return f"{state.get('state')}: {state.get('detail')}"


async def wait_component(port: int, name: str, state: str = "ready", within: float = 30) -> None:
    with anyio.fail_after(within):
        while not (await component_state(port, name)).startswith(state):  # noqa: ASYNC110
            await anyio.sleep(0.05)


def summary(figures: Mapping[str, Any]) -> str:
    """One line of measured figures, printed by the tests for docs/reliability.md."""
    parts = []
    for key, value in figures.items():
        parts.append(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}")
    return "FIGURES " + " ".join(parts)
