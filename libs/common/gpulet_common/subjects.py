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
from collections.abc import Callable
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


# Subjects whose last token names the node the message is about (or the node asked):
# each prefix once, both for the subject and for reading the node back (node_token).
_NODE_SCOPED: list[str] = []


def _node_scoped(prefix: str) -> Callable[[str], str]:
    """The subject of one node under ``prefix`` (its token appended)."""
    _NODE_SCOPED.append(prefix)

    def subject(node: str) -> str:
        return prefix + token(node)

    return subject


inventory = _node_scoped("gpu.inventory.")
samples = _node_scoped("gpu.samples.")
health = _node_scoped("gpu.health.")
# Where a node's relay hands its health events to the hub's fleet stream.
fleet_events = _node_scoped("gpu.events.")
inventory_request = _node_scoped("gpulet.inventory.request.")
health_state = _node_scoped("gpulet.health.state.")
health_clear = _node_scoped("gpulet.health.clear.")
mock_inject = _node_scoped("gpulet.mock.inject.")


# The allocator's endpoint of the GPUs the device plugin holds: common, since the
# reporter (which may not import the allocator's protocol) asks it.
ALLOCATOR_HELD_ENDPOINT: Final = "held"
# The allocator's endpoint of which container holds which device (kubelet's
# PodResources, read by the allocator alone): the collector's pod labels ask it.
ALLOCATOR_PODS_ENDPOINT: Final = "pods"


def allocator_prefix(node: str) -> str:
    """Prefix of the allocator micro service's endpoints for one node."""
    return f"gpulet.allocator.{token(node)}"


def allocator_endpoint(node: str, endpoint: str) -> str:
    return f"{allocator_prefix(node)}.{token(endpoint)}"


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


def fleet_relay_inbox(node: str) -> str:
    """The inbox prefix of a node's relay: the hub's acks reach the node on it."""
    return f"_INBOX.fleet.{token(node)}"


def fleet_status(node: str) -> str:
    """Where a node publishes its status; ``"*"`` gives the wildcard."""
    return f"gpu.fleet.{node if node == '*' else token(node)}"
