"""A small Kubernetes REST client: what gpulet's services ask of an API server.

Why our own
-----------
kubernetes-asyncio's package loads every generated model on import (~40 MB of RSS, and
aiohttp's ~11 MB under it) and a sidecar keeps all of it for its whole life, to send a
handful of JSON requests. gpulet only ever reads and writes raw JSON objects, so this
module is the few verbs it uses, on paths built by :func:`api_path`, over the HTTP/1.1
connections of :mod:`gpulet_common.http1`:

* :meth:`KubeClient.get` / :meth:`~KubeClient.list` / :meth:`~KubeClient.create` /
  :meth:`~KubeClient.replace` / :meth:`~KubeClient.patch` (merge, JSON, strategic,
  server-side apply) / :meth:`~KubeClient.delete`, each with its own total timeout;
* :meth:`KubeClient.watch`: a streaming watch (``watch=1``, ``resourceVersion``,
  ``allowWatchBookmarks``, ``timeoutSeconds``) whose lines come out one by one,
  decoded by :func:`watch_event`; the caller decides what a 410 or an ERROR event
  means (re-list).

For example (``timeout_s`` bounds each request, connecting included)::

    async with KubeClient(await lookup(kubeconfig)) as api:
        pods = await api.list(api_path("", "v1", "pods"), field_selector=f"spec.nodeName={node}",
                              timeout_s=5)
        await api.create(api_path("", "v1", "pods", namespace=ns, name=pod,
                                  subresource="eviction"),
                         {"apiVersion": "policy/v1", "kind": "Eviction",
                          "metadata": {"name": pod, "namespace": ns}}, timeout_s=5)
        await api.create(api_path("events.k8s.io", "v1", "events", namespace=ns), event,
                         timeout_s=5)

The connection and credentials come from a :class:`~gpulet_common.kube.KubeConfig`
(in-cluster or a kubeconfig): TLS with the cluster's CA (or none when the kubeconfig
says ``insecure-skip-tls-verify``), client certificates, a bearer token (a token file
is read again every minute, so rotated service-account tokens keep working) or basic
auth.

Every answer is hostile until decoded
-------------------------------------
* A non-2xx answer is a :class:`KubeApiError` carrying the HTTP status, the reason,
  the headers (``Retry-After``), the first :data:`ERROR_BODY_MAX` bytes of the body and,
  when it is one, the decoded ``Status`` object. This is the only type the client
  raises for what the server *said*; what the network did is an ``OSError`` (a
  connection refused or reset, TLS, an answer that is not HTTP:
  :class:`~gpulet_common.http1.HttpProtocolError`) or, past a request's
  ``timeout_s``, a ``TimeoutError``.
* A body over ``max_body`` bytes (32 MiB by default), or a 2xx body that is not JSON,
  is a :class:`KubeApiError` with status 0 ("no usable answer"), never a crash or an
  unbounded read. A watch line over ``max_line`` bytes ends the watch the same way.
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import quote, urlencode

import anyio
import msgspec

from gpulet_common.http1 import BodyTooLarge, Http1Pool, Response

if TYPE_CHECKING:
    from gpulet_common.kube import KubeConfig

JsonObj = dict[str, Any]
PatchType = Literal["merge", "json", "strategic", "apply"]

PATCH_CONTENT_TYPES: Final[Mapping[str, str]] = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "apply": "application/apply-patch+yaml",  # JSON is YAML
}
MAX_BODY: Final = 32 << 20
MAX_LINE: Final = 16 << 20
ERROR_BODY_MAX: Final = 64 << 10
TOKEN_REREAD_S: Final = 60.0

_decoder: Final = msgspec.json.Decoder()
_encoder: Final = msgspec.json.Encoder()


class KubeApiError(Exception):
    """The API server refused a request (``status`` its HTTP status), or gave no usable
    answer (``status`` 0: a body too large or not JSON)."""

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


def _status_object(body: bytes) -> JsonObj | None:
    if not body.lstrip().startswith(b"{"):
        return None
    try:
        doc = _decoder.decode(body)
    except msgspec.DecodeError:
        return None
    return doc if isinstance(doc, dict) and doc.get("kind") == "Status" else None


def decode(raw: bytes) -> Any:
    """JSON ``raw`` as Python objects; an unusable document is a status-0 KubeApiError."""
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise KubeApiError(0, f"undecodable answer: {exc}") from exc


def watch_event(line: bytes) -> tuple[str, JsonObj] | None:
    """One watch line as ``(type, object)``, or None for anything that is not an event
    with an object (the caller counts it and goes on)."""
    try:
        event = _decoder.decode(line)
    except msgspec.DecodeError:
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


def _query(**params: str | int | bool | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in params.items():
        if value is None or value == "":
            continue
        out[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return out


class KubeClient:
    """One API server and its connections (opened on first use; :meth:`close` it, or
    use ``async with``)."""

    def __init__(
        self, config: KubeConfig, *, max_body: int = MAX_BODY, max_line: int = MAX_LINE
    ) -> None:
        self.config = config
        self.host = config.host.rstrip("/")
        self._max_body = max_body
        self._max_line = max_line
        self._pool: Http1Pool | None = None
        self._token = config.token or ""
        self._token_read = -float("inf")

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()

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
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """One request; the decoded JSON answer (raises :class:`KubeApiError`)."""
        data = None if body is None else _encoder.encode(body)
        with anyio.fail_after(timeout_s):
            async with self._open(method, path, query, data, content_type) as response:
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
            async with self._open("GET", path, query, None, "") as response:
                if response.status >= 300:
                    raise await self._error(response)
                yield self._lines(response)

    # -- plumbing ------------------------------------------------------------------

    @asynccontextmanager
    async def _open(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None,
        data: bytes | None,
        content_type: str,
    ) -> AsyncIterator[Response]:
        headers = {"Accept": "application/json", "User-Agent": "gpulet", **self._auth()}
        if data is not None:
            headers["Content-Type"] = content_type
        target = path + ("?" + urlencode(query) if query else "")
        async with self._pool_now().request(method, target, headers, data) as response:
            yield response

    def _pool_now(self) -> Http1Pool:
        if self._pool is None:
            tls = self.host.startswith("https:")
            self._pool = Http1Pool(
                self.host,
                ssl_context=self.config.ssl_context() if tls else None,
                server_hostname=self.config.tls_server_name,
            )
        return self._pool

    def _auth(self) -> dict[str, str]:
        config = self.config
        if config.token_file and time.monotonic() - self._token_read >= TOKEN_REREAD_S:
            try:
                with open(config.token_file, encoding="utf-8", errors="replace") as token:
                    fresh = token.read(1 << 16).strip()
            except OSError:
                fresh = ""
            if fresh:  # else the token read last keeps working until it expires
                self._token = fresh
                self._token_read = time.monotonic()
        if self._token:
            return {"Authorization": f"Bearer {self._token}"}
        if config.username:
            pair = f"{config.username}:{config.password}".encode()
            return {"Authorization": "Basic " + base64.b64encode(pair).decode()}
        return {}

    @staticmethod
    async def _read(response: Response, limit: int) -> bytes:
        try:
            return await response.read(limit)
        except BodyTooLarge as exc:
            raise KubeApiError(0, str(exc)) from exc

    async def _error(self, response: Response) -> KubeApiError:
        try:
            body = await response.read(ERROR_BODY_MAX)
        except BodyTooLarge:
            body = b""  # too long to keep: the status says enough
        return KubeApiError(response.status, response.reason, body=body, headers=response.headers)

    async def _lines(self, response: Response) -> AsyncIterator[bytes]:
        parts: list[bytes] = []  # the line being read, in pieces (no quadratic joins)
        size = 0
        async for chunk in response.chunks():
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
