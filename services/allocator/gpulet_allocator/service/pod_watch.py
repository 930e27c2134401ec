"""This node's pods, watched into the core's
:class:`~gpulet_allocator.decide.koordinator.PodBook`; Events out.

Why a watch
-----------
``Allocate`` must never wait for the API server: kubelet gives a device plugin a few
seconds, and an API server that is slow or away would fail pod admission node-wide.
So the pods of this node are listed and watched (``fieldSelector=spec.nodeName=<node>``,
:mod:`gpulet_common.kubeapi`) into an in-memory book, and the allocator consults only the book.
A pod is bound before kubelet admits it, and the watch event of the binding arrives
well before kubelet's first call, so the book knows the decision when it is asked.

Protocol, as client-go's reflector does it
------------------------------------------
1. LIST with the field selector; the list's ``resourceVersion`` is where the watch
   starts, and the list replaces the book's content (pods gone meanwhile leave it).
2. WATCH from that version with ``allowWatchBookmarks``; ADDED / MODIFIED update a pod,
   DELETED removes it, BOOKMARK only moves the version. The server ends a watch after
   ``timeoutSeconds``; it is reopened from the last version seen.
3. ``410 Gone`` (the version is older than the server's history) or an ERROR event:
   back to 1. A connection failure: back off (full jitter, up to 30 s), then 1.

Every object is decoded by :func:`~gpulet_allocator.decide.koordinator.watched_pod`,
which never raises; a line that is not JSON is skipped and counted. Nothing here can
end the allocator.

Events
------
:class:`EventWriter` posts a ``Warning`` Event on a pod whose scheduler decision was
refused (reason :data:`EVENT_REASON`). The allocator only puts the pod and the message
in a bounded queue; a full queue drops the event (the refusal itself still reaches
kubelet, which records its own event). The same message for the same pod within a
minute is sent once.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from gpulet_allocator.decide.koordinator import PodBook, PodKey, watched_pod
from gpulet_common.kube import SERVICE_ACCOUNT_DIR, KubeConfig, lookup
from gpulet_common.kube_events import event_body
from gpulet_common.kubeapi import KubeApiError, KubeClient, api_path, watch_event
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.settings.allocator import HandshakeSettings

log = logging.getLogger("gpulet.allocator.pods")

EVENT_REASON: Final = "GpuletRefusedSchedulerDecision"
EVENT_COMPONENT: Final = "gpulet-allocator"
EVENT_QUEUE: Final = 256
EVENT_DEDUP_S: Final = 60.0
BACKOFF_MAX_S: Final = 30.0
PODS: Final = api_path("", "v1", "pods")


async def kube_configuration(
    settings: HandshakeSettings,
    env: Mapping[str, str] | None = None,
    sa_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeConfig:
    """In-cluster config when the pod has a token (and no kubeconfig is set), else a
    kubeconfig: ``handshake.kubeconfig``, ``$KUBECONFIG``, ``~/.kube/config``. Raises
    :class:`~gpulet_common.kube.KubeConfigError` with the reason."""
    return await lookup(settings.kubeconfig, settings.kube_context, env, sa_dir)


class PodWatch:
    """LIST + WATCH of this node's pods into ``book`` (see the module docstring)."""

    def __init__(
        self,
        api: KubeClient,
        book: PodBook,
        settings: HandshakeSettings,
        *,
        on_state: Callable[[str], None] = lambda _detail: None,
    ) -> None:
        self._api = api
        self._book = book
        self._settings = settings
        self._on_state = on_state
        self._selector = f"spec.nodeName={book.node}"
        self.resource_version = ""
        self.lists = 0
        self.watches = 0
        self.bad_lines = 0
        self._log = RateLimitedLog(log, per_minute=4)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        attempt = 0
        started = False
        while True:
            try:
                await self._list()
                if not started:
                    started = True
                    task_status.started()
                attempt = 0
                self._on_state("")
                while await self._watch():
                    pass
            except (KubeApiError, OSError, TimeoutError, ValueError) as exc:
                attempt += 1
                delay = random.uniform(0, min(BACKOFF_MAX_S, 0.2 * 2 ** min(attempt, 10)))
                detail = _describe(exc)
                self._on_state(f"pod watch failing: {detail}")
                self._log.warning(
                    "pod watch of %s: %s; again in %.1fs", self._book.node, detail, delay
                )
                if not started:
                    # Serve without decisions meanwhile: the allocator decides as before.
                    started = True
                    task_status.started()
                await anyio.sleep(delay)

    async def _list(self) -> None:
        timeout = self._settings.api_timeout_s
        with anyio.fail_after(timeout + 1):
            # A failed list raises: it must not empty the book.
            doc = await self._api.list(PODS, field_selector=self._selector, timeout_s=timeout)
        items = doc.get("items") if isinstance(doc, dict) else None
        pods = []
        for item in items if isinstance(items, list) else []:
            pod = watched_pod(item)
            if pod is not None:
                pods.append(pod)
        self._book.replace_all(pods)
        meta = doc.get("metadata") if isinstance(doc, dict) else None
        self.resource_version = str((meta or {}).get("resourceVersion") or "")
        self.lists += 1
        log.debug("listed %d pods of %s at %s", len(pods), self._book.node, self.resource_version)

    async def _watch(self) -> bool:
        """One watch; True when it ended normally (reopen from the version), False
        when the book must be listed again."""
        seconds = max(1, int(self._settings.watch_timeout_s))
        self.watches += 1
        async with self._api.watch(
            PODS,
            field_selector=self._selector,
            bookmarks=True,
            resource_version=self.resource_version,
            timeout_seconds=seconds,
            timeout_s=seconds + self._settings.api_timeout_s,
        ) as lines:
            async for line in lines:
                if not self._apply(line):
                    return False
        return True

    def _apply(self, line: bytes) -> bool:
        event = watch_event(line)
        if event is None:
            self.bad_lines += 1
            return True
        kind, obj = event
        if kind == "ERROR":
            code = obj.get("code")
            log.info("pod watch ended by the server (%s): listing again", code)
            return False
        meta = obj.get("metadata")
        if isinstance(meta, dict) and meta.get("resourceVersion"):
            self.resource_version = str(meta["resourceVersion"])
        if kind == "BOOKMARK":
            return True
        if kind == "DELETED":
            uid = meta.get("uid") if isinstance(meta, dict) else None
            if isinstance(uid, str):
                self._book.remove(uid)
            return True
        if kind in ("ADDED", "MODIFIED"):
            pod = watched_pod(obj)
            if pod is None:
                self.bad_lines += 1
            else:
                self._book.upsert(pod)
        return True


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KubeApiError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class EventWriter:
    """Posts Warning Events on pods whose decision gpulet refused."""

    def __init__(self, api: KubeClient | None, node: str, settings: HandshakeSettings) -> None:
        self._api = api
        self._node = node
        self._settings = settings
        send, receive = anyio.create_memory_object_stream[tuple[PodKey, str]](EVENT_QUEUE)
        self._send: MemoryObjectSendStream[tuple[PodKey, str]] = send
        self._receive: MemoryObjectReceiveStream[tuple[PodKey, str]] = receive
        self._recent: dict[tuple[str, str], float] = {}
        self.sent = 0
        self.dropped = 0
        self.failed = 0
        self._log = RateLimitedLog(log, per_minute=4)

    def post(self, pod: PodKey, message: str) -> None:
        """Queue an Event; never blocks (a full queue drops it)."""
        if self._api is None or not self._settings.events:
            return
        try:
            self._send.send_nowait((pod, message))
        except anyio.WouldBlock:
            self.dropped += 1

    async def run(self) -> None:
        async with self._receive:
            async for pod, message in self._receive:
                now = time.monotonic()
                key = (pod.uid, message)
                if now - self._recent.get(key, -math.inf) < EVENT_DEDUP_S:
                    continue
                self._recent = {k: t for k, t in self._recent.items() if now - t < EVENT_DEDUP_S}
                self._recent[key] = now
                await self._create(pod, message)

    async def _create(self, pod: PodKey, message: str) -> None:
        assert self._api is not None
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": pod.namespace,
            "name": pod.name,
            "uid": pod.uid,
        }
        body: Any = event_body(
            namespace=pod.namespace,
            involved=involved,
            reason=EVENT_REASON,
            message=message,
            component=EVENT_COMPONENT,
            node=self._node,
        )
        timeout = self._settings.api_timeout_s
        try:
            with anyio.fail_after(timeout + 1):
                await self._api.create(
                    api_path("", "v1", "events", namespace=pod.namespace), body, timeout_s=timeout
                )
        except (KubeApiError, OSError, TimeoutError) as exc:
            self.failed += 1
            self._log.warning("cannot post an Event on %s: %s", pod, _describe(exc))
            return
        self.sent += 1
