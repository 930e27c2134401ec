"""The node's circuit breaker: remediation never takes more than a set share of the
node's GPUs, nor evicts more than a set number of pods, nor follows one flapping GPU
more than a set number of times, within a window. Pure, on an injected wall clock;
its state is a :class:`BreakerState` the loop keeps in the node's KV, so a restart
inside the window does not admit a fresh batch.

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

Counting GPUs alone lets one GPU that flaps (a fault, a recovery, a fault again) evict
a pod every time, since an admitted GPU is always admitted again. So each *episode* (a
fault of a GPU that had none a moment before: :meth:`Breaker.settle` ends an episode)
counts too: a GPU with ``max_faults_per_gpu`` episodes within the window is held back
(0: no limit). And each accepted eviction counts: once ``max_evictions`` pods were
evicted within the window nothing more is (0: no limit).

The caller says it (a log line, an Event on the Node, the
``gpulet_allocator_remediation_breaker_open`` gauge and
``gpulet_allocator_remediation_breaker_trips_total`` counter)
on each transition: :meth:`Breaker.admit` answers whether the state changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

import msgspec

from gpulet_common.codec import Codec

# Remembered at most this many times per list (episodes of one GPU, evictions).
_KEPT: Final = 1000


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    # The breaker opened (True) or closed (False) with this call; None: no change.
    changed: bool | None = None


class BreakerState(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the breaker remembers, as kept in the KV (wall-clock seconds)."""

    admitted: dict[str, float] = {}
    episodes: dict[str, list[float]] = {}
    active: list[str] = []
    evictions: list[float] = []
    trips: int = 0
    # Not a remembered state: the one that could not be read. Restored, the window
    # counts as full of evictions from now (fail closed).
    full: bool = False


BREAKER_STATE = Codec(BreakerState)


class Breaker:
    def __init__(
        self,
        max_fraction: float,
        window_s: float,
        clock: Callable[[], float],
        *,
        max_faults_per_gpu: int = 0,
        max_evictions: int = 0,
    ) -> None:
        self.max_fraction = max_fraction
        self.window_s = window_s
        self.max_faults_per_gpu = max_faults_per_gpu
        self.max_evictions = max_evictions
        self._clock = clock
        self._admitted: dict[str, float] = {}
        self._episodes: dict[str, list[float]] = {}
        self._active: set[str] = set()
        self._evictions: list[float] = []
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

    def evictions_in_window(self) -> int:
        self._prune()
        return len(self._evictions)

    def _prune(self) -> None:
        now = self._clock()

        def fresh(t: float) -> bool:
            return now - t < self.window_s

        self._admitted = {g: t for g, t in self._admitted.items() if fresh(t)}
        self._episodes = {
            g: kept for g, ts in self._episodes.items() if (kept := [t for t in ts if fresh(t)])
        }
        self._evictions = [t for t in self._evictions if fresh(t)]

    def admit(self, gpu: str, node_gpus: int) -> Verdict:
        """May remediation of ``gpu`` go on? Admits it when it fits."""
        was_open = self.open
        self._prune()
        if gpu in self._active:
            return Verdict(True)
        flapping = (
            self.max_faults_per_gpu > 0
            and len(self._episodes.get(gpu, ())) >= self.max_faults_per_gpu
        )
        fits = gpu in self._admitted or len(self._admitted) + 1 <= self.limit(node_gpus)
        if fits and not flapping:
            now = self._clock()
            self._admitted.setdefault(gpu, now)
            self._episodes[gpu] = [*self._episodes.get(gpu, []), now][-_KEPT:]
            self._active.add(gpu)
            self._held.discard(gpu)
            return Verdict(True, False if was_open and not self.open else None)
        return self._hold(gpu, was_open)

    def _hold(self, gpu: str, was_open: bool) -> Verdict:
        self._held.add(gpu)
        if not was_open:
            self.trips += 1
            return Verdict(False, True)
        return Verdict(False)

    def may_evict(self) -> bool:
        """Whether one more pod may be evicted within the window."""
        return self.max_evictions <= 0 or self.evictions_in_window() < self.max_evictions

    def evicted(self) -> None:
        """One eviction was accepted."""
        self._evictions = [*self._evictions, self._clock()][-_KEPT:]

    def settle(self, faulty: Iterable[str]) -> bool | None:
        """Forget held-back GPUs whose fault ended, and end their episodes; False when
        that closed the breaker."""
        was_open = self.open
        faulty = set(faulty)
        self._held &= faulty
        self._active &= faulty
        return False if was_open and not self.open else None

    # --- kept across restarts -------------------------------------------------------------

    def state(self) -> BreakerState:
        self._prune()
        return BreakerState(
            admitted=dict(self._admitted),
            episodes={g: list(ts) for g, ts in self._episodes.items()},
            active=sorted(self._active),
            evictions=list(self._evictions),
            trips=self.trips,
        )

    def restore(self, state: BreakerState) -> None:
        """Take back what a previous run remembered (times in the future, from a clock
        that went back, count as now: they stay in the window longest)."""
        now = self._clock()

        def clamp(t: float) -> float:
            return min(t, now) if math.isfinite(t) else now

        self._admitted = {g: clamp(t) for g, t in state.admitted.items()}
        self._episodes = {g: [clamp(t) for t in ts][-_KEPT:] for g, ts in state.episodes.items()}
        self._active = set(state.active)
        self._evictions = [clamp(t) for t in state.evictions][-_KEPT:]
        self.trips = max(self.trips, state.trips)
        if state.full:
            self._evictions = [now] * max(self.max_evictions, 1)
            if self.max_evictions <= 0:
                self.max_evictions = 1
        self._prune()
