"""A minimal HTTP/1.1 client over anyio streams, for :mod:`gpulet_common.kubeapi`.

Why not aiohttp
---------------
aiohttp costs ~11 MB of RSS in every process that imports it, and the sidecars that
talk to the API server (reporter, allocator, the device plugin's DRA plugin) ask it
for JSON requests and one streaming watch at a time. HTTP/1.1 framing for that is
small: a request line and headers out; a status line, headers and a body in, the body
delimited by ``Content-Length``, by ``Transfer-Encoding: chunked`` (how kube-apiserver
streams a watch) or by the end of the connection. ``asyncio`` and ``ssl`` are loaded
by nats-py anyway; this module adds nothing else.

What it does
------------
* :class:`Http1Pool` holds the connections to one origin (``http://`` or ``https://``
  with the caller's :class:`ssl.SSLContext` and TLS server name): a request takes an
  idle one or opens one; a response read to its end on a keep-alive connection gives
  it back (at most :data:`MAX_IDLE` kept). A reused connection that the server closed
  meanwhile (nothing of an answer came back) is replaced once, transparently.
* :meth:`Response.chunks` yields the body as it arrives, in pieces of at most
  :data:`PIECE` bytes, whatever size a hostile server announces; bounding the total is
  the caller's (it knows what it expects).

Every seam is hostile
---------------------
A status line, header or chunk-size line that is malformed or too long (a header
block over :data:`MAX_HEADER_BYTES`), a connection that ends mid-answer, a TLS failure:
each is an :class:`OSError` (:class:`HttpProtocolError`, a ``ConnectionError``, for
what the server sent), never an exception of anyio's or a crash. Timeouts are the
caller's (``anyio.fail_after`` around the request).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Final
from urllib.parse import urlsplit

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

MAX_IDLE: Final = 4
PIECE: Final = 1 << 16
MAX_LINE: Final = 16 << 10
MAX_HEADER_BYTES: Final = 256 << 10
_NO_BODY: Final = frozenset({204, 304})
_STREAM_ERRORS: Final = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.IncompleteRead,
    anyio.DelimiterNotFound,
)


class HttpProtocolError(ConnectionError):
    """The server's answer is not HTTP/1.1 we can read, or the connection ended in it."""


class Headers(dict[str, str]):
    """Response headers; names are case-insensitive (stored lower-case)."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key.lower(), default)


class _Connection:
    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.used = False

    async def aclose(self) -> None:
        # Bounded: a TLS close waits for the peer's close_notify.
        with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
            try:
                await self.stream.aclose()
            except (OSError, *_STREAM_ERRORS):
                pass

    async def line(self) -> bytes:
        return await self.reader.receive_until(b"\r\n", MAX_LINE)


class Response:
    """A status, headers and a body to read once with :meth:`chunks` or :meth:`read`."""

    def __init__(self, conn: _Connection, status: int, reason: str, headers: Headers) -> None:
        self._conn = conn
        self.status = status
        self.reason = reason
        self.headers = headers
        self.complete = False  # the body was read to its end
        self.keep_alive = (headers.get("connection") or "").lower() != "close"

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, piece by piece, as it arrives."""
        try:
            if self.status in _NO_BODY or 100 <= self.status < 200:
                pass
            elif "chunked" in (self.headers.get("transfer-encoding") or "").lower():
                async for piece in self._chunked():
                    yield piece
            elif self.headers.get("content-length") is not None:
                length = _length(self.headers.get("content-length") or "")
                async for piece in self._exactly(length):
                    yield piece
            else:
                self.keep_alive = False  # delimited by the end of the connection
                while True:
                    try:
                        piece = await self._conn.reader.receive(PIECE)
                    except anyio.EndOfStream:
                        break
                    yield piece
        except _STREAM_ERRORS as exc:
            raise HttpProtocolError(f"answer cut short: {type(exc).__name__}") from exc
        self.complete = True

    async def read(self, limit: int) -> bytes:
        """The whole body; raises :class:`BodyTooLarge` past ``limit`` bytes."""
        length = self.headers.get("content-length")
        if length is not None and _length(length) > limit:
            raise BodyTooLarge(f"answer of {_length(length)} bytes, over {limit}")
        parts: list[bytes] = []
        size = 0
        async for piece in self.chunks():
            size += len(piece)
            if size > limit:
                raise BodyTooLarge(f"answer over {limit} bytes")
            parts.append(piece)
        return b"".join(parts)

    async def _exactly(self, length: int) -> AsyncIterator[bytes]:
        while length > 0:
            piece = await self._conn.reader.receive_exactly(min(length, PIECE))
            length -= len(piece)
            yield piece

    async def _chunked(self) -> AsyncIterator[bytes]:
        while True:
            size_line = (await self._conn.line()).split(b";", 1)[0].strip()
            if not 0 < len(size_line) <= 15 or size_line.strip(b"0123456789abcdefABCDEF"):
                raise HttpProtocolError(f"bad chunk size {size_line[:32]!r}")
            size = int(size_line, 16)
            if size == 0:
                await _headers(self._conn)  # trailers, read and dropped
                return
            async for piece in self._exactly(size):
                yield piece
            if await self._conn.reader.receive_exactly(2) != b"\r\n":
                raise HttpProtocolError("chunk not followed by CRLF")


