"""What Prepare did, written where users look: the claim's ``status.devices`` and Events.

``kubectl get resourceclaim -o yaml`` then shows which GPU a pod got, and why a claim
that can never be prepared is stuck (kubelet only retries it, and its message reaches
the pod's events at best).

* **status.devices** (GA in 1.37): after each Prepare, one entry per device of ours
  in the allocation (``driver``, ``pool``, ``device``, ``shareID``), with the condition
  ``Ready`` (``True``/``Prepared``, or ``False``/``PrepareFailed`` and the error) and
  ``data``: ``{"uuid": <GPU UUID>}``, or ``{"migUUID": <MIG UUID>}`` for a MIG device.
  Read, merged (our driver's entries replaced, the other drivers' kept as they are)
  and written to the ``status`` subresource with the read ``resourceVersion`` (a
  conflict reads again); the same state again writes nothing and keeps its
  ``lastTransitionTime``. The API server needs the entries to name allocated devices
  only, and allows the write to a node's driver with ``resourceclaims/status``
  ``update`` plus ``resourceclaims/driver`` ``associated-node:update`` for the driver's
  name (1.36 and later).
* **Events**: a refused Prepare is a ``Warning`` Event ``PrepareFailed`` on the claim,
  once per claim and message every :data:`EVENT_EVERY_S` (kubelet retries a failing
  Prepare every few seconds; the log and the API server must not flood).

Nothing here is on Prepare's path: :meth:`ClaimStatusWriter.report` only records the
outcome (the newest per claim wins, at most :data:`MAX_PENDING` claims waiting) and
:meth:`ClaimStatusWriter.run` writes in the background. A failed write is logged
(rate-limited) and dropped: the next Prepare of that claim reports again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import anyio

from gpulet_allocator.kubelet.dra.claims import GROUP, VERSION
from gpulet_common.dra.mig import parse_name as parse_mig_name
from gpulet_common.kubeapi import KubeApiError, KubeClient, api_path
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.refusal import bounded

log = logging.getLogger("gpulet.dra.status")

MAX_PENDING: Final = 1024
EVENT_EVERY_S: Final = 60.0
MAX_EVENT_KEYS: Final = 4096
READY: Final = "Ready"
CONFLICT_ROUNDS: Final = 3


def _same_condition(before: Any, entry: dict[str, Any]) -> bool:
    conditions = before.get("conditions") if isinstance(before, dict) else None
    if not isinstance(conditions, list) or len(conditions) != 1:
        return False
    old, new = conditions[0], entry["conditions"][0]
    if not isinstance(old, dict):
        return False
    return all(old.get(k) == new[k] for k in ("type", "status", "reason", "message"))


@dataclass(frozen=True)
class DeviceOutcome:
    pool: str
    device: str
    share_id: str = ""
    uuid: str = ""  # empty: not reserved (a refusal)


@dataclass(frozen=True)
class Outcome:
    """One Prepare of one claim."""

    namespace: str
    name: str
    uid: str
    devices: tuple[DeviceOutcome, ...] = ()
    error: str = ""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def device_entry(driver: str, device: DeviceOutcome, error: str, now: str) -> dict[str, Any]:
    """One ``status.devices`` entry."""
    entry: dict[str, Any] = {"driver": driver, "pool": device.pool, "device": device.device}
    if device.share_id:
        entry["shareID"] = device.share_id
    condition = {
        "type": READY,
        "status": "False" if error else "True",
        "reason": "PrepareFailed" if error else "Prepared",
        "message": bounded(error),
        "lastTransitionTime": now,
    }
    entry["conditions"] = [condition]
    if device.uuid and not error:
        mig = parse_mig_name(device.device) is not None
        entry["data"] = {"migUUID" if mig else "uuid": device.uuid}
    return entry


@dataclass
class ClaimStatusWriter:
    api: KubeClient
    driver: str
    node: str
    timeout_s: float = 10.0
    clock: Any = time.monotonic
    pending: OrderedDict[str, Outcome] = field(default_factory=OrderedDict)
    # (claim UID, message) -> when its Event was last sent.
    _events: OrderedDict[tuple[str, str], float] = field(default_factory=OrderedDict)
    _wake: anyio.Event = field(default_factory=anyio.Event)
    written: int = 0
    events: int = 0
    failures: int = 0
    _log: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log, per_minute=6))

    @property
    def field_manager(self) -> str:
        return f"gpulet-dra-{self.node}"[:128]

    def report(self, outcome: Outcome) -> None:
        """Record a Prepare's outcome (never blocks; the newest per claim wins)."""
        self.pending.pop(outcome.uid, None)
        self.pending[outcome.uid] = outcome
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self.pending:
                _, outcome = self.pending.popitem(last=False)
                await self.write(outcome)

    async def write(self, outcome: Outcome) -> None:
        if outcome.devices:
            await self._status(outcome)
        if outcome.error:
            await self._event(outcome)

    async def _status(self, outcome: Outcome) -> None:
        """Read the claim, put our driver's entries in ``status.devices`` (the other
        drivers' as they are), and write ``/status`` with the read ``resourceVersion``
        when anything differs; a conflict reads again, a few rounds."""
        path = api_path(
            GROUP, VERSION, "resourceclaims", namespace=outcome.namespace, name=outcome.name
        )
        try:
            for _ in range(CONFLICT_ROUNDS):
                with anyio.fail_after(self.timeout_s + 1):
                    current = await self.api.get(path, timeout_s=self.timeout_s)
                body = self._merged(current, outcome)
                if body is None:
                    return  # another claim now, or nothing to change
                try:
                    with anyio.fail_after(self.timeout_s + 1):
                        await self.api.replace(
                            f"{path}/status",
                            body,
                            timeout_s=self.timeout_s,
                            field_manager=self.field_manager,
                        )
                except KubeApiError as exc:
                    if exc.status == 409:
                        continue
                    raise
                self.written += 1
                return
        except (KubeApiError, OSError, TimeoutError) as exc:
            self.failures += 1
            self._log.warning(
                "status of claim %s/%s not written: %s", outcome.namespace, outcome.name, exc
            )

    def _merged(self, current: Any, outcome: Outcome) -> dict[str, Any] | None:
        """The claim with our entries for ``outcome``; None when it is another claim
        (another UID) or already says exactly that."""
        if not isinstance(current, dict):
            return None
        meta = current.get("metadata")
        if not isinstance(meta, dict) or meta.get("uid") != outcome.uid:
            return None
        found = current.get("status")
        status: dict[str, Any] = found if isinstance(found, dict) else {}
        listed = status.get("devices")
        held: list[Any] = listed if isinstance(listed, list) else []
        ours = {
            (e.get("pool"), e.get("device"), e.get("shareID", "")): e
            for e in held
            if isinstance(e, dict) and e.get("driver") == self.driver
        }
        now = _now()
        wanted = []
        for d in outcome.devices:
            entry = device_entry(self.driver, d, outcome.error, now)
            before = ours.get((d.pool, d.device, d.share_id))
            if before is not None and _same_condition(before, entry):
                # The same state: keep the time it began (and write nothing).
                entry["conditions"][0]["lastTransitionTime"] = before["conditions"][0].get(
                    "lastTransitionTime", now
                )
            wanted.append(entry)
        others = [e for e in held if not (isinstance(e, dict) and e.get("driver") == self.driver)]
        devices = others + wanted
        if devices == held:
            return None
        return {**current, "status": {**status, "devices": devices}}

    def _event_due(self, key: tuple[str, str]) -> bool:
        now = self.clock()
        last = self._events.get(key)
        if last is not None and now - last < EVENT_EVERY_S:
            return False
        self._events.pop(key, None)
        self._events[key] = now
        while len(self._events) > MAX_EVENT_KEYS:
            self._events.popitem(last=False)
        return True

    async def _event(self, outcome: Outcome) -> None:
        message = bounded(outcome.error)
        if not self._event_due((outcome.uid, message)):
            return
        now = _now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{outcome.name[:200]}.", "namespace": outcome.namespace},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ResourceClaim",
                "name": outcome.name,
                "namespace": outcome.namespace,
                "uid": outcome.uid,
            },
            "reason": "PrepareFailed",
            "message": message,
            "type": "Warning",
            "source": {"component": self.driver, "host": self.node},
            "reportingComponent": self.driver,
            "reportingInstance": self.node[:128],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            with anyio.fail_after(self.timeout_s + 1):
                await self.api.create(
                    api_path("", "v1", "events", namespace=outcome.namespace),
                    body,
                    timeout_s=self.timeout_s,
                )
        except (KubeApiError, OSError, TimeoutError) as exc:
            self.failures += 1
            self._log.warning(
                "event of claim %s/%s not written: %s", outcome.namespace, outcome.name, exc
            )
        else:
            self.events += 1


def outcome_devices(
    wanted: Sequence[Any], uuids: dict[str, str] | None = None
) -> tuple[DeviceOutcome, ...]:
    """The devices of an outcome from the claim's devices (``ClaimDevice``) and, when
    reserved, each device's UUID."""
    found = uuids or {}
    return tuple(
        DeviceOutcome(w.pool, w.device, w.share_id, found.get(w.device, "")) for w in wanted
    )
