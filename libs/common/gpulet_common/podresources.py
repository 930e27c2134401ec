"""A client of kubelet's PodResources API, and how a device ID names its GPU.

Why here
--------
The allocator asks kubelet which container holds which devices
(``v1.PodResourcesLister/List`` on ``/var/lib/kubelet/pod-resources/kubelet.sock``), to
release the grants of pods that are gone; it is the node's one reader of PodResources,
and tells the collector (which labels GPU metrics with the pods using them, as
dcgm-exporter does) over the bus, so the collector never loads gRPC. The call and the
device-ID grammar stay in the common library, beside the vendored kubelet API.

Device IDs
----------
A whole GPU's device ID is its UUID. A share of a GPU is ``<uuid>::<suffix>``:
gpulet's ``<uuid>::core-N`` / ``<uuid>::mem-N`` (see the allocator's
``plugin/resources.py``), NVIDIA's time-slicing replicas ``<uuid>::N``. So the GPU of
any of them is the part before :data:`SHARE_SEPARATOR`.

The call is bounded by a deadline; a missing socket means "no kubelet here" and is
reported as such (:class:`PodResourcesUnavailable`), never as a crash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import anyio
import grpc
import grpc.aio

from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.kubelet_api.podresources.v1 import api_pb2_grpc as pr_grpc

# Between a GPU's UUID and the share part of a device ID.
SHARE_SEPARATOR: Final = "::"


class PodResourcesUnavailable(Exception):
    pass


def gpu_of_device(device_id: str) -> str:
    """The GPU UUID a device ID names (whole GPU or share); "" if it names none."""
    return device_id.partition(SHARE_SEPARATOR)[0].strip()


async def list_pod_resources(socket: Path, timeout_s: float) -> pr.ListPodResourcesResponse:
    """One ``List`` call; raises PodResourcesUnavailable (socket missing, RPC failed)."""
    if not await anyio.Path(socket).exists():
        raise PodResourcesUnavailable(f"{socket} does not exist")
    try:
        # The outer deadline also covers connecting and closing the channel.
        with anyio.fail_after(timeout_s + 1.0):
            async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
                stub = pr_grpc.PodResourcesListerStub(channel)
                return await stub.List(pr.ListPodResourcesRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise PodResourcesUnavailable(f"{exc.code().name}: {exc.details()}") from exc
    except (TimeoutError, OSError) as exc:
        raise PodResourcesUnavailable(f"{type(exc).__name__}: {exc}") from exc
