"""Housekeeping: unprepare the claims the API server no longer knows.

kubelet calls Unprepare when a pod's claim is done, but not always: a node that
rebooted, a kubelet whose state was wiped, a plugin that was down when kubelet gave up
retrying leave claims prepared here whose objects are long gone, and their GPUs stay
reserved in the ledger. NVIDIA's driver sweeps for them; so does
:class:`ClaimSweeper`:

* every ``dra.sweep_interval_s`` each prepared claim (the plugin's checkpoint) is read
  from the API server with a GET (never a cache: a cache may lag); one that is gone (404)
  or is now another object (another UID under its name) is unprepared through the
  plugin's own Unprepare (the ledger released, the CDI spec removed, the checkpoint
  entry dropped), under the same per-claim lock as kubelet's calls;
* keyed by the node's boot ID: a claim prepared in an earlier boot (its checkpoint entry
  names another boot ID) is checked at once when the plugin starts, not an interval
  later, since its containers cannot have survived the reboot;
* a claim that cannot be read now (the API server unreachable, throttled) is left for
  the next round; a round stops early when cancelled. At most :data:`MAX_PER_ROUND`
  claims are read per round.
"""

from __future__ import annotations

import logging
from typing import Final

import anyio

from gpulet_allocator.kubelet.dra.contract import ClaimReader, ClaimReadError
from gpulet_allocator.kubelet.dra.plugin import ClaimRef, DraPlugin
from gpulet_common.logutil import RateLimitedLog

log = logging.getLogger("gpulet.dra.sweep")

MAX_PER_ROUND: Final = 1024


class ClaimSweeper:
    def __init__(
        self, plugin: DraPlugin, reader: ClaimReader, *, interval_s: float, boot_id: str
    ) -> None:
        self._plugin = plugin
        self._reader = reader
        self._interval = interval_s
        self._boot_id = boot_id
        self.rounds = 0
        self.swept = 0
        self._log = RateLimitedLog(log, per_minute=6)

    async def run(self) -> None:
        await self.sweep(earlier_boots_only=True)
        while True:
            await anyio.sleep(self._interval)
            await self.sweep()

    async def sweep(self, *, earlier_boots_only: bool = False) -> int:
        """One round; returns how many claims it unprepared."""
        self.rounds += 1
        claims = list(self._plugin.checkpoint.claims.values())
        if earlier_boots_only:
            claims = [c for c in claims if c.boot_id != self._boot_id]
        gone: list[ClaimRef] = []
        for prepared in claims[:MAX_PER_ROUND]:
            try:
                body = await self._reader.get_claim(prepared.namespace, prepared.name)
            except ClaimReadError as exc:
                self._log.info(
                    "sweep: claim %s/%s unread: %s", prepared.namespace, prepared.name, exc
                )
                continue
            meta = body.get("metadata") if isinstance(body, dict) else None
            if body is None or not isinstance(meta, dict) or meta.get("uid") != prepared.uid:
                gone.append(ClaimRef(prepared.namespace, prepared.uid, prepared.name))
        if not gone:
            return 0
        errors = await self._plugin.unprepare(gone)
        done = [ref for ref in gone if not errors.get(ref.uid)]
        for ref in done:
            log.info(
                "claim %s/%s (%s) is gone from the API server: unprepared",
                ref.namespace,
                ref.name,
                ref.uid,
            )
        self.swept += len(done)
        self._plugin.metrics.swept(len(done))
        return len(done)
