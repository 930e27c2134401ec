"""The DRA kubelet plugin: kubelet's DRA calls enter here (issue 26).

A sibling of the device plugin adapter over the same decision core and ledger.
``contract`` (the Protocols the lead binds: the decision core, the claim reader, the
health source), ``claims`` (a ResourceClaim decoded totally), ``checkpoint``,
``plugin`` (the Prepare/Unprepare rules), ``health`` (DRAResourceHealth), ``server``
(the sockets and gRPC services), ``nats_core`` (the decision core over NATS: the
allocator service's ``reserve-claim`` / ``release-claim``). Besides ``gpulet_common``
and itself it imports only the neutral contract, :mod:`gpulet_allocator.protocol`,
like the device plugin.
"""
