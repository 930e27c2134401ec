"""The checkpoint document sealed: a checksum over it, and decoding that takes only
what was written.

Why
---
A bit flipped in a snapshot used to load: a key that no longer names a field was
ignored (``"alocations"``: zero allocations, ``ok``), a digit changed was a different
GPU. Nothing told damage from data, so the GPUs of answered allocations looked free.

Rules
-----
* **Checksum.** :func:`encode` writes :class:`~.records.StoredState` with
  ``checksum`` = BLAKE2b-128 (hex) of the same document encoded with ``checksum: ""``.
  Both the snapshot and each journal record are such documents (a record has the
  journal's CRC32 around it as well).
* **Strict.** :func:`decode` decodes (size and depth bounded,
  :func:`gpulet_common.untrusted.json_typed`), encodes what it decoded again and
  requires the very bytes it was given: an unknown or renamed field, a key or value
  spelt another way, anything this build would not have written, is a corruption --
  at every level of the document, not just the top. Then the checksum must match.
  The cost: a document written by a *newer* gpulet with a field this build lacks
  fails closed (the allocator rebuilds from PodResources and the claims), which is
  the price of telling that file from a damaged one.
* **Older files.** A document with no ``checksum`` key at all (gpulet before the
  seal, which also lacks fields added since) is read as it always was (unknown fields
  ignored), once: :class:`Decoded` says ``legacy`` and the checkpoint rewrites it
  sealed at once. A document with an empty checksum is a corruption: no gpulet
  writes one. (One flipped bit cannot make a sealed document legacy: it would have
  to remove the key, and a flip inside the key leaves every value as written.)

Every refusal is a ``ValueError`` with the reason; nothing else escapes. :func:`seal`
and :func:`unseal` do the same for any Struct whose last field is
``checksum: str = ""`` (the DRA plugin's checkpoint is one).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final, TypeVar

import msgspec

from gpulet_allocator.state.records import STATE_VERSION, StoredState
from gpulet_common.untrusted import json_typed

# A checkpoint holds a few KiB per GPU; 64 MiB is far above any node's.
MAX_BYTES: Final = 64 << 20
# The deepest a StoredState nests (allocations -> grants -> lists) is under 10.
MAX_DEPTH: Final = 16

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StoredState)
_KEY: Final = b'"checksum":'  # the key; a value "checksum" is never followed by ':'


class _Header(msgspec.Struct):
    version: int


_header_decoder = msgspec.json.Decoder(_Header)
S = TypeVar("S", bound=msgspec.Struct)


def checksum(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def seal(value: S) -> bytes:
    """``value`` (a Struct whose last field is ``checksum: str = ""``) encoded with
    its checksum."""
    body = _encoder.encode(msgspec.structs.replace(value, checksum=""))
    return _encoder.encode(msgspec.structs.replace(value, checksum=checksum(body)))


def unseal(
    data: bytes, decoder: msgspec.json.Decoder[S], *, what: str, max_depth: int = MAX_DEPTH
) -> tuple[S, bool]:
    """The value of a sealed document (its ``checksum`` emptied) and whether it was an
    unsealed one of an older gpulet (module docstring); ValueError for anything else."""
    try:
        value = json_typed(data, decoder, max_bytes=MAX_BYTES, max_depth=max_depth)
        body = _encoder.encode(msgspec.structs.replace(value, checksum=""))
    except Exception as exc:  # total: UntrustedDocumentError, an encoder's error
        raise ValueError(f"invalid {what}: {exc}") from None
    if not getattr(value, "checksum", ""):
        if _KEY in data:
            raise ValueError(f"invalid {what}: an empty checksum")
        return value, True
    if _encoder.encode(value) != data:
        raise ValueError(f"invalid {what}: not as written (a field or value changed)")
    if checksum(body) != value.checksum:  # type: ignore[attr-defined]
        raise ValueError(f"invalid {what}: checksum mismatch")
    return msgspec.structs.replace(value, checksum=""), False


def encode(state: StoredState) -> bytes:
    """``state`` sealed (its ``checksum`` field is replaced)."""
    return seal(state)


@dataclass(frozen=True, slots=True)
class Decoded:
    state: StoredState
    #: Written by a gpulet before the seal (no checksum): rewrite it sealed.
    legacy: bool = False


def decode(data: bytes) -> Decoded:
    """A sealed (or older, unsealed) checkpoint document; ValueError for anything else."""
    try:
        version = json_typed(data, _header_decoder, max_bytes=MAX_BYTES, max_depth=MAX_DEPTH)
    except ValueError as exc:
        raise ValueError(f"not an allocator checkpoint: {exc}") from None
    if version.version != STATE_VERSION:
        raise ValueError(
            f"unsupported checkpoint version {version.version} (this build reads {STATE_VERSION})"
        )
    state, legacy = unseal(data, _decoder, what="allocator checkpoint")
    return Decoded(state, legacy)
