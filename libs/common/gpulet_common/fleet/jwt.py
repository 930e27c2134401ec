"""NATS JWT v2 claims, signed and verified with nkeys (Ed25519).

Why not a JWT library
---------------------
NATS JWTs are ordinary compact JWS tokens (``header.payload.signature``, base64url
without padding) whose header says ``"alg": "ed25519-nkey"`` and whose keys are
nkeys: ``iss`` is the signer's public nkey and the signature is its Ed25519 signature
of ``header.payload``. The only Python implementation on PyPI (``nats-jwt``) calls
itself "not well-tested and in the development stage", pins ``pytz<2025`` and pulls
four more packages; generic JWT libraries know neither nkeys nor NATS' claims. So this
module encodes the claims itself (msgspec Structs, the field names of
github.com/nats-io/jwt v2) and leaves all cryptography to the maintained ``nkeys``
package (NATS' own, over PyNaCl): key generation, seeds, public keys and signing.
What it writes is checked where it matters, by a real nats-server that must accept
the operator, account and user JWTs and enforce their permissions and revocations
(tests/fleet/), and by :func:`decode`, which verifies what :func:`encode` made.

Only the claims gpulet needs are modelled; :func:`decode` ignores the others, so a
JWT made by ``nsc`` decodes too.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time
from typing import Any, Literal, TypeVar

import msgspec
import nacl.exceptions
import nacl.signing
import nkeys

from gpulet_common.untrusted import json_typed

ALGORITHM = "ed25519-nkey"

# nkey roles, by the first character of a public key (and the second of a seed).
OPERATOR: int = nkeys.PREFIX_BYTE_OPERATOR
ACCOUNT: int = nkeys.PREFIX_BYTE_ACCOUNT
USER: int = nkeys.PREFIX_BYTE_USER
_ROLE_LETTER = {OPERATOR: "O", ACCOUNT: "A", USER: "U"}

NO_LIMIT = -1


class JwtError(Exception):
    """A token that is malformed, badly signed, expired or not what was expected."""


# --- claims (github.com/nats-io/jwt/v2 field names) -------------------------------


class Permission(msgspec.Struct, omit_defaults=True):
    allow: list[str] = []
    deny: list[str] = []


class Permissions(msgspec.Struct, omit_defaults=True):
    pub: Permission = msgspec.field(default_factory=Permission)
    sub: Permission = msgspec.field(default_factory=Permission)


class AccountLimits(msgspec.Struct, kw_only=True):
    subs: int = NO_LIMIT
    data: int = NO_LIMIT
    payload: int = NO_LIMIT
    imports: int = NO_LIMIT
    exports: int = NO_LIMIT
    wildcards: bool = True
    conn: int = NO_LIMIT
    leaf: int = NO_LIMIT
    # JetStream: 0 disables it for the account (the system account must not have it).
    mem_storage: int = 0
    disk_storage: int = 0
    streams: int = 0
    consumer: int = 0


class OperatorNats(msgspec.Struct, kw_only=True):
    signing_keys: list[str] = []
    system_account: str = ""
    type: Literal["operator"] = "operator"
    version: int = 2


class Mapping(msgspec.Struct, kw_only=True):
    subject: str
    weight: int = 100


class AccountNats(msgspec.Struct, kw_only=True):
    limits: AccountLimits = msgspec.field(default_factory=AccountLimits)
    default_permissions: Permissions = msgspec.field(default_factory=Permissions)
    # user public key (or "*") -> Unix time: that user's JWTs issued at or before it
    # are revoked.
    revocations: dict[str, int] = {}
    # Subject mappings: source subject -> weighted destinations.
    mappings: dict[str, list[Mapping]] = {}
    type: Literal["account"] = "account"
    version: int = 2


class UserNats(msgspec.Struct, kw_only=True):
    pub: Permission = msgspec.field(default_factory=Permission)
    sub: Permission = msgspec.field(default_factory=Permission)
    # Written even at their defaults (no omit_defaults here): a missing limit would
    # not mean "unlimited" to every reader.
    subs: int = NO_LIMIT
    data: int = NO_LIMIT
    payload: int = NO_LIMIT
    # STANDARD, LEAFNODE, WEBSOCKET, ...; empty: any.
    allowed_connection_types: list[str] = []
    type: Literal["user"] = "user"
    version: int = 2


# No omit_defaults on the claims: ``type`` and ``version`` are defaults, and a claim
# without ``nats.version`` is read as a version 1 JWT (signed differently).
class _Claims(msgspec.Struct, kw_only=True):
    jti: str = ""
    iat: int = 0
    iss: str = ""
    name: str = ""
    sub: str = ""
    exp: int = 0


class OperatorClaims(_Claims, kw_only=True):
    nats: OperatorNats = msgspec.field(default_factory=OperatorNats)


class AccountClaims(_Claims, kw_only=True):
    nats: AccountNats = msgspec.field(default_factory=AccountNats)


class UserClaims(_Claims, kw_only=True):
    nats: UserNats = msgspec.field(default_factory=UserNats)


Claims = OperatorClaims | AccountClaims | UserClaims
C = TypeVar("C", OperatorClaims, AccountClaims, UserClaims)

_ISSUER_ROLE: dict[type[_Claims], int] = {
    OperatorClaims: OPERATOR,
    AccountClaims: OPERATOR,
    UserClaims: ACCOUNT,
}
_SUBJECT_ROLE: dict[type[_Claims], int] = {
    OperatorClaims: OPERATOR,
    AccountClaims: ACCOUNT,
    UserClaims: USER,
}


class _JoseHeader(msgspec.Struct):
    typ: str
    alg: str


# --- keys ---------------------------------------------------------------------------


def new_keypair(role: int) -> nkeys.KeyPair:
    """A fresh key pair (operator, account or user) from 32 random bytes."""
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), role))


def from_seed(seed: str | bytes) -> nkeys.KeyPair:
    raw = seed.encode() if isinstance(seed, str) else seed
    try:
        return nkeys.from_seed(bytearray(raw.strip()))
    except (nkeys.NkeysError, ValueError, TypeError) as exc:
        raise JwtError(f"not an nkey seed: {exc}") from exc


def public_key(kp: nkeys.KeyPair) -> str:
    return str(kp.public_key.decode())


def seed_of(kp: nkeys.KeyPair) -> str:
    return bytes(kp.seed).decode()


def role_of(pub: str) -> int:
    """The role of a public nkey; JwtError unless it is a well-formed one."""
    try:
        raw = base64.b32decode(pub + "=" * (-len(pub) % 8))
    except (ValueError, TypeError) as exc:
        raise JwtError(f"not a public nkey: {pub!r}") from exc
    if len(raw) != 35:
        raise JwtError(f"not a public nkey: {pub!r}")
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if nkeys.crc16(bytearray(body)) != crc:
        raise JwtError(f"bad checksum in public nkey {pub!r}")
    role = body[0]
    if role not in _ROLE_LETTER:
        raise JwtError(f"public nkey {pub!r} is not an operator, account or user key")
    return int(role)


def _verify_key(pub: str) -> nacl.signing.VerifyKey:
    role_of(pub)
    raw = base64.b32decode(pub + "=" * (-len(pub) % 8))
    return nacl.signing.VerifyKey(raw[1:-2])


# --- encode / decode ------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise JwtError("malformed base64url") from exc


_HEADER = _b64(msgspec.json.encode(_JoseHeader(typ="JWT", alg=ALGORITHM)))


def encode(claims: C, signer: nkeys.KeyPair, *, now: float | None = None) -> str:
    """Sign ``claims`` with ``signer``: sets ``iss``, ``iat`` (if unset) and ``jti``."""
    issuer = public_key(signer)
    expected = _ISSUER_ROLE[type(claims)]
    if role_of(issuer) != expected:
        raise JwtError(
            f"{type(claims).__name__} must be signed by an "
            f"{'operator' if expected == OPERATOR else 'account'} key, not {issuer[:1]}..."
        )
    if role_of(claims.sub) != _SUBJECT_ROLE[type(claims)]:
        raise JwtError(f"{type(claims).__name__} cannot be about {claims.sub[:1]}... keys")
    claims = msgspec.structs.replace(
        claims, iss=issuer, iat=claims.iat or int(now if now is not None else time.time()), jti=""
    )
    # The id is the hash of the claims without it, as the Go library makes it.
    digest = hashlib.new("sha512_256", msgspec.json.encode(claims)).digest()
    claims = msgspec.structs.replace(claims, jti=base64.b32encode(digest).rstrip(b"=").decode())
    signing_input = f"{_HEADER}.{_b64(msgspec.json.encode(claims))}"
    signature = bytes(signer.sign(signing_input.encode()))
    return f"{signing_input}.{_b64(signature)}"


_MAX_PART = 1 << 20
_HEADER_DECODER = msgspec.json.Decoder(_JoseHeader)
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}


def _decoder(kind: type[C]) -> msgspec.json.Decoder[C]:
    """The one decoder of a kind of claims (made on first use)."""
    found = _DECODERS.get(kind)
    if found is None:
        found = _DECODERS[kind] = msgspec.json.Decoder(kind)
    return found


def decode(token: str, kind: type[C], *, now: float | None = None) -> C:
    """Decode and verify a JWT of the given kind; JwtError if anything is wrong.

    Checks the algorithm, the Ed25519 signature by ``iss``, that ``iss`` and ``sub``
    have the roles the kind requires, and expiry. Whether ``iss`` is *trusted* is the
    caller's question (compare it with the operator or account you expect).
    """
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise JwtError("a JWT has three dot-separated parts")
    try:
        header = json_typed(_unb64(parts[0]), _HEADER_DECODER, max_bytes=_MAX_PART, what="header")
        claims = json_typed(_unb64(parts[1]), _decoder(kind), max_bytes=_MAX_PART, what="claims")
    except ValueError as exc:  # UntrustedDocumentError; binascii.Error from _unb64
        raise JwtError(f"malformed JWT: {exc}") from exc
    if header.alg not in (ALGORITHM, "ed25519"):
        raise JwtError(f"unsupported JWT algorithm {header.alg!r}")
    if role_of(claims.iss) != _ISSUER_ROLE[kind]:
        raise JwtError(f"{kind.__name__} issued by the wrong kind of key {claims.iss[:1]}...")
    if role_of(claims.sub) != _SUBJECT_ROLE[kind]:
        raise JwtError(f"{kind.__name__} about the wrong kind of key {claims.sub[:1]}...")
    try:
        _verify_key(claims.iss).verify(f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2]))
    except nacl.exceptions.BadSignatureError as exc:
        raise JwtError("bad JWT signature") from exc
    except (ValueError, TypeError) as exc:
        raise JwtError(f"malformed JWT signature: {exc}") from exc
    if claims.exp and claims.exp <= (now if now is not None else time.time()):
        raise JwtError(f"JWT expired at {claims.exp}")
    return claims


# --- .creds files -------------------------------------------------------------------

_CREDS = """-----BEGIN NATS USER JWT-----
{jwt}
------END NATS USER JWT------

************************* IMPORTANT *************************
NKEY Seed printed below can be used to sign and prove identity.
NKEYs are sensitive and should be treated as secrets.

-----BEGIN USER NKEY SEED-----
{seed}
------END USER NKEY SEED------

*************************************************************
"""


def format_creds(user_jwt: str, seed: str) -> str:
    """A ``.creds`` file, as nsc writes it and nats-server / nats-py read it."""
    return _CREDS.format(jwt=user_jwt, seed=seed)


def parse_creds(text: str) -> tuple[str, str]:
    """(user JWT, seed) of a ``.creds`` file; JwtError if it is not one."""
    blocks: list[str] = []
    inside = False
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("-----BEGIN") and line.endswith("-----"):
            inside, current = True, []
        elif line.startswith("------END") and inside:
            inside = False
            blocks.append("".join(current))
        elif inside and line:
            current.append(line)
    if len(blocks) != 2 or not blocks[1].startswith("SU"):
        raise JwtError("not a NATS .creds file (a user JWT and a user seed)")
    return blocks[0], blocks[1]
