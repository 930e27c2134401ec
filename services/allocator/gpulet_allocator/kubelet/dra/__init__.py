"""The DRA kubelet plugin: kubelet's DRA calls enter here (issue 26).

A sibling of the device plugin adapter over the same decision core and ledger.
``contract`` (the Protocols the lead binds: the decision core, the claim reader, the
health source), ``claims`` (a ResourceClaim decoded totally), ``checkpoint``,
``plugin`` (the Prepare/Unprepare rules), ``health`` (DRAResourceHealth), ``server``
(the sockets and gRPC services). Self-contained: it imports only ``gpulet_common`` and
itself, so the allocator's refactor can move around it.
"""
