"""De-duplication: stable event ids, and folding repeats of a fault into one count.

Event ids
---------
Every event's id is a keyed hash (HMAC-SHA256, 128 bits) of what the event *is*:
node, GPU, kind, condition, the onset time of the condition and what happened to it
(raised, repeated, ended), under the node's own secret key (:class:`EventIds`, kept
0600 in the state dir by :func:`load_id_key`). So a republish -- from the disk buffer
after an outage, or after a restart that derives the same event again -- carries the
same id, and JetStream (``Nats-Msg-Id``) and consumers drop the copy; yet no one
without the key can tell an id before it is published. A recovery's id in particular
is not computable from its raise event: a compromised node cannot publish another
node's future ids first and have the genuine events dropped as duplicates (issue 23).
Consumers de-duplicate per node as well (``<node>:<event id>``,
:func:`gpulet_common.subjects.event_msg_id`).

Repeat windows
--------------
A faulty GPU can report the same XID hundreds of times a second. The first occurrence
is published at once (alerting latency matters most there); further occurrences with
the same key within ``window_s`` are only counted. When the window ends with repeats,
one summary event carries the count (``repeat_count``) and a new window starts, so a
fault storm gives one event per window, not one per fault. A window that ends without
repeats is forgotten: the next occurrence is published at once again. When the
condition ends, its pending summary is published *before* the end event, so that no
fault report ever follows its own recovery. GPUd de-duplicates the same way, per
minute, which is the default window.

Keys and variants
-----------------
A key is (GPU, condition or report). An XID from the kernel log also carries its
message, with the pid and process name taken out: the *variant*. Each variant of a key
has a window of its own, so a new distinct message is published at once, not held back;
past :data:`MAX_VARIANTS` open variants of one key, further ones fold into the key's
own window, so a storm of ever-different lines stays bounded too. A condition's end
closes every variant of it.

Storms
------
A repeat inside an open window costs a dictionary lookup and an addition
(:meth:`Deduplicator.absorb`, which the XID rule asks before it builds an event): a
storm of 10,000 lines a second gives one event, then one summary a window, whose
``repeat_count`` values add up to exactly the number of occurrences.

Evidence
--------
A by-product XID (45, and 43 after another fault) is counted as *evidence* for the fault
it follows (op ``evidence``): it adds to that fault's open window, and the window's next
summary carries ``evidence_count``; it never opens a window or publishes anything of its
own.

This is a stage after the rules (:meth:`Deduplicator.apply`): they emit :class:`Emit`
items, an event with its key and what it does to the key's window.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

from gpulet_common.messages import HealthEvent
from gpulet_common.safefile import write_atomic

log = logging.getLogger("gpulet.health.dedup")

KEY_BYTES = 32


class EventIds:
    """Event ids: HMAC-SHA256 of the parts under the node's key (128 bits, hex).

    Stable for one key (a republish has the same id), unguessable without it. A new
    instance without a key gets a random one: unique ids, stable for its lifetime.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key else secrets.token_bytes(KEY_BYTES)

    def __call__(self, *parts: object) -> str:
        text = "\x1f".join(
            "" if p is None else repr(p) if isinstance(p, float) else str(p) for p in parts
        )
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()[:32]


