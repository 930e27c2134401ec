"""Getting the desired state into the API server: compare, write, retry.

Layers
------
* :class:`KubeWriter` -- one attempt at making the API server match a
  :class:`~gpulet_reporter.desired.DesiredState`, through gpulet's own small
  client (:mod:`gpulet_common.kubeapi`):

  - it keeps the last Device and Node it read or wrote (the *observed* objects) and
    compares against them before touching the network: an unchanged desired state
    costs no request at all, which is how steady state makes zero writes;
  - the Device is created when missing, otherwise replaced (PUT) with the observed
    ``resourceVersion``; the body is the observed object with only our parts swapped,
    so others' labels, owners, ``status.allocations`` and ``spec.devices`` entries of
    other types (koordlet's ``rdma``, ``fpga``) survive;
  - node labels go out as a JSON merge patch of only our keys, carrying the Node's
    ``resourceVersion`` (see :func:`~gpulet_reporter.desired.node_label_patch`);
  - 409 (a concurrent writer, or a stale cache) re-reads and tries again at once, a
    few rounds; anything else becomes a :class:`WriteError` for the loop.

* :class:`WriteLoop` -- generic over what it writes (the Device and labels'
  :class:`~gpulet_reporter.desired.DesiredState`; the node condition's intent in a loop
  of its own, :mod:`gpulet_reporter.node_health`) -- waits on the debouncer, applies,
  and on a ``WriteError`` backs off (full jitter, or the server's ``Retry-After`` on
  429) and tries again with the newest desired state, until it succeeds. It runs in
  its own task: the bus side only ever calls :meth:`Debouncer.submit`, so a slow or
  failing API server never blocks NATS. Every ``reconcile_interval_s`` (jittered
  ±10 % so a fleet does not read in lock-step) it forgets the observed objects,
  re-reads them and corrects drift. A newer (debounced) desired state ends a back-off
  early only after a failure it may cure -- ``conflict``, ``4xx`` (our request was
  refused: a new body may pass), ``internal`` (our bug on that state) -- and is written
  at once; after ``429``, ``5xx``, ``timeout`` or ``connection`` the server is what
  fails, so the back-off is served in full and the newest state goes out after it.
  Cancelling the loop's task (a stop) ends any wait at once.

Why read-modify-write and not a patch or server-side apply
----------------------------------------------------------
``spec.devices`` is shared with koordlet and is an *atomic* list in Koordinator's CRD
(no ``x-kubernetes-list-type: map``), so every way of writing part of it writes all of
it: a JSON merge patch replaces the whole list, and a server-side-apply field manager
would own the whole list and take it from koordlet (or conflict with it on every
write). We cannot give the list map keys either: the CRD must stay Koordinator's. So
the one safe write is read-modify-write under optimistic concurrency: render our GPU
entries into the *observed* list and PUT it with the observed ``resourceVersion``. If
anyone wrote in between, the server answers 409 Conflict and nothing of theirs is lost;
we re-read and render again. A stale cache therefore costs one extra round trip, never
another agent's entries.

Requests are bounded by ``api_timeout_s``; nothing here waits without a limit.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Final, Generic, Protocol, TypeVar

import anyio

from gpulet_common.bus import backoff_delay
from gpulet_common.kubeapi import KubeApiError, KubeClient, api_path
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_reporter.debounce import Debouncer
from gpulet_reporter.desired import (
    GROUP,
    PLURAL,
    VERSION,
    DesiredState,
    JsonObj,
    device_differs,
    render_device,
)
from gpulet_reporter.labels import node_label_patch
from gpulet_reporter.metrics import ReporterMetrics

log = logging.getLogger("gpulet.reporter")

# Conflicts re-read and retry at once this many times before backing off: a second
# writer racing us every time is unusual enough to deserve the back-off.
MAX_CONFLICT_ROUNDS: Final = 5
# Failures a newer desired state may cure: it ends their back-off (see above).
CURED_BY_NEWER: Final = frozenset({"conflict", "4xx", "internal"})

StatusCallback = Callable[[str, str], None]

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


class WriteError(Exception):
    """A write attempt failed; ``reason`` is the metric label."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        retry_after: float | None = None,
        permanent: bool = False,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
        self.permanent = permanent


class TryAgain(Exception):
    """Raised by a round of :meth:`NodeClient.in_conflict_rounds` to run the next one at
    once (the object vanished under an update: create it instead)."""


class WriteSink(Protocol[T_contra]):
    """Where desired states go: the API server, or a file in no-cluster mode."""

    description: str

    async def apply(self, desired: T_contra) -> bool:
        """Make the target match; True if something was written. Raises WriteError."""
        ...

    async def refresh(self) -> None:
        """Forget what was observed, so the next apply re-reads and corrects drift."""
        ...


