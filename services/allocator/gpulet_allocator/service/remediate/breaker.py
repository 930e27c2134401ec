"""The circuit breaker: remediation never takes more than a set share of the node's
GPUs within a window. Pure, on an injected monotonic clock.

Why
---
One GPU failing is a GPU fault; half a node's GPUs failing within minutes is more likely
a driver, firmware, power or fabric problem, or a bug in the agent, and evicting every
workload of the node then makes an outage of a fault. So each GPU that starts being
remediated is *admitted* and remembered for ``window_s``; a GPU that would make the
GPUs admitted within the window more than ``max_fraction`` of the node's GPUs is
*held back* (at least one GPU per window is always allowed, so a node of one or two
GPUs still remediates). While a GPU is held back the breaker is **open**: nothing new
is evicted; it closes by itself when admitted GPUs leave the window and the held-back
ones fit again, or when their faults end. A GPU already admitted keeps being
remediated (pods retried after a PodDisruptionBudget refusal, a pod that arrives later).

The caller says it (a log line, an Event on the Node, the
``gpulet_allocator_remediation_breaker_open`` gauge and
``gpulet_allocator_remediation_breaker_trips_total`` counter)
on each transition: :meth:`Breaker.admit` answers whether the state changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    # The breaker opened (True) or closed (False) with this call; None: no change.
    changed: bool | None = None


class Breaker:
    def __init__(self, max_fraction: float, window_s: float, clock: Callable[[], float]) -> None:
        self.max_fraction = max_fraction
        self.window_s = window_s
        self._clock = clock
        self._admitted: dict[str, float] = {}
        self._held: set[str] = set()
        self.trips = 0

    @property
    def open(self) -> bool:
        return bool(self._held)

    @property
    def held(self) -> frozenset[str]:
        return frozenset(self._held)

    def limit(self, node_gpus: int) -> int:
        return max(1, math.floor(self.max_fraction * max(node_gpus, 0) + 1e-9))

    def in_window(self) -> list[str]:
        self._prune()
        return sorted(self._admitted)

    def _prune(self) -> None:
        now = self._clock()
        self._admitted = {g: t for g, t in self._admitted.items() if now - t < self.window_s}

    def admit(self, gpu: str, node_gpus: int) -> Verdict:
        """May remediation of ``gpu`` go on? Admits it when it fits."""
        was_open = self.open
        self._prune()
        if gpu in self._admitted:
            return Verdict(True)
        if len(self._admitted) + 1 <= self.limit(node_gpus):
            self._admitted[gpu] = self._clock()
            self._held.discard(gpu)
            return Verdict(True, False if was_open and not self.open else None)
        self._held.add(gpu)
        if not was_open:
            self.trips += 1
            return Verdict(False, True)
        return Verdict(False)

    def settle(self, faulty: Iterable[str]) -> bool | None:
        """Forget held-back GPUs whose fault ended; False when that closed the breaker."""
        was_open = self.open
        self._held &= set(faulty)
        return False if was_open and not self.open else None
