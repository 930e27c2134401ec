"""gpulet_common.kubeapi (over kubernetes-asyncio's ApiClient) against a hostile HTTP server.

A raw TCP server on 127.0.0.1 answers each request with the next canned answer, byte
for byte, so every framing (Content-Length, chunked, close-delimited) and every way of
being wrong (a body too large, not JSON, a cut connection, a bad status line, a watch
line without end) is what the client really reads. The happy paths against a real API
server are the reporter's, the pod watch's and the DRA tests' (the emulator) and
tests/kube (kube-apiserver over TLS).
"""

from __future__ import annotations

import datetime
import json
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import certifi
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from kubernetes_asyncio.config import incluster_config

from gpulet_common.kube import KubeConfig, in_cluster
from gpulet_common.kubeapi import (
    KubeApiError,
    KubeClient,
    KubeConnectionError,
    api_path,
    watch_event,
)

pytestmark = pytest.mark.anyio

Answer = bytes | Callable[[bytes], bytes]


@dataclass
class Server:
    """Canned answers, one per request; ``close_after`` closes the connection after
    that many answers; ``requests`` holds what arrived."""

    answers: list[Answer]
    close_after: int = 1 << 30
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    url: str = ""

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        self.connections += 1
        buffered = BufferedByteReceiveStream(stream)
        served = 0
        async with stream:
            if not self.answers:
                await anyio.sleep_forever()  # a server that never answers
            while self.answers and served < self.close_after:
                try:
                    head = await buffered.receive_until(b"\r\n\r\n", 1 << 16)
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                body = await buffered.receive_exactly(length) if length else b""
                self.requests.append(head + b"\r\n\r\n" + body)
                answer = self.answers.pop(0)
                await stream.send(answer(head) if callable(answer) else answer)
                served += 1


@asynccontextmanager
async def serving(*answers: Answer, close_after: int = 1 << 30) -> AsyncIterator[Server]:
    server = Server(list(answers), close_after)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    server.url = f"http://127.0.0.1:{port}"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, server.handle)
        try:
            yield server
        finally:
            tg.cancel_scope.cancel()


def answer(status: str, body: bytes, *headers: str) -> bytes:
    head = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunked(*chunks: bytes, status: str = "200 OK") -> bytes:
    out = f"HTTP/1.1 {status}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    for chunk in chunks:
        out += f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    return out + b"0\r\n\r\n"


def client(server: Server, **kw: int) -> KubeClient:
    return KubeClient(KubeConfig(server.url, token="tok"), **kw)


async def test_verbs_send_json_with_the_token_and_keep_the_connection() -> None:
    ok = answer("200 OK", b'{"kind": "Node"}')
    async with serving(ok, ok, ok, ok) as server, client(server) as api:
        path = api_path("", "v1", "nodes", name="n/1")
        assert await api.get(path, timeout_s=5) == {"kind": "Node"}
        await api.patch(path, {"a": 1}, patch="strategic", field_manager="g", timeout_s=5)
        await api.create(api_path("x.io", "v1", "things", namespace="ns"), [1], timeout_s=5)
        await api.list(api_path("", "v1", "pods"), field_selector="spec.nodeName=a", timeout_s=5)
    get, patch, create, listed = server.requests
    assert get.startswith(b"GET /api/v1/nodes/n%2F1 HTTP/1.1\r\n")
    assert b"\r\nauthorization: bearer tok\r\n" in get.lower()
    assert patch.startswith(b"PATCH /api/v1/nodes/n%2F1?fieldManager=g HTTP/1.1")
    assert b"content-type: application/strategic-merge-patch+json" in patch.lower()
    assert json.loads(patch.split(b"\r\n\r\n", 1)[1]) == {"a": 1}
    assert create.startswith(b"POST /apis/x.io/v1/namespaces/ns/things HTTP/1.1")
    assert listed.startswith(b"GET /api/v1/pods?fieldSelector=spec.nodeName%3Da HTTP/1.1")
    assert server.connections == 1  # keep-alive: one connection for all four


async def test_a_refusal_carries_status_reason_headers_and_the_status_object() -> None:
    status = {"kind": "Status", "reason": "Conflict", "message": "the object changed", "code": 409}
    conflict = answer("409 Conflict", json.dumps(status).encode(), "Retry-After: 3")
    async with serving(conflict) as server, client(server) as api:
        with pytest.raises(KubeApiError) as refused:
            await api.replace("/api/v1/nodes/a", {}, timeout_s=5)
    error = refused.value
    assert (error.status, error.reason, error.message) == (409, "Conflict", "the object changed")
    assert error.status_body == status
    assert error.headers.get("retry-after") == error.headers.get("Retry-After") == "3"


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (answer("200 OK", b"{not json"), "undecodable"),
        (answer("200 OK", b"[" * 100 + b"1" + b"]" * 100 + b" x"), "undecodable"),
        (answer("200 OK", b"x" * 2000), "over 1000"),
        (chunked(b"x" * 600, b"y" * 600), "over 1000"),
    ],
)
async def test_an_unusable_answer_is_a_status_0_error(raw: bytes, why: str) -> None:
    async with serving(raw) as server, client(server, max_body=1000) as api:
        with pytest.raises(KubeApiError, match=why) as unusable:
            await api.get("/api/v1/nodes", timeout_s=5)
    assert unusable.value.status == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{}",  # cut short
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
        b"HTTP/1.1 2\xb20 OK\r\n\r\n",  # a digit, but not an ASCII one
        b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\n",
    ],
)
async def test_a_broken_answer_is_an_oserror(raw: bytes) -> None:
    async with serving(raw, close_after=1) as server, client(server) as api:
        with pytest.raises(KubeConnectionError):
            await api.get("/api/v1/nodes", timeout_s=5)


