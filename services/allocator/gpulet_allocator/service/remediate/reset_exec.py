"""Resetting one GPU: the one executor interface, its two backends, and NVIDIA's rule on
what may be reset alone.

Executors
---------
:class:`ResetExecutor` is the whole interface: ``reset(bus_id)`` answers a
:class:`ResetOutcome` and never raises. :class:`NvidiaSmiExecutor` runs
``nvidia-smi --gpu-reset -i <bus id>`` (:func:`nvidia_smi_argv`; the bus id is checked
to be one, so nothing from a message reaches the command line as an option), kills it
when it outlasts ``remediation.reset.timeout_s`` (a hung reset), and reads its exit
status: nvidia-smi refuses a reset while a process holds the GPU, or where the GPU
cannot be reset alone. :class:`MockExecutor` resets the mock NVML's GPU
(:meth:`gpulet_common.mock_nvml.MockNvml.gpu_reset`), off the event loop, under the
same timeout.

Reset alone
-----------
NVIDIA's rules (nvidia-smi's ``--gpu-reset`` help, the Fabric Manager guide):

* GPUs joined by direct NVLinks (no NVSwitch) are reset together: the reset of one
  needs its NVLink peers.
* On an NVSwitch system before Hopper (HGX A100), a GPU reset needs every GPU and
  NVSwitch of the fabric reset together (Fabric Manager's "reset all"); from Hopper
  on, Fabric Manager supports resetting one GPU alone.

:func:`alone_problem` applies them: it names the peers a reset would need, or None when
the GPU may be reset alone. gpulet resets one GPU alone and never resets peers: a reset
that needs peers escalates (the node's condition; the peers may hold pods).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final, Protocol

import anyio

BUS_ID: Final = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
# Compute capability from which Fabric Manager resets one GPU of an NVSwitch fabric alone.
ALONE_ON_NVSWITCH_FROM: Final = 9
_TAIL: Final = 300


@dataclass(frozen=True, slots=True)
class ResetOutcome:
    ok: bool
    detail: str = ""
    # The reset outlasted its timeout (and was killed, or abandoned on the mock).
    hung: bool = False


class ResetExecutor(Protocol):
    async def reset(self, bus_id: str) -> ResetOutcome: ...


def nvidia_smi_argv(nvidia_smi: str, bus_id: str) -> list[str]:
    """The command that resets the GPU at ``bus_id``; raises ValueError for anything
    that is not a PCI bus id."""
    if not BUS_ID.fullmatch(bus_id):
        raise ValueError(f"not a PCI bus id: {bus_id[:40]!r}")
    return [nvidia_smi, "--gpu-reset", "-i", bus_id]


class NvidiaSmiExecutor:
    def __init__(self, nvidia_smi: str, timeout_s: float) -> None:
        self._nvidia_smi = nvidia_smi
        self._timeout = timeout_s

    async def reset(self, bus_id: str) -> ResetOutcome:
        try:
            argv = nvidia_smi_argv(self._nvidia_smi, bus_id)
        except ValueError as exc:
            return ResetOutcome(False, str(exc))
        try:
            with anyio.fail_after(self._timeout):
                # Cancelled by the timeout, run_process kills the child.
                done = await anyio.run_process(argv, check=False)
        except TimeoutError:
            return ResetOutcome(False, f"{' '.join(argv)} hung past {self._timeout:g}s", True)
        except OSError as exc:
            return ResetOutcome(False, f"{' '.join(argv)}: {exc}")
        said = (done.stdout + done.stderr).decode("utf-8", "replace").strip()[-_TAIL:]
        if done.returncode != 0:
            return ResetOutcome(False, f"{' '.join(argv)} exited {done.returncode}: {said}")
        return ResetOutcome(True, said)


class MockExecutor:
    """Resets the mock NVML's GPU (``mock``: a :class:`~gpulet_common.mock_nvml.MockNvml`)."""

    def __init__(self, mock: Any, timeout_s: float) -> None:
        self._mock = mock
        self._timeout = timeout_s
        self.calls: list[str] = []

    async def reset(self, bus_id: str) -> ResetOutcome:
        self.calls.append(bus_id)
        try:
            with anyio.fail_after(self._timeout):
                await anyio.to_thread.run_sync(self._mock.gpu_reset, bus_id, abandon_on_cancel=True)
        except TimeoutError:
            return ResetOutcome(False, f"mock reset of {bus_id} hung past {self._timeout:g}s", True)
        except Exception as exc:  # an NVMLError of the mock: the reset failed
            return ResetOutcome(False, f"mock reset of {bus_id} failed: {exc}")
        return ResetOutcome(True, f"mock reset of {bus_id}")


def alone_problem(direct_peers: list[str], nvswitch: bool, compute_major: int) -> str | None:
    """Why the GPU cannot be reset alone (naming the peers it needs), or None."""
    if direct_peers:
        return (
            "a reset needs its NVLink peers reset with it "
            f"({', '.join(sorted(set(direct_peers)))}); gpulet resets one GPU alone"
        )
    if nvswitch and compute_major < ALONE_ON_NVSWITCH_FROM:
        return (
            "on an NVSwitch fabric before Hopper a reset needs every GPU and NVSwitch of "
            "the fabric (Fabric Manager); gpulet resets one GPU alone"
        )
    return None
