"""Shared fixtures: the asyncio backend for anyio, a real nats-server per test, and a
short temporary directory for unix sockets.

Timeouts: every test has one (pytest-timeout; the default in pyproject.toml). A test
marked ``slow`` gets :data:`SLOW_TIMEOUT_S` unless it names its own with
``@pytest.mark.timeout(N)``: a hang then fails with every thread's stack.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from anyio._backends import _asyncio as _anyio_asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from gpulet_common.embedded_nats import EmbeddedNats

# The real control plane's fixtures (kube_api, kube_cluster, kube_namespace): started
# only by the tests that ask for them; a hang's stacks and asyncio tasks written to a
# file before pytest-timeout ends the worker (xdist swallows its own dump); and the
# test files in a shuffled order (support.file_order).
pytest_plugins = ["support.control_plane_fixtures", "support.hang_dump", "support.file_order"]

# A recording tracer provider, so that trace context really travels in NATS headers.
trace.set_tracer_provider(TracerProvider())


def _quiet_grpc_poller(original: Callable[..., None]) -> Callable[..., None]:
    """anyio's test runner, minus grpc.aio's spurious poller errors between loops.

    Every test gets a new event loop, and grpc.aio's completion-queue poller stays bound
    to the loops of earlier tests (grpc/grpc#25364): when a completion wakes it, its
    callback may run for a closed loop ("Event loop is closed") or find the notification
    already read (BlockingIOError). Those reach the runner's exception handler and failed
    an unrelated test about one run in four. Only those two, raised from
    ``PollerCompletionQueue._handle_events``, are dropped; a service has one loop, so
    production never sees them, and every other error still fails the test.
    """

    def handler(self: object, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        spurious = isinstance(exc, BlockingIOError) or (
            isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)
        )
        if spurious and "PollerCompletionQueue._handle_events" in repr(context.get("handle")):
            return
        original(self, loop, context)

    return handler


setattr(  # noqa: B010 - patching the runner class of anyio's pytest plugin
    _anyio_asyncio.TestRunner,
    "_exception_handler",
    _quiet_grpc_poller(_anyio_asyncio.TestRunner._exception_handler),
)


SLOW_TIMEOUT_S = 600


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """A real nats-server with JetStream on a free 127.0.0.1 port."""
    async with EmbeddedNats(state_dir=tmp_path / "nats", port=0) as server:
        yield server


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory under /tmp, for unix sockets: a socket path holds 107 bytes,
    and pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="gpulet", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
