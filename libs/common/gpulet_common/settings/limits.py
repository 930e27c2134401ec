"""What a message from the bus may be: size, nesting, GPU count, clock skew.

Every payload that crosses a seam (a subscription, a reply, a stream, a KV entry) is
checked against these limits before and after decoding (:mod:`gpulet_common.codec`,
:mod:`gpulet_common.validate`). A payload over a limit is counted, logged and dropped;
it never reaches a service. The byte limits are per message type: an inventory of
``max_gpus`` GPUs is the largest thing gpulet sends.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]

KIB = 1024
MIB = 1024 * KIB


class LimitsSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Most GPUs one inventory, sample batch or health state may list; a larger one is
    # refused before any work is done with it.
    max_gpus: PositiveInt = 1024
    # How far (s) a timestamp in a message may lie ahead of the receiver's clock.
    max_clock_skew_s: PositiveFloat = 300.0
    # How old (s) an observation in a message may be (samples, health events,
    # inventories). 30 days: longer than the GPU_HEALTH stream keeps events, so a
    # replay of the whole stream passes.
    max_age_s: PositiveFloat = 30 * 24 * 3600.0
    # Deepest JSON nesting (objects and arrays) accepted in any message; gpulet's own
    # messages nest at most 6 deep. Checked before decoding.
    max_depth: PositiveInt = 32
    # Largest inventory payload (bytes): room for max_gpus GPUs with NVLink peers and
    # long CPU affinity lists (about 1.5 KiB per GPU).
    inventory_max_bytes: PositiveInt = 2 * MIB
    # Largest sample batch payload (bytes).
    samples_max_bytes: PositiveInt = 1 * MIB
    # Largest health event payload (bytes).
    health_event_max_bytes: PositiveInt = 64 * KIB
    # Largest health state payload (bytes): a state query's answer, a KV entry.
    health_state_max_bytes: PositiveInt = 1 * MIB
    # Largest control request payload (bytes): inventory, health state and clear
    # requests, mock fault injection.
    request_max_bytes: PositiveInt = 64 * KIB
    # Largest payload of every other message type (bytes): the allocator's requests
    # and replies, acknowledgements, error replies. 1 MiB is NATS's default max_payload.
    max_bytes: PositiveInt = 1 * MIB

    def max_bytes_for(self, group: str) -> int:
        """The byte limit of a message group (see :class:`gpulet_common.codec.Codec`)."""
        value = getattr(self, f"{group}_max_bytes", None)
        return value if isinstance(value, int) else self.max_bytes
