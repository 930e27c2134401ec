"""Answers that leave only once the ledger's change is on disk (group commit).

Every decision that changes the ledger is answered only once the checkpoint holds it
(:class:`~gpulet_allocator.state.checkpoint.Committer`: one write covers every change
made while the previous write was in flight). Two kinds of caller wait for that:

* a NATS request (:meth:`Durable.answer`): the handler returns at once and a task of
  the service's task group sends the answer when the write is done, so nats.micro
  decides the next request meanwhile;
* a caller in the allocator's own process, the DRA kubelet plugin's
  :class:`~gpulet_allocator.service.claims.LocalClaimCore` (:meth:`Durable.settle`):
  it awaits the write itself.

A failed write fails exactly the changes it covered: a change with an ``undo`` is
undone and refused ``checkpoint_failed`` ("nothing was allocated"); one without (a
release) stays done in memory, and the next write retries it.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio.abc
from nats.micro.request import Request

from gpulet_allocator.decide.books import Undo
from gpulet_allocator.service.replies import Replies
from gpulet_allocator.state.checkpoint import CheckpointError, Committer
from gpulet_common.refusal import Refused


class Durable:
    def __init__(
        self,
        version: Callable[[], int],
        committer: Callable[[], Committer | None],
        task_group: Callable[[], anyio.abc.TaskGroup | None],
        replies: Replies,
        count_held: Callable[[], None],
    ) -> None:
        self._version = version
        self._committer = committer
        self._tg = task_group
        self._replies = replies
        self._count_held = count_held

    async def _failure(self, version: int, undo: Undo | None) -> str | None:
        """Wait until ``version`` is durable: None, or why it is not (undone if it can)."""
        committer = self._committer()
        assert committer is not None
        try:
            await committer.wait(version)
        except CheckpointError as exc:
            if undo is None:
                return f"{exc}; done in memory only, the next write will retry"
            undo()
            self._count_held()
            return f"{exc}; nothing was allocated"
        return None

    async def settle(self, undo: Undo | None) -> None:
        """Return once the ledger as it is now is on disk; raise ``checkpoint_failed``
        (after the undo) when its write failed."""
        if (failure := await self._failure(self._version(), undo)) is not None:
            raise Refused("checkpoint_failed", failure)

    async def answer(
        self,
        req: Request,
        endpoint: str,
        data: bytes,
        started: float,
        undo: Undo | None,
        on_answer: Callable[[], None] = lambda: None,
    ) -> None:
        """Answer ``req`` with ``data`` once the state it reflects is on disk.

        ``on_answer`` runs just before ``data`` is sent (not when a failed write
        replaces it with a refusal).
        """
        committer, version, tg = self._committer(), self._version(), self._tg()
        assert committer is not None
        assert tg is not None
        if committer.durable >= version:
            on_answer()
            await self._replies.ok(req, endpoint, data, started)
            return

        async def when_durable() -> None:
            failure = await self._failure(version, undo)
            if failure is not None:
                await self._replies.reject(req, endpoint, "checkpoint_failed", failure, started)
                return
            on_answer()
            await self._replies.ok(req, endpoint, data, started)

        tg.start_soon(when_durable)
