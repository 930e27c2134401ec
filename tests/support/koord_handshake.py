"""Helpers of the koord-scheduler handshake tests (``test_koordinator_handshake*.py``):
settings with the handshake on, pods bound as koord-scheduler's binding leaves them, the
allocator's pod book, and the Events it posts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from gpulet_allocator.decide.koordinator import ANNOTATION_DEVICE_ALLOCATED
from gpulet_allocator.service.pod_watch import EVENT_REASON
from gpulet_common.settings import Settings
from gpulet_common.settings.allocator import HandshakeSettings
from support.allocator_stack import GPU, NODE, Stack
from support.kube_emulator import EVENTS, PODS, KubeEmulator

CORE = "koordinator.sh/gpu-core"
RATIO = "koordinator.sh/gpu-memory-ratio"


def handshake_settings(settings: Settings, tmp_path: Path, *, profile: str = "gpulet") -> Settings:
    handshake = HandshakeSettings(
        enabled=True,
        kubeconfig=str(tmp_path / "kubeconfig"),
        api_timeout_s=2.0,
        watch_timeout_s=5.0,
    )
    allocator = msgspec.structs.replace(
        settings.allocator,
        handshake=handshake,
        plugin=msgspec.structs.replace(settings.allocator.plugin, profile=profile),
    )
    return msgspec.structs.replace(settings, allocator=allocator)


def decision(*minors: int, core: int | None = None, ratio: int | None = None) -> str:
    entries: list[dict[str, Any]] = []
    for minor in minors:
        resources: dict[str, str] = {}
        if core is not None:
            resources[CORE] = str(core)
        if ratio is not None:
            resources[RATIO] = str(ratio)
        entries.append({"minor": minor, "resources": resources} if resources else {"minor": minor})
    return json.dumps({"gpu": entries})


def gpus(n: int) -> dict[str, Any]:
    return {"name": "main", "image": "cuda", "resources": {"limits": {GPU: str(n)}}}


def shares(core: int, ratio: int) -> dict[str, Any]:
    limits = {CORE: str(core), RATIO: str(ratio)}
    return {"name": "main", "image": "cuda", "resources": {"limits": limits}}


async def bound(
    stack: Stack,
    emu: KubeEmulator,
    name: str,
    spec: dict[str, Any],
    annotation: str | None,
    *,
    at: str = "2026-01-01T00:00:00Z",
) -> None:
    """Bind a pod to the node and wait until the allocator's pod watch has it."""
    annotations = {ANNOTATION_DEVICE_ALLOCATED: annotation} if annotation is not None else None
    emu.add_pod(
        name, node=NODE, namespace="ml", containers=[spec], annotations=annotations, scheduled_at=at
    )
    book = stack.allocator.core.book if stack.allocator else None
    assert book is not None
    await stack.wait_for(
        lambda: any(p.key.name == name for p in book.pods.values()), f"the watch to see {name}"
    )


async def unbound(stack: Stack, emu: KubeEmulator, name: str) -> None:
    emu.delete_object(PODS, f"ml/{name}")
    book = stack.allocator.core.book if stack.allocator else None
    assert book is not None
    await stack.wait_for(
        lambda: all(p.key.name != name for p in book.pods.values()), f"{name} to leave the book"
    )


async def synced(stack: Stack) -> None:
    await stack.wait_for(
        lambda: (
            stack.allocator is not None
            and stack.allocator.core.book is not None
            and stack.allocator.core.book.synced
        ),
        "the pod watch to list",
    )


def events_for(emu: KubeEmulator, pod: str) -> list[dict[str, Any]]:
    return [
        e
        for e in emu.list_objects(EVENTS)
        if e["involvedObject"]["name"] == pod and e["reason"] == EVENT_REASON
    ]
