"""Logging set-up and the one rate limit for log paths that bad input could flood.

Every log call that runs once per message, record or request (a decode failure, a
malformed or rejected message, a kmsg line, a slow consumer's drop) goes through
:class:`RateLimitedLog`: counted exactly, written at most a few times an interval.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter


class RateLimitedLog:
    """The one way to log from a path that runs once per message, record or request.

    Anything a sender controls (a flood of malformed messages, a slow consumer's drops,
    kmsg lines) must not be able to flood the log. Each call is counted exactly
    (:attr:`count`, and ``counter`` when given, with ``attributes``); at most
    ``per_minute`` records are written per 60 s (or ``per_interval`` per
    ``interval_s``), and the first record after a window that suppressed some says how
    many (``... (N similar messages suppressed in the last 10s)``).
    """

    def __init__(
        self,
        logger: logging.Logger,
        per_minute: int = 20,
        *,
        per_interval: int | None = None,
        interval_s: float = 60.0,
        counter: Counter | None = None,
        attributes: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._limit = per_interval if per_interval is not None else per_minute
        self._interval_s = interval_s
        self._counter = counter
        self._attributes = dict(attributes or {})
        self._clock = clock
        self._window_start: float | None = None
        self._emitted = 0
        self._suppressed = 0
        self.count = 0  # every call, logged or not
        self.suppressed_total = 0

    def _log(self, level: int, msg: str, args: tuple[Any, ...], exc_info: bool = False) -> None:
        self.count += 1
        if self._counter is not None:
            self._counter.add(1, self._attributes)
        now = self._clock()
        suffix = ""
        if self._window_start is None or now - self._window_start >= self._interval_s:
            if self._suppressed:
                suffix = (
                    f" ({self._suppressed} similar messages suppressed in the last "
                    f"{self._interval_s:g}s)"
                )
            self._window_start, self._emitted, self._suppressed = now, 0, 0
        if self._emitted < self._limit:
            self._emitted += 1
            self._logger.log(level, msg + suffix, *args, exc_info=exc_info)
        else:
            self._suppressed += 1
            self.suppressed_total += 1

    def flush(self) -> None:
        """Report what the current window suppressed now (at shutdown, for instance)."""
        if self._suppressed:
            self._logger.warning("%d similar messages suppressed", self._suppressed)
            self._suppressed = 0

    def info(self, msg: str, *args: Any) -> None:
        self._log(logging.INFO, msg, args)

    def warning(self, msg: str, *args: Any) -> None:
        self._log(logging.WARNING, msg, args)

    def error(self, msg: str, *args: Any) -> None:
        self._log(logging.ERROR, msg, args)

    def exception(self, msg: str, *args: Any) -> None:
        """An error with the traceback (only on the records that are written)."""
        self._log(logging.ERROR, msg, args, exc_info=True)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # nats-py logs every reconnect attempt at ERROR; our callbacks already report them.
    logging.getLogger("nats").setLevel(logging.CRITICAL)
