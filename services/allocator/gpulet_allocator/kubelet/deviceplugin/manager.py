"""Runs every resource server, registers them with kubelet and survives kubelet restarts.

Why
---
Kubelet forgets every plugin when it restarts: it deletes the plugin sockets in its
device-plugins dir, creates ``kubelet.sock`` again and waits for plugins to register
anew. Reference plugins watch the dir with fsnotify; we poll (``stat`` every
``watch_interval_s``, no inotify dependency, works on any filesystem) for:

- our own socket gone or replaced: restart that server (new socket), register again;
- ``kubelet.sock`` gone, or back with a new identity (inode, ctime): register again.

Registration is a small state machine per resource, driven by a single loop, so there
is never more than one Register call per resource in flight. Failed attempts back
off exponentially (kubelet may not be up yet) without blocking the other resources.
Re-registering is harmless: kubelet replaces the endpoint of the resource.

Layers
------
:class:`DevicePluginManager` owns the :class:`~.server.ResourceServer` s and runs in
the caller's task group: ``await tg.start(manager.run)`` returns once every resource is
registered; cancelling it (or :meth:`DevicePluginManager.stop`) stops the servers with
a short grace and removes the sockets. ``mig_specs`` are the mixed MIG strategy's
resources (one per profile on the node), served and registered like the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import anyio
import grpc
import grpc.aio
from anyio.abc import TaskStatus

from gpulet_allocator.kubelet.deviceplugin.backend import AllocationBackend
from gpulet_allocator.kubelet.deviceplugin.config import PluginConfig
from gpulet_allocator.kubelet.deviceplugin.devicelist import DeviceListSource
from gpulet_allocator.kubelet.deviceplugin.devnodes import DeviceNodes
from gpulet_allocator.kubelet.deviceplugin.metrics import PluginMetrics
from gpulet_allocator.kubelet.deviceplugin.server import ResourceServer, ServerParts
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as pb
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpulet_allocator.protocol import ResourceSpec, resource_specs
from gpulet_common.logutil import RateLimitedLog

log = logging.getLogger(__name__)
# A socket removed or replaced more than REPLACED_FREE times in REPLACED_WINDOW_S is
# restarted after a back-off (doubling, at most REPLACED_BACKOFF_MAX_S), said at most
# twice a minute.
REPLACED_FREE: Final = 3
REPLACED_WINDOW_S: Final = 60.0
REPLACED_BACKOFF_MAX_S: Final = 30.0
_replaced_log = RateLimitedLog(log, per_minute=2)

# st_dev, st_ino, st_ctime_ns: inodes are reused quickly on tmpfs, the ctime tells a
# recreated kubelet.sock apart even then.
SocketIdentity = tuple[int, int, int]


def socket_identity(path: Path) -> SocketIdentity | None:
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


async def register(kubelet_socket: Path, request: pb.RegisterRequest, timeout_s: float) -> None:
    """One ``Registration.Register`` call; raises ``grpc.aio.AioRpcError`` or TimeoutError."""
    # The outer deadline also covers connection setup and channel teardown.
    with anyio.fail_after(timeout_s + 1.0):
        async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
            stub = pb_grpc.RegistrationStub(channel)
            await stub.Register(request, timeout=timeout_s)


class _Registration:
    """Registration state of one resource."""

    def __init__(self, initial_backoff: float) -> None:
        self.initial_backoff = initial_backoff
        self.registered_with: SocketIdentity | None = None
        self.next_attempt = -math.inf
        self.backoff = initial_backoff
        self.failures = 0
        # Restarts of the server because its socket was removed or replaced: a socket
        # that keeps being replaced (another device plugin, a second gpulet, serving
        # the same file) is restarted with a back-off, not every tick.
        self.restarts: list[float] = []
        self.next_restart = -math.inf

    def restart_due(self, now: float) -> bool:
        """Whether the server may be restarted now; records the restart when it may."""
        if now < self.next_restart:
            return False
        self.restarts = [t for t in self.restarts if now - t < REPLACED_WINDOW_S] + [now]
        extra = len(self.restarts) - REPLACED_FREE
        self.next_restart = now + (min(2.0**extra, REPLACED_BACKOFF_MAX_S) if extra > 0 else 0.0)
        return True

    def forget(self) -> None:
        self.registered_with = None
        self.next_attempt = -math.inf
        self.backoff = self.initial_backoff


class DevicePluginManager:
    def __init__(
        self,
        config: PluginConfig,
        source: DeviceListSource,
        backend: AllocationBackend,
        *,
        device_nodes: DeviceNodes | None = None,
        metrics: PluginMetrics | None = None,
        mig_specs: Sequence[ResourceSpec] = (),
    ) -> None:
        self.config = config
        nodes = device_nodes or DeviceNodes(
            config.dev_root,
            config.host_dev,
            container_dev=config.container_dev or None,
            capabilities=config.mig_capabilities_root,
        )
        calls = metrics or PluginMetrics()
        self.servers = [
            ResourceServer(ServerParts(spec, source, backend, config, nodes, calls))
            for spec in [
                *resource_specs(config.resources, shares=config.shares, profile=config.profile),
                *mig_specs,
            ]
        ]
        self.kubelet_socket = Path(config.plugin_dir) / config.kubelet_socket
        self._state = {
            s.spec.name: _Registration(config.register_backoff_initial_s) for s in self.servers
        }
        self._kubelet_seen: SocketIdentity | None = None
        self._stop_requested = False
        self._stop_event: anyio.Event | None = None
        #: Successful Register calls per resource; for metrics and tests.
        self.registrations: dict[str, int] = {s.spec.name: 0 for s in self.servers}

    @property
    def socket_paths(self) -> list[Path]:
        return [s.socket_path for s in self.servers]

    def all_registered(self) -> bool:
        return all(st.registered_with is not None for st in self._state.values())

    def stop(self) -> None:
        """Ask :meth:`run` to stop the servers and return."""
        self._stop_requested = True
        if self._stop_event is not None:
            self._stop_event.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or stopped; ``started`` once every resource registered."""
        self._stop_event = anyio.Event()
        if self._stop_requested:
            self._stop_event.set()
        await anyio.Path(self.config.plugin_dir).mkdir(parents=True, exist_ok=True)
        started = False
        try:
            for server in self.servers:
                await server.start()
            while not self._stop_requested:
                await self._reconcile()
                if not started and self.all_registered():
                    started = True
                    task_status.started()
                with anyio.move_on_after(self.config.watch_interval_s):
                    await self._stop_event.wait()
        finally:
            # Bounded and shielded: shutdown must finish even when we are cancelled.
            with anyio.move_on_after(self.config.stop_grace_s + 2.0, shield=True):
                for server in self.servers:
                    await server.stop()
            for server in self.servers:
                # Whatever happened above, leave no socket kubelet could dial.
                if server.socket_intact():
                    server.socket_path.unlink(missing_ok=True)

    async def _reconcile(self) -> None:
        kubelet = socket_identity(self.kubelet_socket)
        if kubelet != self._kubelet_seen:
            if kubelet is None:
                log.warning("%s disappeared: kubelet is restarting", self.kubelet_socket)
            elif self._kubelet_seen is not None:
                log.info("%s was recreated: kubelet restarted", self.kubelet_socket)
            self._kubelet_seen = kubelet
            for st in self._state.values():
                st.forget()

        for server in self.servers:
            st = self._state[server.spec.name]
            if not server.socket_intact():
                if not st.restart_due(anyio.current_time()):
                    continue
                if len(st.restarts) > REPLACED_FREE:
                    _replaced_log.warning(
                        "%s was removed or replaced %d times in %d s: is another device "
                        "plugin (a second gpulet?) serving the same socket? restarting its "
                        "server at most every %.0f s",
                        server.socket_path,
                        len(st.restarts),
                        int(REPLACED_WINDOW_S),
                        st.next_restart - st.restarts[-1],
                    )
                elif server.running:
                    log.warning("%s was removed: restarting its server", server.socket_path)
                st.forget()
                try:
                    await server.restart()
                except (OSError, RuntimeError) as exc:
                    # E.g. the dir is gone while kubelet reinstalls; next tick retries.
                    log.warning("restarting %s failed: %s", server.spec.name, exc)
                    continue
            if kubelet is None or st.registered_with == kubelet:
                continue
            now = anyio.current_time()
            if now < st.next_attempt:
                continue
            await self._register(server, st, kubelet)

    async def _register(
        self, server: ResourceServer, st: _Registration, kubelet: SocketIdentity
    ) -> None:
        try:
            await register(
                self.kubelet_socket, server.register_request(), self.config.register_timeout_s
            )
        except (grpc.aio.AioRpcError, TimeoutError, OSError) as exc:
            st.failures += 1
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            log.log(
                logging.WARNING if st.failures <= 3 else logging.DEBUG,
                "registering %s with kubelet failed (attempt %d, retry in %.1f s): %s",
                server.spec.name,
                st.failures,
                st.backoff,
                detail,
            )
            st.next_attempt = anyio.current_time() + st.backoff
            st.backoff = min(st.backoff * 2, self.config.register_backoff_max_s)
            return
        st.registered_with = kubelet
        st.failures = 0
        st.backoff = st.initial_backoff
        self.registrations[server.spec.name] += 1
        log.info("registered %s with kubelet (endpoint %s)", server.spec.name, server.endpoint)
