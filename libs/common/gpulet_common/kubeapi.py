"""gpulet's thin typed layer over kubernetes-asyncio: what its services ask of an API server.

gpulet reads and writes raw JSON objects (Device CRs, ResourceSlices, claims, pods,
events, evictions), so it uses kubernetes-asyncio's ``ApiClient`` -- its aiohttp
session, TLS, proxies and authentication (:mod:`gpulet_common.kube` loads the
``Configuration``) -- and not its generated models. This module is the few verbs gpulet
uses, on paths built by :func:`api_path`, the way kopf keeps a thin layer over its
HTTP library: one error type, bounded bodies, and watches whose lines come out one by
one:

* :meth:`KubeClient.get` / :meth:`~KubeClient.list` / :meth:`~KubeClient.create` /
  :meth:`~KubeClient.replace` / :meth:`~KubeClient.patch` (merge, JSON, strategic,
  server-side apply) / :meth:`~KubeClient.delete`, each with its own total timeout;
* :meth:`KubeClient.watch`: a streaming watch (``watch=1``, ``resourceVersion``,
  ``allowWatchBookmarks``, ``timeoutSeconds``) whose lines come out one by one,
  decoded by :func:`watch_event`; the caller decides what a 410 or an ERROR event
  means (re-list; :mod:`gpulet_common.kube_watch` keeps one open).

For example (``timeout_s`` bounds each request, connecting included)::

    async with KubeClient(await lookup(kubeconfig)) as api:
        pods = await api.list(api_path("", "v1", "pods"), field_selector=f"spec.nodeName={node}",
                              timeout_s=5)
        await api.create(api_path("events.k8s.io", "v1", "events", namespace=ns), event,
                         timeout_s=5)

Every request goes through ``ApiClient.call_api`` with ``_preload_content=False``: the
library builds the URL, the query and the headers and refreshes the credentials (a
rotated service-account token, an expired ``exec`` credential); gpulet reads the body
itself, so that no answer is read or decoded without a bound.

Every answer is hostile until decoded
-------------------------------------
* A non-2xx answer is a :class:`KubeApiError` carrying the HTTP status, the reason,
  the headers (``Retry-After``), the first :data:`ERROR_BODY_MAX` bytes of the body and,
  when it is one, the decoded ``Status`` object. This is the only type the client
  raises for what the server *said*. What the network did is a
  :class:`KubeConnectionError` (an ``OSError``: refused, reset, TLS, an answer that is
  not HTTP -- every aiohttp failure is mapped to it here, once) or, past a request's
  ``timeout_s``, a ``TimeoutError``.
* A body over ``max_body`` bytes (32 MiB by default), or a 2xx body that is not JSON or
  nests deeper than :data:`gpulet_common.untrusted.MAX_DEPTH`, is a
  :class:`KubeApiError` with status 0 ("no usable answer"), never a ``RecursionError``
  or an unbounded read. A watch line over ``max_line`` bytes ends the watch the same
  way; a watch line that does not decode is None from :func:`watch_event`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, Literal
from urllib.parse import quote

import aiohttp
import anyio
from multidict import CIMultiDict

# ApiClient through kube.py, which prepares kubernetes-asyncio's import (kube_lazy).
from gpulet_common.kube import ApiClient, KubeConfig
from gpulet_common.untrusted import MAX_DEPTH, UntrustedDocumentError, json_document

JsonObj = dict[str, Any]
PatchType = Literal["merge", "json", "strategic", "apply"]
Query = list[tuple[str, str]]

PATCH_CONTENT_TYPES: Final[Mapping[str, str]] = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "apply": "application/apply-patch+yaml",  # JSON is YAML
}
MAX_BODY: Final = 32 << 20
MAX_LINE: Final = 16 << 20
ERROR_BODY_MAX: Final = 64 << 10
USER_AGENT: Final = "gpulet"


class KubeApiError(Exception):
    """The API server refused a request (``status`` its HTTP status), or gave no usable
    answer (``status`` 0: a body too large, not JSON, or too deep)."""

    def __init__(
        self,
        status: int,
        reason: str,
        *,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.body = body[:ERROR_BODY_MAX]
        self.headers: Mapping[str, str] = headers or {}
        self.status_body = _status_object(self.body)
        super().__init__(f"HTTP {status} {reason}".strip() if status else reason)

    @property
    def message(self) -> str:
        """The ``Status`` object's message, else the start of the body."""
        if self.status_body is not None and isinstance(self.status_body.get("message"), str):
            return str(self.status_body["message"])[:500]
        return self.body[:500].decode(errors="replace")


