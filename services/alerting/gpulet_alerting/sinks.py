"""Where ``gpulet alerts`` delivers: stdout, webhooks, and the errors every sink raises.

* **stdout**: one JSON line per event (the event as published);
* **webhooks**: each event POSTed as JSON to every ``alerts.webhooks`` URL.

A sink raises :class:`DeliveryError` for a delivery that may succeed if retried, and
:class:`PermanentDeliveryError` when retrying the same body cannot help (a 4xx other
than 408/429). The Alertmanager sink is in :mod:`.alertmanager`.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from datetime import UTC, datetime
from typing import Protocol, TextIO

import anyio

from gpulet_common.codec import HEALTH_EVENT
from gpulet_common.messages import HealthEvent


class DeliveryError(Exception):
    """A delivery that may succeed if retried."""


class PermanentDeliveryError(Exception):
    """A delivery that retrying cannot fix (the receiver rejected the body)."""


def rfc3339(ts: float) -> str:
    # Total: an event's time is its sender's word (1e18, NaN): clamp, never raise.
    ts = min(max(ts, 0.0), 253402300799.0) if ts == ts else 0.0
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def post_json(url: str, body: bytes, timeout_s: float) -> None:
    """POST (blocking); DeliveryError or PermanentDeliveryError on failure."""
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        if 400 <= exc.code < 500 and exc.code not in (408, 429):
            raise PermanentDeliveryError(f"{url}: HTTP {exc.code}: {detail}") from exc
        raise DeliveryError(f"{url}: HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise DeliveryError(f"{url}: {exc}") from exc


class AlertSink(Protocol):
    name: str

    async def deliver(self, event: HealthEvent) -> None: ...

    async def resend(self, now: float) -> None: ...


class StdoutSink:
    name = "stdout"

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out

    async def deliver(self, event: HealthEvent) -> None:
        out = self._out or sys.stdout
        out.write(HEALTH_EVENT.encode(event).decode() + "\n")
        out.flush()

    async def resend(self, now: float) -> None:
        return None


class WebhookSink:
    def __init__(self, url: str, *, timeout_s: float) -> None:
        self.name = f"webhook {url}"
        self._url = url
        self._timeout_s = timeout_s

    async def deliver(self, event: HealthEvent) -> None:
        await anyio.to_thread.run_sync(
            post_json,
            self._url,
            HEALTH_EVENT.encode(event),
            self._timeout_s,
            abandon_on_cancel=True,
        )

    async def resend(self, now: float) -> None:
        return None
