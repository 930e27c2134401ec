"""Every mistake on the command line is one line on stderr and exit code 2.

Each case runs the real ``gpulet`` as a subprocess, as an operator would, and checks
the whole of stderr: one line, starting with the program's name, naming what is
wrong, and no traceback.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulet_common.embedded_nats import free_port
from support.agent_process import GPULET


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A 127.0.0.1 port another process (here: this one) listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def _fails_in_one_line(
    args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 30
) -> str:
    result = subprocess.run(
        [*GPULET, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, **(env or {})},
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpulet"), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


def _run(tmp_path: Path, *extra: str) -> list[str]:
    """``gpulet run`` on free ports with a mock NVML, plus ``extra``."""
    return [
        "run",
        "--nvml",
        "mock",
        "--state-dir",
        str(tmp_path / "state"),
        "--set",
        f"nats.embedded_port={free_port()}",
        "--metrics-port",
        str(free_port()),
        *extra,
    ]


def test_busy_embedded_nats_port(tmp_path: Path, busy_port: int) -> None:
    line = _fails_in_one_line(_run(tmp_path, "--set", f"nats.embedded_port={busy_port}"))
    assert "nats.embedded_port" in line
    assert f"127.0.0.1:{busy_port} is already in use" in line
    # The likely cause (a second `make run`) and the way round it.
    assert "another `gpulet run` or `make run`, still running?" in line
    assert "--set nats.embedded_port=PORT" in line


def test_busy_metrics_port(tmp_path: Path, busy_port: int) -> None:
    line = _fails_in_one_line(
        _run(tmp_path, "--metrics-port", str(busy_port), "--set", "telemetry.http_host=127.0.0.1")
    )
    assert "telemetry.http_port" in line
    assert "already in use" in line
    assert "--metrics-port PORT" in line


def test_metrics_port_is_the_nats_port(tmp_path: Path) -> None:
    port = free_port()
    line = _fails_in_one_line(
        _run(tmp_path, "--set", f"nats.embedded_port={port}", "--metrics-port", str(port))
    )
    assert f"'telemetry.http_port': {port} is nats.embedded_port as well" in line


def test_state_dir_is_a_file(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    line = _fails_in_one_line(_run(tmp_path, "--state-dir", str(a_file)))
    assert f"'state_dir': {a_file} is not a directory" in line


def test_state_dir_below_a_file(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    line = _fails_in_one_line(_run(tmp_path, "--state-dir", str(a_file / "below")))
    assert "'state_dir': cannot create" in line


def test_unknown_mock_scenario(tmp_path: Path) -> None:
    line = _fails_in_one_line(_run(tmp_path, "--nvml", "mock:doesnotexist"))
    assert "scenario doesnotexist: not found" in line
    assert "dgx-h100" in line  # the shipped scenarios are listed


def test_unknown_mock_scenario_in_a_sidecar(tmp_path: Path) -> None:
    # A sidecar retries its NATS forever; the scenario is checked before that.
    line = _fails_in_one_line(
        [
            "serve",
            "collector",
            "--nvml",
            "mock:doesnotexist",
            "--nats",
            f"nats://127.0.0.1:{free_port()}",
            "--state-dir",
            str(tmp_path / "state"),
            "--metrics-port",
            str(free_port()),
        ]
    )
    assert "scenario doesnotexist: not found" in line


def test_unparseable_embedded_host(tmp_path: Path) -> None:
    line = _fails_in_one_line(_run(tmp_path, "--set", "nats.embedded_host=256.1.1.1"))
    assert "nats.embedded_host" in line


@pytest.mark.parametrize(
    ("only", "expected"),
    [("nosuch", "unknown service(s) ['nosuch']"), (",", "names no service")],
)
def test_bad_only(tmp_path: Path, only: str, expected: str) -> None:
    line = _fails_in_one_line(_run(tmp_path, "--only", only))
    assert "--only" in line
    assert expected in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "allocator.plugin.resources.gpu=x"], "'x' is not a Kubernetes extended"),
        (["--set", "allocator.plugin.resources.memory=Gpulet.io/mem"], "not a Kubernetes"),
        (["--set", "allocator.plugin.resources.gpu=kubernetes.io/gpu"], "reserved"),
        (["--set", "allocator.plugin.resources.core=nvidia.com/gpu"], "must be distinct"),
        (["--set", "collector.sample_period_s=fast"], "'collector.sample_period_s'"),
        (["--set", "collector.sample_period_s=[1"], "not valid JSON"),
        (["--set", "collector.sample_period_s=-1"], "'collector.sample_period_s'"),
        (["--set", "nats.embedded_port=99999"], "'nats.embedded_port'"),
        (["--set", "nats.embedded_restart_attempts=-1"], "'nats.embedded_restart_attempts'"),
        (["--set", "no_such.setting=1"], "unknown setting"),
        (["--set", "collector.sample_period_s"], "expected section.key=value"),
        (["--set", "=1"], "empty setting name"),
        (["--set", "nvml=1"], "'nvml'"),
        (["--nvml", "bogus"], "expected auto, nvml or mock[:scenario]"),
        (["--nvml", "nvml:t4"], "only the mock backend takes a scenario"),
        (["--log-level", "loud"], "invalid choice: 'loud'"),
        (["--metrics-port", "abc"], "invalid int value: 'abc'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags_and_settings(args: list[str], expected: str) -> None:
    assert expected in _fails_in_one_line(["config", "show", *args])


def test_bad_setting_from_the_environment() -> None:
    line = _fails_in_one_line(["config", "show"], env={"GPULET_COLLECTOR__SAMPLE_PERIOD_S": "abc"})
    assert "'collector.sample_period_s'" in line


@pytest.mark.parametrize("kind", ["missing", "directory", "not-toml", "not-a-table"])
def test_bad_config_file(tmp_path: Path, kind: str) -> None:
    path = {
        "missing": tmp_path / "missing.toml",
        "directory": tmp_path,
        "not-toml": tmp_path / "bad.toml",
        "not-a-table": tmp_path / "list.json",
    }[kind]
    (tmp_path / "bad.toml").write_text("x = [\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    line = _fails_in_one_line(["config", "show", "--config", str(path)])
    assert "'config'" in line
    assert str(path) in line


def test_unknown_command() -> None:
    line = _fails_in_one_line(["no-such-command"])
    assert "invalid choice: 'no-such-command'" in line
