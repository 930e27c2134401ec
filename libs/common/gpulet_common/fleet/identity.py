"""The fleet's NATS identities: operator, accounts and one user per node.

Design
------
NATS decentralised auth (docs/fleet.md says why it, and not auth callout): an
*operator* signs *accounts*, an account signs its *users*, each a JWT naming an nkey.
The hub servers trust the operator and hold the account JWTs (a ``full`` resolver,
preloaded from :meth:`IdentityStore.hub_accounts_conf`); a user proves its identity by
signing the server's nonce with its seed, so no secret of a user is ever on the hub.

The store is one directory (``gpulet fleet --store DIR``, mode 0700):

* ``operator.seed``, ``accounts/<NAME>.seed``: the signing keys. Keep the directory
  offline (or in a secret manager); the hub never needs it.
* ``ledger.json``: every user issued (name, role, node, public key, when) and the
  account's revocations. Account JWTs are re-signed from it on every change, so the
  JWTs are a function of the ledger and the seeds.

Accounts: ``SYS`` (the system account; its ``sys`` user pushes account updates to a
running hub, ``$SYS.REQ.CLAIMS.UPDATE``) and ``GPULET`` (JetStream enabled), where
every gpulet user lives:

* ``node`` (one per node, LEAFNODE connections only): may publish ``gpu.*.<node>``
  only (its data, ``gpu.events.<node>`` for its relay, ``gpu.fleet.<node>`` for its
  status, which the account maps onto the fleet bucket's key ``<node>``); may receive
  only ``$LDS.>`` (the leaf protocol's loop detection) and its relay's acks on
  ``_INBOX.fleet.<node>.>``, so the hub sends nothing else down its leaf connection.
* ``alerts``: the durable consumer of the fleet stream (``gpulet alerts --hub``).
* ``viewer``: reads the fleet KV bucket and ``gpu.>`` (``gpulet fleet status``,
  ``gpulet watch``).
* ``admin``: creates and updates the fleet stream and bucket (``gpulet fleet setup``).

Rotating a node's credential issues a new key pair and revokes the old public key;
revoking writes the key into the account's ``revocations`` with the current time
(every JWT of that key issued until then is refused) and re-signs the account JWT,
which must then reach the hub (:meth:`push` or a config reload with the new preload).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nkeys

from gpulet_common import subjects
from gpulet_common.fleet import jwt
from gpulet_common.fleet.roles import FLEET_ACCOUNT, ROLES, SYSTEM_ACCOUNT, Role
from gpulet_common.safefile import write_atomic
from gpulet_common.untrusted import json_typed

__all__ = ["FLEET_ACCOUNT", "ROLES", "SYSTEM_ACCOUNT", "Credential", "IdentityStore", "Role"]


class IdentityError(Exception):
    pass


class IssuedUser(msgspec.Struct, kw_only=True):
    name: str
    role: Role
    public_key: str
    issued_at: int
    node: str = ""
    revoked_at: int = 0


class CredentialLedger(msgspec.Struct, kw_only=True):
    users: list[IssuedUser] = []
    # public key -> Unix time (the account's revocations).
    revocations: dict[str, int] = {}


_LEDGER = msgspec.json.Decoder(CredentialLedger)


def _consumer_rights(stream: str) -> list[str]:
    """What any user that reads ``stream`` through a consumer of its own publishes."""
    return [
        "$JS.API.INFO",
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.*",
    ]


def _may(
    pub: list[str], sub: list[str], *, connection_types: list[str] | None = None
) -> jwt.UserNats:
    """A user who may publish on ``pub`` and subscribe to ``sub``, and nothing else."""
    return jwt.UserNats(
        pub=jwt.Permission(allow=pub),
        sub=jwt.Permission(allow=sub),
        allowed_connection_types=connection_types or [],
    )


def user_permissions(role: Role, node: str = "") -> jwt.UserNats:
    """What a user of each role may do on the hub."""
    inbox = f"_INBOX.{role}.>"
    stream = subjects.FLEET_STREAM
    bucket = subjects.FLEET_KV_BUCKET
    kv_stream = f"KV_{bucket}"
    if role == "node":
        if not node:
            raise IdentityError("a node user needs its node name")
        tok = subjects.token(node)
        return _may(
            [f"gpu.*.{tok}"],
            # From the hub: the leaf protocol's loop detection and the fleet stream's
            # acks to this node's relay (its own inbox prefix); nothing else.
            ["$LDS.>", f"{subjects.fleet_relay_inbox(node)}.>"],
            connection_types=["LEAFNODE"],
        )
    if role == "alerts":
        return _may(
            [
                *_consumer_rights(stream),
                f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*",
                f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
                f"$JS.ACK.{stream}.>",
            ],
            [inbox],
        )
    if role == "viewer":
        return _may(
            [
                *_consumer_rights(kv_stream),
                f"$JS.API.STREAM.INFO.{stream}",
                f"$JS.API.DIRECT.GET.{kv_stream}",
                f"$JS.API.DIRECT.GET.{kv_stream}.>",
                f"$JS.API.STREAM.MSG.GET.{kv_stream}",
                f"$JS.API.CONSUMER.DELETE.{kv_stream}.*",
                # Flow control replies of the bucket watch (an ordered consumer).
                f"$JS.FC.{kv_stream}.>",
            ],
            ["gpu.>", inbox],
        )
    if role == "admin":
        return _may(["$JS.API.>"], [inbox])
    # sys: in the system account, for $SYS.REQ.CLAIMS.UPDATE and server monitoring.
    return _may(["$SYS.REQ.>"], [inbox])


def fleet_mappings() -> dict[str, list[jwt.Mapping]]:
    """The GPULET account's subject mappings: a node's status, published on
    ``gpu.fleet.<node>``, is stored as key ``<node>`` of the fleet bucket. (A leaf
    connection between two JetStream domains never carries ``$KV.>``, so the node
    cannot write the bucket's subject itself; and ``gpu.*.<node>`` is all it may
    publish.)"""
    return {
        subjects.fleet_status("*"): [
            jwt.Mapping(subject=f"$KV.{subjects.FLEET_KV_BUCKET}.{{{{wildcard(1)}}}}")
        ]
    }


@dataclass(frozen=True)
class Credential:
    name: str
    role: Role
    public_key: str
    creds: str  # the .creds file text (user JWT + seed): a secret


class IdentityStore:
    """The operator, account and user keys of one fleet, in one directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    # -- files ------------------------------------------------------------------

    @property
    def exists(self) -> bool:
        return (self.path / "operator.seed").exists()

    def _write_secret(self, rel: str, text: str) -> None:
        target = self.path / rel
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Mode 0600, a random temporary name, never through a symlink (safefile).
        write_atomic(target, text.encode(), mode=0o600)

    def _read(self, rel: str) -> str:
        try:
            return (self.path / rel).read_text().strip()
        except FileNotFoundError as exc:
            raise IdentityError(
                f"{self.path / rel} is missing: run `gpulet fleet init --store {self.path}`"
            ) from exc

    def _keypair(self, rel: str) -> nkeys.KeyPair:
        try:
            return jwt.from_seed(self._read(rel))
        except jwt.JwtError as exc:
            raise IdentityError(f"{self.path / rel}: {exc}") from exc

    def ledger(self) -> CredentialLedger:
        path = self.path / "ledger.json"
        if not path.exists():
            return CredentialLedger()
        try:
            return json_typed(path.read_bytes(), _LEDGER, what=str(path))
        except ValueError as exc:  # UntrustedDocumentError: bad, deep or huge
            raise IdentityError(f"{path} is corrupt: {exc}") from exc

    def _save_ledger(self, ledger: CredentialLedger) -> None:
        text = json.dumps(msgspec.to_builtins(ledger), indent=1, sort_keys=True)
        self._write_secret("ledger.json", text + "\n")

    # -- the operator and accounts ---------------------------------------------

    def init(self) -> None:
        """Create the operator and both accounts (idempotent: keeps existing keys)."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        for rel, role in (
            ("operator.seed", jwt.OPERATOR),
            (f"accounts/{SYSTEM_ACCOUNT}.seed", jwt.ACCOUNT),
            (f"accounts/{FLEET_ACCOUNT}.seed", jwt.ACCOUNT),
        ):
            if not (self.path / rel).exists():
                self._write_secret(rel, jwt.seed_of(jwt.new_keypair(role)) + "\n")
        if not (self.path / "ledger.json").exists():
            self._save_ledger(CredentialLedger())

    def operator_key(self) -> nkeys.KeyPair:
        return self._keypair("operator.seed")

    def account_key(self, account: str) -> nkeys.KeyPair:
        return self._keypair(f"accounts/{account}.seed")

    def account_public_key(self, account: str) -> str:
        return jwt.public_key(self.account_key(account))

    def operator_jwt(self) -> str:
        op = self.operator_key()
        claims = jwt.OperatorClaims(
            sub=jwt.public_key(op),
            name="gpulet",
            nats=jwt.OperatorNats(system_account=self.account_public_key(SYSTEM_ACCOUNT)),
        )
        return jwt.encode(claims, op)

    def account_jwt(self, account: str, *, now: float | None = None) -> str:
        limits = (
            jwt.AccountLimits()
            if account == SYSTEM_ACCOUNT
            else jwt.AccountLimits(
                mem_storage=jwt.NO_LIMIT,
                disk_storage=jwt.NO_LIMIT,
                streams=jwt.NO_LIMIT,
                consumer=jwt.NO_LIMIT,
            )
        )
        revocations = self.ledger().revocations if account == FLEET_ACCOUNT else {}
        claims = jwt.AccountClaims(
            sub=self.account_public_key(account),
            name=account,
            nats=jwt.AccountNats(
                limits=limits,
                revocations=dict(revocations),
                mappings=fleet_mappings() if account == FLEET_ACCOUNT else {},
            ),
        )
        return jwt.encode(claims, self.operator_key(), now=now)

    def hub_accounts_conf(self, *, resolver_dir: str = "/data/jwt") -> str:
        """The hub's operator, system account and resolver (with both accounts
        preloaded): a nats-server config fragment with public data only."""
        sys_pub = self.account_public_key(SYSTEM_ACCOUNT)
        fleet_pub = self.account_public_key(FLEET_ACCOUNT)
        return (
            "# Generated by `gpulet fleet hub-config`: public keys and JWTs only.\n"
            f"# {SYSTEM_ACCOUNT} = {sys_pub}, {FLEET_ACCOUNT} = {fleet_pub}\n"
            f'operator: "{self.operator_jwt()}"\n'
            f"system_account: {sys_pub}\n"
            "resolver: {\n"
            "  type: full\n"
            f'  dir: "{resolver_dir}"\n'
            "  allow_delete: false\n"
            '  interval: "2m"\n'
            '  timeout: "5s"\n'
            "}\n"
            "resolver_preload: {\n"
            f'  {sys_pub}: "{self.account_jwt(SYSTEM_ACCOUNT)}"\n'
            f'  {fleet_pub}: "{self.account_jwt(FLEET_ACCOUNT)}"\n'
            "}\n"
        )

    # -- users ------------------------------------------------------------------

    @staticmethod
    def user_name(role: Role, node: str = "") -> str:
        return f"node/{node}" if role == "node" else role

    def active_user(self, name: str) -> IssuedUser | None:
        for user in self.ledger().users:
            if user.name == name and not user.revoked_at:
                return user
        return None

    def issue(self, role: Role, *, node: str = "", now: float | None = None) -> Credential:
        """A new key pair and user JWT; the previous one of the same name is revoked
        (so issuing again is rotating). Returns the .creds text; the seed is not kept."""
        if role not in ROLES:
            raise IdentityError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
        if role == "node":
            if not node:
                raise IdentityError("--node is required")
            subjects.token(node)  # an empty name raises
        issued = int(now if now is not None else time.time())
        name = self.user_name(role, node)
        account = SYSTEM_ACCOUNT if role == "sys" else FLEET_ACCOUNT
        user = jwt.new_keypair(jwt.USER)
        claims = jwt.UserClaims(
            sub=jwt.public_key(user), name=name, nats=user_permissions(role, node)
        )
        token = jwt.encode(claims, self.account_key(account), now=issued)
        # A revocation names a public key: the previous key's revocation cannot touch
        # the new one, whenever it was issued.
        ledger = self.ledger()
        for old in [u for u in ledger.users if u.name == name and not u.revoked_at]:
            self._revoke_in(ledger, old, issued)
        ledger.users.append(
            IssuedUser(name=name, role=role, public_key=claims.sub, issued_at=issued, node=node)
        )
        self._save_ledger(ledger)
        return Credential(name, role, claims.sub, jwt.format_creds(token, jwt.seed_of(user)))

    @staticmethod
    def _revoke_in(ledger: CredentialLedger, user: IssuedUser, at: int) -> None:
        user.revoked_at = at
        if user.role != "sys":
            ledger.revocations[user.public_key] = at

    def revoke(self, role: Role, *, node: str = "", now: float | None = None) -> list[str]:
        """Revoke every active credential of the user; returns their public keys."""
        name = self.user_name(role, node)
        ledger = self.ledger()
        at = int(now if now is not None else time.time())
        revoked = []
        for user in ledger.users:
            if user.name == name and not user.revoked_at:
                self._revoke_in(ledger, user, at)
                revoked.append(user.public_key)
        if not revoked:
            raise IdentityError(f"no active credential for {name!r}")
        self._save_ledger(ledger)
        return revoked
