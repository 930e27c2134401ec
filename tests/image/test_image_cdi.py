"""A real CDI consumer: podman runs a container with the CDI devices that the DRA
kubelet plugin's Prepare answered, from the spec Prepare wrote.

Opt-in like every image test (``IMAGE_TESTS=1``); it runs the gpulet image that the
image tests build (only its ``sh`` and ``stat``).

The plugin is the real one, called by the fake kubelet over its real sockets; its
decision core is the tests' in-memory one (support.dra_core) and the claims come from a
fixed reader (what the API server would answer). Its device nodes are real and
harmless: a temporary directory of character devices made with the numbers of
``/dev/null`` (the GPUs, ``nvidia<minor>``) and ``/dev/zero`` (the control nodes), given
to the plugin as its ``dev_root`` / ``host_dev``, as ``/dev`` is on a GPU node.

Where podman reads the specs: ``--cdi-spec-dir`` (podman 4.9 and later) pointed at a
temporary directory; an older podman (4.3 in Debian 12) reads only its built-in
``/etc/cdi`` and ``/var/run/cdi``, so there Prepare writes to ``/var/run/cdi``, as on a
node (one file per claim UID, removed by Unprepare). Inside the container: a whole GPU
claim sees its GPU's node and the control nodes, not the other GPUs', and the
claim's ``NVIDIA_VISIBLE_DEVICES`` and ``GPULET_ALLOCATION_ID``; a share also gets its MPS
limits and the MPS pipe directory, mounted. After Unprepare podman cannot resolve the
device any more.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpulet_allocator.kubelet.dra.plugin import DraPlugin, PluginSettings
from gpulet_allocator.kubelet.dra.server import DraKubeletPlugin, Sockets
from gpulet_common.dra import cdi
from support.dra_core import InMemoryCore, InMemoryHealth
from support.fake_dra_kubelet import FakeDraKubelet, registered
from support.podman import IMAGE, Podman, local

pytestmark = pytest.mark.anyio

DRIVER = "gpu.gpulet.io"
NODE = "cdi-node"
GPUS = 4
NULL, ZERO = os.makedev(1, 3), os.makedev(1, 5)
BUILTIN_SPEC_DIR = Path("/var/run/cdi")


class FixedClaims:
    """The claims as the API server would answer them (a ClaimReader)."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}

    def add(self, name: str, *results: dict[str, Any]) -> str:
        uid = str(uuid.uuid4())
        self.claims[("default", name)] = {
            "metadata": {"namespace": "default", "name": name, "uid": uid},
            "status": {"allocation": {"devices": {"results": list(results)}}},
        }
        return uid

    async def get_claim(self, namespace: str, name: str, uid: str = "") -> dict[str, Any] | None:
        return self.claims.get((namespace, name))


def result(device: str, **extra: Any) -> dict[str, Any]:
    return {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device, **extra}


