"""Which services exist and how each is built from a :class:`Runtime`.

Imports are lazy so that a sidecar image holding only one service's extras (say the
reporter without grpcio) starts without importing the others, and so that importing
this module (the CLI does, for every command) costs nothing: not even the NATS client.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpulet_common.lifecycle import Service
    from gpulet_common.runtime import Runtime

# name -> "module:Class"; the class takes a Runtime.
REGISTRY: dict[str, str] = {
    "collector": "gpulet_collector.service:CollectorService",
    "health": "gpulet_health.service:HealthService",
    "reporter": "gpulet_reporter.service:ReporterService",
    "allocator": "gpulet_allocator.service:AllocatorService",
    "device-plugin": "gpulet_allocator.kubelet.deviceplugin.service:DevicePluginService",
}

# One line on what each does, for `gpulet serve --help`.
SUMMARIES: dict[str, str] = {
    "collector": "NVML inventory and samples (gpu.inventory.<node>, gpu.samples.<node>)",
    "health": "NVML events and samples into health state (KV gpu_health, gpu.health.<node>)",
    "reporter": "the node's Device object, labels, condition and taint (a file off-cluster)",
    "allocator": "the allocation decisions (micro service gpulet.allocator.<node>.*)",
    "device-plugin": "kubelet's device-plugin gRPC API, asking the allocator",
}

# The services that write into the state directory itself (the health service's buffer,
# GPU list and kmsg cursor; the reporter's offline output). The allocator writes only
# into its own subdirectory (a separate mount in the DaemonSet) and the collector and
# the device plugin write nothing there, so they need it to exist, not to be writable:
# in the DaemonSet they run as root without capabilities and the directory is uid 65532's.
WRITES_STATE_DIR: frozenset[str] = frozenset({"health", "reporter"})

# The services that use aiohttp: the ones that talk to the API server, through
# kubernetes-asyncio. The others never load it: nats-py imports it only for its
# WebSocket transport (see gpulet.cli.skip_unused_aiohttp).
USES_AIOHTTP: frozenset[str] = frozenset({"reporter", "allocator"})

# `gpulet run` starts these, in this order (producers before consumers).
RUN_ORDER: tuple[str, ...] = ("collector", "health", "reporter", "allocator", "device-plugin")

# Packages that add their own subcommands through a `cli` module with
# `add_commands(subparsers, add_flags, load_settings)`, and the commands each adds: the
# CLI imports only the module of the command it runs (all of them for `gpulet --help`).
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "gpulet.tools": ("watch", "schema", "mock"),
    "gpulet_health.cli": ("health",),
    "gpulet_alerting.cli": ("alerts",),
    "gpulet_reporter.cli": ("reporter-preview",),
    "gpulet_allocator.cli": ("allocator",),
    "gpulet.fleet": ("fleet",),
}


def factory(name: str) -> Callable[[Runtime], Service]:
    module_name, _, class_name = REGISTRY[name].partition(":")
    cls: Callable[[Runtime], Service] = getattr(import_module(module_name), class_name)
    return cls


def build(names: list[str], runtime: Runtime) -> list[Service]:
    return [factory(name)(runtime) for name in names]
