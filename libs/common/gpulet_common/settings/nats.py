"""How services reach NATS, and the embedded server ``gpulet run`` starts."""

from __future__ import annotations

from typing import Annotated

import msgspec

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class NatsSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Comma-separated server URLs. Empty: `gpulet run` starts an embedded nats-server.
    url: str = ""
    name: str = "gpulet"
    user: str = ""
    password: str = ""
    token: str = ""
    # NKey seed file, or a .creds file (JWT + seed) for decentralised auth.
    nkey_seed_file: str = ""
    creds_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    connect_timeout_s: PositiveFloat = 2.0
    # Reconnect back-off: starts at the first value, doubles up to the second, jittered.
    reconnect_wait_s: PositiveFloat = 0.25
    reconnect_max_wait_s: PositiveFloat = 5.0
    request_timeout_s: PositiveFloat = 2.0
    # Messages a subscription may hold before nats-py reports a slow consumer.
    pending_msgs_limit: Annotated[int, msgspec.Meta(gt=0)] = 65536
    # Embedded server (used when url is empty).
    embedded_host: str = "127.0.0.1"
    embedded_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 4222
    embedded_jetstream: bool = True
