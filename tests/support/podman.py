"""podman for the image tests (tests/image), with the settings ``make image`` uses.

``scripts/image.sh env`` says what podman needs on this machine (CONTAINERS_CONF naming
the containers.conf the script writes); :class:`Podman` runs every command with it, so
the tests and ``make image`` share one configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from support.deploy import ROOT

IMAGE_SCRIPT = ROOT / "scripts" / "image.sh"
# Not GPULET_*: gpulet reads every GPULET_* variable as a setting (and refuses unknown
# ones), and the other tests' gpulet subprocesses inherit pytest's environment.
ENABLE_VARIABLE = "IMAGE_TESTS"
# The images `make image` builds (its IMAGE and NATS_IMAGE), as podman names them.
IMAGE = os.environ.get("IMAGE", "gpulet:dev")
NATS_IMAGE = os.environ.get("NATS_IMAGE", "gpulet-nats:dev")
SKIP_REASON = (
    "the image tests build the images and run containers with podman: run them with "
    f"{ENABLE_VARIABLE}=1 (.ci/run installs podman, buildah, runc, catatonit, "
    "debootstrap, podman-compose and sets it)"
)
# Debian's packages for the image tests (.ci/run installs the missing ones).
PACKAGES = (
    "podman buildah runc catatonit debootstrap podman-compose "
    "golang-github-containernetworking-plugin-dnsname prometheus"
)


def enabled() -> bool:
    return os.environ.get(ENABLE_VARIABLE) == "1"


def local(image: str) -> str:
    """podman's full name for an image built without a registry."""
    return image if "/" in image else f"localhost/{image}"


def missing_tool(tool: str) -> str | None:
    """Why ``tool`` cannot run, or None."""
    if shutil.which(tool) is None:
        return (
            f"{tool} is not installed, and {ENABLE_VARIABLE}=1 asks for the image tests: "
            f"apt-get install {PACKAGES} (.ci/run installs what is missing), and kubectl"
        )
    return None


class Podman:
    def __init__(self) -> None:
        out = subprocess.run(
            [str(IMAGE_SCRIPT), "env"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        self.env = dict(os.environ)
        for line in out.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                self.env[key] = value

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            check=False,
        )

    def __call__(self, *args: str, timeout: float = 120) -> str:
        """podman ARGS; its stdout. Fails with podman's error when it does."""
        result = self.run(*args, timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(
                f"podman {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}"
            )
        return result.stdout

    def inspect(self, name: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = json.loads(self("inspect", name))
        return found[0]

    def logs(self, container: str, lines: int = 40) -> str:
        result = self.run("logs", "--tail", str(lines), container, timeout=30)
        return (result.stdout + result.stderr)[-4000:]


def build_images(podman: Podman, log: Path, timeout_s: float) -> dict[str, Any]:
    """``scripts/image.sh build`` (what ``make image`` runs), its output in ``log``: the
    build's time and the images' sizes. Fails with the end of the log when it fails."""
    started = time.monotonic()
    with log.open("w") as out:
        result = subprocess.run(
            [str(IMAGE_SCRIPT), "build"],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
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
