"""Fixtures shared by the allocator and device-plugin tests."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.settings import Settings
from support.allocator_stack import dev_root_with, make_settings


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Short: a unix socket path must fit in 108 bytes, pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="gpl-") as d:
        yield Path(d)


@pytest.fixture
def settings(nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path) -> Settings:
    """The whole stack's settings: a real nats-server, 8 GPUs' device files."""
    return make_settings(
        nats_server.url, tmp_path / "state", plugin_dir, dev_root_with(tmp_path / "dev", 8)
    )