def retry_after_seconds(headers: Any) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or an HTTP date), or None."""
    if not headers:
        return None
    try:
        raw = headers.get("Retry-After")
    except AttributeError:
        return None
    if raw is None:
        return None
    text = str(raw).strip()
    try:
        value = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        value = when.timestamp() - time.time()
    if math.isnan(value) or math.isinf(value):
        return None
    return max(0.0, value)


def api_error(exc: KubeApiError, what: str) -> WriteError:
    status = int(exc.status or 0)
    detail = f"{what}: HTTP {status} {exc.reason or ''}".strip()
    if status == 429:
        return WriteError("429", detail, retry_after=retry_after_seconds(exc.headers))
    if status >= 500 or status == 0:
        return WriteError("5xx", detail, retry_after=retry_after_seconds(exc.headers))
    if status in (408, 409, 425):
        # A conflict where the caller did not expect one (a read), a request timeout,
        # "too early": transient by definition, retried with the normal back-off.
        return WriteError("conflict" if status == 409 else "timeout", detail)
    # 400/401/403/422...: our request or our RBAC is wrong. Retrying soon is pointless, but
    # an RBAC fix or a new desired state may cure it, so keep trying at the slowest pace.
    return WriteError("4xx", f"{detail}: {exc.message}", permanent=True)


@dataclass(frozen=True, slots=True)
class NodeApi:
    """What every writer of one node's objects works with: the API client, the node,
    the reporter's settings and its metrics."""

    api: KubeClient
    node: str
    settings: ReporterSettings
    metrics: ReporterMetrics


