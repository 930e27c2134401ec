"""``gpulet fleet``: identities of a fleet's nodes, the hub's stream, the fleet view.

* ``init``, ``creds``, ``revoke``, ``hub-config``: offline, on the credential store
  (:mod:`gpulet_common.fleet.identity`); ``creds`` for an existing name rotates.
* ``push``: send the (re-signed) GPULET account JWT to a running hub as the system
  user, so a revocation takes effect at once (``$SYS.REQ.CLAIMS.UPDATE``; the hub's
  full resolver stores it and passes it on to the other hub servers).
* ``setup``: create or update the fleet stream and bucket on the hub (admin user).
* ``status``: the fleet view from the hub's bucket (viewer user).

Hub commands take the usual settings flags: ``--nats nats://hub:4222`` and
``--set nats.creds_file=FILE`` (or ``GPULET_NATS__CREDS_FILE``), and each role's inbox
prefix ``_INBOX.<role>`` is set for it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from gpulet_alerting import fleet_hub as hub
from gpulet_common.bus import Bus, BusError
from gpulet_common.cli_support import AddFlags, LoadSettings, bind, tool_nats
from gpulet_common.fleet.roles import FLEET_ACCOUNT, ROLES, Role
from gpulet_common.settings import Settings
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.untrusted import json_document

if TYPE_CHECKING:
    from gpulet_common.fleet.identity import IdentityStore

DEFAULT_STORE = "gpulet-fleet"


def _store(args: argparse.Namespace) -> IdentityStore:
    # Imported here: it needs nkeys (the `fleet` extra); the hub commands do not.
    from gpulet_common.fleet.identity import IdentityStore

    return IdentityStore(Path(args.store))


def _role(args: argparse.Namespace) -> tuple[Role, str]:
    if args.node:
        return "node", args.node
    role: Role = args.role
    return role, ""


def _write_out(text: str, out: str) -> None:
    if out == "-":
        sys.stdout.write(text)
        return
    from gpulet_common.safefile import write_atomic

    # A secret: mode 0600, never written through a symlink planted at --out.
    write_atomic(Path(out), text.encode(), mode=0o600)


def _cmd_init(args: argparse.Namespace, _load: LoadSettings) -> int:
    store = _store(args)
    store.init()
    print(f"fleet identities in {store.path} (keep its *.seed files secret and offline)")
    print(f"operator      {_pub(store.operator_key())}")
    for account in ("SYS", FLEET_ACCOUNT):
        print(f"account {account:<6}{store.account_public_key(account)}")
    return 0


def _pub(kp: Any) -> str:
    from gpulet_common.fleet import jwt

    return jwt.public_key(kp)


def _cmd_creds(args: argparse.Namespace, _load: LoadSettings) -> int:
    store = _store(args)
    role, node = _role(args)
    previous = store.active_user(store.user_name(role, node))
    credential = store.issue(role, node=node)
    out = args.out or f"{store.path}/creds/{credential.name.replace('/', '-')}.creds"
    _write_out(credential.creds, out)
    what = "rotated" if previous else "issued"
    print(
        f"{what} {credential.name}: {credential.public_key}"
        + (f" (revoked {previous.public_key})" if previous else "")
        + (f" -> {out}" if out != "-" else ""),
        file=sys.stderr,
    )
    if previous:
        print(
            "the old key is revoked in the account JWT: run `gpulet fleet push` "
            "(or reload the hub with a new hub-config)",
            file=sys.stderr,
        )
    return 0


def _cmd_revoke(args: argparse.Namespace, _load: LoadSettings) -> int:
    store = _store(args)
    role, node = _role(args)
    for key in store.revoke(role, node=node):
        print(f"revoked {store.user_name(role, node)}: {key}")
    print("run `gpulet fleet push` so the hub refuses it now", file=sys.stderr)
    return 0


def _cmd_hub_config(args: argparse.Namespace, _load: LoadSettings) -> int:
    _write_out(_store(args).hub_accounts_conf(resolver_dir=args.resolver_dir), args.out)
    return 0


def _hub_nats(settings: Settings, role: str) -> NatsSettings:
    nats_settings = tool_nats(settings)
    if nats_settings.inbox_prefix == "_INBOX":
        nats_settings = msgspec.structs.replace(nats_settings, inbox_prefix=f"_INBOX.{role}")
    return nats_settings


async def push(settings: NatsSettings, account_jwt: str, *, timeout_s: float = 5.0) -> str:
    """Send an account JWT to the hub (system user); returns the server's message."""
    async with Bus.connect(settings, name="gpulet-fleet-push", max_initial_attempts=3) as bus:
        try:
            reply = await bus.client.request(
                "$SYS.REQ.CLAIMS.UPDATE", account_jwt.encode(), timeout=timeout_s
            )
        except Exception as exc:
            raise BusError(f"no answer to the account update: {exc}") from exc
    try:
        body = json_document(reply.data, max_bytes=1 << 20, what="the hub's answer")
    except ValueError as exc:  # UntrustedDocumentError
        raise BusError(f"unreadable answer to the account update: {reply.data[:200]!r}") from exc
    if not isinstance(body, dict):
        raise BusError(f"unexpected answer to the account update: {body!r}")
    if body.get("error"):
        raise BusError(f"the hub refused the account update: {body['error']}")
    data = body.get("data") or {}
    return str(data.get("message", "updated")) if isinstance(data, dict) else "updated"


