"""Remediation's only calls to the API server, behind :class:`KubeActions`.

Three calls, nothing else: list the node's pods (``GET /api/v1/pods?fieldSelector=
spec.nodeName=<node>``), evict one (``POST .../pods/<name>/eviction``, a ``policy/v1``
``Eviction`` with the pod's UID as a precondition, so a new pod of the same name is
never evicted in its place), and create an Event (on a pod in its namespace; on the
Node in ``remediation.node_event_namespace``, as kubelet does). The Eviction API is what
respects PodDisruptionBudgets: it answers 429 while an eviction would violate one.

Everything above this module talks to the :class:`KubeActions` protocol, so tests and
the benchmark can stand in for the server, and the client library can change here
alone. :class:`KubeClient` is the implementation on kubernetes-asyncio, as
:mod:`gpulet_allocator.service.pod_watch` uses it. No call raises for an answer of the
server or a failed connection: each returns what happened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import aiohttp
import anyio
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.client.exceptions import ApiException

from gpulet_allocator.service.remediate.policy import PodInfo, pod_info
from gpulet_common.kube_events import event_body

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
        doc = json.loads(body) if body else {}
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
    """:class:`KubeActions` on kubernetes-asyncio (``api``: its ApiClient)."""

    def __init__(self, api: Any, node: str, node_event_namespace: str, timeout_s: float) -> None:
        self._core = k8s_client.CoreV1Api(api)
        self._node = node
        self._node_ns = node_event_namespace
        self._timeout = timeout_s

    async def list_pods(self) -> list[PodInfo]:
        try:
            with anyio.fail_after(self._timeout + 1):
                response: Any = await self._core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={self._node}",
                    _request_timeout=self._timeout,
                    _preload_content=False,
                )
                raw = await response.read()
        except (ApiException, aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise KubeError(_describe(exc)) from exc
        if response.status != 200:
            raise KubeError(f"HTTP {response.status} listing the node's pods")
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise KubeError("the pod list is not JSON") from exc
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
        try:
            with anyio.fail_after(self._timeout + 1):
                response: Any = await self._core.create_namespaced_pod_eviction(
                    name, namespace, body, _request_timeout=self._timeout, _preload_content=False
                )
                raw = await response.read()
        except ApiException as exc:
            headers: Any = exc.headers or {}
            raw_body: Any = exc.body or b""
            body_bytes = raw_body.encode() if isinstance(raw_body, str) else bytes(raw_body)
            return outcome_of(int(exc.status or 0), body_bytes, headers.get("Retry-After"))
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return EvictOutcome("failed", 0, _describe(exc))
        return outcome_of(response.status, raw, response.headers.get("Retry-After"))

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
                await self._core.create_namespaced_event(
                    namespace, body, _request_timeout=self._timeout
                )
        except (ApiException, aiohttp.ClientError, OSError, TimeoutError):
            return False
        return True


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"
