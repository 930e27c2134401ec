"""Fixtures of the image tests: podman, and the images ``make image`` builds.

Every test here is opt-in (``IMAGE_TESTS=1``, see support.podman) and marked
``image`` and ``slow``.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest

from support.podman import (
    IMAGE,
    IMAGE_SCRIPT,
    NATS_IMAGE,
    SKIP_REASON,
    Podman,
    enabled,
    local,
    missing_tool,
)

BUILD_TIMEOUT_S = 1800  # from scratch: debootstrap and every wheel, on a busy machine


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.image)
            item.add_marker(pytest.mark.slow)
            # The first test pays for the session's image build.
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S + 900))
            if not enabled():
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def podman() -> Podman:
    if problem := missing_tool("podman"):
        pytest.fail(problem)
    return Podman()


@pytest.fixture(scope="session")
def images(podman: Podman, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``scripts/image.sh build`` (what ``make image`` runs): its time and the sizes."""
    log = tmp_path_factory.mktemp("build") / "build.log"
    started = time.monotonic()
    with log.open("w") as out:
        result = subprocess.run(
            [str(IMAGE_SCRIPT), "build"],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=BUILD_TIMEOUT_S,
            env={**podman.env, "IMAGE": IMAGE, "NATS_IMAGE": NATS_IMAGE},
            check=False,
        )
    assert result.returncode == 0, f"scripts/image.sh build failed:\n{log.read_text()[-4000:]}"
    return {
        "build_s": round(time.monotonic() - started, 1),
        "image_bytes": {
            name: int(podman.inspect(local(name))["Size"]) for name in (IMAGE, NATS_IMAGE)
        },
    }