class BodyTooLarge(Exception):
    """A body over the caller's limit (the connection is dropped, not reused)."""


def _number(text: str, what: str) -> int:
    """A decimal number of at most 18 ASCII digits, or a protocol error."""
    digits = text.strip()
    if not (0 < len(digits) <= 18 and digits.isascii() and digits.isdigit()):
        raise HttpProtocolError(f"bad {what} {text[:32]!r}")
    return int(digits)


def _length(text: str) -> int:
    return _number(text, "Content-Length")


async def _headers(conn: _Connection) -> Headers:
    headers = Headers()
    total = 0
    while True:
        line = await conn.line()
        if not line:
            return headers
        total += len(line)
        if total > MAX_HEADER_BYTES:
            raise HttpProtocolError(f"header block over {MAX_HEADER_BYTES} bytes")
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip():
            raise HttpProtocolError(f"bad header line {line[:64]!r}")
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value


class Http1Pool:
    """Connections to one origin (see the module docstring)."""

    def __init__(
        self, url: str, *, ssl_context: ssl.SSLContext | None = None, server_hostname: str = ""
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = (self.port == 443) if self.tls else (self.port == 80)
        self.host_header = host if default else f"{host}:{self.port}"
        self._ssl = ssl_context
        self._server_hostname = server_hostname or self.host
        self._idle: list[_Connection] = []

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    async def _connect(self) -> _Connection:
        if not self.tls:
            return _Connection(await anyio.connect_tcp(self.host, self.port))
        context = self._ssl or ssl.create_default_context()
        stream = await anyio.connect_tcp(
            self.host,
            self.port,
            ssl_context=context,
            tls_hostname=self._server_hostname,
            tls_standard_compatible=False,
        )
        return _Connection(stream)

    @asynccontextmanager
    async def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
    ) -> AsyncIterator[Response]:
        """Send one request and yield its response (the body still to read)."""
        head = [f"{method} {self.prefix}{target} HTTP/1.1", f"Host: {self.host_header}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        if any(c in line for line in head for c in "\r\n"):
            raise ValueError("a request line or header holds a line break")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body or b'')}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        conn, response = await self._exchange(data)
        try:
            yield response
        finally:
            if response.complete and response.keep_alive and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
            else:
                await conn.aclose()

    async def _exchange(self, data: bytes) -> tuple[_Connection, Response]:
        """Send on an idle connection, else a new one, and read the answer's head. An
        idle one the server closed meanwhile (no answer at all) is dropped for the next
        one; a new connection's failure is the caller's."""
        while self._idle:
            conn = self._idle.pop()
            try:
                await conn.stream.send(data)
                return conn, await _response(conn)
            except _Stale:
                await conn.aclose()
            except (OSError, *_STREAM_ERRORS):
                await conn.aclose()  # the send failed: nothing reached the server
            except BaseException:
                await conn.aclose()
                raise
        conn = await self._connect()
        try:
            await conn.stream.send(data)
            return conn, await _response(conn)
        except _Stale as exc:
            await conn.aclose()
            raise HttpProtocolError("the server closed the connection without an answer") from exc
        except (OSError, *_STREAM_ERRORS) as exc:
            await conn.aclose()
            if isinstance(exc, OSError):
                raise
            raise HttpProtocolError(f"request not sent: {type(exc).__name__}") from exc
        except BaseException:
            await conn.aclose()
            raise


class _Stale(Exception):
    """The connection ended before any byte of an answer."""


async def _response(conn: _Connection) -> Response:
    try:
        status_line = await conn.line()
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead) as exc:
        if conn.reader.buffer:
            raise HttpProtocolError("answer cut short in its status line") from exc
        raise _Stale from exc
    try:
        while True:
            version, _, rest = status_line.decode("latin-1").partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/1.") or len(code) != 3:
                raise HttpProtocolError(f"bad status line {status_line[:64]!r}")
            status = _number(code, "status")
            headers = await _headers(conn)
            if not 100 <= status < 200:  # 1xx are interim: the real answer follows
                return Response(conn, status, reason.strip(), headers)
            status_line = await conn.line()
    except _STREAM_ERRORS as exc:
        raise HttpProtocolError(f"answer cut short: {type(exc).__name__}") from exc
