"""The body of a core/v1 Event, as gpulet's components post them.

One shape for every Event gpulet writes (the allocator's refused scheduler decisions,
remediation's evictions): a unique name under the involved object's, the message cut to
1 KiB, ``source`` and ``reporting*`` naming the component and the node, both timestamps
now and a count of one. Plain data, no client: whichever API client posts it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

MAX_MESSAGE = 1024


def event_body(
    *,
    namespace: str,
    involved: Mapping[str, str],
    reason: str,
    message: str,
    component: str,
    node: str,
    warning: bool = True,
) -> dict[str, Any]:
    """``involved``: the ``involvedObject`` (apiVersion, kind, name, and namespace and
    uid where known)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{involved['name']}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": dict(involved),
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": "Warning" if warning else "Normal",
        "source": {"component": component, "host": node},
        "reportingComponent": component,
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
