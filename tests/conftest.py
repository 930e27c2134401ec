"""Shared fixtures: the asyncio backend for anyio and a real nats-server per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from gpulet_common.embedded_nats import EmbeddedNats

# A recording tracer provider, so that trace context really travels in NATS headers.
trace.set_tracer_provider(TracerProvider())


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """A real nats-server with JetStream on a free 127.0.0.1 port."""
    async with EmbeddedNats.running(state_dir=tmp_path / "nats", port=0) as server:
        yield server
