"""NodePrepareResources / NodeUnprepareResources: the rules, apart from gRPC.

Prepare, for each claim of the request (one claim's failure is that claim's ``error``
entry, never the call's):

1. the UID must be a UID (it names a file); a claim listed twice is prepared once;
2. the claim is read from the API server (:class:`~.contract.ClaimReader`) and decoded
   by :func:`~.claims.devices_of`: same UID, allocated, our driver's results only, in
   our pool;
3. the decision core reserves the devices for the claim UID in the shared ledger
   (idempotent: the same claim again gets the same reservation; a device held by
   another claim or by the device plugin is refused);
4. the claim's CDI spec is written atomically (a MIG device gets its parent's device
   node and its capability nodes) (written again on a repeat, so a spec lost or left
   stale is repaired), on the event loop (about a millisecond, see
   :meth:`DraPlugin._prepare`); the claim is checkpointed in memory, and the writer task
   (:meth:`DraPlugin.write_checkpoint`) writes the file after the answer
   (:mod:`.checkpoint` says why that is safe);
5. the answer lists each device with its CDI ID.

A failure after step 3 releases a reservation that this call made (not one an earlier
Prepare made and kubelet still counts on).

Unprepare, for each claim: release the claim in the ledger, remove its CDI spec and
its checkpoint entry, each by the UID alone, so it works after a restart without the
claim object, and for a UID never prepared (an empty, successful entry): idempotent.

Order: calls for one claim UID are serialized by a per-claim lock, and Prepare reads
the claim afresh each time. So an Unprepare that arrives while a Prepare of the same
claim is in flight waits for it and then undoes it, and a Prepare that comes after an
Unprepare prepares again only if the claim is still allocated to this node (NVIDIA's
#641: the reverse order leaked devices there). Each claim is bounded by
``claim_timeout_s`` (kubelet gives the whole call about 45 s).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from gpulet_allocator.kubelet.deviceplugin.devnodes import DeviceNodes
from gpulet_allocator.kubelet.dra.checkpoint import CheckpointFile, PreparedClaim, PreparedDevice
from gpulet_allocator.kubelet.dra.claims import ClaimError, devices_of
from gpulet_allocator.kubelet.dra.contract import (
    ClaimDevice,
    ClaimReader,
    ClaimReadError,
    DecisionCore,
    Reservation,
    ReservedDevice,
)
from gpulet_common.dra import cdi
from gpulet_common.dra.mig import parse_name as parse_mig_name
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.refusal import BusError, bounded

log = logging.getLogger("gpulet.dra.plugin")

WRITE_RETRY_S = 1.0
# The checkpoint's writer waits until no claim changed for WRITE_QUIET_S, but never
# more than WRITE_MAX_DELAY_S after the first change it covers (see write_checkpoint).
WRITE_QUIET_S = 0.05
WRITE_MAX_DELAY_S = 1.0


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


@dataclass
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class PluginSettings:
    driver: str
    pool: str  # the node's pool: the node name
    cdi_dir: Path
    checkpoint: Path
    dev_root: Path = Path("/dev")
    host_dev: str = "/dev"
    # Where the device nodes appear in the container (None: host_dev).
    container_dev: str | None = None
    mps_pipe_directory: str = ""
    claim_timeout_s: float = 30.0
    # Where the driver names a MIG device's capability nodes (issue 27).
    mig_capabilities_root: Path = Path("/proc/driver/nvidia/capabilities")


class _Locks:
    """One lock per claim UID, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[anyio.Lock, int]] = {}

    def acquire_ref(self, uid: str) -> anyio.Lock:
        lock, users = self._locks.get(uid, (anyio.Lock(), 0))
        self._locks[uid] = (lock, users + 1)
        return lock

    def release_ref(self, uid: str) -> None:
        lock, users = self._locks[uid]
        if users <= 1:
            del self._locks[uid]
        else:
            self._locks[uid] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


