"""One JSON encoder and one decoder per message type, created once and reused.

msgspec encoders and decoders are cheap to call but not free to build; holding one
pair per type also gives every call site the same validation.

Decoding is total
-----------------
:meth:`Codec.decode` is the one door through which a payload from the bus, a stream,
a KV bucket or a file becomes a message, so it must never fail in a way a caller does
not expect, whatever the bytes. In order:

1. **Size**: a payload over its type's byte limit (``[limits]`` in the settings, one
   per message group, see :class:`~gpulet_common.settings.limits.LimitsSettings`) is
   refused without looking at it.
2. **Nesting depth**, before msgspec sees it: msgspec recurses per nesting level and
   raises ``RecursionError`` on ``{"a":{"a":...}}`` 1,500 deep, which escaped every
   ``except`` of the services and killed ``gpulet run``. The check runs at C speed:
   strings are cut out (escaped quotes first, then ``bytes.translate`` keeps only
   quotes and brackets, then every bracket-free string collapses by one
   ``replace``), and the remaining brackets are peeled one nesting level per
   ``bytes.replace`` pass, at most ``max_depth`` passes. A payload with few enough
   brackets skips it.
3. **GPU count**, for the types that list GPUs (``count``): a message over
   ``limits.max_gpus`` is refused after one msgspec pass that builds no object (the
   list's items are kept as raw bytes), 1 ms for a 1,025-GPU inventory instead of the
   20-30 ms a full decode would cost before the count could be checked.
4. **msgspec** decodes and checks types and ranges (``msgspec.Meta`` in
   :mod:`gpulet_common.messages`).
5. **Claims** (:mod:`gpulet_common.validate`): node against subject and consumer, GPU
   count and unique UUIDs, timestamps against the receiver's clock.

Every failure -- whatever the exception, ``RecursionError`` and ``MemoryError``
included -- leaves as :class:`MalformedMessage` (a :class:`msgspec.DecodeError`: steps
1, 2 and 4; :class:`InvalidValue`, also a :class:`msgspec.ValidationError`, for step 4)
or :class:`RejectedMessage` (a :class:`msgspec.ValidationError`: steps 3 and 5), each
with a short ``reason`` for the metrics. Callers keep catching
``(msgspec.DecodeError, msgspec.ValidationError)`` as before.
"""

from __future__ import annotations

from typing import Any, Final, Generic, TypeVar

import msgspec

from gpulet_common import messages as m
from gpulet_common import validate
from gpulet_common.settings.limits import LimitsSettings
from gpulet_common.validate import RejectedMessage

T = TypeVar("T")

DEFAULT_LIMITS: Final = LimitsSettings()

# Reasons of MalformedMessage (RejectedMessage's are in gpulet_common.validate).
TOO_LARGE: Final = "too_large"
TOO_DEEP: Final = "too_deep"
INVALID_JSON: Final = "invalid_json"
INVALID_UTF8: Final = "invalid_utf8"
SCHEMA: Final = "schema"
ERROR: Final = "error"

# The shortest JSON a listed GPU can take ({"gpu_uuid":""}): a payload shorter than
# max_gpus times this cannot list too many, and skips the counting pass.
_MIN_GPU_BYTES: Final = 15

_BRACKETS: Final = bytes.maketrans(b"{}", b"[]")
_NOT_QUOTE_OR_BRACKET: Final = bytes(b for b in range(256) if b not in b'"[]{}')


