"""``gpulet alerts`` against a real Alertmanager, a webhook receiver and stdout."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from gpulet_alerting.alertmanager import AlertmanagerSink
from gpulet_alerting.consumer import AlertsConsumer
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats, free_port
from gpulet_common.settings.health import AlertSettings
from gpulet_common.settings.nats import NatsSettings
from support.health_harness import HealthNode, health_node, until

pytestmark = pytest.mark.anyio

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"


def alertmanager_binary() -> str | None:
    if Path(ALERTMANAGER).exists():
        return ALERTMANAGER
    return shutil.which("prometheus-alertmanager")


@pytest.fixture
async def alertmanager(tmp_path: Path) -> AsyncIterator[str]:
    """A real Alertmanager (Debian package prometheus-alertmanager) on 127.0.0.1."""
    binary = alertmanager_binary()
    if binary is None:
        pytest.skip(
            "prometheus-alertmanager is not installed (apt-get install prometheus-alertmanager)"
        )
    config = tmp_path / "alertmanager.yml"
    config.write_text(
        'route:\n  receiver: "null"\n  group_wait: 1s\nreceivers:\n  - name: "null"\n'
    )
    port = free_port()
    log = (tmp_path / "alertmanager.log").open("wb")
    process = await anyio.open_process(
        [
            binary,
            f"--config.file={config}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with anyio.fail_after(10):
            while True:
                try:
                    await anyio.to_thread.run_sync(_get, f"{url}/-/ready")
                    break
                except OSError:
                    assert process.returncode is None, (tmp_path / "alertmanager.log").read_text()
                    await anyio.sleep(0.05)
        yield url
    finally:
        process.terminate()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await process.wait()
        if process.returncode is None:
            process.kill()
        log.close()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:
        body = response.read()
    return json.loads(body) if body.strip().startswith((b"[", b"{")) else body


async def am_alerts(url: str) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = await anyio.to_thread.run_sync(_get, f"{url}/api/v2/alerts")
    return alerts


class Receiver:
    """A webhook receiver that fails the first ``fail_first`` POSTs with 503."""

    def __init__(self, fail_first: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.failures_left = fail_first
        self.lock = threading.Lock()


@pytest.fixture
def receiver() -> Iterator[tuple[str, Receiver]]:
    state = Receiver(fail_first=2)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with state.lock:
                fail = state.failures_left > 0
                if fail:
                    state.failures_left -= 1
                else:
                    state.bodies.append(json.loads(body))
            self.send_response(503 if fail else 200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="webhook", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def settings(**kw: Any) -> AlertSettings:
    base: dict[str, Any] = {"retry_initial_s": 0.05, "retry_max_s": 0.2, "resend_interval_s": 0.5}
    base.update(kw)
    return msgspec.convert(base, AlertSettings)


async def wait_until(check: Any, within: float = 5.0) -> Any:
    with anyio.fail_after(within):
        while True:
            result = await check()
            if result:
                return result
            await anyio.sleep(0.1)


def by_name(alerts: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [a for a in alerts if a["labels"]["alertname"] == name]


async def test_alertmanager_alert_fires_and_resolves(
    nats_server: EmbeddedNats, tmp_path: Path, alertmanager: str, receiver: tuple[str, Receiver]
) -> None:
    hook_url, hook = receiver
    out = io.StringIO()
    async with (
        health_node(nats_server.url, tmp_path) as h,
        Bus.connect(NatsSettings(url=nats_server.url), name="alerts") as bus,
        anyio.create_task_group() as tg,
    ):
        consumer = AlertsConsumer.from_settings(
            bus, settings(alertmanager_urls=[alertmanager], webhooks=[hook_url]), out=out
        )
        await tg.start(consumer.run)
        h.inject("temperature", gpu=1, value=99)
        uuid = h.uuid(1)

        async def firing() -> list[dict[str, Any]]:
            alerts = await am_alerts(alertmanager)
            return by_name(alerts, "GpuThermal") if by_name(alerts, "GpuUnhealthy") else []

        [thermal] = await wait_until(firing)
        assert thermal["status"]["state"] == "active"
        labels = thermal["labels"]
        assert labels == {
            "alertname": "GpuThermal",
            "node": h.node,
            "gpu": "1",
            "uuid": uuid,
            "severity": "critical",
            "condition": "thermal",
        }
        assert "99 C" in thermal["annotations"]["summary"]
        assert thermal["annotations"]["action"] == "operator_check"
        # An application XID: reported as a one-off alert with an end in the future.
        h.inject("xid", gpu=0, value=13)
        [xid] = await wait_until(lambda: _named(alertmanager, "GpuXid"))
        assert xid["labels"]["severity"] == "warning"
        assert xid["labels"]["xid"] == "13"

        h.inject("temperature", gpu=1, value=None)

        async def resolved() -> bool:
            alerts = await am_alerts(alertmanager)
            return not by_name(alerts, "GpuThermal") and not by_name(alerts, "GpuUnhealthy")

        await wait_until(resolved)
        # The firing alerts are re-sent while active; resolved ones are not.
        sink = next(s for s in consumer.sinks if isinstance(s, AlertmanagerSink))
        assert not [k for k in sink.active if k[1] == uuid]

        # The webhook failed twice (503) and still got every event, once, in order.
        await wait_until(lambda: _async(len(hook.bodies) >= 3))
        assert [b["kind"] for b in hook.bodies] == ["thermal", "xid", "recovered"]
        assert len({b["event_id"] for b in hook.bodies}) == len(hook.bodies)
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
        assert [line["event_id"] for line in lines][: len(hook.bodies)] == [
            b["event_id"] for b in hook.bodies
        ]
        tg.cancel_scope.cancel()


async def _named(url: str, name: str) -> list[dict[str, Any]]:
    return by_name(await am_alerts(url), name)


async def _async(value: bool) -> bool:
    return value


async def test_durable_consumer_gets_what_it_missed(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async def run_consumer(h: HealthNode, out: io.StringIO, want: int) -> list[dict[str, Any]]:
        async with (
            Bus.connect(NatsSettings(url=nats_server.url), name="alerts") as bus,
            anyio.create_task_group() as tg,
        ):
            consumer = AlertsConsumer.from_settings(bus, settings(durable="ops"), out=out)
            await tg.start(consumer.run)
            await until(lambda: consumer.processed >= want, within=5)
            tg.cancel_scope.cancel()
        return [json.loads(line) for line in out.getvalue().splitlines()]

    async with health_node(nats_server.url, tmp_path, collector=False, subscriber=False) as h:
        first = io.StringIO()
        async with anyio.create_task_group() as tg:

            async def inject_soon() -> None:
                await anyio.sleep(0.3)
                h.inject("xid", gpu=0, value=79)

            tg.start_soon(inject_soon)
            lines = await run_consumer(h, first, 1)
        assert [line["xid"] for line in lines] == [79]
        # While the consumer is down.
        h.inject("xid", gpu=1, value=48)
        h.inject("xid", gpu=2, value=95)
        await until(lambda: h.service.publisher.published_count >= 3)
        lines = await run_consumer(h, io.StringIO(), 2)
        assert [line["xid"] for line in lines] == [48, 95]