class NodeClient:
    """API calls for one node's writers: our timeout and error mapping around every
    request, the Node as last read, and read-modify-write merge patches of it with
    conflict retries. The Device writer and the node-condition writer each hold one."""

    def __init__(
        self,
        api: KubeClient,
        node: str,
        settings: ReporterSettings,
        metrics: ReporterMetrics,
        *,
        missing: str,
    ) -> None:
        self.api = api
        self.node = node
        self.node_path = api_path("", "v1", "nodes", name=node)
        self._settings = settings
        self._metrics = metrics
        self.node_object: JsonObj | None = None
        self.node_read = False
        # What waits while the Node does not exist (logged at most once a minute).
        self._missing = missing
        self._missing_log = RateLimitedLog(log, per_minute=1)

    @classmethod
    def of(cls, target: NodeApi, *, missing: str) -> NodeClient:
        """The client of a writer of ``target``'s objects."""
        return cls(target.api, target.node, target.settings, target.metrics, missing=missing)

    async def call(
        self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any
    ) -> Any:
        timeout = self._settings.api_timeout_s
        try:
            # The client's own timeout covers the request; ours also covers connection
            # set-up, so no call can hang the loop.
            with anyio.fail_after(timeout + 1.0):
                return await fn(*args, timeout_s=timeout, **kw)
        except KubeApiError:
            raise
        except TimeoutError as exc:
            raise WriteError("timeout", f"{what}: no answer within {timeout:.1f}s") from exc
        except OSError as exc:
            raise WriteError("connection", f"{what}: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def as_dict(obj: Any) -> JsonObj | None:
        return obj if isinstance(obj, dict) else None

    async def read_node(self) -> None:
        try:
            found = await self.call("get node", self.api.get, self.node_path)
        except KubeApiError as exc:
            if exc.status != 404:
                raise api_error(exc, "get node") from exc
            self._missing_log.warning("node %s not found: %s", self.node, self._missing)
            found = None
        self.node_object = self.as_dict(found) if found is not None else None
        self.node_read = True

    async def in_conflict_rounds(
        self, obj: str, attempt: Callable[[], Awaitable[T]], *, stale: Callable[[], None]
    ) -> T:
        """Read-modify-write under optimistic concurrency, for every object we write.

        ``attempt`` reads what is not read yet, builds and writes, and lets a 409 from
        its write through as :class:`~gpulet_common.kubeapi.KubeApiError`: that
        conflict is counted, ``stale`` forgets the read, and the attempt runs again at
        once; so does one that raised :class:`TryAgain`. After
        :data:`MAX_CONFLICT_ROUNDS` rounds it is a ``conflict`` :class:`WriteError`, for
        the loop's back-off."""
        for _ in range(MAX_CONFLICT_ROUNDS):
            try:
                return await attempt()
            except TryAgain:
                continue
            except KubeApiError as exc:
                if exc.status != 409:
                    raise
                self._metrics.conflict(obj)
                stale()
        raise WriteError("conflict", f"{obj} {self.node}: {MAX_CONFLICT_ROUNDS} conflicts in a row")

    def _forget_node(self) -> None:
        self.node_read = False

    async def patch_node(
        self, what: str, build: Callable[[JsonObj], JsonObj | None], metric: str
    ) -> JsonObj | None:
        """Merge-patch the Node with what ``build`` makes of it as last read; on a
        conflict read it again and rebuild. Returns the patch written, or None when
        there was nothing to write or no Node."""

        async def attempt() -> JsonObj | None:
            if not self.node_read:
                await self.read_node()
            if self.node_object is None:
                return None
            patch = build(self.node_object)
            if patch is None:
                return None
            try:
                result = await self.call(
                    what,
                    self.api.patch,
                    self.node_path,
                    patch,
                    patch="merge",
                    field_manager=self._settings.field_manager,
                )
            except KubeApiError as exc:
                if exc.status == 409:
                    raise
                if exc.status == 404:
                    self.node_object = None
                    return None
                raise api_error(exc, what) from exc
            self.node_object = self.as_dict(result)
            self.node_read = self.node_object is not None
            self._metrics.wrote(metric, "patch")
            return patch

        return await self.in_conflict_rounds("node", attempt, stale=self._forget_node)


class KubeWriter:
    """The API side of one node: observed objects, compare, create/update/patch."""

    def __init__(
        self, target: NodeApi, *, clock: Callable[[], float] = time.time, server: str = ""
    ) -> None:
        self._kube = NodeClient.of(
            target, missing="the Device gets no owner reference and node labels wait"
        )
        self._api = target.api
        self._device_path = api_path(GROUP, VERSION, PLURAL, name=target.node)
        self._node = target.node
        self._settings = target.settings
        self._metrics = target.metrics
        self._clock = clock
        self.description = f"API server {server}" if server else "API server"
        self.device: JsonObj | None = None
        self._device_read = False

    @property
    def node_object(self) -> JsonObj | None:
        return self._kube.node_object

    async def refresh(self) -> None:
        self._device_read = False
        self._kube.node_read = False

    async def apply(self, desired: DesiredState) -> bool:
        if not self._kube.node_read:
            await self._kube.read_node()
        wrote = await self._apply_device(desired)
        if self._settings.node_labels:
            wrote = await self._apply_labels(desired) or wrote
        return wrote

    async def _read_device(self) -> None:
        try:
            found = await self._kube.call("get device", self._api.get, self._device_path)
        except KubeApiError as exc:
            if exc.status != 404:
                raise api_error(exc, "get device") from exc
            found = None
        self.device = found if isinstance(found, dict) else None
        self._device_read = True

    def _node_uid(self) -> str | None:
        if self.node_object is None:
            return None
        uid = (self.node_object.get("metadata") or {}).get("uid")
        return uid if isinstance(uid, str) and uid else None

    # -- the Device --------------------------------------------------------------

    def _forget_device(self) -> None:
        self._device_read = False

    async def _apply_device(self, desired: DesiredState) -> bool:
        return await self._kube.in_conflict_rounds(
            "device", lambda: self._write_device(desired), stale=self._forget_device
        )

    async def _write_device(self, desired: DesiredState) -> bool:
        """One round of :meth:`_apply_device` (see :meth:`NodeClient.in_conflict_rounds`)."""
        manager = self._settings.field_manager
        if not self._device_read:
            await self._read_device()
        rendered = render_device(desired, self.device, node_uid=self._node_uid(), now=self._clock())
        if not device_differs(rendered, self.device):
            return False
        rendered["metadata"].pop("managedFields", None)
        verb = "create" if self.device is None else "update"
        try:
            if self.device is None:
                result = await self._kube.call(
                    "create device",
                    self._api.create,
                    api_path(GROUP, VERSION, PLURAL),
                    rendered,
                    field_manager=manager,
                )
            else:
                result = await self._kube.call(
                    "update device",
                    self._api.replace,
                    self._device_path,
                    rendered,
                    field_manager=manager,
                )
        except KubeApiError as exc:
            if exc.status == 409:
                # Stale resourceVersion (someone wrote in between) or AlreadyExists.
                raise
            if exc.status == 404 and verb == "update":
                self.device = None
                raise TryAgain from exc
            raise api_error(exc, f"{verb} device") from exc
        self.device = result if isinstance(result, dict) else None
        self._device_read = self.device is not None
        self._metrics.wrote("device", verb)
        log.info("device %s: %s (%d GPUs)", self._node, verb, len(desired.gpus))
        return True

    # -- node labels -------------------------------------------------------------

    async def _apply_labels(self, desired: DesiredState) -> bool:
        patch = await self._kube.patch_node(
            "patch node", lambda node: node_label_patch(desired.node_labels, node), "node"
        )
        if patch is None:
            return False
        log.info("node %s: labels patched (%s)", self._node, _describe(patch))
        return True


def _describe(patch: JsonObj) -> str:
    labels = (patch.get("metadata") or {}).get("labels") or {}
    changed = [k for k, v in labels.items() if v is not None]
    removed = [k for k, v in labels.items() if v is None]
    parts = []
    if changed:
        parts.append(f"set {len(changed)}")
    if removed:
        parts.append("removed " + ", ".join(sorted(removed)))
    return "; ".join(parts) or "ownership annotation"


class WriteLoop(Generic[T]):
    """Debouncer → sink, with back-off, newest-state-wins retries and reconciles.

    ``reconcile_interval_s`` overrides the settings' (the node condition's loop ticks at
    its heartbeat); ``track_pending`` False leaves the ``pending`` gauge to another loop.
    """

    def __init__(
        self,
        sink: WriteSink[T],
        debouncer: Debouncer[T],
        settings: ReporterSettings,
        metrics: ReporterMetrics,
        *,
        on_status: StatusCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        reconcile_interval_s: float | None = None,
        track_pending: bool = True,
    ) -> None:
        self._sink = sink
        self._debouncer = debouncer
        self._settings = settings
        self._metrics = metrics
        self._on_status = on_status or (lambda _state, _detail: None)
        self._clock = clock
        self._reconcile_s = (
            settings.reconcile_interval_s if reconcile_interval_s is None else reconcile_interval_s
        )
        self._track_pending = track_pending
        self._failure_log = RateLimitedLog(log, per_minute=6)
        self.current: T | None = None
        self.applied: T | None = None
        # For tests: reconciles begun, and whether the loop waits for input or timer.
        self.reconciles = 0
        self.waiting = False

    def _set_pending(self, pending: bool) -> None:
        if self._track_pending:
            self._metrics.pending = pending

    def _next_reconcile_in(self) -> float:
        interval = self._reconcile_s
        if interval <= 0:
            return math.inf
        return interval * random.uniform(0.9, 1.1)

    async def run(self) -> None:
        deadline = self._clock() + self._next_reconcile_in()
        while True:
            self.waiting = True
            try:
                got = await self._debouncer.next_within(deadline - self._clock())
            finally:
                self.waiting = False
            if got is None:
                # The reconcile timer: forget what we saw, re-read, correct drift.
                self.reconciles += 1
                deadline = self._clock() + self._next_reconcile_in()
                await self._sink.refresh()
            else:
                self.current = got
            if self.current is not None:
                await self.apply_until_done(self._debouncer.taken_since if got else None)

    async def apply_until_done(self, since: float | None = None) -> None:
        """Apply the current desired state, retrying until it sticks."""
        attempt = 0
        self._set_pending(True)
        while True:
            newer = self._debouncer.take_now()
            if newer is not None:
                self.current = newer
                if since is None:
                    since = self._debouncer.taken_since
            desired = self.current
            if desired is None:
                self._set_pending(False)
                return
            try:
                try:
                    wrote = await self._sink.apply(desired)
                except WriteError:
                    raise
                except Exception as exc:
                    # An answer the client could not digest, or a bug of ours: one node
                    # agent must not die of it. Logged with its traceback, retried slowly.
                    log.exception("unexpected failure writing to %s", self._sink.description)
                    raise WriteError(
                        "internal", f"{type(exc).__name__}: {exc}", permanent=True
                    ) from exc
            except WriteError as err:
                attempt += 1
                delay = self._delay(err, attempt)
                self._metrics.failed(err.reason)
                self._metrics.retried(err.reason)
                self._failure_log.warning(
                    "write to %s failed (%s): %s; retry %d in %.2fs",
                    self._sink.description,
                    err.reason,
                    err,
                    attempt,
                    delay,
                )
                self._on_status("degraded", f"writes failing ({err.reason}): {err}")
                if err.reason not in CURED_BY_NEWER:
                    await anyio.sleep(delay)
                elif (newer := await self._debouncer.next_within(delay)) is not None:
                    self.current = newer
                    since = since if since is not None else self._debouncer.taken_since
                continue
            self.applied = desired
            self._set_pending(self._debouncer.pending)
            if wrote:
                latency = self._clock() - since if since is not None else None
                self._metrics.succeeded(latency)
            else:
                self._metrics.unchanged()
                self._metrics.succeeded(None)
            if attempt:
                log.info("write to %s succeeded after %d retries", self._sink.description, attempt)
            self._on_status("ready", self._sink.description)
            return

    def _delay(self, err: WriteError, attempt: int) -> float:
        settings = self._settings
        if err.retry_after is not None and err.reason == "429":
            # Honour the server's Retry-After (clamped), plus a little jitter so a fleet
            # told "1 s" does not come back in one wave.
            return min(err.retry_after, settings.retry_after_max_s) + random.uniform(
                0, settings.backoff_base_s
            )
        if err.permanent:
            return settings.backoff_max_s
        return backoff_delay(attempt - 1, settings.backoff_base_s, settings.backoff_max_s)
