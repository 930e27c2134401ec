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


class Agent:
    """``gpulet run --nvml mock`` on free ports, its output in ``agent.log``."""

    def __init__(self, tmp_path: Path, *extra: str, node: str = "test.node") -> None:
        self.nats_port = free_port()
        self.http_port = free_port()
        while self.http_port == self.nats_port:  # two calls may get the same free port
            self.http_port = free_port()
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.node = node
        self.state_dir = tmp_path / "state"
        self.log = (tmp_path / "agent.log").open("w+b")
        self.proc = subprocess.Popen(
            [
                *GPULET,
                "run",
                "--nvml",
                "mock",
                "--node",
                node,
                "--state-dir",
                str(self.state_dir),
                "--set",
                f"nats.embedded_port={self.nats_port}",
                "--metrics-port",
                str(self.http_port),
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

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
            assert self.proc.poll() is None, self.output()
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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
