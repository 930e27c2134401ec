"""This node's allocated ResourceClaims, watched: Prepare reads a claim from memory.

Why: a GET of the claim was a quarter of Prepare's time in bench/dra.py (2.3 of 9 ms at
the median, more at p99), and Prepare is on the pod's start-up path. With
``dra.claim_cache`` on, :class:`WatchedClaimReader` keeps the claims allocated to this
node from a watch, and :meth:`~WatchedClaimReader.get_claim` answers from it.

Rules:

* **What is kept.** A watch of ``resourceclaims`` (``resource.k8s.io/v1``) in all
  namespaces; only a claim with an allocation result of our driver in our pool (this
  node) is kept, at most :data:`MAX_CACHED` of them, so memory follows the node's
  claims, not the cluster's. A claim deleted, or no longer allocated here, is dropped.
* **Only what this watch saw.** Each watch opens without a resourceVersion, so the API
  server first sends every claim as it is now; the cache is built anew from that
  watch's events alone (nothing kept from before a watch failed or expired, when
  events may have been missed). While no watch is open the cache is empty.
* **A miss is a GET.** A claim not in the cache (the watch lags the scheduler's
  allocation by a few milliseconds, or it is down), or cached under another UID than
  the one kubelet named, is read by the fallback reader (:class:`~.claims.KubeClaimReader`),
  so the cache makes Prepare faster, never answers what a GET would not: kubelet
  prepares only a claim reserved for its pod, and the API server does not deallocate a
  reserved claim, so the allocation of a claim under one UID does not change under
  Prepare. The plugin checks the claim the same way whichever reader gave it
  (:func:`~.claims.devices_of`).
* **Hostile input.** Event lines are decoded totally
  (:func:`gpulet_common.untrusted.json_document`: size and depth bounded, every
  failure one ``ValueError``): a line that is not a JSON event with an object -- a
  claim whose opaque parameters nest thousands deep, say -- is counted
  (``bad_lines``) and skipped, and the watch goes on; that claim is then a miss, and
  the GET's own total decoding refuses it to its Prepare alone. A failed or ended
  watch is opened again after a jittered back-off.

Cost: every claim event of the cluster reaches every node that turns it on (one watch
each), which is why it is off by default.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import anyio

from gpulet_allocator.kubelet.dra.claims import GROUP, VERSION
from gpulet_allocator.kubelet.dra.contract import ClaimReader, JsonObj
from gpulet_common.kube_watch import keep_watching, watch_lines
from gpulet_common.kubeapi import KubeClient, api_path
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.untrusted import json_document

log = logging.getLogger("gpulet.dra.claims")

MAX_CACHED: Final = 4096
WATCH_TIMEOUT_S: Final = 300
BACKOFF_MAX_S: Final = 30.0


def _dict(value: Any) -> JsonObj:
    return value if isinstance(value, dict) else {}


def allocated_here(claim: JsonObj, *, driver: str, pool: str) -> bool:
    """Whether a claim has an allocation result of ``driver`` in ``pool``."""
    allocation = _dict(_dict(claim.get("status")).get("allocation"))
    results = _dict(allocation.get("devices")).get("results")
    if not isinstance(results, list):
        return False
    return any(
        isinstance(r, dict) and r.get("driver") == driver and r.get("pool") == pool for r in results
    )


class WatchedClaimReader:
    """A :class:`~.contract.ClaimReader` from a watch, with a GET on a miss."""

    def __init__(self, api: KubeClient, fallback: ClaimReader, *, driver: str, pool: str) -> None:
        self._api = api
        self._fallback = fallback
        self._driver = driver
        self._pool = pool
        self._claims: dict[tuple[str, str], JsonObj] = {}
        self.hits = 0
        self.misses = 0
        self.bad_lines = 0
        self.watches = 0
        self._log = RateLimitedLog(log, per_minute=6)

    def __len__(self) -> int:
        return len(self._claims)

    async def get_claim(self, namespace: str, name: str, uid: str = "") -> JsonObj | None:
        cached = self._claims.get((namespace, name))
        if cached is not None and uid and _dict(cached.get("metadata")).get("uid") == uid:
            self.hits += 1
            return cached
        self.misses += 1
        return await self._fallback.get_claim(namespace, name, uid)

    # --- the watch -----------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        await keep_watching(
            self._watch_once, self._log, "resourceclaims", backoff_max_s=BACKOFF_MAX_S
        )

    async def _watch_once(self) -> None:
        try:
            async with watch_lines(
                self._api,
                api_path(GROUP, VERSION, "resourceclaims"),
                timeout_s=WATCH_TIMEOUT_S,
                request_timeout_s=WATCH_TIMEOUT_S + 30,
            ) as lines:
                self._claims = {}
                self.watches += 1
                async for line in lines:
                    self.on_line(line)
        finally:
            self._claims = {}

    def on_line(self, line: bytes) -> None:
        """One watch event (public for the tests)."""
        try:
            event = json_document(line, what="ResourceClaim watch line")
        except ValueError:
            event = None
        obj = event.get("object") if isinstance(event, dict) else None
        meta = _dict(obj.get("metadata")) if isinstance(obj, dict) else {}
        namespace, name = meta.get("namespace"), meta.get("name")
        if not isinstance(obj, dict) or not isinstance(namespace, str) or not isinstance(name, str):
            if isinstance(event, dict) and event.get("type") == "ERROR":
                raise ValueError(f"watch error: {str(_dict(obj).get('message'))[:200]}")
            self.bad_lines += 1
            return
        key = (namespace, name)
        kind = event.get("type") if isinstance(event, dict) else None
        if kind in ("ADDED", "MODIFIED") and allocated_here(
            obj, driver=self._driver, pool=self._pool
        ):
            if key in self._claims or len(self._claims) < MAX_CACHED:
                self._claims[key] = obj
        elif kind in ("ADDED", "MODIFIED", "DELETED"):
            self._claims.pop(key, None)