def load_id_key(path: Path) -> bytes:
    """The node's event-id key from ``path``, made (0600, :mod:`~gpulet_common.safefile`)
    when missing. Blocking. A key that cannot be read or kept is replaced by a random
    one for this run (ids stay unique and unguessable; a restart may then publish an
    event again under a new id), and the log says why."""
    try:
        data = path.read_bytes()
        if len(data) >= KEY_BYTES and not path.is_symlink():
            return data[:KEY_BYTES]
        if data:
            log.warning("ignoring the event-id key %s: not a key gpulet wrote", path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot read the event-id key %s: %s", path, exc)
    key = secrets.token_bytes(KEY_BYTES)
    try:
        write_atomic(path, key, mode=0o600)
    except OSError as exc:
        log.warning("cannot keep the event-id key in %s (ids change on restart): %s", path, exc)
    return key


DedupKey = tuple[str, str]  # (gpu uuid, condition or report key)

# Open variants (distinct messages) per key; further ones fold into the key's window.
MAX_VARIANTS = 16
_SEP = "\x1f"


class Emit(NamedTuple):
    """What a rule emits: "raise" a condition, "offer" an occurrence or one-off report,
    "end" a condition, "evidence" for the fault of ``key`` (a by-product XID, the code
    in ``byproduct``: counted, never published), or "pass" (published as it is)."""

    op: Literal["raise", "offer", "end", "pass", "evidence"]
    key: DedupKey
    event: HealthEvent
    # The occurrence's message without pid and process name: a window of its own.
    variant: str = ""
    byproduct: int = 0


def refreshed(event: HealthEvent, healthy: bool, index: int | None) -> HealthEvent:
    """A delayed (summary) event carries the GPU's health as of its publication."""
    if event.healthy == healthy and event.gpu_index == index:
        return event
    return msgspec.structs.replace(event, healthy=healthy, gpu_index=index)


@dataclass(slots=True)
class _Window:
    start: float
    last: float
    suppressed: int
    template: HealthEvent
    # By-product XIDs counted as evidence for this window's fault, by code.
    evidence: dict[int, int] = field(default_factory=dict)


class Deduplicator:
    def __init__(self, window_s: float, ids: EventIds) -> None:
        self._window_s = window_s
        self._ids = ids
        self._windows: dict[DedupKey, _Window] = {}
        # Open variant windows per key (bounded by MAX_VARIANTS).
        self._variants: dict[DedupKey, int] = {}

    def apply(self, emits: Iterable[Emit]) -> list[HealthEvent]:
        """The stage: what the rules emitted, in order, as it is to be published."""
        out: list[HealthEvent] = []
        for op, key, event, variant, byproduct in emits:
            if op == "raise":  # always published; its window folds later repeats
                out += self.close(key) + self.offer(key, event, variant)
            elif op == "offer":
                out += self.offer(key, event, variant)
            elif op == "evidence":
                self.evidence(key, variant, byproduct)
            elif op == "end":  # never a fault report after its own recovery
                out += [refreshed(e, event.healthy, event.gpu_index) for e in self.close(key)]
                out.append(event)
            else:
                out.append(event)
        return out

    def _key(self, key: DedupKey, variant: str) -> DedupKey:
        """The window key of an occurrence: its variant's, or the key's own when the key
        has too many variants open already."""
        if not variant:
            return key
        wkey = (key[0], key[1] + _SEP + variant)
        if wkey in self._windows or self._variants.get(key, 0) < MAX_VARIANTS:
            return wkey
        return key

    def _open(self, wkey: DedupKey, window: _Window) -> None:
        if wkey not in self._windows and _SEP in wkey[1]:
            base = (wkey[0], wkey[1].split(_SEP, 1)[0])
            self._variants[base] = self._variants.get(base, 0) + 1
        self._windows[wkey] = window

    def _drop(self, wkey: DedupKey) -> _Window | None:
        window = self._windows.pop(wkey, None)
        if window is not None and _SEP in wkey[1]:
            base = (wkey[0], wkey[1].split(_SEP, 1)[0])
            left = self._variants.get(base, 1) - 1
            if left > 0:
                self._variants[base] = left
            else:
                self._variants.pop(base, None)
        return window

    def absorb(self, key: DedupKey, variant: str, now: float) -> bool:
        """Count a repeat inside its open window, before any event is built: True when
        it was counted (nothing to publish), False when the rule must emit it."""
        if self._window_s <= 0:
            return False
        window = self._windows.get(self._key(key, variant))
        if window is None or now - window.start >= self._window_s:
            return False
        window.suppressed += 1
        if now > window.last:
            window.last = now
        return True

    def evidence(self, key: DedupKey, variant: str, code: int) -> None:
        """A by-product XID counted for the fault of ``key``, if its window is open."""
        window = self._windows.get(self._key(key, variant))
        if window is not None:
            window.evidence[code] = window.evidence.get(code, 0) + 1

    def offer(self, key: DedupKey, event: HealthEvent, variant: str = "") -> list[HealthEvent]:
        """The events to publish for this occurrence: itself, or nothing (counted)."""
        if self._window_s <= 0:
            return [event]
        out: list[HealthEvent] = []
        wkey = self._key(key, variant)
        window = self._windows.get(wkey)
        if window is not None:
            if event.observed_at - window.start < self._window_s:
                window.suppressed += 1
                window.last = max(window.last, event.observed_at)
                return out
            out += self._summary(window)
        self._open(wkey, _Window(event.observed_at, event.observed_at, 0, event))
        out.append(event)
        return out

    def close(self, key: DedupKey) -> list[HealthEvent]:
        """End the key's windows, its variants' too (its condition ended): their
        summaries, for those with repeats."""
        out: list[HealthEvent] = []
        window = self._drop(key)
        if window is not None:
            out += self._summary(window)
        if self._variants.get(key):
            prefix = key[1] + _SEP
            for wkey in [k for k in self._windows if k[0] == key[0] and k[1].startswith(prefix)]:
                dropped = self._drop(wkey)
                if dropped is not None:
                    out += self._summary(dropped)
        return out

    def tick(self, now: float) -> list[HealthEvent]:
        """Summaries of the windows that ended by ``now``."""
        out: list[HealthEvent] = []
        for key, window in list(self._windows.items()):
            if now - window.start < self._window_s:
                continue
            if window.suppressed:
                out += self._summary(window)
                self._windows[key] = _Window(now, now, 0, window.template)
            else:
                self._drop(key)
        return out

    def _summary(self, window: _Window) -> list[HealthEvent]:
        if not window.suppressed:
            return []
        template = window.template
        count = window.suppressed
        span = max(window.last - window.start, 0.0)
        evidence = sum(window.evidence.values())
        by = ", ".join(f"{n} x XID {c}" for c, n in sorted(window.evidence.items()))
        summary = msgspec.structs.replace(
            template,
            event_id=self._ids(template.event_id, "repeat", window.start),
            repeat_count=count,
            evidence_count=evidence,
            observed_at=window.last,
            published_at=0.0,
            message=(
                f"{count} more occurrence(s) within {span:.1f}s after the one reported"
                + (f", and {by} counted as evidence for it" if by else "")
                + (f": {template.message}" if template.message else "")
            ),
        )
        window.suppressed = 0
        window.evidence = {}
        return [summary]
