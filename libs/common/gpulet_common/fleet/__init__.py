"""Fleet scale: per-node NATS identities (the credential tooling of ``gpulet fleet``).

* :mod:`gpulet_common.fleet.jwt`: NATS JWT v2 claims (operator, account, user),
  encoded and signed with nkeys (Ed25519); decoded and verified.
* :mod:`gpulet_common.fleet.identity`: the credential store behind ``gpulet fleet
  creds``: one operator, a system account, the GPULET account, one user per node;
  issue, rotate, revoke; ``.creds`` files; the hub's resolver preload.
* :mod:`gpulet_common.fleet.roles`: the accounts and user roles.

The node side lives in the health service (``gpulet_health.fleet_relay``,
``gpulet_health.fleet_status``); the hub side (its stream, bucket and fleet view,
``gpulet alerts --hub``) in the alerting package (``gpulet_alerting.fleet_hub``,
``gpulet_alerting.fleet_alerts``).

See docs/fleet.md.
"""
