"""What ``/readyz`` says of the allocator: ready only while it can allocate.

``blocked`` (503) while the record is lost and while the checkpoint cannot be written
(a failed write, or :meth:`AllocatorStatus.probe` of its directory), since every
Allocate is then refused; ``degraded`` without an inventory or with the handshake
failing; ready, the GPUs and the allocations held now.
"""

from __future__ import annotations

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.state.checkpoint import CheckpointFile
from gpulet_common.telemetry import StatusBoard


class AllocatorStatus:
    def __init__(self, board: StatusBoard, name: str, checkpoint: CheckpointFile) -> None:
        self._board = board
        self._name = name
        self._checkpoint = checkpoint
        #: The last failed checkpoint write (None: the last write succeeded).
        self.checkpoint_error: str | None = None
        #: The last probe of the checkpoint's directory (None: writable).
        self.probe_error: str | None = None

    def probe(self) -> bool:
        """Readiness must not wait for an Allocate to fail: is the checkpoint writable?
        Returns whether the answer changed."""
        try:
            self._checkpoint.probe()
        except OSError as exc:
            problem: str | None = f"cannot write the allocation checkpoint: {exc}"
        else:
            problem = None
        changed, self.probe_error = problem != self.probe_error, problem
        return changed

    def update(self, core: AllocatorCore, handshake_problem: str) -> None:
        board, name = self._board, self._name
        if core.lost is not None:
            board.set(name, "blocked", core.lost_refusal().message)
            return
        disk = self.checkpoint_error or self.probe_error
        if disk:
            # Every Allocate is refused (checkpoint_failed) meanwhile: not ready.
            board.set(name, "blocked", f"{disk}; Allocate is refused until it can be written")
        elif not core.ready:
            board.set(name, "degraded", "waiting for the GPU inventory (is the collector running?)")
        elif handshake_problem:
            board.set(name, "degraded", handshake_problem)
        else:
            held = core.ledger.count()
            board.set(name, "ready", f"{core.ledger.device_count()} GPUs, {held} allocations")
