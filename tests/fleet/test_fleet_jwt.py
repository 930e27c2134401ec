"""NATS JWTs and the credential store (gpulet_common.fleet.jwt, .identity).

The real check of what these produce is a nats-server accepting them
(test_fleet_auth.py); these pin down decoding, verification and the store's rules.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from gpulet_common import subjects
from gpulet_common.fleet import jwt
from gpulet_common.fleet.identity import FLEET_ACCOUNT, IdentityError, IdentityStore


def _payload(token: str) -> dict[str, object]:
    part = token.split(".")[1]
    result: dict[str, object] = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    return result


def test_a_user_jwt_round_trips_and_names_its_signer() -> None:
    account = jwt.new_keypair(jwt.ACCOUNT)
    user = jwt.new_keypair(jwt.USER)
    claims = jwt.UserClaims(
        sub=jwt.public_key(user),
        name="node/a",
        nats=jwt.UserNats(pub=jwt.Permission(allow=["gpu.*.a"])),
    )
    token = jwt.encode(claims, account, now=1000)
    decoded = jwt.decode(token, jwt.UserClaims)
    assert decoded.iss == jwt.public_key(account)
    assert decoded.iat == 1000
    assert decoded.nats.pub.allow == ["gpu.*.a"]
    # What nats-server needs to read it as a version 2 JWT with explicit limits.
    nats = _payload(token)["nats"]
    assert isinstance(nats, dict)
    assert (nats["type"], nats["version"], nats["subs"], nats["data"]) == ("user", 2, -1, -1)
    assert decoded.jti
    assert decoded.jti == _payload(token)["jti"]


def test_a_tampered_or_wrongly_signed_jwt_is_refused() -> None:
    account = jwt.new_keypair(jwt.ACCOUNT)
    user = jwt.new_keypair(jwt.USER)
    token = jwt.encode(jwt.UserClaims(sub=jwt.public_key(user)), account)
    header, payload, signature = token.split(".")
    widened = dict(_payload(token), nats={"pub": {"allow": [">"]}, "type": "user", "version": 2})
    forged = base64.urlsafe_b64encode(json.dumps(widened).encode()).rstrip(b"=").decode()
    with pytest.raises(jwt.JwtError, match="signature"):
        jwt.decode(f"{header}.{forged}.{signature}", jwt.UserClaims)
    for bad in ("", "a.b", f"{header}.{payload}.!!!", f"{header}.e30.{signature}", "x.y.z"):
        with pytest.raises(jwt.JwtError):
            jwt.decode(bad, jwt.UserClaims)
    # A user JWT signed by another user (not an account) is refused on both ends.
    with pytest.raises(jwt.JwtError):
        jwt.encode(jwt.UserClaims(sub=jwt.public_key(user)), jwt.new_keypair(jwt.USER))
    with pytest.raises(jwt.JwtError, match="expired"):
        jwt.decode(
            jwt.encode(jwt.UserClaims(sub=jwt.public_key(user), exp=10), account, now=5),
            jwt.UserClaims,
            now=11,
        )


def test_public_keys_are_checked() -> None:
    user = jwt.public_key(jwt.new_keypair(jwt.USER))
    assert jwt.role_of(user) == jwt.USER
    flipped = user[:-1] + ("A" if user[-1] != "A" else "B")
    for bad in (flipped, "UABC", "not a key", ""):
        with pytest.raises(jwt.JwtError):
            jwt.role_of(bad)


def test_creds_files_round_trip() -> None:
    seed = jwt.seed_of(jwt.new_keypair(jwt.USER))
    text = jwt.format_creds("eyJ.a.b", seed)
    assert jwt.parse_creds(text) == ("eyJ.a.b", seed)
    with pytest.raises(jwt.JwtError):
        jwt.parse_creds("-----BEGIN NATS USER JWT-----\nx\n------END NATS USER JWT------\n")


def test_the_store_issues_rotates_and_revokes(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path / "store")
    store.init()
    seeds = sorted(p.name for p in (tmp_path / "store").rglob("*.seed"))
    assert seeds == ["GPULET.seed", "SYS.seed", "operator.seed"]
    assert all(p.stat().st_mode & 0o077 == 0 for p in (tmp_path / "store").rglob("*.seed"))
    store.init()  # idempotent: same keys
    assert sorted(p.name for p in (tmp_path / "store").rglob("*.seed")) == seeds

    first = store.issue("node", node="gpu-1.example", now=100)
    user_jwt, seed = jwt.parse_creds(first.creds)
    claims = jwt.decode(user_jwt, jwt.UserClaims)
    assert claims.iss == store.account_public_key(FLEET_ACCOUNT)
    assert claims.sub == jwt.public_key(jwt.from_seed(seed)) == first.public_key
    tok = subjects.token("gpu-1.example")
    assert claims.nats.pub.allow == [f"gpu.*.{tok}"]
    assert claims.nats.sub.allow == ["$LDS.>", f"_INBOX.fleet.{tok}.>"]
    assert claims.nats.allowed_connection_types == ["LEAFNODE"]

    second = store.issue("node", node="gpu-1.example", now=200)  # rotation
    assert second.public_key != first.public_key
    account = jwt.decode(store.account_jwt(FLEET_ACCOUNT), jwt.AccountClaims)
    assert account.nats.revocations == {first.public_key: 200}
    assert account.iss == jwt.public_key(store.operator_key())
    assert list(account.nats.mappings) == ["gpu.fleet.*"]

    assert store.revoke("node", node="gpu-1.example", now=300) == [second.public_key]
    account = jwt.decode(store.account_jwt(FLEET_ACCOUNT), jwt.AccountClaims)
    assert account.nats.revocations == {first.public_key: 200, second.public_key: 300}
    with pytest.raises(IdentityError):
        store.revoke("node", node="gpu-1.example")
    with pytest.raises(IdentityError):
        store.issue("node", node="")

    operator = jwt.decode(store.operator_jwt(), jwt.OperatorClaims)
    assert operator.nats.system_account == store.account_public_key("SYS")
    conf = store.hub_accounts_conf(resolver_dir="/x")
    assert store.account_public_key(FLEET_ACCOUNT) in conf
    for seed_file in (tmp_path / "store").rglob("*.seed"):  # no seed in the hub's config
        assert seed_file.read_text().strip() not in conf