def _cmd_push(args: argparse.Namespace, load: LoadSettings) -> int:
    settings = load(args)
    account_jwt = _store(args).account_jwt(FLEET_ACCOUNT)
    try:
        message = anyio.run(lambda: push(_hub_nats(settings, "sys"), account_jwt))
    except BusError as exc:
        print(f"gpulet fleet push: {exc}", file=sys.stderr)
        return 1
    print(f"account {FLEET_ACCOUNT}: {message}")
    return 0


async def setup(settings: Settings) -> None:
    async with Bus.connect(
        _hub_nats(settings, "admin"), name="gpulet-fleet-setup", max_initial_attempts=3
    ) as bus:
        await hub.ensure_fleet_stream(bus, settings.fleet)
        await hub.ensure_fleet_bucket(bus, settings.fleet)


def _cmd_setup(args: argparse.Namespace, load: LoadSettings) -> int:
    settings = load(args)
    try:
        anyio.run(setup, settings)
    except Exception as exc:
        print(f"gpulet fleet setup: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"stream GPU_FLEET and bucket gpulet_fleet ready (R{settings.fleet.replicas})")
    return 0


async def status(settings: Settings) -> list[hub.FleetNodeStatus]:
    async with Bus.connect(
        _hub_nats(settings, "viewer"), name="gpulet-fleet-status", max_initial_attempts=3
    ) as bus:
        return await hub.read_fleet(bus)


def _cmd_status(args: argparse.Namespace, load: LoadSettings) -> int:
    settings = load(args)
    try:
        views = anyio.run(status, settings)
    except Exception as exc:
        print(f"gpulet fleet status: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    now = time.time()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "node": v.node,
                        "last_heard": v.last_heard,
                        "age_s": round(v.age(now), 3),
                        "stale": v.age(now) > settings.fleet.stale_after_s,
                        "status": msgspec.to_builtins(v.status) if v.status else None,
                        "problem": v.problem,
                    }
                    for v in views
                ],
                indent=2,
            )
        )
    else:
        print(hub.format_fleet(views, now=now, stale_after_s=settings.fleet.stale_after_s))
    return 0


def _guard(command: Any) -> Any:
    def run(args: argparse.Namespace, load: LoadSettings) -> int:
        try:
            from gpulet_common.fleet.identity import IdentityError
        except ModuleNotFoundError as exc:
            print(f"gpulet fleet: {exc}: install gpulet[fleet]", file=sys.stderr)
            return 2
        try:
            code: int = command(args, load)
        except IdentityError as exc:
            print(f"gpulet fleet: {exc}", file=sys.stderr)
            return 1
        return code

    return run


def add_commands(sub: Any, add_flags: AddFlags, load: LoadSettings) -> None:
    fleet = sub.add_parser("fleet", help="fleet scale: node credentials, hub stream, fleet view")
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True)

    def store_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--store",
            default=DEFAULT_STORE,
            help=f"credential store directory (default ./{DEFAULT_STORE}; keep it secret)",
        )

    p = fleet_sub.add_parser("init", help="create the operator and accounts (idempotent)")
    store_flag(p)
    p.set_defaults(func=bind(_guard(_cmd_init), load))

    p = fleet_sub.add_parser(
        "creds", help="issue a credential (.creds); again for the same name rotates it"
    )
    store_flag(p)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--node", help="a node's leaf credential (may publish gpu.*.<node> only)")
    who.add_argument("--role", choices=[r for r in ROLES if r != "node"], help="a hub user")
    p.add_argument("--out", help="file to write (- for stdout; default STORE/creds/NAME.creds)")
    p.set_defaults(func=bind(_guard(_cmd_creds), load))

    p = fleet_sub.add_parser("revoke", help="revoke a node's (or hub user's) credential")
    store_flag(p)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--node")
    who.add_argument("--role", choices=[r for r in ROLES if r != "node"])
    p.set_defaults(func=bind(_guard(_cmd_revoke), load))

    p = fleet_sub.add_parser(
        "hub-config", help="the hub's operator/resolver config (public keys and JWTs only)"
    )
    store_flag(p)
    p.add_argument("--resolver-dir", default="/data/jwt", help="the full resolver's directory")
    p.add_argument("--out", default="-", help="file to write (default stdout)")
    p.set_defaults(func=bind(_guard(_cmd_hub_config), load))

    p = fleet_sub.add_parser(
        "push", help="send the account JWT (revocations) to a running hub, as the sys user"
    )
    store_flag(p)
    add_flags(p)
    p.set_defaults(func=bind(_guard(_cmd_push), load))

    p = fleet_sub.add_parser("setup", help="create/update the hub's fleet stream and bucket")
    add_flags(p)
    p.set_defaults(func=bind(_cmd_setup, load))

    p = fleet_sub.add_parser("status", help="nodes seen, last heard, unhealthy GPUs (from the hub)")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_flags(p)
    p.set_defaults(func=bind(_cmd_status, load))