async def test_interim_answers_are_skipped_and_line_breaks_never_sent() -> None:
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + answer("200 OK", b"[1]")
    async with serving(interim) as server, client(server) as api:
        assert await api.get("/api/v1/nodes", timeout_s=5) == [1]
    async with serving() as server:
        forged = KubeClient(KubeConfig(server.url, token="tok\r\nX-Forged: 1"))
        # aiohttp refuses to send it: "Forbidden control character detected in headers".
        with pytest.raises(ValueError, match="control character"):
            await forged.get("/api/v1/nodes", timeout_s=5)
        await forged.close()
    assert server.requests == []


async def test_a_connection_closed_while_idle_is_replaced_once() -> None:
    ok = answer("200 OK", b"{}")
    # The server closes after each answer without saying so (no Connection: close).
    async with serving(ok, ok, ok, close_after=1) as server, client(server) as api:
        for _ in range(3):
            assert await api.get("/api/v1/nodes/a", timeout_s=5) == {}
    assert server.connections == 3


async def test_a_silent_server_is_a_timeout() -> None:
    async with serving() as server, client(server) as api:
        with pytest.raises(TimeoutError):
            await api.get("/api/v1/nodes/a", timeout_s=0.2)


async def test_watch_lines_across_chunks_and_a_line_without_end() -> None:
    events = [{"type": "ADDED", "object": {"metadata": {"name": f"p{i}"}}} for i in range(3)]
    text = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    # Lines split anywhere: inside a line, across chunks, several in one chunk.
    stream = chunked(b"\n" + text[:7], text[7:60], text[60:] + b"\n\n")
    async with (
        serving(stream) as server,
        client(server) as api,
        api.watch(
            "/api/v1/pods", timeout_seconds=5, timeout_s=5, resource_version="7", bookmarks=True
        ) as lines,
    ):
        got = [watch_event(line) async for line in lines]
    assert got == [(e["type"], e["object"]) for e in events]
    assert b"resourceVersion=7" in server.requests[0]
    assert b"allowWatchBookmarks=true" in server.requests[0]
    endless = chunked(b"a" * 700, b"b" * 700)
    async with serving(endless) as server, client(server, max_line=1000) as api:
        with pytest.raises(KubeApiError, match="watch line over 1000"):
            await drain(api)


async def drain(api: KubeClient) -> None:
    async with api.watch("/api/v1/pods", timeout_seconds=5, timeout_s=5) as lines:
        async for _ in lines:
            pass


async def test_a_watch_refused_is_the_error_type() -> None:
    gone = answer("410 Gone", b'{"kind": "Status", "code": 410, "reason": "Expired"}')
    async with serving(gone) as server, client(server) as api:
        with pytest.raises(KubeApiError) as refused:
            await drain(api)
    assert refused.value.status == 410


@pytest.mark.parametrize(
    "line",
    [b"not json", b"[]", b'{"type": "ADDED"}', b'{"type": 1, "object": {}}', b"\xff"],
)
def test_watch_event_is_total(line: bytes) -> None:
    assert watch_event(line) is None


async def test_a_rotated_service_account_token_is_picked_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kubernetes-asyncio re-reads the token file once its minute is up; with no minute
    # to wait, every request reads it.
    monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", datetime.timedelta(0))
    token = tmp_path / "token"
    token.write_text("one\n")
    shutil.copy(certifi.where(), tmp_path / "ca.crt")  # any CA bundle that loads
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1"}
    config = in_cluster(env, tmp_path)
    ok = answer("200 OK", b"{}")
    async with serving(ok, ok, ok, ok) as server:
        config.configuration.host = server.url  # the canned server speaks plain HTTP
        async with KubeClient(config) as api:
            await api.get("/a", timeout_s=5)
            token.write_text("two\n")
            await api.get("/a", timeout_s=5)
            token.write_text("")  # mid-rotation: an empty file is not a token
            await api.get("/a", timeout_s=5)
            token.write_text("three")
            await api.get("/a", timeout_s=5)
    auth = [r.lower().split(b"authorization: ")[1].split(b"\r\n")[0] for r in server.requests]
    assert auth == [b"bearer one", b"bearer two", b"bearer two", b"bearer three"]


async def test_a_deep_answer_or_watch_line_is_a_typed_error_never_a_recursion_error() -> None:
    deep = b"[" * 10_000 + b"]" * 10_000
    async with serving(answer("200 OK", deep)) as server, client(server) as api:
        with pytest.raises(KubeApiError, match="nesting deeper") as unusable:
            await api.get("/api/v1/nodes", timeout_s=5)
    assert unusable.value.status == 0
    assert watch_event(b'{"type": "ADDED", "object": {"a": ' + deep + b"}}") is None
    # A refusal whose body is deep still carries its status; the body is no Status.
    deep_status = b"{" + b'"a":{' * 10_000 + b"}" * 10_001
    async with serving(answer("500 Oops", deep_status)) as server, client(server) as api:
        with pytest.raises(KubeApiError) as refused:
            await api.get("/api/v1/nodes", timeout_s=5)
    assert (refused.value.status, refused.value.status_body) == (500, None)
