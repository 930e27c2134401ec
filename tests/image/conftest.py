"""Fixtures of the image tests: podman, and the images ``make image`` builds.

Every test here is opt-in (``IMAGE_TESTS=1``, see support.podman) and marked
``image`` and ``slow``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from support.podman import SKIP_REASON, Podman, build_images, enabled, missing_tool

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
    return build_images(podman, tmp_path_factory.mktemp("build") / "build.log", BUILD_TIMEOUT_S)
