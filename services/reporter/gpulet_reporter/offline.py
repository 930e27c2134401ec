"""No-cluster mode: show the Device the reporter would apply, instead of applying it.

On a laptop (``gpulet run``) or any host without a cluster, the reporter still does
all of its work -- inventory, health, debounce, rendering -- and then writes the
result where a person can see it:

* ``<dir>/device-<node>.json``: the Device object, ready for ``kubectl apply -f``;
* ``<dir>/node-labels-<node>.json``: the node labels it would set;
* the log: one line at INFO per change (how many GPUs, how many unhealthy, where the
  files are), the whole Device and labels at debug level.

``<dir>`` is ``reporter.offline_output_dir``, by default ``<state_dir>/reporter``.
Files are replaced atomically (write to a temporary file, then rename), so a reader
never sees half a document. The previous run's file is read back at start and used as
the observed object, so timestamps are stable across restarts exactly as they are
against an API server, and an unchanged state rewrites nothing.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import anyio

from gpulet_common.safefile import write_atomic
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_common.untrusted import json_document
from gpulet_reporter.desired import DesiredState, JsonObj, device_differs, render_device
from gpulet_reporter.writer import WriteError

log = logging.getLogger("gpulet.reporter")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _file_token(node: str) -> str:
    return _UNSAFE.sub("_", node) or "node"


def _write_atomic(path: Path, text: str) -> None:
    # The one safe writer (gpulet_common.safefile): never through a symlink.
    write_atomic(path, text.encode("utf-8"))


def _read_json(path: Path) -> JsonObj | None:
    try:
        data = json_document(path.read_bytes(), what=str(path))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class OfflineSink:
    """A :class:`~gpulet_reporter.writer.WriteSink` that writes files and logs."""

    def __init__(
        self,
        out_dir: Path,
        node: str,
        settings: ReporterSettings,
        *,
        reason: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        token = _file_token(node)
        self.device_path = out_dir / f"device-{token}.json"
        self.labels_path = out_dir / f"node-labels-{token}.json"
        self._settings = settings
        self._clock = clock
        self.description = f"no cluster: {self.device_path}"
        self.reason = reason
        self.device: JsonObj | None = _read_json(self.device_path)
        labels = _read_json(self.labels_path)
        self.labels: dict[str, str] | None = (
            {str(k): str(v) for k, v in labels.items()} if labels is not None else None
        )

    async def refresh(self) -> None:
        # Someone may have edited or deleted the files: treat them like drift.
        self.device = await anyio.to_thread.run_sync(_read_json, self.device_path)
        labels = await anyio.to_thread.run_sync(_read_json, self.labels_path)
        self.labels = {str(k): str(v) for k, v in labels.items()} if labels is not None else None

    async def apply(self, desired: DesiredState) -> bool:
        rendered = render_device(desired, self.device, node_uid=None, now=self._clock())
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation"):
            rendered["metadata"].pop(key, None)
        labels = dict(desired.node_labels) if self._settings.node_labels else {}
        device_changed = device_differs(rendered, self.device)
        labels_changed = labels != self.labels
        if not device_changed and not labels_changed:
            return False
        device_text = json.dumps(rendered, indent=2, sort_keys=False) + "\n"
        labels_text = json.dumps(labels, indent=2, sort_keys=True) + "\n"
        try:
            if device_changed:
                await anyio.to_thread.run_sync(_write_atomic, self.device_path, device_text)
            if labels_changed:
                await anyio.to_thread.run_sync(_write_atomic, self.labels_path, labels_text)
        except OSError as exc:
            raise WriteError("file", f"cannot write {self.device_path}: {exc}") from exc
        self.device = rendered
        self.labels = labels
        # One line; the whole Device (~240 lines for 8 GPUs) only at debug level.
        devices = rendered.get("spec", {}).get("devices", [])
        unhealthy = sum(1 for d in devices if isinstance(d, dict) and d.get("health") is False)
        log.info(
            "no cluster: the Device this node would apply (%d GPUs, %d unhealthy) is in %s, "
            "its %d node labels in %s (--log-level debug logs both)",
            len(devices),
            unhealthy,
            self.device_path,
            len(labels),
            self.labels_path,
        )
        log.debug(
            "the Device this node would apply:\n%snode labels it would set:\n%s",
            device_text,
            labels_text,
        )
        return True
