"""Dynamic Resource Allocation (resource.k8s.io/v1): the pure model gpulet publishes.

``settings`` (the operator's choices), ``limits`` (the API server's rules), ``devices``
(a GPU as a device), ``taints`` (health as device taints), ``pool`` (the node's
ResourceSlices), ``cdi`` (the CDI spec of a prepared claim). No I/O except ``cdi``'s
spec writer; no service imports.
"""
