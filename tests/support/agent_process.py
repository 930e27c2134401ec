"""`gpulet run` as a real child process, and the HTTP probes tests ask it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpulet_common.embedded_nats import free_port

GPULET = [sys.executable, "-m", "gpulet"]


def http_get(url: str, timeout_s: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


def _server_url(readyz: dict[str, Any]) -> str | None:
    component = readyz.get("components", {}).get("nats-server") or {}
    found = re.match(r"(nats://\S+)", str(component.get("detail", "")))
    return found.group(1) if found else None


class Agent:
    """``gpulet run --nvml mock``, its output in ``agent.log``.

    Its embedded nats-server binds a port of its own choosing (``nats.embedded_port=0``)
    and :attr:`nats_url` reads it from ``/readyz``. The HTTP port has to be known to ask
    ``/readyz`` at all, so it is picked free; when another process takes it before the
    agent binds it (the agent then exits 2 saying the port is in use), the agent is
    started again on another one. Every wait fails at once, with the log, when the
    agent has exited otherwise.
    """

    START_ATTEMPTS = 5

    def __init__(self, tmp_path: Path, *extra: str, node: str = "test.node") -> None:
        self.node = node
        self.state_dir = tmp_path / "state"
        self.extra = extra
        self.log = (tmp_path / "agent.log").open("w+b")
        self.attempts = 0
        self._nats_url: str | None = None
        self._spawn()

    def _spawn(self) -> None:
        self.attempts += 1
        self.http_port = free_port()
        self._nats_url = None
        self.proc = subprocess.Popen(
            [
                *GPULET,
                "run",
                "--nvml",
                "mock",
                "--node",
                self.node,
                "--state-dir",
                str(self.state_dir),
                "--set",
                "nats.embedded_port=0",
                "--metrics-port",
                str(self.http_port),
                *self.extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def check_running(self) -> None:
        """Raise with the agent's log if it has exited; restart it if its HTTP port was
        taken by another process between the pick and the bind."""
        code = self.proc.poll()
        if code is None:
            return
        output = self.output()
        if code == 2 and "already in use" in output and self.attempts < self.START_ATTEMPTS:
            self.log.write(f"\n--- port {self.http_port} was taken; starting again\n".encode())
            self._spawn()
            return
        raise AssertionError(f"the agent exited with status {code}:\n{output[-4000:]}")

    @property
    def nats_url(self) -> str:
        """The embedded nats-server's URL, as the agent's ``/readyz`` reports it."""
        if self._nats_url is None:
            _, _, body = self.wait_readyz(
                lambda _, body: _server_url(body) is not None,
                what="the nats-server component to name its URL",
            )
            self._nats_url = _server_url(body)
        assert self._nats_url is not None
        return self._nats_url

    @property
    def nats_port(self) -> int:
        return int(self.nats_url.rsplit(":", 1)[1])

    def readyz(self) -> tuple[int, dict[str, Any]] | None:
        """``/readyz`` as (HTTP status, body), or None while nothing answers."""
        try:
            status, body = http_get(f"http://127.0.0.1:{self.http_port}/readyz")
        except OSError:
            return None
        decoded: dict[str, Any] = json.loads(body)
        return status, decoded

    def wait_readyz(
        self,
        predicate: Callable[[int, dict[str, Any]], bool],
        *,
        timeout_s: float = 20,
        interval_s: float = 0.02,
        what: str = "",
    ) -> tuple[float, int, dict[str, Any]]:
        """Poll ``/readyz`` until ``predicate(status, body)``: (time it held, status, body)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_running()
            answer = self.readyz()
            if answer is not None and predicate(*answer):
                return time.monotonic(), answer[0], answer[1]
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"/readyz: timed out after {timeout_s}s waiting for {what or predicate}; "
                    f"last answer {answer}\n{self.output()}"
                )
            time.sleep(interval_s)

    def wait_ready(self, timeout_s: float = 20) -> dict[str, Any]:
        _, _, body = self.wait_readyz(
            lambda status, _: status == 200, timeout_s=timeout_s, interval_s=0.1, what="ready"
        )
        return body

    def nats_server_pid(self) -> int:
        """The embedded nats-server's pid, as the agent's ``/readyz`` reports it."""
        answer = self.readyz()
        assert answer is not None, "the agent does not answer /readyz"
        detail = answer[1]["components"]["nats-server"]["detail"]
        found = re.search(r"\(pid (\d+)\)", detail)
        assert found, detail
        return int(found.group(1))

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def restart(self) -> None:
        """SIGTERM the agent, wait for its exit, and start it again (same state dir)."""
        self.proc.terminate()
        self.proc.wait(10)
        self.log.write(b"\n--- restarted by the test\n")
        self.attempts = 0
        self._spawn()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