class MalformedMessage(msgspec.DecodeError):
    """The payload is not a message of the type: too large, too deep, not JSON, or
    not of the type's shape and ranges."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class InvalidValue(MalformedMessage, msgspec.ValidationError):
    """JSON, but not of the type's shape or ranges (what msgspec's validation says)."""


def failure_reason(exc: BaseException) -> tuple[str, str]:
    """``("malformed" | "rejected", reason)`` of a decoding failure, for metrics."""
    if isinstance(exc, RejectedMessage):
        return "rejected", exc.reason
    if isinstance(exc, MalformedMessage):
        return "malformed", exc.reason
    if isinstance(exc, msgspec.ValidationError):
        return "malformed", SCHEMA
    return "malformed", INVALID_JSON if isinstance(exc, msgspec.DecodeError) else ERROR


def nesting_problem(data: bytes | bytearray | memoryview, max_depth: int) -> tuple[str, str] | None:
    """``(reason, detail)`` when ``data`` nests deeper than ``max_depth`` or cannot be
    JSON (unbalanced brackets, an unterminated string), else None. Linear in
    ``len(data)`` per pass, at most ``max_depth`` passes, all at C speed."""
    raw = bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return None  # cannot nest deeper than it has brackets
    if b"\\" in raw:
        # Escapes only occur inside strings: drop escaped backslashes first (so that
        # `\\"` still ends its string), then escaped quotes.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    shape = raw.translate(_BRACKETS, _NOT_QUOTE_OR_BRACKET)
    # Two adjacent quotes enclose no bracket (an empty string, or the end of one and
    # the start of the next with no bracket between): removing them keeps every other
    # bracket on its side of every string. What is left is the few strings that hold
    # brackets.
    shape = shape.replace(b'""', b"")
    if b'"' in shape:
        parts = shape.split(b'"')
        if len(parts) % 2 == 0:
            return INVALID_JSON, "an unterminated string"
        shape = b"".join(parts[::2])
    too_deep = b"[" * (max_depth + 1)
    passes = 0
    while shape:
        if passes >= max_depth or too_deep in shape:
            return TOO_DEEP, f"nesting deeper than {max_depth} levels"
        peeled = shape.replace(b"[]", b"")
        if len(peeled) == len(shape):
            return INVALID_JSON, "unbalanced brackets"
        shape = peeled
        passes += 1
    return None


class Codec(Generic[T]):
    """The encoder and the total decoder of one message type.

    ``limit`` names the type's byte-limit group in
    :class:`~gpulet_common.settings.limits.LimitsSettings` (``inventory`` reads
    ``inventory_max_bytes``); unknown groups use ``max_bytes``. ``count`` names the
    field listing GPUs, bounded by ``limits.max_gpus`` before the full decode.
    """

    __slots__ = ("_counter", "_decoder", "_encoder", "count", "limit", "type")

    def __init__(self, type_: type[T], *, limit: str = "", count: str = "") -> None:
        self.type = type_
        self.limit = limit
        self.count = count
        self._encoder = msgspec.json.Encoder()
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(type_)
        self._counter: msgspec.json.Decoder[Any] | None = None
        if count:
            raw_list: list[msgspec.Raw] = msgspec.field(default_factory=list)
            shape = msgspec.defstruct(
                f"_{type_.__name__}Count", [(count, list[msgspec.Raw], raw_list)]
            )
            self._counter = msgspec.json.Decoder(shape)

    def encode(self, value: T) -> bytes:
        return self._encoder.encode(value)

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        *,
        limits: LimitsSettings | None = None,
        subject: str | None = None,
        node: str | None = None,
        now: float | None = None,
    ) -> T:
        """Decode, validate and check the message's claims.

        ``subject``: the subject it came on (or was asked on), whose node token must
        match the message's ``node``. ``node``: the consumer's node, which it must
        match too. ``now``: the receiver's clock, against which its timestamps are
        checked (not checked without it: files and tests replay old messages).
        Raises :class:`MalformedMessage` or
        :class:`~gpulet_common.validate.RejectedMessage`, and nothing else.
        """
        limits = limits or DEFAULT_LIMITS
        size = len(data)
        max_bytes = limits.max_bytes_for(self.limit)
        if size > max_bytes:
            raise MalformedMessage(
                TOO_LARGE, f"{size} bytes is over the {max_bytes}-byte limit of {self.name}"
            )
        try:
            problem = nesting_problem(data, limits.max_depth)
            if problem is not None:
                raise MalformedMessage(*problem)  # noqa: TRY301 - one except for all paths
            if self._counter is not None and size > limits.max_gpus * _MIN_GPU_BYTES:
                listed = len(getattr(self._counter.decode(data), self.count))
                if listed > limits.max_gpus:
                    raise RejectedMessage(  # noqa: TRY301 - one except for all paths
                        validate.TOO_MANY_GPUS,
                        f"{self.name} lists {listed} GPUs, at most {limits.max_gpus} allowed",
                    )
            value = self._decoder.decode(data)
            validate.check(
                value,
                validate.Context(limits=limits, subject=subject, node=node, now=now),
            )
        except (MalformedMessage, RejectedMessage):
            raise
        except UnicodeDecodeError as exc:
            # msgspec lets invalid UTF-8 inside a string escape as UnicodeDecodeError.
            raise MalformedMessage(
                INVALID_UTF8, f"invalid UTF-8 in a string: {exc.reason}"
            ) from None
        except msgspec.ValidationError as exc:
            raise InvalidValue(SCHEMA, str(exc) or "invalid value") from None
        except msgspec.DecodeError as exc:
            # msgspec 0.23 and later report invalid UTF-8 as a DecodeError (earlier
            # ones let a UnicodeDecodeError escape, above): the same family either way.
            detail = str(exc) or "invalid JSON"
            if "utf-8" in detail.lower():
                raise MalformedMessage(
                    INVALID_UTF8, f"invalid UTF-8 in a string: {detail}"
                ) from None
            raise MalformedMessage(INVALID_JSON, detail) from None
        except Exception as exc:
            # RecursionError, MemoryError, or a bug in a check: never the caller's end.
            raise MalformedMessage(ERROR, f"{type(exc).__name__}: {exc}"[:300]) from None
        return value

    @property
    def name(self) -> str:
        return self.type.__name__

    def __repr__(self) -> str:
        return f"Codec({self.type.__name__})"


INVENTORY = Codec(m.Inventory, limit="inventory", count="gpus")
SAMPLES = Codec(m.SampleBatch, limit="samples", count="samples")
INVENTORY_REQUEST = Codec(m.InventoryRequest, limit="request")
HEALTH_EVENT = Codec(m.HealthEvent, limit="health_event")
HEALTH_STATE = Codec(m.HealthState, limit="health_state", count="gpus")
HEALTH_STATE_REQUEST = Codec(m.HealthStateRequest, limit="request")
HEALTH_CLEAR_REQUEST = Codec(m.HealthClearRequest, limit="request")
HELD_REQUEST = Codec(m.HeldRequest, limit="request")
HELD_REPLY = Codec(m.HeldReply)
# The allocator's ``pods`` endpoint (asked with HELD_REQUEST); the collector's pod labels.
PODS_REPLY = Codec(m.PodsReply)
ERROR_REPLY = Codec(m.ErrorReply)
MOCK_INJECT_REQUEST = Codec(m.MockInjectRequest, limit="request")
MOCK_INJECT_REPLY = Codec(m.MockInjectReply)
ACK = Codec(m.Ack)
# Value of each key of the gpu_health KV bucket (written by the health service).
GPU_HEALTH = Codec(m.GpuHealth, limit="health_state")
NODE_STATUS = Codec(m.NodeStatus, limit="request")