class KubeConnectionError(OSError):
    """The network failed the request: refused, reset, TLS, or an answer that is not
    HTTP (aiohttp's errors, mapped once here)."""


def _status_object(body: bytes) -> JsonObj | None:
    if not body.lstrip().startswith(b"{"):
        return None
    try:
        doc = json_document(body, what="status")
    except UntrustedDocumentError:
        return None
    return doc if isinstance(doc, dict) and doc.get("kind") == "Status" else None


def decode(raw: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """JSON ``raw`` as Python objects; an unusable document is a status-0 KubeApiError."""
    try:
        return json_document(raw, max_bytes=len(raw), max_depth=max_depth, what="answer")
    except UntrustedDocumentError as exc:
        raise KubeApiError(0, f"undecodable answer: {exc}") from None


def watch_event(line: bytes, *, max_depth: int = MAX_DEPTH) -> tuple[str, JsonObj] | None:
    """One watch line as ``(type, object)``, or None for anything that is not an event
    with an object (the caller counts it and goes on)."""
    try:
        event = json_document(line, max_bytes=len(line), max_depth=max_depth)
    except UntrustedDocumentError:
        return None
    if not isinstance(event, dict):
        return None
    kind, obj = event.get("type"), event.get("object")
    if not isinstance(kind, str) or not isinstance(obj, dict):
        return None
    return kind, obj


def api_path(
    group: str,
    version: str,
    plural: str,
    *,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection or an object: ``group`` "" is the core API
    (``/api/v1``); names are percent-encoded."""
    parts = ["/api", version] if not group else ["/apis", group, version]
    if namespace is not None:
        parts += ["namespaces", quote(namespace, safe="")]
    parts.append(plural)
    if name is not None:
        parts.append(quote(name, safe=""))
    if subresource is not None:
        parts.append(subresource)
    return "/".join(parts)


def _query(**params: str | int | bool | None) -> Query:
    out: Query = []
    for key, value in params.items():
        if value is None or value == "":
            continue
        out.append((key, ("true" if value else "false") if isinstance(value, bool) else str(value)))
    return out


class KubeClient:
    """One API server, through one kubernetes-asyncio ``ApiClient`` (its connection
    pool, opened on first use: :meth:`close` it, or use ``async with``)."""

    def __init__(
        self, config: KubeConfig, *, max_body: int = MAX_BODY, max_line: int = MAX_LINE
    ) -> None:
        self.config = config
        self.host = config.host
        self._max_body = max_body
        self._max_line = max_line
        self._api: ApiClient | None = None

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        api, self._api = self._api, None
        if api is not None:
            with anyio.move_on_after(1, shield=True):
                await api.close()

    # -- verbs ---------------------------------------------------------------------

    async def get(self, path: str, *, timeout_s: float, **query: str | int | bool | None) -> Any:
        return await self.request("GET", path, timeout_s=timeout_s, query=_query(**query))

    async def list(
        self,
        path: str,
        *,
        timeout_s: float,
        field_selector: str | None = None,
        label_selector: str | None = None,
    ) -> Any:
        query = _query(fieldSelector=field_selector, labelSelector=label_selector)
        return await self.request("GET", path, timeout_s=timeout_s, query=query)

    async def create(
        self, path: str, body: Any, *, timeout_s: float, field_manager: str | None = None
    ) -> Any:
        query = _query(fieldManager=field_manager)
        return await self.request("POST", path, body=body, timeout_s=timeout_s, query=query)

    async def replace(
        self, path: str, body: Any, *, timeout_s: float, field_manager: str | None = None
    ) -> Any:
        query = _query(fieldManager=field_manager)
        return await self.request("PUT", path, body=body, timeout_s=timeout_s, query=query)

    async def patch(
        self,
        path: str,
        body: Any,
        *,
        timeout_s: float,
        patch: PatchType = "merge",
        field_manager: str | None = None,
        force: bool | None = None,
    ) -> Any:
        query = _query(fieldManager=field_manager, force=force)
        return await self.request(
            "PATCH",
            path,
            body=body,
            timeout_s=timeout_s,
            query=query,
            content_type=PATCH_CONTENT_TYPES[patch],
        )

    async def delete(self, path: str, *, timeout_s: float, body: Any = None) -> Any:
        return await self.request("DELETE", path, body=body, timeout_s=timeout_s)

    async def request(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float,
        body: Any = None,
        query: Query | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """One request; the decoded JSON answer (raises :class:`KubeApiError`)."""
        with anyio.fail_after(timeout_s):
            async with self._open(method, path, query, body, content_type) as response:
                if response.status >= 300:
                    raise await self._error(response)
                raw = await self._read(response, self._max_body)
        if not raw.strip():
            return None
        return decode(raw)

    @asynccontextmanager
    async def watch(
        self,
        path: str,
        *,
        timeout_seconds: int,
        timeout_s: float,
        resource_version: str = "",
        bookmarks: bool = False,
        field_selector: str | None = None,
        label_selector: str | None = None,
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """A watch of ``path``: yields an iterator of its non-empty lines (raw; decode
        each with :func:`watch_event`). ``timeout_s`` bounds the whole watch."""
        query = _query(
            watch=True,
            resourceVersion=resource_version,
            allowWatchBookmarks=bookmarks or None,
            timeoutSeconds=timeout_seconds,
            fieldSelector=field_selector,
            labelSelector=label_selector,
        )
        with anyio.fail_after(timeout_s):
            async with self._open("GET", path, query, None, "application/json") as response:
                if response.status >= 300:
                    raise await self._error(response)
                yield self._lines(response)

    # -- plumbing ------------------------------------------------------------------

    def _client(self) -> ApiClient:
        if self._api is None:
            self._api = ApiClient(self.config.configuration)
            self._api.user_agent = USER_AGENT
        return self._api

    @asynccontextmanager
    async def _open(
        self,
        method: str,
        path: str,
        query: Query | None,
        body: Any,
        content_type: str,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            response: aiohttp.ClientResponse = await self._client().call_api(
                path,
                method,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
            )
        except aiohttp.ClientError as exc:
            raise KubeConnectionError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        try:
            yield response
        except aiohttp.ClientError as exc:
            raise KubeConnectionError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        finally:
            response.close()

    @staticmethod
    async def _read(response: aiohttp.ClientResponse, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            chunk = await response.content.read(1 << 16)
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            if size > limit:
                raise KubeApiError(0, f"answer over {limit} bytes")
            parts.append(chunk)

    async def _error(self, response: aiohttp.ClientResponse) -> KubeApiError:
        try:
            body = await self._read(response, ERROR_BODY_MAX)
        except KubeApiError:
            body = b""  # too long to keep: the status says enough
        # A case-insensitive copy: Retry-After and retry-after are one header.
        headers = CIMultiDict(response.headers)
        return KubeApiError(response.status, response.reason or "", body=body, headers=headers)

    async def _lines(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        parts: list[bytes] = []  # the line being read, in pieces (no quadratic joins)
        size = 0
        async for chunk in response.content.iter_any():
            start = 0
            while True:
                cut = chunk.find(b"\n", start)
                piece = chunk[start:] if cut < 0 else chunk[start:cut]
                size += len(piece)
                if size > self._max_line:
                    raise KubeApiError(0, f"watch line over {self._max_line} bytes")
                parts.append(piece)
                if cut < 0:
                    break
                line = b"".join(parts)
                parts, size, start = [], 0, cut + 1
                if line.strip():
                    yield line
        line = b"".join(parts)
        if line.strip():
            yield line
