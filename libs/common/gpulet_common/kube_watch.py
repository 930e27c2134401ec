"""A raw watch of custom objects through kubernetes-asyncio, and the loop that keeps
one open: what the reporter's slice publisher and the DRA plugin's claim cache share.

* :func:`watch_lines` opens a watch (``list_cluster_custom_object(watch=True)``
  without decoding), checks the status, and gives the stream's non-blank lines, each a
  JSON event that the caller decodes totally; the response is released however the
  block ends.
* :func:`keep_watching` runs one watch after another: an ended watch (the server's
  timeout) is opened again at once, a failed one after a jittered exponential back-off
  (0.2 s doubling, at most ``backoff_max_s``), logged through a rate-limited log.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import aiohttp
import anyio
from kubernetes_asyncio.client.exceptions import ApiException

from gpulet_common.logutil import RateLimitedLog

# What a failed watch raises: the API's answer, the connection, a timeout, a bad line.
WATCH_ERRORS = (ApiException, aiohttp.ClientError, OSError, TimeoutError, ValueError)


@contextlib.asynccontextmanager
async def watch_lines(
    custom: Any,
    group: str,
    version: str,
    plural: str,
    *,
    timeout_s: int,
    request_timeout_s: float,
    field_selector: str | None = None,
) -> AsyncIterator[AsyncIterator[bytes]]:
    """The lines of one watch of ``plural`` in all namespaces (or cluster-scoped)."""
    extra = {"field_selector": field_selector} if field_selector else {}
    response: Any = await custom.list_cluster_custom_object(
        group,
        version,
        plural,
        watch=True,
        timeout_seconds=timeout_s,
        _request_timeout=request_timeout_s,
        _preload_content=False,
        **extra,
    )
    try:
        if response.status != 200:
            raise ApiException(status=response.status, reason=str(response.reason))
        yield _lines(response)
    finally:
        response.release()


async def _lines(response: Any) -> AsyncIterator[bytes]:
    async for line in response.content:
        if line.strip():
            yield line


async def keep_watching(
    once: Callable[[], Awaitable[None]],
    log: RateLimitedLog,
    what: str,
    *,
    backoff_max_s: float,
) -> NoReturn:
    attempt = 0
    while True:
        try:
            await once()
            attempt = 0
        except WATCH_ERRORS as exc:
            attempt += 1
            delay = random.uniform(0, min(backoff_max_s, 0.2 * 2 ** min(attempt, 10)))
            log.warning("watch of %s failed (%s); again in %.1fs", what, exc, delay)
            await anyio.sleep(delay)
