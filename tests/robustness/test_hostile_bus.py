"""Hostile messages on every subject a running ``gpulet run`` reads, and in its stream.

What is real: a nats-server with JetStream (the ``nats_server`` fixture), ``gpulet run``
as a process (every service, mock NVML), ``gpulet alerts --replay-all`` as a process.

Each subject the agent subscribes to or serves gets every class of hostile payload
that applies to its message type:

* **deep**: ``{"a":`` 1,500 times (msgspec's RecursionError used to end the agent),
  and 200,000 unbalanced ``[``;
* **huge**: close to NATS's 1 MB limit -- over the type's byte limit, or a
  20,000-GPU inventory / 5,000-sample batch over ``limits.max_gpus``;
* **invalid UTF-8** inside a string; **wrong types**;
* **forged node** (another node's name on our subject), **duplicate UUIDs**,
  **out-of-range numbers**, **far-future and far-past timestamps**, where the type
  carries a node, GPUs, numbers or times;
* **random JSON trees**, seeded, up to 10,000 deep and 1 MB.

After each message: the agent process is alive, ``/readyz`` answers within one
second with the status it had, and the state is the state before -- the health
state, the allocator's state and the collector's inventory, each asked over NATS.
A message was *handled* (not merely not yet read) when a request got its refusal,
or, for a publication, when ``gpulet_bus_{malformed,rejected}_messages_total`` of the
agent counted it once per consumer of the subject.

Finally ``gpulet alerts --replay-all`` reads the GPU_HEALTH stream holding every
hostile event published above, plus one real event (an XID injected through the
mock): it stays up, prints the real one, and prints nothing else.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
from nats.aio.client import Client as NatsClient

from gpulet_allocator import protocol as p
from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats, free_port
from gpulet_common.messages import (
    GpuSample,
    HealthEvent,
    HealthStateRequest,
    Inventory,
    InventoryRequest,
    MockInjectRequest,
    SampleBatch,
)

pytestmark = pytest.mark.anyio

NODE = "test.node"
OTHER = "other.node"
GPULET = [sys.executable, "-m", "gpulet"]
# Below the nats-server's default max_payload (1 MiB) with room for headers.
NEAR_MAX = 1_000_000
RANDOM_TREES = 6  # per subject, seeded


# --- the agent -----------------------------------------------------------------------


class AgentProcess:
    def __init__(self, tmp_path: Path, nats_url: str) -> None:
        self.http_port = free_port()
        self.log = (tmp_path / "agent.log").open("w+b")
        self.proc = subprocess.Popen(
            [
                *GPULET,
                "run",
                "--nvml",
                "mock",
                "--node",
                NODE,
                "--nats",
                nats_url,
                "--state-dir",
                str(tmp_path / "state"),
                "--metrics-port",
                str(self.http_port),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, timeout_s: float = 1.0) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), bytes(exc.read())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def bad_messages(self) -> float:
        """Messages the agent's bus dropped (malformed or rejected), all types."""
        assert self.alive(), f"the agent died\n{self.output()[-3000:]}"
        _, body = self.get("/metrics", timeout_s=5)
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith(
                ("gpulet_bus_malformed_messages_total{", "gpulet_bus_rejected_messages_total{")
            ):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> tuple[int | None, str]:
        """Terminate (SIGTERM); the exit code and everything the agent logged."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        output = self.output()
        self.log.close()
        return self.proc.returncode, output


# --- hostile payloads ----------------------------------------------------------------


def _json(value: Any) -> bytes:
    return msgspec.json.encode(value)


def _with(template: dict[str, Any], **changes: Any) -> bytes:
    return _json({**template, **changes})


def _utf8(template: dict[str, Any], field: str) -> bytes:
    marker = "@@INVALID@@"
    return _with(template, **{field: marker}).replace(marker.encode(), b"\xff\xfe\xc3(")


def _common(template: dict[str, Any], string_field: str) -> dict[str, bytes]:
    """Classes every message type gets."""
    return {
        "deep-objects": b'{"a":' * 1500 + b"1" + b"}" * 1500,
        "deep-arrays-unbalanced": b"[" * 200_000,
        "deep-inside-a-valid-message": _with(template, extra="@@DEEP@@").replace(
            b'"@@DEEP@@"', _deep_value(5000)
        ),
        "huge": _with(template, **{string_field: "x" * (NEAR_MAX - 2000)}),
        "invalid-utf8": _utf8(template, string_field),
        "wrong-types": _with(template, **{string_field: {"not": ["a", "string"]}}),
        "not-json": b"\x00\x01{]",
        "empty": b"",
    }


def _deep_value(depth: int) -> bytes:
    """JSON nested ``depth`` levels (objects and arrays in turn), built as bytes: an
    encoder would hit the recursion limit itself."""
    half = depth // 2
    return b'{"k":[' * half + b"1" + b"]}" * half


def _random_tree(rng: random.Random, max_depth: int, max_bytes: int) -> bytes:
    """A random JSON document: a spine of random depth, random scalars along it and a
    wide array of them at its end; sometimes cut short."""
    depth = rng.choice([1, 10, 100, 1000, max_depth, rng.randint(1, max_depth)])
    width = rng.choice([0, 10, 1000, 20_000])
    scalars = [b"null", b"true", b"-1", b"1" + b"0" * 30, b"1e308", b"-0.0", b'""', b'"]}["']
    scalars += [b'"\\u00e9\\"[{"', b'"\\\\"', b'"\xe2\x80\xa8"', b'"\\ud800"']
    leaf = b"[" + b",".join(rng.choice(scalars) for _ in range(width)) + b"]"
    opens: list[bytes] = []
    closes: list[bytes] = []
    for level in range(depth):
        if level % 2:
            opens.append(b"[" + rng.choice(scalars) + b",")
            closes.append(b"]")
        else:
            opens.append(b'{"node":"' + NODE.encode() + b'","k":')
            closes.append(b"}")
    data = b"".join(opens) + leaf + b"".join(reversed(closes))
    # A string that would be a complete document is trimmed at a random point: a
    # truncated tree must be refused like any other.
    if len(data) > max_bytes:
        data = data[: rng.randint(1, max_bytes)]
    return data


def event_template(uuid: str) -> dict[str, Any]:
    now = time.time()
    template: dict[str, Any] = msgspec.to_builtins(
        HealthEvent(
            event_id="hostile-1",
            node=NODE,
            gpu_uuid=uuid,
            gpu_index=0,
            kind="xid",
            severity="fatal",
            healthy=False,
            reason="forged",
            message="forged",
            observed_at=now,
            published_at=now,
        )
    )
    return template


def health_event_payloads(uuid: str) -> dict[str, bytes]:
    t = event_template(uuid)
    return {
        **_common(t, "message"),
        "forged-node": _with(t, node=OTHER),
        "empty-node": _with(t, node=""),
        "out-of-range-index": _with(t, gpu_index=-1),
        "out-of-range-repeat": _with(t, repeat_count=0),
        "far-future": _with(t, observed_at=1e18),
        "far-past": _with(t, observed_at=1.0),
        "infinite-time": _json(t).replace(
            f'"observed_at":{_json(t["observed_at"]).decode()}'.encode(), b'"observed_at":1e999'
        ),
        "future-condition-since": _with(t, condition_since=1e18),
    }


def inventory_payloads(inventory: Inventory) -> dict[str, bytes]:
    t = msgspec.to_builtins(inventory)
    gpus = t["gpus"]
    g0 = gpus[0]
    # The 10,000-GPU inventory (it held the agent at 86 % CPU for minutes).
    many = [{"uuid": f"GPU-{i:08d}", "index": i} for i in range(10_000)]
    return {
        **_common(t, "driver_version"),
        # Over NATS's 1 MB the server refuses it; under, it is too many GPUs.
        "huge": _with(t, gpus=many * 3)[: NEAR_MAX - 10] + b"]}",
        "forged-node": _with(t, node=OTHER),
        "forged-node-no-gpus": _with(t, node=OTHER, gpus=[]),
        "forged-node-other-gpus": _with(
            t, node=OTHER, gpus=[{**g, "uuid": "GPU-fake-" + g["uuid"]} for g in gpus]
        ),
        "duplicate-uuids": _with(t, gpus=[g0, {**g0, "index": 99}]),
        "duplicate-indexes": _with(t, gpus=[g0, {**gpus[1], "index": g0["index"]}]),
        "too-many-gpus": _with(t, gpus=many),
        "one-gpu-too-many": _with(t, gpus=[{"uuid": f"G{i}", "index": i} for i in range(1025)]),
        "out-of-range-index": _with(t, gpus=[{**g0, "index": -1}]),
        "out-of-range-memory": _with(t, gpus=[{**g0, "memory_total_bytes": -5}]),
        "out-of-range-temperature": _with(t, gpus=[{**g0, "temp_shutdown_c": 10**9}]),
        "far-future": _with(t, published_at=1e18),
        "far-past": _with(t, published_at=1.0),
    }


def samples_payloads(uuids: list[str]) -> dict[str, bytes]:
    now = time.time()
    batch = SampleBatch(
        node=NODE,
        timestamp=now,
        samples=[
            GpuSample(uuid=u, index=i, timestamp=now, gpu_util_pct=10, temperature_c=40)
            for i, u in enumerate(uuids)
        ],
    )
    t = msgspec.to_builtins(batch)
    s0 = t["samples"][0]
    return {
        **_common(t, "node"),
        "forged-node": _with(t, node=OTHER),
        "duplicate-uuids": _with(t, samples=[s0, {**s0, "index": 1}]),
        "too-many-gpus": _with(
            t, samples=[{**s0, "uuid": f"GPU-{i}", "index": i} for i in range(5000)]
        ),
        "out-of-range-pct": _with(t, samples=[{**s0, "gpu_util_pct": 150}]),
        "out-of-range-temperature": _with(t, samples=[{**s0, "temperature_c": 5000}]),
        "negative-counter": _with(t, samples=[{**s0, "ecc_volatile_uncorrected": -1}]),
        "far-future": _with(t, timestamp=1e18),
        "far-past": _with(t, timestamp=1.0),
        "far-future-sample": _with(t, samples=[{**s0, "timestamp": 1e18}]),
    }


def request_payloads(template: dict[str, Any], string_field: str) -> dict[str, bytes]:
    return _common(template, string_field)


# --- what must not change ------------------------------------------------------------


class Observer:
    def __init__(self, nc: NatsClient, agent: AgentProcess) -> None:
        self.nc = nc
        self.agent = agent

    async def ask(self, subject: str, payload: bytes) -> Any:
        msg = await self.nc.request(subject, payload, timeout=5)
        return msg

    async def inventory(self) -> Inventory:
        msg = await self.ask(
            subjects.inventory_request(NODE),
            codec.INVENTORY_REQUEST.encode(InventoryRequest(reason="hostile-test")),
        )
        return codec.INVENTORY.decode(msg.data)

    async def state(self) -> dict[str, Any]:
        health = await self.ask(
            subjects.health_state(NODE), codec.HEALTH_STATE_REQUEST.encode(HealthStateRequest())
        )
        allocator = await self.ask(
            subjects.allocator_endpoint(NODE, p.ENDPOINT_STATE),
            p.STATE_REQUEST.encode(p.StateRequest()),
        )
        inventory = await self.inventory()
        state = codec.HEALTH_STATE.decode(health.data)
        return {
            "health": [
                (
                    g.gpu_uuid,
                    g.gpu_index,
                    g.healthy,
                    g.present,
                    sorted(c.condition for c in g.conditions),
                )
                for g in state.gpus
            ],
            "allocator": msgspec.to_builtins(p.STATE_REPLY.decode(allocator.data)),
            "inventory": [(g.uuid, g.index) for g in inventory.gpus],
            "inventory_node": inventory.node,
        }

    def readyz(self) -> tuple[int, float]:
        started = time.monotonic()
        status, _ = self.agent.get("/readyz", timeout_s=1.0)
        return status, time.monotonic() - started


@pytest.fixture
def agent(tmp_path: Path, nats_server: EmbeddedNats) -> Iterator[AgentProcess]:
    running = AgentProcess(tmp_path, nats_server.url)
    try:
        yield running
    finally:
        code, output = running.stop()
        assert code == 0, output[-3000:]
        assert "Traceback" not in output, output[-3000:]


async def _wait_ready(obs: Observer) -> dict[str, Any]:
    """The agent has all its GPUs everywhere: health, allocator, inventory."""
    last: Exception | None = None
    for _ in range(300):
        assert obs.agent.alive(), obs.agent.output()[-3000:]
        try:
            state = await obs.state()
        except (nats.errors.Error, msgspec.DecodeError, OSError) as exc:
            last = exc
        else:
            if (
                len(state["health"]) == 8
                and state["allocator"]["ready"]
                and len(state["allocator"]["gpus"]) == 8
                and len(state["inventory"]) == 8
            ):
                return state
        await anyio.sleep(0.1)
    raise AssertionError(f"agent not ready: {last}\n{obs.agent.output()[-3000:]}")


async def test_no_payload_on_any_subject_kills_misleads_or_stalls_the_agent(
    agent: AgentProcess, nats_server: EmbeddedNats
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        obs = Observer(nc, agent)
        before = await _wait_ready(obs)
        ready_status, _ = await anyio.to_thread.run_sync(obs.readyz)
        inventory = await obs.inventory()
        uuids = [g.uuid for g in inventory.gpus]

        # Publications: (subject, payloads, consumers in `gpulet run`).
        published = [
            # The reporter, allocator and plugin read the gpu_health KV bucket (NodeView),
            # not events; the collector follows them for DCGM_FI_DEV_XID_ERRORS.
            # `gpulet alerts` is below.
            (subjects.health(NODE), health_event_payloads(uuids[0]), 1),
            (subjects.inventory(NODE), inventory_payloads(inventory), 4),
            (subjects.samples(NODE), samples_payloads(uuids), 1),
        ]
        # Requests: answered with a refusal once handled.
        requested = [
            (
                subjects.health_clear(NODE),
                request_payloads({"gpu": uuids[0], "requested_by": "x"}, "gpu"),
            ),
            (subjects.health_state(NODE), request_payloads({"gpu": uuids[0]}, "gpu")),
            (
                subjects.inventory_request(NODE),
                request_payloads({"reason": "x"}, "reason"),
            ),
            (
                subjects.mock_inject(NODE),
                {
                    **request_payloads({"gpu": 0, "fault": "xid", "value": 79}, "fault"),
                    "out-of-range-gpu": _json({"gpu": -1, "fault": "xid", "value": 79}),
                    "negative-duration": _json(
                        {"gpu": 0, "fault": "xid", "value": 79, "duration_s": -1}
                    ),
                    "infinite-value": b'{"gpu":0,"fault":"xid","value":1e999}',
                },
            ),
            *[
                (
                    subjects.allocator_endpoint(NODE, endpoint),
                    request_payloads(
                        {"resource": "nvidia.com/gpu", "containers": [[uuids[0]]]}, "resource"
                    ),
                )
                for endpoint in (
                    p.ENDPOINT_ALLOCATE,
                    p.ENDPOINT_ALLOCATE_BATCH,
                    p.ENDPOINT_PREFERRED,
                    p.ENDPOINT_RELEASE,
                    p.ENDPOINT_STATE,
                )
            ],
        ]
        rng = random.Random(20261123)
        for _subject, payloads, _ in published:
            for i in range(RANDOM_TREES):
                payloads[f"random-tree-{i}"] = _random_tree(rng, 10_000, NEAR_MAX)
        for _subject, payloads in requested:
            for i in range(RANDOM_TREES // 2):
                payloads[f"random-tree-{i}"] = _random_tree(rng, 10_000, NEAR_MAX)
        # The samples' "huge" is over max_gpus rather than over its byte limit (1 MiB,
        # above what this nats-server carries); the byte limits are the health event's
        # and the requests' (64 KiB).

        async def check(what: str) -> None:
            assert agent.alive(), f"{what}: the agent died\n{agent.output()[-3000:]}"
            status, elapsed = await anyio.to_thread.run_sync(obs.readyz)
            assert status == ready_status, f"{what}: /readyz {status}"
            assert elapsed < 1.0, f"{what}: /readyz took {elapsed:.2f} s"
            after = await obs.state()
            assert after == before, f"{what}: the state changed"

        handled = 0
        for subject, payloads, consumers in published:
            for name, payload in payloads.items():
                what = f"{name} on {subject} ({len(payload)} bytes)"
                counted = await anyio.to_thread.run_sync(agent.bad_messages)
                await nc.publish(subject, payload)
                await nc.flush()
                for _ in range(200):
                    now = await anyio.to_thread.run_sync(agent.bad_messages)
                    if now >= counted + consumers:
                        break
                    assert agent.alive(), f"{what}: the agent died\n{agent.output()[-3000:]}"
                    await anyio.sleep(0.05)
                else:
                    raise AssertionError(f"{what}: not counted as dropped ({now - counted})")
                await check(what)
                handled += 1

        for subject, payloads in requested:
            for name, payload in payloads.items():
                what = f"{name} on {subject} ({len(payload)} bytes)"
                msg = await nc.request(subject, payload, timeout=5)
                headers = msg.headers or {}
                # Refused (malformed, or, for a well-formed allocator request naming a
                # resource of a megabyte, unknown), never a crash nor silence. The
                # allocator's state request has no field: junk fields beside none are
                # a well-formed request, answered.
                fieldless = subject.endswith(p.ENDPOINT_STATE) and name in (
                    "huge",
                    "wrong-types",
                    "invalid-utf8",
                )
                if not name.startswith("random-tree") and not fieldless:
                    assert headers.get("Nats-Service-Error-Code"), (what, headers, msg.data[:200])
                await check(what)
                handled += 1
        assert handled >= 170

        # One real event, so that the replay below has something to deliver.
        reply = await nc.request(
            subjects.mock_inject(NODE),
            codec.MOCK_INJECT_REQUEST.encode(MockInjectRequest(gpu=2, fault="xid", value=79)),
            timeout=5,
        )
        assert codec.MOCK_INJECT_REPLY.decode(reply.data).applied
    finally:
        await nc.close()

    await anyio.to_thread.run_sync(_replay_all, nats_server.url, uuids[2])


def _replay_all(nats_url: str, uuid: str) -> None:
    """`gpulet alerts --replay-all` over a stream full of hostile events."""
    proc = subprocess.Popen(
        [*GPULET, "alerts", "--replay-all", "--nats", nats_url, "--durable", "hostile-replay"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        printed: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            event = json.loads(line)
            printed.append(event)
            if event["gpu_uuid"] == uuid and event.get("xid") == 79:
                break
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert any(e["gpu_uuid"] == uuid and e.get("xid") == 79 for e in printed), printed
        # Only the health service's own events: nothing forged got through.
        assert all(e["node"] == NODE and e["event_id"] != "hostile-1" for e in printed), printed
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "Traceback" not in err, err[-3000:]
    assert "dropped" in err  # the hostile events were seen, counted and logged
