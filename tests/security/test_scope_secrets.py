"""What scopes and tokens promise beyond the matrix (spec §6.1, §6.2; DESIGN.md §3):

* a lookup of another scope's keys is indistinguishable from a miss: same status, headers
  and body octets;
* a record naming a holder the principal may not publish for is refused, in its own scope too;
* tokens are looked up by their SHA-256 and the decision is ``hmac.compare_digest``, so the
  lookup never compares a presented token with a stored one octet by octet;
* neither the principals file nor any token or token hash reaches a log, in-process at DEBUG
  or from a real ``kvsp serve index`` process at ``--log-level debug``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.errors import Unauthorized
from kvsp.web import auth
from kvsp.web.auth import (
    Principals,
    PrincipalsError,
    ensure_default_principals,
    principal_entry,
    write_principals,
)
from kvsp.web.testing import start_process
from tests.support.authz import (
    COMPAT,
    FRESH,
    H_URI,
    SCOPES,
    STORED,
    bearer,
    index_env,
    record_json,
    replica_path,
    token,
)

pytestmark = pytest.mark.timeout(60)


def lookup(side: str, key: bytes, targets: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "scope_id": SCOPES[side].hex(),
        "compat_id": COMPAT.hex(),
        "block_keys": [key.hex(), (b"\x33" * 32).hex()],
    }
    if targets:
        body["targets"] = ["http://ii.test/"]
    return body


@pytest.mark.parametrize("targets", [False, True], ids=["plain", "with targets"])
def test_another_scopes_keys_look_like_a_miss(tmp_path: Path, targets: bool) -> None:
    async def scenario() -> list[httpx.Response]:
        async with index_env(tmp_path) as env:
            answers = []
            for side, key in (("other", STORED), ("other", FRESH), ("own", FRESH)):
                answers.append(
                    await env.http.post(
                        "lookup", json=lookup(side, key, targets), headers=bearer("client")
                    )
                )
            hit = await env.http.post(
                "lookup", json=lookup("own", STORED), headers=bearer("client")
            )
            assert hit.json()["matched"] == 1  # the stored key is really there, in both scopes
            other_hit = await env.http.post(
                "lookup", json=lookup("other", STORED), headers=bearer("root")
            )
            assert other_hit.json()["matched"] == 1
            return answers

    hidden, miss_other, miss_own = asyncio.run(scenario())
    for answer in (hidden, miss_other, miss_own):
        assert answer.status_code == 200
        assert answer.json()["matched"] == 0
    assert hidden.content == miss_other.content == miss_own.content
    for name in ("content-type", "content-length"):
        assert hidden.headers[name] == miss_other.headers[name] == miss_own.headers[name]


def test_a_record_for_another_holder_is_refused_in_its_own_scope(tmp_path: Path) -> None:
    other_holder = "http://someone-else.test/"

    async def scenario() -> None:
        async with index_env(tmp_path) as env:
            record = record_json("own", FRESH, holder=other_holder)
            url = replica_path("own", FRESH, holder=other_holder)
            put = await env.http.put(url, json=record, headers=bearer("holder"))
            assert put.status_code == 403, put.text
            batch = await env.http.post(
                "replicas", json={"records": [record]}, headers=bearer("holder")
            )
            assert batch.json()["results"][0]["ok"] is False
            # nor may it withdraw another holder's record (root published H_URI's in seeding)
            await env.root("PUT", url, json=record)
            withdraw = await env.http.delete(url, headers=bearer("holder"))
            assert withdraw.status_code == 403
            mine = await env.http.put(
                replica_path("own", FRESH), json=record_json("own", FRESH), headers=bearer("holder")
            )
            assert mine.status_code == 200 and record_json("own")["holder"] == H_URI

    asyncio.run(scenario())


class _HashOnlyTable(dict):  # type: ignore[type-arg]
    """The principals table, recording the keys it is asked for and refusing to be walked."""

    def __init__(self, items: dict[bytes, Any]) -> None:
        super().__init__(items)
        self.asked: list[bytes] = []

    def get(self, key: Any, default: Any = None) -> Any:
        self.asked.append(key)
        return super().get(key, default)

    def __iter__(self) -> Any:
        raise AssertionError("authentication walked the principals table")

    def items(self) -> Any:
        raise AssertionError("authentication walked the principals table")

    def values(self) -> Any:
        raise AssertionError("authentication walked the principals table")


def test_tokens_are_found_by_hash_and_decided_in_constant_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = token("client")
    principals = Principals.from_entries([principal_entry("c", real, ["client"], None)])
    table = _HashOnlyTable(principals._by_hash)
    monkeypatch.setattr(principals, "_by_hash", table)
    compared: list[tuple[bytes, bytes]] = []
    constant_time = auth.hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return constant_time(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    assert principals.authenticate(f"Bearer {real}", 0).name == "c"
    assert compared == [(hashlib.sha256(real.encode()).digest(),) * 2]
    # tokens sharing all but their last octet with the real one, or a long prefix of it
    for near in (real[:-1] + "X", real[:10], real + "0"):
        with pytest.raises(Unauthorized):
            principals.authenticate(f"Bearer {near}", 0)
        # what the table was asked is the presented token's SHA-256: a prefix shared with the
        # real token leaves no trace in it, so no comparison can stop early on that prefix
        assert table.asked[-1] == hashlib.sha256(near.encode()).digest()
        assert table.asked[-1][:4] != hashlib.sha256(real.encode()).digest()[:4]
    assert all(len(key) == 32 for key in dict.keys(table))  # stored: hashes only


SECRETS_TOKENS = [token(n) for n in ("holder", "client", "root", "expired")]


def _secrets(path: Path) -> list[str]:
    """Everything that must never be logged: tokens, their hashes, the file's lines."""
    text = path.read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if "token_sha256" in line]
    hashes = [hashlib.sha256(t.encode()).hexdigest() for t in SECRETS_TOKENS]
    return [*SECRETS_TOKENS, *hashes, *lines]