@pytest.fixture
def root() -> Iterator[Path]:
    # Short: the plugin's unix sockets live here (108 bytes at most).
    path = Path(tempfile.mkdtemp(prefix="cdi", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def device_nodes(dev: Path) -> None:
    dev.mkdir()
    try:
        for minor in range(GPUS):
            os.mknod(dev / f"nvidia{minor}", 0o666 | stat.S_IFCHR, NULL)
        for name in cdi.CONTROL_DEVICES:
            os.mknod(dev / name, 0o666 | stat.S_IFCHR, ZERO)
    except PermissionError as exc:
        pytest.fail(f"the CDI test makes harmless device nodes (as root, like podman): {exc}")


def spec_dir_args(podman: Podman, root: Path) -> tuple[Path, list[str]]:
    """Where Prepare writes, and podman's global arguments to read it there."""
    if "--cdi-spec-dir" in podman("--help"):
        return root / "cdi", ["--cdi-spec-dir", str(root / "cdi")]
    return BUILTIN_SPEC_DIR, []


@asynccontextmanager
async def plugin(root: Path, cdi_dir: Path, claims: FixedClaims) -> AsyncIterator[FakeDraKubelet]:
    settings = PluginSettings(
        driver=DRIVER,
        pool=NODE,
        cdi_dir=cdi_dir,
        checkpoint=root / "state" / "checkpoint.json",
        dev_root=root / "dev",
        host_dev=str(root / "dev"),
        mps_pipe_directory=str(root / "mps"),
    )
    core = InMemoryCore.with_gpus(GPUS)
    sockets = Sockets.for_driver(DRIVER, root / "registry", root / "plugins")
    server = DraKubeletPlugin(
        DraPlugin(core, claims, settings), InMemoryHealth(NODE, sorted(core.gpus)), sockets, DRIVER
    )
    async with anyio.create_task_group() as tg:
        await tg.start(server.run)
        async with registered(root / "registry", DRIVER) as kubelet:
            yield kubelet
        tg.cancel_scope.cancel()


# What the container reports: its environment, then each of the node dir's entries.
REPORT = (
    'env | grep -E "^(NVIDIA_VISIBLE_DEVICES|GPULET_ALLOCATION_ID|CUDA_MPS_[A-Z_]+)=" '
    '| sort; for f in "$1"/*; do stat -c "node %n %F %t:%T" "$f"; done; '
    'if grep -q " $2 " /proc/self/mountinfo; then echo "mounted $2"; fi'
)


def in_container(podman: Podman, args: list[str], cdi_ids: list[str], root: Path) -> list[str]:
    devices = [arg for cdi_id in cdi_ids for arg in ("--device", cdi_id)]
    out = podman(
        *args,
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        "sh",
        *devices,
        local(IMAGE),
        "-c",
        REPORT,
        "report",
        str(root / "dev"),
        str(root / "mps"),
    )
    return sorted(out.splitlines())


async def test_podman_gives_a_container_what_the_claim_was_given(
    podman: Podman, images: dict[str, Any], root: Path
) -> None:
    cdi_dir, args = spec_dir_args(podman, root)
    device_nodes(root / "dev")
    (root / "mps").mkdir()
    claims = FixedClaims()
    whole = claims.add("whole", result("gpu-2"))
    share = claims.add("share", result("gpu-1", consumedCapacity={"cores": "30", "memory": "20Gi"}))
    dev = root / "dev"
    control = [f"node {dev}/{name} character special file 1:5" for name in cdi.CONTROL_DEVICES]
    try:
        async with plugin(root, cdi_dir, claims) as kubelet:
            answer = await kubelet.prepare(("default", whole, "whole"), ("default", share, "share"))
            assert {uid: c.error for uid, c in answer.claims.items()} == {whole: "", share: ""}
            whole_ids = [i for d in answer.claims[whole].devices for i in d.cdi_device_ids]
            share_ids = [i for d in answer.claims[share].devices for i in d.cdi_device_ids]
            assert whole_ids == [cdi.device_id(DRIVER, whole, "gpu-2")]

            seen = await anyio.to_thread.run_sync(in_container, podman, args, whole_ids, root)
            assert seen == sorted(
                [
                    f"GPULET_ALLOCATION_ID=dra-{whole[:8]}",
                    "NVIDIA_VISIBLE_DEVICES=GPU-2",
                    f"node {dev}/nvidia2 character special file 1:3",
                    *control,
                ]
            )
            seen = await anyio.to_thread.run_sync(in_container, podman, args, share_ids, root)
            assert seen == sorted(
                [
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M",
                    f"CUDA_MPS_PIPE_DIRECTORY={root / 'mps'}",
                    f"GPULET_ALLOCATION_ID=dra-{share[:8]}",
                    "NVIDIA_VISIBLE_DEVICES=GPU-1",
                    f"mounted {root / 'mps'}",
                    f"node {dev}/nvidia1 character special file 1:3",
                    *control,
                ]
            )

            undone = await kubelet.unprepare(("default", whole, "whole"))
            assert undone.claims[whole].error == ""
            gone = await anyio.to_thread.run_sync(
                lambda: podman.run(*args, "run", "--rm", "--device", whole_ids[0], local(IMAGE))
            )
            assert gone.returncode != 0
            assert "unresolvable CDI devices" in gone.stderr
            await kubelet.unprepare(("default", share, "share"))
    finally:
        # Specs left by a failure, where podman's built-in directory was used.
        for uid in (whole, share):
            cdi.spec_file(cdi_dir, DRIVER, uid).unlink(missing_ok=True)
