"""A raw watch of a collection through :mod:`gpulet_common.kubeapi`, and the loop that
keeps one open: what the reporter's slice publisher and the DRA plugin's claim cache
share.

* :func:`watch_lines` opens a watch of a collection path (:func:`~.kubeapi.api_path`),
  checks the status, and gives the stream's non-blank lines, each a JSON event that
  the caller decodes totally (:func:`~.kubeapi.watch_event`); the connection is closed
  however the block ends.
* :func:`keep_watching` runs one watch after another: an ended watch (the server's
  timeout) is opened again at once, a failed one after a jittered exponential back-off
  (0.2 s doubling, at most ``backoff_max_s``), logged through a rate-limited log.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import anyio

from gpulet_common.kubeapi import KubeApiError, KubeClient
from gpulet_common.logutil import RateLimitedLog

# What a failed watch raises: the API's answer, the connection, a timeout, a bad line.
WATCH_ERRORS = (KubeApiError, OSError, TimeoutError, ValueError)


@contextlib.asynccontextmanager
async def watch_lines(
    api: KubeClient,
    path: str,
    *,
    timeout_s: int,
    request_timeout_s: float,
    field_selector: str | None = None,
) -> AsyncIterator[AsyncIterator[bytes]]:
    """The lines of one watch of the collection ``path`` (all namespaces, or
    cluster-scoped)."""
    async with api.watch(
        path,
        timeout_seconds=timeout_s,
        timeout_s=request_timeout_s,
        field_selector=field_selector,
    ) as lines:
        yield lines


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
