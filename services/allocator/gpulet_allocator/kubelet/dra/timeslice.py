"""``TimeSlicing`` of a claim's configuration, applied: the GPU's time-slice interval.

A ``GpuConfig`` with ``sharing.strategy: TimeSlicing`` sets the interval with which the
GPU switches between the contexts of the claim's containers, as NVIDIA's driver does:
``nvidia-smi compute-policy -i <GPU UUID> --set-timeslice=<n>``, ``n`` 0-3 for
``Default``, ``Short``, ``Medium``, ``Long``. The ``nvidia-smi`` is the driver's, found
under the driver root with the rest of its user space (:mod:`.driver`); the mock driver
root's logs the arguments it got. A failure (no ``nvidia-smi``, an error, no answer
within :data:`TIMEOUT_S`) fails that claim's Prepare, saying why: the claim asked for
something the node did not do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import anyio

from gpulet_common.dra import config as dra_config

INTERVALS: Final = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
TIMEOUT_S: Final = 10.0


def wanted(configs: Mapping[str, dra_config.Config], uuids: Mapping[str, str]) -> dict[str, int]:
    """GPU UUID -> the interval (0-3) its claim's configuration asks for."""
    out: dict[str, int] = {}
    for device, config in configs.items():
        sharing = config.sharing
        if sharing is None or sharing.strategy != "TimeSlicing" or device not in uuids:
            continue
        interval = (
            sharing.time_slicing_config.interval if sharing.time_slicing_config else "Default"
        )
        out[uuids[device]] = INTERVALS[interval]
    return out


async def apply(nvidia_smi: str, intervals: Mapping[str, int]) -> str:
    """Set each GPU's interval; the first problem, or ""."""
    for uuid, interval in sorted(intervals.items()):
        if not nvidia_smi:
            return "TimeSlicing: no nvidia-smi of the driver on this node"
        args = [nvidia_smi, "compute-policy", "-i", uuid, f"--set-timeslice={interval}"]
        try:
            with anyio.fail_after(TIMEOUT_S):
                done = await anyio.run_process(args, check=False)
        except (OSError, TimeoutError) as exc:
            return f"TimeSlicing of {uuid}: {type(exc).__name__}: {exc}"
        if done.returncode != 0:
            why = (done.stderr or done.stdout).decode(errors="replace").strip()[:200]
            return f"TimeSlicing of {uuid}: nvidia-smi exited {done.returncode}: {why}"
    return ""
