"""Ordering one sender's messages by its own sequence, never by its clock.

Why
---
A timestamp in a message is whatever its sender wrote: one event dated ``1e18``
made every later, true one look old, and consumers that kept "the newest
``observed_at``" believed it for ever. Late delivery is real too: after a NATS
outage, sample batches taken before it arrive after newer ones, and a GPU that went
lost flapped lost/recovered once a second. So consumers order by a sequence instead:

* the **KV revision** (health state, :mod:`gpulet_common.nodeview`) or the stream
  sequence: assigned by the server, a sender cannot forge one;
* the **collector's own sequence** on :class:`~gpulet_common.messages.Inventory` and
  :class:`~gpulet_common.messages.SampleBatch`: ``seq`` counts the collector's
  messages from 1 and ``boot_id`` names the collector process (random per start).

The rule (:class:`SenderOrder`)
-------------------------------
A message is accepted when its ``seq`` is greater than the last one accepted *from
the same boot*. A restarted collector has a new ``boot_id`` and is accepted from its
first message: a restart never makes a consumer ignore it. The last sequence of the
:data:`MAX_BOOTS` most recent boots is kept, so a late message of a previous boot is
still dropped when it is older than what was seen of it, and a message forged with a
made-up boot cannot evict the real one's record until many boots were seen. ``seq``
0 is a sender that does not sequence (an older collector): accepted, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

MAX_BOOTS: Final = 8


class SenderOrder:
    """Which of one sender's messages are new (see the module docstring)."""

    def __init__(self, max_boots: int = MAX_BOOTS) -> None:
        self._last: OrderedDict[str, int] = OrderedDict()
        self._max_boots = max_boots

    def accept(self, boot_id: str, seq: int) -> bool:
        """True for a message newer than every one accepted from its boot."""
        if seq <= 0:
            return True
        last = self._last.get(boot_id)
        if last is not None and seq <= last:
            return False
        self._last[boot_id] = seq
        self._last.move_to_end(boot_id)
        while len(self._last) > self._max_boots:
            self._last.popitem(last=False)
        return True
