"""A ResourceClaim read from the API server, decoded totally into our devices.

What Prepare may act on (``resource.k8s.io/v1``, ``status.allocation.devices.results``)
is checked here, never assumed:

* the object is a claim whose ``metadata.uid``, ``namespace`` and ``name`` are the ones
  kubelet named (a claim deleted and created again under the same name has another
  UID: preparing it would hand the old pod's devices to a new claim);
* it is allocated (``status.allocation`` present);
* only results whose ``driver`` is ours are taken (a claim may also hold other
  drivers' devices: theirs are theirs to prepare); each must name our pool (this node)
  and a device name that is a DNS label;
* ``request`` ``main/sub`` (a prioritized-list sub-request) counts as ``main``;
* ``consumedCapacity`` of a shared device gives the share: ``cores`` (percent, 1-100)
  and ``memory`` (bytes, a whole quantity);
* a result with ``adminAccess: true`` is admin access (a monitoring pod's): it owns
  nothing, whatever capacity it was charged (0 on a busy GPU).

Anything else is a :class:`ClaimError` whose message is the per-claim ``error`` kubelet
sees. Nothing here raises anything else, whatever the JSON.
"""

from __future__ import annotations

from typing import Any, Final

import anyio

from gpulet_allocator.kubelet.dra.contract import ClaimDevice, ClaimReadError, JsonObj
from gpulet_common.dra import config as dra_config
from gpulet_common.dra import limits
from gpulet_common.dra.mig import parse_name as parse_mig_name
from gpulet_common.kubeapi import KubeApiError, KubeClient, api_path
from gpulet_common.quantity import parse_whole as parse_quantity

MAX_RESULTS: Final = 128
GROUP: Final = "resource.k8s.io"
VERSION: Final = "v1"


class ClaimError(ValueError):
    """The claim cannot be prepared; the message says why (kubelet shows it)."""


# A name as kubelet sent it is echoed in an error to this many characters at most
# (Kubernetes names are at most 253; a longer one is no claim's, and is cut).
MAX_NAME_ECHO: Final = 253


def _cut(text: str) -> str:
    if len(text) <= MAX_NAME_ECHO:
        return text
    return f"{text[:64]}... ({len(text)} characters)"


def claim_words(namespace: str, name: str) -> str:
    """``namespace/name`` for an error message, each part cut when it is too long."""
    return f"{_cut(namespace)}/{_cut(name)}"


def _dict(value: Any) -> JsonObj:
    return value if isinstance(value, dict) else {}


def devices_of(
    claim: Any, *, uid: str, namespace: str, name: str, driver: str, pool: str
) -> list[ClaimDevice]:
    """Our driver's devices of an allocated claim; raises ClaimError."""
    if not isinstance(claim, dict):
        raise ClaimError("the API server's answer is not a ResourceClaim")
    meta = _dict(claim.get("metadata"))
    if meta.get("uid") != uid:
        raise ClaimError(
            f"claim {namespace}/{name} has UID {str(meta.get('uid'))[:64]!r}, not {uid}"
        )
    if meta.get("namespace") != namespace or meta.get("name") != name:
        raise ClaimError(f"the API server answered with another claim for {namespace}/{name}")
    allocation = _dict(claim.get("status")).get("allocation")
    if not isinstance(allocation, dict):
        raise ClaimError(f"claim {namespace}/{name} is not allocated")
    results = _dict(allocation.get("devices")).get("results")
    if results is None:
        results = []
    if not isinstance(results, list) or len(results) > MAX_RESULTS:
        raise ClaimError(f"claim {namespace}/{name}: malformed allocation results")
    found: list[ClaimDevice] = []
    seen: set[tuple[str, str, str]] = set()
    for i, result in enumerate(results):
        if not isinstance(result, dict):
            raise ClaimError(f"claim {namespace}/{name}: result {i} is not an object")
        if result.get("driver") != driver:
            continue
        device = _one(result, i, pool=pool, where=f"{namespace}/{name}")
        key = (device.pool, device.device, device.share_id)
        if key in seen:
            # The same device twice in one claim (two requests): merge request names.
            merged = next(d for d in found if (d.pool, d.device, d.share_id) == key)
            found[found.index(merged)] = ClaimDevice(
                merged.pool,
                merged.device,
                tuple(dict.fromkeys(merged.requests + device.requests)),
                merged.cores,
                merged.memory_bytes,
                merged.share_id,
                merged.admin,
            )
            continue
        seen.add(key)
        found.append(device)
    return found


