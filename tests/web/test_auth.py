"""Principals: the TOML file, bearer authentication, scope/role/holder authorization."""

from __future__ import annotations

import hashlib
import stat
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.errors import Forbidden, Unauthorized
from kvsp.web.auth import (
    Principal,
    Principals,
    PrincipalsError,
    dump_principals,
    ensure_default_principals,
    may_publish_for,
    may_use_scope,
    mint_token,
    principal_entry,
    require_publish_for,
    require_role,
    require_scope,
    token_sha256,
    write_principals,
)
from kvsp.web.clock import ManualClock, SystemClock
from kvsp.web.testing import InProcessClient

SCOPE_A = bytes(16)
SCOPE_B = bytes([1]) * 16
HOLDER = "https://h1.example/kvsp/"
HASH = "ab" * 32

FILE = f"""
[[principal]]
name = "holder-1"
token_sha256 = "{token_sha256("tok-holder")}"
roles = ["holder"]
scopes = ["{SCOPE_A.hex()}"]
holders = ["{HOLDER}"]

[[principal]]
name = "pc"
token_sha256 = "{token_sha256("tok-pc")}"
roles = ["pc", "client"]
scopes = ["*"]

[[principal]]
name = "temp"
token_sha256 = "{token_sha256("tok-temp")}"
roles = ["client"]
scopes = []
expires = 1970-01-01T00:00:10Z
"""


@pytest.fixture
def loaded(tmp_path: Path) -> Principals:
    path = tmp_path / "principals.toml"
    path.write_text(FILE)
    return Principals.load(path)


def test_load_and_authenticate(loaded: Principals) -> None:
    assert len(loaded) == 3
    holder = loaded.authenticate("Bearer tok-holder", now_ms=0)
    assert holder.name == "holder-1"
    assert holder.roles == {"holder"}
    assert holder.scopes == frozenset({SCOPE_A})
    assert holder.holders == {HOLDER}
    assert holder.expires_ms is None
    assert "tok-holder" not in repr(holder)
    pc = loaded.authenticate("bearer   tok-pc", now_ms=0)
    assert pc.scopes is None


def test_expiry_is_exclusive(loaded: Principals) -> None:
    assert loaded.authenticate("Bearer tok-temp", now_ms=9_999).name == "temp"
    with pytest.raises(Unauthorized, match="expired"):
        loaded.authenticate("Bearer tok-temp", now_ms=10_000)


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Basic dG9rLXBj", "tok-pc", "Bearer tok-pc extra",
     "Bearer tok\u00e9", "Bearer tok-unknown", "Bearertok-pc"],
)  # fmt: skip
def test_authenticate_refuses(loaded: Principals, header: str | None) -> None:
    with pytest.raises(Unauthorized):
        loaded.authenticate(header, now_ms=0)


def test_authorization_rules(loaded: Principals) -> None:
    holder = loaded.authenticate("Bearer tok-holder", 0)
    assert may_use_scope(holder, SCOPE_A)
    assert not may_use_scope(holder, SCOPE_B)
    require_scope(holder, SCOPE_A)
    with pytest.raises(Forbidden):
        require_scope(holder, SCOPE_B)
    assert may_publish_for(holder, HOLDER)
    assert not may_publish_for(holder, HOLDER + "x")  # exact match, no prefixes
    assert not may_publish_for(holder, "https://h1.example/")
    with pytest.raises(Forbidden):
        require_publish_for(holder, "https://h2.example/kvsp/")
    require_role(holder, "holder")
    require_role(holder, "client", "holder")
    with pytest.raises(Forbidden):
        require_role(holder, "pc")


def test_admin_has_every_role_and_publishes_for_all() -> None:
    admin = Principal(name="root", roles=frozenset({"admin"}), scopes=frozenset())
    require_role(admin, "pc")
    assert may_publish_for(admin, HOLDER)
    assert not may_use_scope(admin, SCOPE_A)  # scopes stay explicit


