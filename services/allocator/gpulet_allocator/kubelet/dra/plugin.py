"""NodePrepareResources / NodeUnprepareResources: the rules, apart from gRPC.

Prepare, for each claim of the request (one claim's failure is that claim's ``error``
entry, never the call's):

1. the UID must be a UID (it names a file); a claim listed twice is prepared once;
2. the claim is read from the API server (:class:`~.contract.ClaimReader`) and decoded
   by :func:`~.claims.devices_of`: same UID, allocated, our driver's results only, in
   our pool;
3. the decision core reserves the devices for the claim UID in the shared ledger
   (idempotent: the same claim again gets the same reservation; a device held by
   another claim or by the device plugin is refused); a result with ``adminAccess``
   is not reserved (it owns nothing: a monitoring pod sees a busy GPU), only looked
   up (:attr:`DraPlugin.lookup`);
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from gpulet_allocator.kubelet.deviceplugin.devnodes import DeviceNodes
from gpulet_allocator.kubelet.dra import timeslice
from gpulet_allocator.kubelet.dra.checkpoint import CheckpointFile, PreparedClaim, PreparedDevice
from gpulet_allocator.kubelet.dra.claims import ClaimError, claim_words, configs_of, devices_of
from gpulet_allocator.kubelet.dra.contract import (
    ClaimDevice,
    ClaimReader,
    ClaimReadError,
    DecisionCore,
    MpsDaemons,
    Reservation,
    ReservedDevice,
)
from gpulet_allocator.kubelet.dra.metrics import DraMetrics
from gpulet_allocator.kubelet.dra.status import ClaimStatusWriter, Outcome, outcome_devices
from gpulet_common.dra import cdi, limits
from gpulet_common.dra import config as dra_config
from gpulet_common.dra.mig import parse_name as parse_mig_name
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.refusal import BusError, bounded

log = logging.getLogger("gpulet.dra.plugin")

MIB = 1 << 20
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
    # Why it failed, for the metrics (.metrics.REASONS or a ledger refusal's code).
    reason: str = ""
    # What to tell the claim's readers (:mod:`.status`): None when the claim was not
    # read (not found, the API unreachable).
    outcome: Outcome | None = None


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
    # gpulet's per-GPU MPS control daemons (gpulet_common.mps): a share's device mounts
    # its GPU's pipe and log directories. Empty: none (or the operator's pipe directory).
    mps_root: str = ""
    claim_timeout_s: float = 30.0
    # The node's boot ID, recorded with each prepared claim (.sweep).
    boot_id: str = ""
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
    def __init__(
        self,
        core: DecisionCore,
        reader: ClaimReader,
        settings: PluginSettings,
        status: ClaimStatusWriter | None = None,
        metrics: DraMetrics | None = None,
    ) -> None:
        self._core = core
        self._reader = reader
        self.settings = settings
        self.status = status
        self.metrics = metrics or DraMetrics()
        self.metrics.watch_prepared(lambda: len(self.checkpoint.claims))
        # Device name -> the device as it is now (uuid, minor), for adminAccess results
        # (never reserved): the node read model in production; None serves no admin.
        self.lookup: Callable[[str], ReservedDevice | None] | None = None
        # The driver's user space for every spec (.driver.DriverFilesKeeper sets it).
        self.driver_edits: dict[str, object] = {}
        # The driver's nvidia-smi as this process can run it (TimeSlicing; .timeslice).
        self.nvidia_smi = ""
        # The allocator's MPS daemons when they share this process (.contract.MpsDaemons).
        self.mps: MpsDaemons | None = None
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
        started = anyio.current_time()
        result = await self._timed_prepare(claim)
        self.metrics.prepared(anyio.current_time() - started, result.reason)
        return result

    async def _timed_prepare(self, claim: ClaimRef) -> PrepareResult:
        try:
            cdi.check_uid(claim.uid)
        except ValueError as exc:
            return PrepareResult(error=str(exc), reason="invalid_uid")
        lock = self.locks.acquire_ref(claim.uid)
        try:
            async with lock:
                result: PrepareResult | None = None
                with anyio.move_on_after(self.settings.claim_timeout_s):
                    result = await self._prepare(claim)
                if result is None:
                    limit = self.settings.claim_timeout_s
                    return PrepareResult(
                        error=f"prepare timed out after {limit:.0f}s", reason="timeout"
                    )
                if result.outcome is not None and self.status is not None:
                    self.status.report(result.outcome)
                return result
        except Exception as exc:  # a bug of ours must not fail the other claims
            log.exception("prepare of claim %s failed", claim.uid)
            return PrepareResult(error=f"internal error: {type(exc).__name__}", reason="internal")
        finally:
            self.locks.release_ref(claim.uid)

    async def _prepare(self, claim: ClaimRef) -> PrepareResult:
        s = self.settings
        where = claim_words(claim.namespace, claim.name)
        if not (limits.is_dns_label(claim.namespace) and limits.is_dns_subdomain(claim.name)):
            # No claim can have this name: not asked of the API server, not echoed whole.
            return PrepareResult(
                error=f"claim {where} not found: not a valid claim name", reason="not_found"
            )
        try:
            body = await self._reader.get_claim(claim.namespace, claim.name, claim.uid)
        except ClaimReadError as exc:
            return PrepareResult(error=bounded(str(exc)), reason="read_error")
        if body is None:
            return PrepareResult(error=f"claim {where} not found", reason="not_found")

        def failed(error: str, reason: str, devices: Sequence[ClaimDevice] = ()) -> PrepareResult:
            outcome = Outcome(
                claim.namespace, claim.name, claim.uid, outcome_devices(devices), error
            )
            return PrepareResult(error=error, outcome=outcome, reason=reason)

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
            return failed(bounded(str(exc)), "invalid_claim")
        try:
            configs = configs_of(body, wanted, driver=s.driver, where=where)
        except ClaimError as exc:
            return failed(bounded(str(exc)), "invalid_config", wanted)
        held_before = claim.uid in self.checkpoint.claims
        if not wanted:
            # Nothing of ours in this claim: nothing to reserve, nothing to inject.
            return PrepareResult()
        owned = [w for w in wanted if not w.admin]
        admin: list[ReservedDevice] = []
        for w in wanted:
            if not w.admin:
                continue
            found = self.lookup(w.device) if self.lookup is not None else None
            if found is None:
                return failed(
                    f"claim {where}: admin access to unknown device {w.device}",
                    "unknown_device",
                    wanted,
                )
            admin.append(found)
        try:
            reservation = (
                await self._core.reserve_claim(
                    claim.uid, owned, namespace=claim.namespace, name=claim.name
                )
                if owned
                else Reservation(claim.uid, "", ())
            )
        except BusError as exc:
            return failed(bounded(f"claim {where}: {exc.message}"), exc.code, wanted)
        missing = {w.device for w in owned} - {d.device for d in reservation.devices}
        if admin:
            # Admin access is prepared beside what is reserved, owning nothing.
            reservation = Reservation(
                reservation.claim_uid, reservation.allocation, (*reservation.devices, *admin)
            )
        if missing:
            if not held_before:
                await self._release_quietly(claim.uid)
            return failed(f"claim {where}: not reserved: {sorted(missing)}", "not_reserved", wanted)
        uuids = {d.device: d.uuid for d in reservation.devices}
        problem = await timeslice.apply(self.nvidia_smi, timeslice.wanted(configs, uuids))
        if problem:
            if not held_before:
                await self._release_quietly(claim.uid)
            return failed(f"claim {where}: {problem}", "timeslice", wanted)
        try:
            # On the event loop, as the allocator writes its checkpoint: about a
            # millisecond (a spec on tmpfs, the checkpoint in memory), where a worker
            # thread's half-dozen system calls each wait to win the GIL back from a busy
            # loop (1-6 ms more at p99 in bench/dra.py).
            prepared = self._write(claim, wanted, reservation, configs)
        except OSError as exc:
            if not held_before:
                await self._release_quietly(claim.uid)
            self._log.warning("prepare of %s: cannot write its CDI spec: %s", where, exc)
            return failed(
                bounded(f"claim {where}: cannot write CDI spec: {exc}"), "cdi_write", wanted
            )
        outcome = Outcome(claim.namespace, claim.name, claim.uid, outcome_devices(wanted, uuids))
        return PrepareResult(devices=prepared.devices, outcome=outcome)

    async def _release_quietly(self, uid: str) -> None:
        """Give back a reservation this call made; the core unreachable, Unprepare will."""
        try:
            await self._core.release_claim(uid)
        except BusError as exc:
            self._log.warning("release of claim %s after a failed prepare: %s", uid, exc)

    def _write(
        self,
        claim: ClaimRef,
        wanted: Sequence[ClaimDevice],
        reservation: Reservation,
        configs: Mapping[str, dra_config.Config],
    ) -> PreparedClaim:
        s = self.settings
        by_device = {d.device: d for d in reservation.devices}
        requests = {w.device: w.requests for w in wanted}
        spec = cdi.build_spec(
            s.driver,
            claim.uid,
            reservation.allocation,
            [
                self._cdi_device(d, requests.get(d.device, ()), configs.get(d.device))
                for d in reservation.devices
            ],
            dev_root=s.dev_root,
            host_dev=s.host_dev,
            container_dev=s.container_dev,
            mps_pipe_directory=s.mps_pipe_directory,
            mps_root=s.mps_root,
            control=self._nodes.control_names(),  # looked at once a second
            driver_edits=self.driver_edits,
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
                share_id=w.share_id,
            )
            for w in wanted
        ]
        prepared = PreparedClaim(
            uid=claim.uid,
            namespace=claim.namespace,
            name=claim.name,
            allocation=reservation.allocation,
            devices=devices,
            boot_id=s.boot_id,
            mps=self._mps_whole_of(reservation, configs),
        )
        self.checkpoint.remember(prepared)
        self._wake_writer()
        if prepared.mps and self.mps is not None:
            self.mps.changed()
        return prepared

    def _mps_whole_of(
        self, reservation: Reservation, configs: Mapping[str, dra_config.Config]
    ) -> dict[str, list[int]]:
        """The whole GPUs of the claim that its configuration puts under MPS."""
        out: dict[str, list[int]] = {}
        for d in reservation.devices:
            percent, memory = dra_config.mps_limits(configs.get(d.device))
            if (
                d.cores is None
                and d.memory_mib is None
                and dra_config.strategy(configs.get(d.device)) == "MPS"
            ):
                out[d.uuid] = [percent or 100, -(-memory // MIB) if memory else 0]
        return out

    def mps_whole(self) -> dict[str, tuple[int, int]]:
        """GPU UUID -> (cores %, memory MiB) for every prepared claim's whole GPUs under
        MPS: the allocator runs their control daemons (.contract.MpsDaemons)."""
        return {
            uuid: (limits[0], limits[1])
            for claim in self.checkpoint.claims.values()
            for uuid, limits in claim.mps.items()
            if len(limits) == 2
        }

    def use_driver(self, edits: Mapping[str, object], nvidia_smi: str) -> None:
        """The driver's user space for the specs written from now on, and its
        nvidia-smi (:class:`~.driver.DriverFilesKeeper`)."""
        self.driver_edits = dict(edits)
        self.nvidia_smi = nvidia_smi

    def _cdi_device(
        self, d: ReservedDevice, requests: tuple[str, ...], config: dra_config.Config | None
    ) -> cdi.PreparedDevice:
        """A reserved device for its CDI spec. A share keeps the limits the scheduler
        accounted for; a whole device configured for MPS gets its config's limits."""
        cores, memory_mib = d.cores, d.memory_mib
        if cores is None and memory_mib is None:
            percent, memory = dra_config.mps_limits(config)
            cores = percent
            memory_mib = -(-memory // MIB) if memory else None
        return cdi.PreparedDevice(
            d.device, d.uuid, d.minor, cores, memory_mib, self._mig_nodes(d), requests
        )

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
            self.metrics.unprepare_failed(exc.code)
            return bounded(f"claim {claim.uid}: {exc.message}")
        except OSError as exc:
            self.metrics.unprepare_failed("cdi_write")
            return bounded(f"claim {claim.uid}: cannot remove its CDI spec: {exc}")
        except Exception as exc:
            self.metrics.unprepare_failed("internal")
            log.exception("unprepare of claim %s failed", claim.uid)
            return f"internal error: {type(exc).__name__}"
        finally:
            self.locks.release_ref(claim.uid)

    def _forget(self, uid: str) -> None:
        cdi.remove_spec(self.settings.cdi_dir, self.settings.driver, uid)
        held = self.checkpoint.claims.get(uid)
        self.checkpoint.forget(uid)
        self._wake_writer()
        if held is not None and held.mps and self.mps is not None:
            self.mps.changed()

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
