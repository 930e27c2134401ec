"""The consumers of node health, apart from the node: alert delivery and the fleet hub.

The node's health service (gpulet_health) finds faults and publishes them; nothing in
it depends on who reads them. This package is what reads them, and runs wherever an
operator puts it (usually cluster-side):

* :mod:`.consumer`, :mod:`.sinks`, :mod:`.alertmanager`: ``gpulet alerts``, a durable
  JetStream consumer that delivers every health event to stdout, webhooks and
  Alertmanager, at least once and in order;
* :mod:`.fleet_alerts`: ``gpulet alerts --hub``, the same consumer on the hub's
  fleet stream, shared by its replicas and de-duplicated per node;
* :mod:`.fleet_hub`: the hub's fleet stream and bucket (``gpulet fleet setup``) and
  the fleet view (``gpulet fleet status``);
* :mod:`.cli`: the ``gpulet alerts`` command.

The node's side of the fleet (its relay to the hub, its status) stays in the health
service, where it runs. tests/common/test_import_layers.py keeps the two apart.
"""
