"""Every NATS subject gpulet uses, in one place.

Naming
------
Data that other teams consume lives under ``gpu.``; gpulet's own control traffic
(requests, micro-service endpoints, mock fault injection) lives under ``gpulet.``,
so a subscriber of ``gpu.>`` sees data and never requests.

``gpu.health.<node>`` has exactly one token after ``gpu.health`` so that an alerting
system subscribing to exactly ``gpu.health.*`` receives every health event of every
node. The event kind is a field of the payload, not a subject token, for that reason.

Tokens are sanitised with :func:`token`: a Kubernetes node name may contain dots
(which would split it into several tokens) and a wildcard (``*``, ``>``) or whitespace
must never reach a subject. The encoding is injective: ``.`` becomes ``_`` (valid node
names never contain ``_``) and any other character outside ``[A-Za-z0-9-]`` becomes
``~`` followed by the hex of its UTF-8 bytes, ``_`` and ``~`` included.
"""

from __future__ import annotations

import re
from typing import Final

_SAFE = re.compile(r"[A-Za-z0-9-]")

HEALTH_WILDCARD: Final = "gpu.health.*"
ALL_DATA: Final = "gpu.>"
HEALTH_STREAM_SUBJECTS: Final = ("gpu.health.*",)


def token(value: str) -> str:
    """Turn an arbitrary string into one safe subject token."""
    if not value:
        raise ValueError("a subject token cannot be empty")
    out: list[str] = []
    for ch in value:
        if ch == ".":
            out.append("_")
        elif _SAFE.fullmatch(ch):
            out.append(ch)
        else:
            out.extend(f"~{b:02x}" for b in ch.encode())
    return "".join(out)


def untoken(tok: str) -> str:
    """Inverse of :func:`token`."""
    raw = bytearray()
    i = 0
    while i < len(tok):
        ch = tok[i]
        if ch == "_":
            raw += b"."
            i += 1
        elif ch == "~":
            raw.append(int(tok[i + 1 : i + 3], 16))
            i += 3
        else:
            raw += ch.encode()
            i += 1
    return raw.decode()


def inventory(node: str) -> str:
    return f"gpu.inventory.{token(node)}"


def samples(node: str) -> str:
    return f"gpu.samples.{token(node)}"


def health(node: str) -> str:
    return f"gpu.health.{token(node)}"


def inventory_request(node: str) -> str:
    return f"gpulet.inventory.request.{token(node)}"


def health_state(node: str) -> str:
    return f"gpulet.health.state.{token(node)}"


def health_clear(node: str) -> str:
    return f"gpulet.health.clear.{token(node)}"


def mock_inject(node: str) -> str:
    return f"gpulet.mock.inject.{token(node)}"


def allocator_prefix(node: str) -> str:
    """Prefix of the allocator micro service's endpoints for one node."""
    return f"gpulet.allocator.{token(node)}"


def allocator_endpoint(node: str, endpoint: str) -> str:
    return f"{allocator_prefix(node)}.{token(endpoint)}"


# Subjects whose last token names the node the message is about (or the node asked).
_NODE_SCOPED: Final = (
    "gpu.inventory.",
    "gpu.samples.",
    "gpu.health.",
    "gpu.events.",
    "gpulet.inventory.request.",
    "gpulet.health.state.",
    "gpulet.health.clear.",
    "gpulet.mock.inject.",
)


def node_token(subject: str) -> str | None:
    """The node token of a node-scoped subject (``gpu.health.<node>`` and the like),
    or None for a subject that names no node."""
    for prefix in _NODE_SCOPED:
        if subject.startswith(prefix):
            return subject[len(prefix) :]
    return None


HEALTH_STREAM: Final = "GPU_HEALTH"
HEALTH_KV_BUCKET: Final = "gpu_health"


def health_kv_key(node: str, gpu_uuid: str) -> str:
    return f"{token(node)}.{token(gpu_uuid)}"


# Fleet (docs/fleet.md): on the hub, the replicated stream of every node's health
# events and the KV bucket where each node keeps its status under its own key. Each
# node's relay hands its events to the stream on gpu.events.<node> (and gets the
# stream's ack on its own inbox prefix); it publishes its status on gpu.fleet.<node>,
# which the hub's account maps to the bucket's key <node> (a leaf connection between
# JetStream domains never carries $KV.>).
FLEET_STREAM: Final = "GPU_FLEET"
FLEET_STREAM_SUBJECTS: Final = ("gpu.events.*",)
FLEET_KV_BUCKET: Final = "gpulet_fleet"


def fleet_kv_key(node: str) -> str:
    return token(node)


def event_msg_id(node: str, event_id: str) -> str:
    """A health event's de-duplication key where several nodes meet (``Nats-Msg-Id``
    in a stream, a consumer's memory): scoped to the node that published it, so one
    node's ids never make another's events "duplicates"."""
    return f"{token(node)}:{event_id}"


def fleet_events(node: str) -> str:
    """Where a node's relay hands its health events to the hub's fleet stream."""
    return f"gpu.events.{token(node)}"


def fleet_relay_inbox(node: str) -> str:
    """The inbox prefix of a node's relay: the hub's acks reach the node on it."""
    return f"_INBOX.fleet.{token(node)}"


def fleet_status(node: str) -> str:
    """Where a node publishes its status; ``"*"`` gives the wildcard."""
    return f"gpu.fleet.{node if node == '*' else token(node)}"