class DraPlugin:
    def __init__(self, core: DecisionCore, reader: ClaimReader, settings: PluginSettings) -> None:
        self._core = core
        self._reader = reader
        self.settings = settings
        self.checkpoint = CheckpointFile(settings.checkpoint)
        self.locks = _Locks()
        self._nodes = DeviceNodes(
            settings.dev_root,
            settings.host_dev,
            container_dev=settings.container_dev,
            capabilities=settings.mig_capabilities_root,
        )
        self._wake: anyio.Event | None = None
        self._log = RateLimitedLog(log, per_minute=10)

    def load(self) -> None:
        """Read the checkpoint (blocking file I/O: call at start, off the loop if need be)."""
        self.checkpoint.load()

    # --- Prepare -------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        out: dict[str, PrepareResult] = {}
        unique = list({c.uid: c for c in claims}.values())
        if len(unique) == 1:  # kubelet's usual call: no task group for one claim
            return {unique[0].uid: await self._serialized_prepare(unique[0])}

        async def one(claim: ClaimRef) -> None:
            out[claim.uid] = await self._serialized_prepare(claim)

        async with anyio.create_task_group() as tg:
            for claim in unique:
                tg.start_soon(one, claim)
        return out

    async def _serialized_prepare(self, claim: ClaimRef) -> PrepareResult:
        try:
            cdi.check_uid(claim.uid)
        except ValueError as exc:
            return PrepareResult(error=str(exc))
        lock = self.locks.acquire_ref(claim.uid)
        try:
            async with lock:
                result: PrepareResult | None = None
                with anyio.move_on_after(self.settings.claim_timeout_s):
                    result = await self._prepare(claim)
                if result is None:
                    limit = self.settings.claim_timeout_s
                    return PrepareResult(error=f"prepare timed out after {limit:.0f}s")
                return result
        except Exception as exc:  # a bug of ours must not fail the other claims
            log.exception("prepare of claim %s failed", claim.uid)
            return PrepareResult(error=f"internal error: {type(exc).__name__}")
        finally:
            self.locks.release_ref(claim.uid)

    async def _prepare(self, claim: ClaimRef) -> PrepareResult:
        s = self.settings
        where = f"{claim.namespace}/{claim.name}"
        try:
            body = await self._reader.get_claim(claim.namespace, claim.name, claim.uid)
        except ClaimReadError as exc:
            return PrepareResult(error=bounded(str(exc)))
        if body is None:
            return PrepareResult(error=f"claim {where} not found")
        try:
            wanted = devices_of(
                body,
                uid=claim.uid,
                namespace=claim.namespace,
                name=claim.name,
                driver=s.driver,
                pool=s.pool,
            )
        except ClaimError as exc:
            return PrepareResult(error=bounded(str(exc)))
        held_before = claim.uid in self.checkpoint.claims
        if not wanted:
            # Nothing of ours in this claim: nothing to reserve, nothing to inject.
            return PrepareResult()
        try:
            reservation = await self._core.reserve_claim(
                claim.uid, wanted, namespace=claim.namespace, name=claim.name
            )
        except BusError as exc:
            return PrepareResult(error=bounded(f"claim {where}: {exc.message}"))
        missing = {w.device for w in wanted} - {d.device for d in reservation.devices}
        if missing:
            if not held_before:
                await self._release_quietly(claim.uid)
            return PrepareResult(error=f"claim {where}: not reserved: {sorted(missing)}")
        try:
            # On the event loop, as the allocator writes its checkpoint: about a
            # millisecond (a spec on tmpfs, the checkpoint in memory), where a worker
            # thread's half-dozen system calls each wait to win the GIL back from a busy
            # loop (1-6 ms more at p99 in bench/dra.py).
            prepared = self._write(claim, wanted, reservation)
        except OSError as exc:
            if not held_before:
                await self._release_quietly(claim.uid)
            self._log.warning("prepare of %s: cannot write its CDI spec: %s", where, exc)
            return PrepareResult(error=bounded(f"claim {where}: cannot write CDI spec: {exc}"))
        return PrepareResult(devices=prepared.devices)

    async def _release_quietly(self, uid: str) -> None:
        """Give back a reservation this call made; the core unreachable, Unprepare will."""
        try:
            await self._core.release_claim(uid)
        except BusError as exc:
            self._log.warning("release of claim %s after a failed prepare: %s", uid, exc)

    def _write(
        self, claim: ClaimRef, wanted: Sequence[ClaimDevice], reservation: Reservation
    ) -> PreparedClaim:
        s = self.settings
        by_device = {d.device: d for d in reservation.devices}
        spec = cdi.build_spec(
            s.driver,
            claim.uid,
            reservation.allocation,
            [
                cdi.PreparedDevice(
                    d.device, d.uuid, d.minor, d.cores, d.memory_mib, self._mig_nodes(d)
                )
                for d in reservation.devices
            ],
            dev_root=s.dev_root,
            host_dev=s.host_dev,
            container_dev=s.container_dev,
            mps_pipe_directory=s.mps_pipe_directory,
            control=self._nodes.control_names(),  # looked at once a second
        )
        cdi.write_spec(s.cdi_dir, s.driver, claim.uid, spec)
        devices = [
            PreparedDevice(
                requests=list(w.requests),
                pool=w.pool,
                device=w.device,
                cdi_ids=[cdi.device_id(s.driver, claim.uid, w.device)]
                if w.device in by_device
                else [],
            )
            for w in wanted
        ]
        prepared = PreparedClaim(
            uid=claim.uid,
            namespace=claim.namespace,
            name=claim.name,
            allocation=reservation.allocation,
            devices=devices,
        )
        self.checkpoint.remember(prepared)
        self._wake_writer()
        return prepared

    def _mig_nodes(self, device: ReservedDevice) -> tuple[str, ...]:
        """A MIG device's capability nodes (its name carries its GPU and compute
        instance, :func:`gpulet_common.dra.mig.parse_name`); none for a GPU."""
        ids = parse_mig_name(device.device)
        if ids is None or ids[0] != device.minor:
            return ()
        return tuple(spec.host_path for spec in self._nodes.mig_specs(*ids))

    # --- Unprepare -----------------------------------------------------------------------

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        out: dict[str, str] = {}
        for claim in {c.uid: c for c in claims}.values():
            out[claim.uid] = await self._serialized_unprepare(claim)
        return out

    async def _serialized_unprepare(self, claim: ClaimRef) -> str:
        try:
            cdi.check_uid(claim.uid)
        except ValueError as exc:
            return str(exc)
        lock = self.locks.acquire_ref(claim.uid)
        try:
            async with lock:
                await self._core.release_claim(claim.uid)
                # On the event loop, as Prepare writes the spec (an unlink on tmpfs): the
                # claims in memory and the writer's event are the loop's alone.
                self._forget(claim.uid)
                return ""
        except BusError as exc:
            return bounded(f"claim {claim.uid}: {exc.message}")
        except OSError as exc:
            return bounded(f"claim {claim.uid}: cannot remove its CDI spec: {exc}")
        except Exception as exc:
            log.exception("unprepare of claim %s failed", claim.uid)
            return f"internal error: {type(exc).__name__}"
        finally:
            self.locks.release_ref(claim.uid)

    def _forget(self, uid: str) -> None:
        cdi.remove_spec(self.settings.cdi_dir, self.settings.driver, uid)
        self.checkpoint.forget(uid)
        self._wake_writer()

    # --- the checkpoint's writer ---------------------------------------------------------

    def _wake_writer(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def write_checkpoint(self) -> None:
        """Write the checkpoint after the answers that changed it, one write for all the
        changes since the last (see :mod:`.checkpoint`), and once more when cancelled.
        A failed write is logged and tried again a second later.

        The write waits for a lull: until no claim changed for :data:`WRITE_QUIET_S`,
        at most :data:`WRITE_MAX_DELAY_S` after the first change. Its worker thread
        takes the GIL from the event loop for each of its system calls, so a write
        started right after an answer delayed the calls behind it (1 ms at the median
        and 2-3 ms at p99 of bench/dra.py's Prepare); a burst of pods now costs one
        write instead of one per claim. What an answer stands on is durable before it
        leaves either way (the ledger's reservation and the CDI spec)."""
        self._wake = anyio.Event()
        try:
            while True:
                await self._wake.wait()
                await self._lull()
                self._wake = anyio.Event()
                if not await self._flush():
                    await anyio.sleep(WRITE_RETRY_S)
                    self._wake.set()
        finally:
            with anyio.CancelScope(shield=True):
                await self._flush()

    async def _lull(self) -> None:
        """Return once no change came for WRITE_QUIET_S, or WRITE_MAX_DELAY_S passed."""
        deadline = anyio.current_time() + WRITE_MAX_DELAY_S
        while (left := deadline - anyio.current_time()) > 0:
            self._wake = anyio.Event()
            with anyio.move_on_after(min(WRITE_QUIET_S, left)):
                await self._wake.wait()
                continue  # another change: wait for quiet again
            return

    async def _flush(self) -> bool:
        try:
            await anyio.to_thread.run_sync(self.checkpoint.flush)
        except OSError as exc:
            self._log.warning("cannot write the DRA checkpoint %s: %s", self.checkpoint.path, exc)
            return False
        return True