def _one(result: JsonObj, i: int, *, pool: str, where: str) -> ClaimDevice:
    got_pool, device, request = result.get("pool"), result.get("device"), result.get("request")
    if got_pool != pool:
        raise ClaimError(f"claim {where}: result {i} is in pool {str(got_pool)[:64]!r}, not {pool}")
    if not isinstance(device, str) or not limits.is_dns_label(device):
        raise ClaimError(f"claim {where}: result {i} names no valid device")
    if not isinstance(request, str) or not request:
        raise ClaimError(f"claim {where}: result {i} names no request")
    main = request.split("/", 1)[0]
    share = result.get("shareID")
    share_id = share if isinstance(share, str) else ""
    admin = result.get("adminAccess") is True
    if admin:
        # Admin access owns nothing: whatever it consumed, it is no share.
        return ClaimDevice(pool, device, (main,), share_id=share_id, admin=True)
    consumed = result.get("consumedCapacity")
    cores = memory = None
    if consumed is not None:
        if not isinstance(consumed, dict):
            raise ClaimError(f"claim {where}: result {i} has malformed consumedCapacity")
        if "cores" in consumed:
            cores = parse_quantity(consumed["cores"])
            if cores is None or not 1 <= cores <= 100:
                raise ClaimError(f"claim {where}: result {i} consumes invalid cores")
        if "memory" in consumed:
            memory = parse_quantity(consumed["memory"])
            if memory is None or memory <= 0:
                raise ClaimError(f"claim {where}: result {i} consumes invalid memory")
    return ClaimDevice(pool, device, (main,), cores, memory, share_id)


def configs_of(
    claim: JsonObj, devices: list[ClaimDevice], *, driver: str, where: str
) -> dict[str, dra_config.Config]:
    """Each of our devices' configuration (by device name) from the allocation's
    opaque configs of our driver (:mod:`gpulet_common.dra.config`); raises ClaimError
    naming the config and the field when one is invalid or of the wrong kind."""
    allocation = _dict(_dict(claim.get("status")).get("allocation"))
    configs = _dict(allocation.get("devices")).get("config")
    requests = sorted({r for d in devices for r in d.requests})
    chosen, errors = dra_config.resolve(configs, driver, requests)
    if errors:
        raise ClaimError(f"claim {where}: invalid configuration: " + "; ".join(errors))
    out: dict[str, dra_config.Config] = {}
    for device in devices:
        config = next((chosen[r] for r in device.requests if r in chosen), None)
        if config is None:
            continue
        mig = parse_mig_name(device.device) is not None
        if mig != isinstance(config, dra_config.MigDeviceConfig):
            want = "MigDeviceConfig" if mig else "GpuConfig"
            raise ClaimError(
                f"claim {where}: invalid configuration: kind: device {device.device} "
                f"takes a {want}, not a {type(config).__name__}"
            )
        out[device.device] = config
    return out


class KubeClaimReader:
    """:class:`~.contract.ClaimReader` through :mod:`gpulet_common.kubeapi` (raw JSON)."""

    def __init__(self, api: KubeClient, *, timeout_s: float = 10.0) -> None:
        self._api = api
        self._timeout = timeout_s

    async def get_claim(self, namespace: str, name: str, uid: str = "") -> JsonObj | None:
        try:
            with anyio.fail_after(self._timeout + 1):
                found = await self._api.get(
                    api_path(GROUP, VERSION, "resourceclaims", namespace=namespace, name=name),
                    timeout_s=self._timeout,
                )
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise ClaimReadError(f"get claim {namespace}/{name}: HTTP {exc.status}") from exc
        except (TimeoutError, OSError) as exc:
            raise ClaimReadError(f"get claim {namespace}/{name}: {type(exc).__name__}") from exc
        except Exception as exc:  # whatever else: the claim cannot be read now
            raise ClaimReadError(f"get claim {namespace}/{name}: {type(exc).__name__}") from exc
        return found if isinstance(found, dict) else {}
