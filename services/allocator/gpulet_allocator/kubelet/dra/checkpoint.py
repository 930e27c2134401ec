"""The DRA plugin's checkpoint: which claims it prepared, and what it answered.

Why: kubelet calls Unprepare after our restarts too, possibly after the claim object
is gone from the API server; and it may call Prepare again for a claim already
prepared, expecting the same answer. So each prepared claim is written down (atomic
replace through :func:`gpulet_common.statefile.write_atomic`) before Prepare answers,
and removed after Unprepare released it.

Unprepare does not depend on the checkpoint: the ledger releases by claim UID and the
CDI spec's path is the UID's. The checkpoint makes Prepare's repeat answer cheap and
lets an operator see what is prepared. So it is written atomically (a reader sees the
old or the new file, never a mix) but not fsynced: on the 2-core machine under load
the two fsyncs of a durable write were half of Prepare's time (7.6 of 16 ms at the
median, bench/dra.py), for a file whose loss after a power cut costs nothing but a
re-read of the claims. For the same reason Prepare and Unprepare change the claims in
memory, on the event loop (:meth:`CheckpointFile.remember`,
:meth:`CheckpointFile.forget`; the writer's thread only reads them), and the
plugin's writer task writes the file after they answered, at the next lull in the calls
and at most a second later (:meth:`CheckpointFile.flush`, one write for every change
since the last, and once more when the plugin stops): even
unsynced, replacing the file cost 1-2 ms of each answer on ext4, whose rename over an
existing file flushes the new file's data (``auto_da_alloc``). What a Prepare answered
OK stands on is durable before it answers: the ledger's reservation (the allocator's
checkpoint) and the CDI spec. The file is sealed as the ledger's is
(:mod:`gpulet_allocator.state.seal`: a checksum, and only the bytes this build writes
are accepted; an older gpulet's unsealed file is read as before). A checkpoint that
fails its seal (an empty or damaged file after a power cut, a document nested too
deep, say) is kept aside (:func:`~gpulet_common.statefile.quarantine`) and the plugin
starts empty: it re-reads each claim kubelet names and the ledger answers by its UID
(the rebuild); it never fails to start over it. The ledger keeps its own, durable,
checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import msgspec

from gpulet_allocator.state.seal import seal, unseal
from gpulet_common.safefile import write_atomic
from gpulet_common.statefile import quarantine

log = logging.getLogger("gpulet.dra.checkpoint")

SCHEMA_VERSION = 1
MAX_CLAIMS = 4096
CHECKPOINT_MODE = 0o600
# plugins/<driver>/ when the checkpoint makes it: as kubelet makes its plugin dirs.
DIR_MODE = 0o750


class PreparedDevice(msgspec.Struct, frozen=True, kw_only=True):
    requests: list[str] = []
    pool: str
    device: str
    cdi_ids: list[str] = []
    # The allocation result's shareID (a share of a device that allows multiple
    # allocations), answered to kubelet so PodResources tells two shares apart.
    share_id: str = ""


class PreparedClaim(msgspec.Struct, frozen=True, kw_only=True):
    uid: str
    namespace: str
    name: str
    allocation: str = ""
    devices: list[PreparedDevice] = []
    # The node's boot ID when it was prepared (.sweep: a claim of an earlier boot is
    # checked with the API server at start, not a sweep interval later).
    boot_id: str = ""
    # GPU UUID -> [cores %, memory MiB] of the whole GPUs the claim configured for MPS
    # (their control daemon runs while the claim is prepared).
    mps: dict[str, list[int]] = {}


class Checkpoint(msgspec.Struct, kw_only=True):
    schema_version: int = SCHEMA_VERSION
    claims: Annotated[dict[str, PreparedClaim], msgspec.Meta(max_length=MAX_CLAIMS)] = {}
    # The seal (gpulet_allocator.state.seal): last, "" in an older gpulet's file.
    checksum: str = ""


_DECODER = msgspec.json.Decoder(Checkpoint)


def decode_claims(data: bytes) -> dict[str, PreparedClaim]:
    """The prepared claims of a checkpoint file's bytes; ValueError for anything that
    fails the seal or the checks."""
    loaded, _legacy = unseal(data, _DECODER, what="DRA checkpoint")
    if loaded.schema_version != SCHEMA_VERSION:
        raise ValueError(f"schema {loaded.schema_version}, this build reads {SCHEMA_VERSION}")
    if any(uid != claim.uid for uid, claim in loaded.claims.items()):
        raise ValueError("a claim is filed under another UID")
    return dict(loaded.claims)


class CheckpointFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, PreparedClaim] = {}
        # Changes in memory not yet written (remember / forget), and the last write's.
        self.pending = 0
        self.written = 0

    def load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.claims = {}
            return
        try:
            self.claims = decode_claims(data)
        except ValueError as exc:  # damaged, deep, huge: every failure
            kept = quarantine(self.path)
            log.warning("DRA checkpoint %s unreadable (%s): kept as %s", self.path, exc, kept)
            self.claims = {}

    def _save(self, claims: dict[str, PreparedClaim]) -> None:
        """Write ``claims`` (never replaced in place: :meth:`remember` and :meth:`forget`
        swap the dict, so a writer thread holds a consistent one). The claims held in
        memory are not touched: the event loop may have changed them meanwhile."""
        write_atomic(
            self.path,
            seal(Checkpoint(claims=claims)),
            mode=CHECKPOINT_MODE,
            dir_mode=DIR_MODE,
            durable=False,
        )

    def remember(self, claim: PreparedClaim) -> None:
        """Hold ``claim`` now; the file follows with the next :meth:`flush`."""
        if self.claims.get(claim.uid) != claim:
            self.claims = {**self.claims, claim.uid: claim}
            self.pending += 1

    def forget(self, uid: str) -> None:
        """Drop ``uid`` now; the file follows with the next :meth:`flush`."""
        if uid in self.claims:
            self.claims = {k: v for k, v in self.claims.items() if k != uid}
            self.pending += 1

    def flush(self) -> bool:
        """Write the claims held now if they changed since the last write; returns
        whether it wrote. Raises OSError (the changes stay pending)."""
        pending = self.pending
        if pending == self.written:
            return False
        self._save(self.claims)
        self.written = pending
        return True
