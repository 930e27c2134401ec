"""The catalogue of subjects and their payload types.

It drives ``gpulet schema`` (a JSON Schema per subject, for other teams), the
README's subject table and ``gpulet watch`` (which decoder to use for a subject).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from gpulet_common import codec
from gpulet_common.codec import Codec


@dataclass(frozen=True, slots=True)
class SubjectSpec:
    pattern: str
    codec: Codec[Any]
    publisher: str
    description: str
    reply: Codec[Any] | None = None

    def matches(self, subject: str) -> bool:
        want = self.pattern.split(".")
        have = subject.split(".")
        if len(want) != len(have):
            return False
        return all(w.startswith("<") or w == h for w, h in zip(want, have, strict=True))


SUBJECTS: tuple[SubjectSpec, ...] = (
    SubjectSpec(
        "gpu.inventory.<node>",
        codec.INVENTORY,
        "collector",
        "The node's GPUs, driver and pairwise topology; on start, on change and on request.",
    ),
    SubjectSpec(
        "gpu.samples.<node>",
        codec.SAMPLES,
        "collector",
        "One batch of per-GPU samples every sample period (default 1 s).",
    ),
    SubjectSpec(
        "gpu.health.<node>",
        codec.HEALTH_EVENT,
        "health",
        "Health events, for alerting and history; subscribe to `gpu.health.*` for every "
        "node. Also in the GPU_HEALTH JetStream stream. gpulet's own consumers read each "
        "GPU's state from the gpu_health KV bucket instead (ordered by KV revision).",
    ),
    SubjectSpec(
        "gpu.events.<node>",
        codec.HEALTH_EVENT,
        "health (fleet relay)",
        "The node's health events relayed to the hub's GPU_FLEET stream, each acked by "
        "it (at least once, de-duplicated by event_id; docs/fleet.md).",
    ),
    SubjectSpec(
        "gpu.fleet.<node>",
        codec.NODE_STATUS,
        "health",
        "The node's summary (unhealthy GPUs) for the fleet view; on the hub it is "
        "key <node> of the gpulet_fleet KV bucket (docs/fleet.md).",
    ),
    SubjectSpec(
        "gpulet.inventory.request.<node>",
        codec.INVENTORY_REQUEST,
        "(any client)",
        "Request: the collector republishes and returns the inventory.",
        reply=codec.INVENTORY,
    ),
    SubjectSpec(
        "gpulet.health.state.<node>",
        codec.HEALTH_STATE_REQUEST,
        "(any client)",
        "Request: the current health of every GPU of the node.",
        reply=codec.HEALTH_STATE,
    ),
    SubjectSpec(
        "gpulet.health.clear.<node>",
        codec.HEALTH_CLEAR_REQUEST,
        "operator (`gpulet health clear`)",
        "Request: clear sticky conditions of one GPU.",
        reply=codec.HEALTH_STATE,
    ),
    SubjectSpec(
        "gpulet.mock.inject.<node>",
        codec.MOCK_INJECT_REQUEST,
        "operator (`gpulet mock inject`)",
        "Request: inject a fault into the mock NVML of every process of the node.",
        reply=codec.MOCK_INJECT_REPLY,
    ),
)


def could_match(pattern: str, subject: str) -> bool:
    """Whether the NATS subscription ``pattern`` receives ``subject``."""
    want, have = pattern.split("."), subject.split(".")
    for i, tok in enumerate(want):
        if tok == ">":
            return len(have) > i
        if i >= len(have) or (tok != "*" and tok != have[i]):
            return False
    return len(want) == len(have)


def codec_for(subject: str) -> Codec[Any] | None:
    for spec in SUBJECTS:
        if spec.matches(subject):
            return spec.codec
    return None


def json_schemas() -> dict[str, Any]:
    """One JSON Schema document per subject, sharing ``$defs``."""
    types = []
    for spec in SUBJECTS:
        types.append(spec.codec.type)
        if spec.reply is not None:
            types.append(spec.reply.type)
    schemas, components = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    by_type = dict(zip(types, schemas, strict=True))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "gpulet NATS messages",
        "subjects": {
            spec.pattern: {
                "publisher": spec.publisher,
                "description": spec.description,
                "payload": by_type[spec.codec.type],
                **({"reply": by_type[spec.reply.type]} if spec.reply is not None else {}),
            }
            for spec in SUBJECTS
        },
        "$defs": components,
    }
