"""Fleet scale: per-node NATS identities, the hub's fleet stream and fleet view.

* :mod:`gpulet_common.fleet.jwt`: NATS JWT v2 claims (operator, account, user),
  encoded and signed with nkeys (Ed25519); decoded and verified.
* :mod:`gpulet_common.fleet.identity`: the credential store behind ``gpulet fleet
  creds``: one operator, a system account, the GPULET account, one user per node;
  issue, rotate, revoke; ``.creds`` files; the hub's resolver preload.
* :mod:`gpulet_common.fleet.hub`: the hub's fleet stream and bucket, and the fleet
  view ``gpulet fleet status`` prints from the bucket.

The node side lives in the health service (``gpulet_health.fleet_relay``,
``gpulet_health.fleet_status``), ``gpulet alerts --hub`` in ``gpulet_health.fleet_alerts``.

See docs/fleet.md.
"""
