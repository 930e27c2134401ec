"""Fleet scale (docs/fleet.md): the hub's fleet stream and bucket, the node's status
publisher, and ``gpulet alerts --hub``."""

from __future__ import annotations

from typing import Annotated

import msgspec

PosFloat = Annotated[float, msgspec.Meta(gt=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Replicas = Annotated[int, msgspec.Meta(ge=1, le=5)]


class FleetSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # --- the node: its status in the hub's fleet bucket (gpu.fleet.<node>) ---
    # Publish the node's status for the fleet view (needs the leaf connection to the
    # hub, components/nats-fleet; without one it goes nowhere).
    status_enabled: bool = False
    # At most one status per this many seconds (the rate limit), however often GPUs change.
    status_min_interval_s: PosFloat = 2.0
    # A status at least this often (s), changed or not: the hub's "last heard".
    status_heartbeat_s: PosFloat = 30.0

    # Relay this node's health events from its GPU_HEALTH stream to the hub's fleet
    # stream, each acked by the hub (at least once; needs the leaf connection).
    relay_enabled: bool = False
    # How long the relay waits for the hub's ack of one event (s).
    relay_timeout_s: PosFloat = 2.0
    # First back-off after the hub did not ack (s); it doubles on each failure.
    relay_retry_initial_s: PosFloat = 0.2
    # Longest back-off between two tries of one event (s).
    relay_retry_max_s: PosFloat = 5.0

    # --- the hub: the fleet stream (created by `gpulet fleet setup`) ---
    # Replicas of the fleet stream and bucket (3 on a 3-server hub cluster).
    replicas: Replicas = 3
    # Oldest event kept (s); default 7 days.
    stream_max_age_s: PosFloat = 7 * 24 * 3600.0
    # Size cap of the stream (bytes); the oldest events go first.
    stream_max_bytes: PosInt = 8 * 1024**3
    # Event count cap of the stream.
    stream_max_msgs: PosInt = 50_000_000
    # Largest event accepted (bytes).
    stream_max_msg_size: PosInt = 64 * 1024
    # The server drops a second event with the same event_id (Nats-Msg-Id) within
    # this window (s): a node's re-publish after a lost ack, its disk buffer's replay.
    duplicate_window_s: PosFloat = 600.0

    # --- the hub: `gpulet alerts --hub` (one durable consumer shared by replicas) ---
    # The durable consumer every alerts replica pulls from.
    alerts_durable: str = "gpulet-alerts-fleet"
    # An event not acked this long (s) after delivery goes to another replica.
    alerts_ack_wait_s: PosFloat = 30.0
    # Deliveries of one event before the server gives up on it (an advisory is sent).
    alerts_max_deliver: PosInt = 20
    # Events delivered and not yet acked, across all replicas.
    alerts_max_ack_pending: PosInt = 1000

    # --- `gpulet fleet status` ---
    # A node not heard from for this long (s) is shown as stale.
    stale_after_s: PosFloat = 90.0
