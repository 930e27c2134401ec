"""One label of this node, watched: the time-slicing config the node picks.

Why the allocator reads it
--------------------------
The label picks how many replicas each GPU is offered as; the allocator's ledger must
know that before anyone (it refuses a time-sliced GPU whole, a replica above the
count...), and the device plugin and the reporter learn the result from the allocator
(the ``withheld`` and ``held`` replies), so the label has one reader and the fact one
source. The allocator already talks to the API server (:mod:`.pod_watch`).

The Kubernetes I/O is :func:`watch_node_label` alone -- one LIST and one WATCH of
``/api/v1/nodes?fieldSelector=metadata.name=<node>`` through gpulet's own client
(:mod:`gpulet_common.kubeapi`) -- so that porting it to another client touches this one
function. :class:`NodeLabelFollower`
is the loop around it: a kube config (as the pod watch finds one: in-cluster, else a
kubeconfig), then list and watch again after every end, with a full-jitter back-off
after a failure. It never raises: without an API server the config in force stays
(the default's, at start) and the status says why.

Least privilege: listing and watching Nodes is not in the base RBAC (it would let every
node's agent read every Node). The watch needs the ``components/time-slicing`` kustomize
component (Helm: ``sharing.timeSlicing.watchNode``). Without it the LIST answers 403 and
the follower reads its own Node with a GET (which the base grants) every ``poll_s``
instead (:func:`get_node_label`): a label change then applies within that period.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any, Final

import anyio

from gpulet_allocator.service.pod_watch import kube_configuration
from gpulet_common.kube import KubeConfigError
from gpulet_common.kubeapi import KubeApiError, KubeClient, api_path
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.settings.allocator import HandshakeSettings
from gpulet_common.untrusted import json_document

log = logging.getLogger("gpulet.allocator.node-label")

BACKOFF_MAX_S: Final = 30.0
# A label value is at most 63 characters; anything longer is not a label.
_MAX_VALUE: Final = 63


def _label(obj: Any, key: str) -> str | None:
    """The label ``key`` of a Node object (None: absent or not a string)."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    labels = meta.get("labels") if isinstance(meta, dict) else None
    value = labels.get(key) if isinstance(labels, dict) else None
    return value[:_MAX_VALUE] if isinstance(value, str) else None


async def watch_node_label(
    api: KubeClient,
    node: str,
    key: str,
    on_value: Callable[[str | None], None],
    *,
    timeout_s: float,
    watch_s: float,
) -> None:
    """LIST this node, then WATCH it from the list's version, calling ``on_value`` with
    the label's value (None: absent) after the list and after every change. Returns when
    the watch ends (call again); raises KubeApiError, OSError, TimeoutError or
    ValueError (bad JSON) when the API server fails."""
    nodes = api_path("", "v1", "nodes")
    selector = f"metadata.name={node}"
    with anyio.fail_after(timeout_s + 1):
        doc = await api.list(nodes, field_selector=selector, timeout_s=timeout_s)
    items = doc.get("items") if isinstance(doc, dict) else None
    on_value(_label(items[0], key) if isinstance(items, list) and items else None)
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    version = str((meta or {}).get("resourceVersion") or "")
    seconds = max(1, int(watch_s))
    async with api.watch(
        nodes,
        field_selector=selector,
        resource_version=version,
        timeout_seconds=seconds,
        timeout_s=seconds + timeout_s,
    ) as lines:
        async for line in lines:
            event = json_document(line, what="Node watch line")
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "ERROR":
                return  # an expired version: list again
            if kind in ("ADDED", "MODIFIED"):
                on_value(_label(event.get("object"), key))
            elif kind == "DELETED":
                on_value(None)


async def get_node_label(
    api: KubeClient,
    node: str,
    key: str,
    on_value: Callable[[str | None], None],
    *,
    timeout_s: float,
) -> None:
    """GET this node and call ``on_value`` with the label (None: absent, or no Node)."""
    try:
        with anyio.fail_after(timeout_s + 1):
            doc = await api.get(api_path("", "v1", "nodes", name=node), timeout_s=timeout_s)
    except KubeApiError as exc:
        if exc.status != 404:
            raise
        doc = None
    on_value(_label(doc, key))


class NodeLabelFollower:
    """Keeps ``on_value`` told of one label of this node (see the module docstring)."""

    def __init__(
        self,
        node: str,
        key: str,
        settings: HandshakeSettings,
        on_value: Callable[[str | None], None],
        on_problem: Callable[[], None] = lambda: None,
        *,
        poll_s: float = 10.0,
    ) -> None:
        self._node = node
        self._poll_s = poll_s
        #: True once the API server refused the LIST/WATCH (403): GET every poll_s.
        self.polling = False
        self._on_problem = on_problem
        self._key = key
        self._settings = settings
        self._on_value = on_value
        #: Why the label is not followed now ("" when it is).
        self.problem = ""
        self._log = RateLimitedLog(log, per_minute=4)

    async def run(self) -> None:
        attempt = 0
        while True:
            try:
                configuration = await kube_configuration(self._settings)
                async with KubeClient(configuration) as api:
                    while True:
                        await self._follow(api)
                        attempt = 0
            except (
                KubeConfigError,
                KubeApiError,
                OSError,
                TimeoutError,
                ValueError,
            ) as exc:
                attempt += 1
                delay = random.uniform(0, min(BACKOFF_MAX_S, 0.2 * 2 ** min(attempt, 10)))
                self._set_problem(f"node label {self._key} not read: {type(exc).__name__}: {exc}")
                self._log.warning("%s; again in %.1fs", self.problem, delay)
                await anyio.sleep(delay)

    async def _follow(self, api: KubeClient) -> None:
        """One watch (until it ends), or, without the right to watch Nodes, one GET and
        a wait of ``poll_s``."""
        timeout_s = self._settings.api_timeout_s
        if self.polling:
            await get_node_label(api, self._node, self._key, self._seen, timeout_s=timeout_s)
            await anyio.sleep(self._poll_s)
            return
        try:
            await watch_node_label(
                api,
                self._node,
                self._key,
                self._seen,
                timeout_s=timeout_s,
                watch_s=self._settings.watch_timeout_s,
            )
        except KubeApiError as exc:
            if exc.status != 403:
                raise
            self.polling = True
            log.info(
                "may not list/watch Nodes (%s): reading node %s's label %s with a GET every"
                " %.0f s (components/time-slicing grants the watch)",
                exc,
                self._node,
                self._key,
                self._poll_s,
            )

    def _seen(self, value: str | None) -> None:
        self._set_problem("")
        self._on_value(value)

    def _set_problem(self, problem: str) -> None:
        if problem != self.problem:
            self.problem = problem
            self._on_problem()
