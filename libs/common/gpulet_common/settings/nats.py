"""How services reach NATS, and the embedded server ``gpulet run`` starts."""

from __future__ import annotations

from typing import Annotated

import msgspec

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
# One or more NATS subject tokens joined by single dots: no empty token, no space,
# no wildcard (`*`, `>`).
SubjectPrefix = Annotated[str, msgspec.Meta(pattern=r"^[^\s.*>]+(\.[^\s.*>]+)*$")]


class NatsSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Comma-separated server URLs. Empty: `gpulet run` starts an embedded nats-server.
    url: str = ""
    # Client name shown in the server's connection list.
    name: str = "gpulet"
    # User for user/password authentication.
    user: str = ""
    # Password for user/password authentication (never logged).
    password: str = ""
    # Token authentication (never logged).
    token: str = ""
    # NKey seed file for NKey authentication.
    nkey_seed_file: str = ""
    # A .creds file (JWT + NKey seed) for decentralised (operator/account) authentication.
    creds_file: str = ""
    # CA bundle to verify the server's TLS certificate.
    tls_ca_file: str = ""
    # Client certificate for mutual TLS.
    tls_cert_file: str = ""
    # Key of the client certificate.
    tls_key_file: str = ""
    # Seconds to wait for one connection attempt.
    connect_timeout_s: PositiveFloat = 2.0
    # First reconnect back-off in seconds; it doubles per failed attempt, with jitter.
    reconnect_wait_s: PositiveFloat = 0.25
    # Ceiling of the reconnect back-off in seconds.
    reconnect_max_wait_s: PositiveFloat = 5.0
    # Subject prefix of this client's reply inboxes (requests, JetStream and KV calls).
    # With a per-user `_INBOX.<user>`, the server can let each user read only its own
    # replies (deploy/nats/auth.conf).
    inbox_prefix: SubjectPrefix = "_INBOX"
    # Default seconds a request waits for its reply.
    request_timeout_s: PositiveFloat = 2.0
    # Messages a subscription may hold before nats-py reports a slow consumer.
    pending_msgs_limit: Annotated[int, msgspec.Meta(gt=0)] = 65536
    # Address the embedded server (used when url is empty) listens on.
    embedded_host: str = "127.0.0.1"
    # Port of the embedded server.
    embedded_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 4222
    # Whether the embedded server runs JetStream (the health stream and KV need it).
    embedded_jetstream: bool = True
    # Restarts of a dead embedded server tried in a row before `gpulet run` gives up
    # and exits 1 (0: exit at its first death). A restart counts as a success once the
    # server has then run for a minute.
    embedded_restart_attempts: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 8
    # First wait in seconds before restarting a dead embedded server; it doubles per
    # failed attempt, with jitter.
    embedded_restart_wait_s: PositiveFloat = 0.25
    # Ceiling of the wait between two restarts of the embedded server, in seconds.
    embedded_restart_max_wait_s: PositiveFloat = 5.0
