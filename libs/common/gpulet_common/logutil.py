"""Logging set-up and a rate limit for messages that bad input could flood."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


class RateLimitedLog:
    """At most ``per_minute`` records a minute; the number suppressed is reported."""

    def __init__(self, logger: logging.Logger, per_minute: int = 20) -> None:
        self._logger = logger
        self._per_minute = per_minute
        self._window_start = 0.0
        self._emitted = 0
        self._suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._window_start >= 60.0:
            if self._suppressed:
                self._logger.warning("%d similar messages suppressed", self._suppressed)
            self._window_start, self._emitted, self._suppressed = now, 0, 0
        if self._emitted < self._per_minute:
            self._emitted += 1
            self._logger.warning(msg, *args)
        else:
            self._suppressed += 1


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
