"""How long ``gpulet run`` is not ready when its embedded nats-server is SIGKILLed.

Method
------
Each round starts a fresh ``gpulet run --nvml mock --only collector,health`` (a real
process with its real embedded nats-server, default restart settings), waits until
``/readyz`` answers 200, reads the server's pid from ``/readyz``, SIGKILLs it and polls
``/readyz`` every 5 ms. A fresh agent per round, because restarts within a minute of
each other count as one crash loop and back off further (see docs/reliability.md).
For each round:

* **to not ready**: SIGKILL to the first 503 from ``/readyz``;
* **server back**: SIGKILL to the first answer where the ``nats-server`` component is
  ready again, after one where it was not (it includes the jittered first back-off,
  0.125-0.25 s by default);
* **to ready**: SIGKILL to the first 200 again (the services' NATS connection is back,
  after nats-py's own reconnect back-off);
* **down (agent)**: the downtime the agent itself reports ("restarted after ... down").

The mock NVML stands in for the GPUs; it plays no part in what is measured.

Run: ``python bench/nats_restart.py [--rounds 5]``
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _util import mean, percentile, table

POLL_S = 0.005


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _readyz(port: int) -> tuple[int, dict[str, Any]] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read())
    except (OSError, http.client.HTTPException):
        return None


def _round(work: Path) -> dict[str, float]:
    http_port, nats_port = _free_port(), _free_port()
    while nats_port == http_port:
        nats_port = _free_port()
    log = (work / "agent.log").open("wb")
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpulet",
            "run",
            "--nvml",
            "mock",
            "--only",
            "collector,health",
            "--node",
            "bench",
            "--state-dir",
            str(work / "state"),
            "--set",
            f"nats.embedded_port={nats_port}",
            "--metrics-port",
            str(http_port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            answer = _readyz(http_port)
            if answer is not None and answer[0] == 200:
                break
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not get ready; see {work / 'agent.log'}")
            time.sleep(0.05)
        detail = answer[1]["components"]["nats-server"]["detail"]
        found = re.search(r"\(pid (\d+)\)", detail)
        assert found, detail
        killed = time.monotonic()
        os.kill(int(found.group(1)), signal.SIGKILL)
        figures: dict[str, float] = {}
        # The agent's connection may see the loss before the supervisor sees the exit:
        # "server back" counts only once the nats-server component was seen down.
        server_down_seen = False
        deadline = killed + 60
        while time.monotonic() < deadline:
            answer = _readyz(http_port)
            now = time.monotonic() - killed
            if answer is None:
                time.sleep(POLL_S)
                continue
            status, body = answer
            server = body["components"]["nats-server"]
            if status == 503:
                figures.setdefault("not_ready", now)
            if server["state"] != "ready":
                server_down_seen = True
            if server_down_seen and server["state"] == "ready":
                figures.setdefault("server_back", now)
            if "server_back" in figures and status == 200:
                figures["ready"] = now
                down = re.search(r"restarted after ([0-9.]+)s down", server["detail"])
                figures["down_agent"] = float(down.group(1)) if down else float("nan")
                return figures
            time.sleep(POLL_S)
        raise RuntimeError(f"no recovery within 60 s: {figures}")
    finally:
        agent.terminate()
        agent.wait(10)
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="gpulet-nats-restart-") as tmp:
        for n in range(args.rounds):
            work = Path(tmp) / str(n)
            work.mkdir()
            rounds.append(_round(work))
            print(
                f"round {n + 1}: "
                + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in rounds[-1].items()),
                flush=True,
            )
    rows = []
    for key, label in [
        ("not_ready", "SIGKILL to /readyz 503"),
        ("server_back", "SIGKILL to nats-server ready"),
        ("ready", "SIGKILL to /readyz 200"),
        ("down_agent", "downtime the agent reports"),
    ]:
        values = [r[key] * 1000 for r in rounds]
        rows.append(
            [
                label,
                f"{mean(values):.0f}",
                f"{percentile(values, 50):.0f}",
                f"{max(values):.0f}",
            ]
        )
    print()
    print(
        table(
            f"Embedded nats-server SIGKILLed under gpulet run ({args.rounds} rounds, ms)",
            ["", "mean", "median", "max"],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
