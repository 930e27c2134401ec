"""One JSON encoder and one decoder per message type, created once and reused.

msgspec encoders and decoders are cheap to call but not free to build; holding one
pair per type also gives every call site the same validation.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from gpulet_common import messages as m

T = TypeVar("T")


class Codec(Generic[T]):
    __slots__ = ("_decoder", "_encoder", "type")

    def __init__(self, type_: type[T]) -> None:
        self.type = type_
        self._encoder = msgspec.json.Encoder()
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(type_)

    def encode(self, value: T) -> bytes:
        return self._encoder.encode(value)

    def decode(self, data: bytes | bytearray | memoryview) -> T:
        """Decode and validate; raises :class:`msgspec.DecodeError` or
        :class:`msgspec.ValidationError` on bad input, and nothing else."""
        try:
            return self._decoder.decode(data)
        except UnicodeDecodeError as exc:
            # msgspec lets invalid UTF-8 inside a string escape as UnicodeDecodeError;
            # callers handle one family of errors for bad input, so fold it in.
            raise msgspec.DecodeError(f"invalid UTF-8 in a string: {exc.reason}") from None

    def json_schema(self) -> dict[str, Any]:
        return msgspec.json.schema(self.type)

    def __repr__(self) -> str:
        return f"Codec({self.type.__name__})"


INVENTORY = Codec(m.Inventory)
SAMPLES = Codec(m.SampleBatch)
INVENTORY_REQUEST = Codec(m.InventoryRequest)
HEALTH_EVENT = Codec(m.HealthEvent)
HEALTH_STATE = Codec(m.HealthState)
HEALTH_STATE_REQUEST = Codec(m.HealthStateRequest)
HEALTH_CLEAR_REQUEST = Codec(m.HealthClearRequest)
ERROR_REPLY = Codec(m.ErrorReply)
MOCK_INJECT_REQUEST = Codec(m.MockInjectRequest)
MOCK_INJECT_REPLY = Codec(m.MockInjectReply)
ACK = Codec(m.Ack)
NODE_STATUS = Codec(m.NodeStatus)