def _write(path: Path) -> None:
    write_principals(
        path,
        [
            principal_entry("holder", token("holder"), ["holder"], [SCOPES["own"]], [H_URI]),
            principal_entry("client", token("client"), ["client"], [SCOPES["own"]]),
            principal_entry("root", token("root"), ["admin"], None),
            principal_entry("expired", token("expired"), ["admin"], None, expires_ms=1),
        ],
    )


def test_nothing_secret_is_logged_in_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "principals.toml"
    _write(path)
    principals = Principals.load(path)
    default_file, token_file = ensure_default_principals(tmp_path / "state")
    Principals.load(default_file)
    broken = tmp_path / "broken.toml"
    broken.write_text(path.read_text().replace("token_sha256 = ", "token_sha256 = 7"))
    with pytest.raises(PrincipalsError) as info:
        Principals.load(broken)
    assert not any(s in str(info.value) for s in _secrets(path))
    for presented in ("Bearer nope-0123456789", f"Bearer {token('expired')}", "Basic x"):
        with pytest.raises(Unauthorized) as failed:
            principals.authenticate(presented, 10**13)
        assert token("expired") not in str(failed.value)

    async def requests() -> None:
        async with index_env(tmp_path) as env:
            await env.http.post("lookup", json=lookup("own", FRESH), headers=bearer("client"))
            await env.http.post("lookup", json=lookup("own", FRESH), headers=bearer("expired"))
            await env.http.post("lookup", json=lookup("own", FRESH), headers={"authorization": "x"})

    asyncio.run(requests())
    logged = caplog.text
    secrets = [*_secrets(path), token_file.read_text().strip()]
    leaked = [s for s in secrets if s in logged]
    assert not leaked, f"{len(leaked)} secrets in the log"


@pytest.mark.slow
def test_nothing_secret_is_logged_by_a_real_service(tmp_path: Path) -> None:
    path = tmp_path / "principals.toml"
    _write(path)
    argv = [sys.executable, "-m", "kvsp", "serve", "index", "--listen", "127.0.0.1:0"]
    argv += ["--state", str(tmp_path / "state"), "--principals", str(path)]
    argv += ["--log-level", "debug", "--log-format", "text"]
    with start_process(argv, workdir=tmp_path) as service:
        with httpx.Client(base_url=service.base_url, timeout=10) as http:
            for who in ("client", "expired"):
                http.post("lookup", json=lookup("own", FRESH), headers=bearer(who))
            http.post("lookup", json=lookup("own", FRESH), headers={"authorization": "Bearer z"})
            http.put(replica_path("other"), json=record_json("other"), headers=bearer("holder"))
            assert http.get("healthz").status_code == 200
        service.stop()
        output = service.output()
    assert "lookup" in output  # debug/info records were written: the check below means something
    leaked = [s for s in _secrets(path) if s in output]
    assert not leaked, f"{len(leaked)} secrets in the service's output"
