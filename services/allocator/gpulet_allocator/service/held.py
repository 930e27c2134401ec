"""How many allocations the allocator holds, and who hears when its record changes.

Every decision that changes the record (an allocate, a release, a claim reserved or
released, an undo, a restore, a PodResources pass, a time-slicing change) calls
:meth:`HeldCount.changed`. It

* moves the ``gpulet.allocator.allocations`` gauge by the difference (the ledger's
  count is the size of its map: O(1), no walk);
* tells the long polls of the record (``withheld``, ``held``) that it may have
  changed: they read it again only while one of them waits, else at their next
  request (:meth:`~gpulet_allocator.service.withheld.WithheldFeed.follow`), so a
  decision nobody follows costs nothing there;
* rewrites ``/readyz``'s line once, when the count moved or the caller asks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.metrics import UpDownCounter

from gpulet_allocator.service.withheld import WithheldFeed


class HeldCount:
    def __init__(
        self,
        count: Callable[[], int],
        gauge: UpDownCounter,
        feeds: Sequence[WithheldFeed[Any]],
        update_status: Callable[[], None],
    ) -> None:
        self._count, self._gauge = count, gauge
        self._feeds, self._update_status = feeds, update_status
        #: The allocations held, as the gauge last said.
        self.held = 0

    def changed(self, *, status: bool = False) -> None:
        """The record may have changed; ``status``: rewrite ``/readyz``'s line even when
        the count did not move (a record change may end a loss)."""
        held = self._count()
        moved = held != self.held
        if moved:
            self._gauge.add(held - self.held)
            self.held = held
        for feed in self._feeds:
            feed.follow()
        if moved or status:
            self._update_status()