def _one(extra: str, name: str = "a", token_hash: str = HASH) -> str:
    return f"[[principal]]\nname = '{name}'\ntoken_sha256 = '{token_hash}'\n{extra}\n"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("principal = 3", "principal"),
        ("[[principal]]\ntoken_sha256 = '" + HASH + "'", "principal[0].name"),
        (_one("", token_hash="AB"), "principal[0].token_sha256"),
        (_one("roles = ['root']"), "principal[0].roles[0]"),
        (_one("roles = 'pc'"), "principal[0].roles"),
        (_one("scopes = ['00']"), "principal[0].scopes[0]"),
        (_one(f"scopes = ['*', '{SCOPE_A.hex()}']"), "principal[0].scopes"),
        (_one("holders = [1]"), "principal[0].holders[0]"),
        (_one("expires = 2020-01-01T00:00:00"), "principal[0].expires"),
        (_one("") + _one("", token_hash="cd" * 32), "principal[1].name"),
        (_one("") + _one("", name="b"), "principal[1].token_sha256"),
    ],
)
def test_load_errors_name_file_and_path(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(PrincipalsError) as info:
        Principals.load(path)
    assert info.value.path == where
    assert str(path) in str(info.value)


def test_load_errors_never_echo_contents(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[[principal]]\nname = 'a'\ntoken_sha256 = 'secret-looking-value'\n")
    with pytest.raises(PrincipalsError) as info:
        Principals.load(path)
    assert "secret-looking-value" not in str(info.value)
    path.write_text("token = 'secret-looking-value\n")
    with pytest.raises(PrincipalsError) as info:
        Principals.load(path)
    assert "secret-looking-value" not in str(info.value)
    with pytest.raises(PrincipalsError, match="cannot read"):
        Principals.load(tmp_path / "absent.toml")


def test_write_and_load_round_trip(tmp_path: Path) -> None:
    token = mint_token()
    assert len(token) >= 43
    entry = principal_entry("h1", token, ["holder"], [SCOPE_B, SCOPE_A], [HOLDER], expires_ms=5)
    path = tmp_path / "principals.toml"
    write_principals(path, [entry])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token not in path.read_text()
    p = Principals.load(path).authenticate(f"Bearer {token}", now_ms=4)
    assert (p.name, p.holders, p.expires_ms) == ("h1", frozenset({HOLDER}), 5)
    assert p.scopes == frozenset({SCOPE_A, SCOPE_B})
    assert [f.name for f in tmp_path.iterdir()] == ["principals.toml"]


@given(st.text(min_size=1, max_size=30), st.lists(st.text(max_size=30), max_size=3))
def test_toml_writer_round_trips_any_text(name: str, holders: list[str]) -> None:
    entry = principal_entry(name, "t", ["client"], None, holders)
    doc = tomllib.loads(dump_principals([entry]))
    assert doc["principal"] == [entry]


def test_ensure_default_principals(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path, token_path = ensure_default_principals(state)
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = token_path.read_text().strip()
    admin = Principals.load(path).authenticate(f"Bearer {token}", 0)
    assert admin.roles == {"admin"}
    assert admin.scopes is None
    before = path.read_bytes()
    assert ensure_default_principals(state) == (path, token_path)
    assert path.read_bytes() == before  # an existing file is left alone
    assert hashlib.sha256(token.encode()).hexdigest() in before.decode()


def test_principal_of_in_a_handler(
    client: InProcessClient, clock: ManualClock, client_auth: dict[str, str], client_scope: bytes
) -> None:
    auth = client_auth
    assert client.get("/whoami", headers=auth).json() == {"name": "c1"}
    assert client.get(f"/whoami?scope={client_scope.hex()}", headers=auth).status_code == 200
    other = client.get(f"/whoami?scope={SCOPE_B.hex()}", headers=auth)
    assert other.status_code == 403
    assert other.json()["type"].endswith("kvsp-forbidden")
    anonymous = client.get("/whoami")
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    clock.advance(1_000_000)  # the principal expires at 2,000,000 ms
    assert client.get("/whoami", headers=auth).status_code == 401


def test_clocks() -> None:
    clock = ManualClock(5)
    assert clock.advance(10) == 15
    with pytest.raises(ValueError):
        clock.advance(-1)
    clock.set(3)
    assert clock.now_ms() == 3
    assert SystemClock().now_ms() > 1_600_000_000_000
