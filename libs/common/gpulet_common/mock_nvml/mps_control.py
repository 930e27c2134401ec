"""A mock ``nvidia-cuda-mps-control``: the control daemon's command line, recording the
limits it is given, so tests check them without a GPU.

As the real one: ``-d`` starts the daemon in the background and returns (``-f`` runs it
in the foreground), with its pipes in ``$CUDA_MPS_PIPE_DIRECTORY`` (a FIFO named
``control`` says it is there) and its log in ``$CUDA_MPS_LOG_DIRECTORY``
(``control.log``); without an option it is the client: it reads commands from stdin and
hands them to the daemon, and fails (status 1, "Cannot find MPS control daemon") when
there is none.

What the daemon does with a command: appends ``CMD: <command>`` to ``control.log``
(as the real daemon logs them); ``quit`` ends it. It writes its pid to
``<pipe>/daemon.pid``, and ends by itself when its pipe directory goes (a test's
temporary directory) or after :data:`IDLE_S` without a command (gpulet asks every few
seconds), so no mock daemon outlives its agent for long. Commands travel through
``<pipe>/commands`` (appended under a lock, read in order): no socket path to keep
under 108 bytes.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.1
# A mock daemon nobody spoke to for this long ends (gpulet asks each daemon every few
# seconds while it runs): a stopped test agent leaves no process behind for long.
IDLE_S = 30.0


def _dirs() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    log = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    return pipe, log


def _alive(pipe: Path) -> bool:
    try:
        pid = int((pipe / "daemon.pid").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return (pipe / "control").exists()


def daemon() -> int:
    pipe, log = _dirs()
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    with (log / "control.log").open("a") as out:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        out.write(f"mock MPS control daemon {os.getpid()} for {visible}\n")
    commands = pipe / "commands"
    commands.touch()
    if not (pipe / "control").exists():
        os.mkfifo(pipe / "control")
    (pipe / "daemon.pid").write_text(str(os.getpid()))
    offset = 0
    heard = time.monotonic()
    while pipe.is_dir() and time.monotonic() - heard < IDLE_S:
        try:
            data = commands.read_bytes()
        except OSError:
            break
        lines = data[offset:].split(b"\n")
        done = lines[:-1]
        offset += sum(len(line) + 1 for line in done)
        if done:
            heard = time.monotonic()
        for raw in done:
            command = raw.decode(errors="replace").strip()
            if not command:
                continue
            with (log / "control.log").open("a") as out:
                out.write(f"CMD: {command}\n")
            if command == "quit":
                for name in ("control", "daemon.pid"):
                    (pipe / name).unlink(missing_ok=True)
                return 0
        time.sleep(POLL_S)
    for name in ("control", "daemon.pid"):
        (pipe / name).unlink(missing_ok=True)
    return 0


def client() -> int:
    pipe, _ = _dirs()
    if not _alive(pipe):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    text = sys.stdin.read()
    with (pipe / "commands").open("a") as out:
        fcntl.flock(out, fcntl.LOCK_EX)
        for line in text.splitlines():
            if line.strip():
                out.write(line.strip() + "\n")
    return 0


def main(argv: list[str]) -> int:
    if "-f" in argv:
        return daemon()
    if "-d" in argv:
        subprocess.Popen(
            [sys.executable, "-m", "gpulet_common.mock_nvml.mps_control", "-f"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        pipe, _ = _dirs()
        deadline = time.monotonic() + 5
        while not _alive(pipe) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return 0 if _alive(pipe) else 1
    return client()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
