"""Remediation's only calls to the API server, behind :class:`KubeActions`.

Three calls, nothing else: list the node's pods (``GET /api/v1/pods?fieldSelector=
spec.nodeName=<node>``), evict one (``POST .../pods/<name>/eviction``, a ``policy/v1``
``Eviction`` with the pod's UID as a precondition, so a new pod of the same name is
never evicted in its place), and create an Event (on a pod in its namespace; on the
Node in ``remediation.node_event_namespace``, as kubelet does). The Eviction API is what
respects PodDisruptionBudgets: it answers 429 while an eviction would violate one.

Everything above this module talks to the :class:`KubeActions` protocol, so tests and
the benchmark can stand in for the server, and the client library can change here
alone. :class:`KubeClient` is the implementation on gpulet's own client
(:mod:`gpulet_common.kubeapi`), as :mod:`gpulet_allocator.service.pod_watch` uses it.
No call raises for an answer of the server or a failed connection: each returns what
happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import anyio

from gpulet_allocator.service.remediate.policy import PodInfo, pod_info
from gpulet_common import kubeapi
from gpulet_common.kube_events import event_body
from gpulet_common.kubeapi import KubeApiError, api_path
from gpulet_common.untrusted import json_document

EVENT_COMPONENT: Final = "gpulet-allocator"
EvictResult = Literal["evicted", "blocked_by_pdb", "gone", "failed"]


@dataclass(frozen=True, slots=True)
class EvictOutcome:
    result: EvictResult
    status: int = 0
    detail: str = ""
    # The server's Retry-After, when it gave one.
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class EventTarget:
    kind: Literal["Pod", "Node"]
    name: str
    namespace: str = ""
    uid: str = ""


class KubeActions(Protocol):
    async def list_pods(self) -> list[PodInfo]:
        """This node's pods; raises :class:`KubeError` when they cannot be listed."""
        ...

    async def evict(self, namespace: str, name: str, uid: str) -> EvictOutcome: ...

    async def post_event(
        self, target: EventTarget, reason: str, message: str, *, warning: bool = True
    ) -> bool: ...


class KubeError(Exception):
    """A list that failed, with the reason."""


def outcome_of(status: int, body: bytes, retry_after: str | None = None) -> EvictOutcome:
    """An eviction's answer: 200/201 accepted, 429 a PodDisruptionBudget (or the
    server's rate limit) refused it, 404 the pod is gone (or not the UID asked for:
    409), anything else failed."""
    detail = ""
    try:
        doc = json_document(body, max_bytes=1 << 20, what="eviction answer") if body else {}
        if isinstance(doc, dict) and isinstance(doc.get("message"), str):
            detail = doc["message"]
    except ValueError:
        detail = body[:200].decode("utf-8", "replace")
    after: float | None = None
    if retry_after and retry_after.strip().isdigit():
        after = float(retry_after.strip())
    if status in (200, 201):
        return EvictOutcome("evicted", status)
    if status == 429:
        return EvictOutcome("blocked_by_pdb", status, detail[:300], after)
    if status in (404, 409):
        return EvictOutcome("gone", status, detail[:300])
    return EvictOutcome("failed", status, (detail or f"HTTP {status}")[:300], after)


class KubeClient:
    """:class:`KubeActions` on :class:`gpulet_common.kubeapi.KubeClient` (``api``)."""

    def __init__(
        self, api: kubeapi.KubeClient, node: str, node_event_namespace: str, timeout_s: float
    ) -> None:
        self._api = api
        self._node = node
        self._node_ns = node_event_namespace
        self._timeout = timeout_s

    async def list_pods(self) -> list[PodInfo]:
        try:
            with anyio.fail_after(self._timeout + 1):
                doc = await self._api.list(
                    api_path("", "v1", "pods"),
                    field_selector=f"spec.nodeName={self._node}",
                    timeout_s=self._timeout,
                )
        except KubeApiError as exc:
            if exc.status:
                raise KubeError(f"HTTP {exc.status} listing the node's pods") from exc
            raise KubeError(f"the pod list is not usable: {exc}") from exc
        except (OSError, TimeoutError) as exc:
            raise KubeError(_describe(exc)) from exc
        items = doc.get("items") if isinstance(doc, dict) else None
        pods = [pod_info(item) for item in items if isinstance(items, list)] if items else []
        return [p for p in pods if p is not None]

    async def evict(self, namespace: str, name: str, uid: str) -> EvictOutcome:
        body: Any = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if uid:
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        path = api_path("", "v1", "pods", namespace=namespace, name=name, subresource="eviction")
        try:
            with anyio.fail_after(self._timeout + 1):
                await self._api.create(path, body, timeout_s=self._timeout)
        except KubeApiError as exc:
            return outcome_of(exc.status, exc.body, exc.headers.get("Retry-After"))
        except (OSError, TimeoutError) as exc:
            return EvictOutcome("failed", 0, _describe(exc))
        # Accepted (the API server answers 201 Created; the client keeps no status of a
        # success).
        return outcome_of(201, b"")

    async def post_event(
        self, target: EventTarget, reason: str, message: str, *, warning: bool = True
    ) -> bool:
        namespace = target.namespace if target.kind == "Pod" else self._node_ns
        involved: dict[str, str] = {"apiVersion": "v1", "kind": target.kind, "name": target.name}
        if target.kind == "Pod":
            involved["namespace"] = target.namespace
        if target.uid:
            involved["uid"] = target.uid
        body: Any = event_body(
            namespace=namespace,
            involved=involved,
            reason=reason,
            message=message,
            component=EVENT_COMPONENT,
            node=self._node,
            warning=warning,
        )
        try:
            with anyio.fail_after(self._timeout + 1):
                await self._api.create(
                    api_path("", "v1", "events", namespace=namespace), body, timeout_s=self._timeout
                )
        except (KubeApiError, OSError, TimeoutError):
            return False
        return True


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KubeApiError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
