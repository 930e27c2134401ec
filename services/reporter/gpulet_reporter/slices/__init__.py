"""The node's DRA ResourceSlices, published by the reporter (issue 26).

``writer``: list, compare, create/replace/delete against the API server;
``publisher``: the node read model into a debounced write loop, and a watch that
repairs slices someone else deleted or changed. The pool itself is the pure model in
:mod:`gpulet_common.dra`.
"""
