"""Where kubelet's calls enter: one adapter per kubelet API, over the one decision core.

* :mod:`.deviceplugin` -- the device plugin API (v1beta1): ``ListAndWatch``,
  ``GetPreferredAllocation``, ``Allocate``;
* ``dra/`` (a later issue) -- DRA's kubelet plugin, beside it.

Adapters translate and ask; the decisions are :mod:`gpulet_allocator.decide`'s
(tests/common/test_import_layers.py: the core never imports an adapter).
"""
