"""Fleet scale: per-node NATS identities, the hub's fleet stream and fleet view.

* :mod:`gpulet_common.fleet.jwt`: NATS JWT v2 claims (operator, account, user),
  encoded and signed with nkeys (Ed25519); decoded and verified.
* :mod:`gpulet_common.fleet.identity`: the credential store behind ``gpulet fleet
  creds``: one operator, a system account, the GPULET account, one user per node;
  issue, rotate, revoke; ``.creds`` files; the hub's resolver preload.
* :mod:`gpulet_common.fleet.status`: the node status a node puts in the hub's
  ``gpulet_fleet`` KV bucket, and how ``gpulet fleet status`` reads it.

See docs/fleet.md.
"""
