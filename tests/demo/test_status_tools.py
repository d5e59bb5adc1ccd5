"""``kvsp status``, ``kvsp generate --verbose`` and every printing command under ``| head``, run
as a user runs them: real subprocesses against a control plane on Redis (``kvsp serve control
--store redis://…``), a holder and a toy-engine instance (:mod:`tests.support.cluster`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.index import ReplicaCensus
from kvsp.records import ReplicaRecord
from kvsp.sessions import SessionState, new_session
from kvsp.stores.memory import MemoryStore
from kvsp.stores.sessions import MemorySessionStore, SessionCensus
from tests.support.cluster import (
    ADMIN,
    CLIENT_TOKEN,
    SCOPE_KEY,
    Cluster,
    prompt_of,
    start_cluster,
)
from tests.support.polling import eventually

pytestmark = pytest.mark.slow  # control plane, holder and instance processes
KVSP = [sys.executable, "-m", "kvsp"]
PROMPT_BLOCKS = 3


@pytest.fixture(scope="module")
def cluster(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Control plane on Redis (a key prefix of this module's own), holder, instance ``a``."""
    pytest.importorskip("redis")
    url = f"{redis_server}{'&' if '?' in redis_server else '?'}prefix=st-{secrets.token_hex(6)}"
    started = start_cluster(tmp_path_factory.mktemp("status"), {"a": []}, ["--store", url])
    try:
        yield started
    finally:
        started.stop()
        started.http.close()


def generate_argv(cluster: Cluster, prompt: list[int], *extra: str) -> list[str]:
    folder = cluster.folder
    return [
        *KVSP, "generate", "--pc", cluster.control,
        "--token-file", str(folder / "admin.token"),
        "--descriptor", str(folder / "descriptor.json"),
        "--scope-key-file", str(folder / "scope.key"),
        "--tokens", ",".join(map(str, prompt)), "--max-tokens", "4", *extra,
    ]  # fmt: skip


def status_argv(cluster: Cluster) -> list[str]:
    token = str(cluster.folder / "admin.token")
    return [*KVSP, "status", "--pc", cluster.control, "--token-file", token]


def section(text: str, heading: str) -> str:
    """The lines under ``heading`` up to the next heading."""
    lines = text.splitlines()
    start = lines.index(heading) + 2
    end = next(
        (i - 1 for i in range(start, len(lines)) if lines[i] and set(lines[i]) == {"-"}),
        len(lines),
    )
    return "\n".join(lines[start:end])


def test_status_on_redis_shows_replicas_sessions_holders_and_kv(cluster: Cluster) -> None:
    prompt = prompt_of(PROMPT_BLOCKS, seed=7, tail=5)
    cluster.store_at_holder(prompt)
    ran = subprocess.run(generate_argv(cluster, prompt), capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert assert_no_traceback(ran.stderr)

    def shown() -> str | None:
        out = subprocess.run(status_argv(cluster), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        instances = section(out.stdout, "Instances (PC)")
        row = next(line for line in instances.splitlines() if line.startswith(cluster.url("a")))
        kv = re.search(r"(\d+(?:\.\d+)?)%", row)
        return out.stdout if kv is not None and float(kv.group(1)) > 0 else None

    text = eventually(shown, 30, "a nonzero KV share for instance a in kvsp status", interval=0.5)
    assert "answered 405" not in text and "answered 404" not in text, text
    holders = section(text, "Replicas per holder (IS)")
    assert cluster.holder in holders, text
    assert cluster.url("a") in holders, text  # the instance's holder face holds the prefix
    sessions = section(text, "Sessions (PC)")
    assert cluster.url("a") in sessions and "done" in sessions, text


def assert_no_traceback(stderr: str) -> bool:
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    return True


def closed_after_one_line(argv: list[str]) -> tuple[int, str, str]:
    """Run ``argv`` with stdout a pipe that is closed after its first line (``| head -1``)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline().decode()
    proc.stdout.close()
    with proc.stderr:
        stderr = proc.stderr.read().decode()
    return proc.wait(timeout=60), first, stderr


@pytest.mark.parametrize("command", ["block-keys", "help"])
def test_a_closed_pipe_ends_a_command_quietly(command: str, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([1] * 20_000))  # 1.3 MB of keys: far more than a pipe holds
    argv = {
        "block-keys": [
            *KVSP, "block-keys", "--scope-key", SCOPE_KEY.hex(), "--compat-id", "00" * 32,
            "--block-tokens", "1", "--tokens-file", str(tokens),
        ],
        "help": [*KVSP, "--help"],
    }[command]  # fmt: skip
    code, first, stderr = closed_after_one_line(argv)
    assert first
    assert code in (0, 141), stderr
    assert_no_traceback(stderr)


def test_status_and_generate_end_quietly_on_a_closed_pipe(cluster: Cluster) -> None:
    code, first, stderr = closed_after_one_line(status_argv(cluster))
    assert first and code in (0, 141), stderr
    assert_no_traceback(stderr)
    prompt = prompt_of(1, seed=11)
    argv = generate_argv(cluster, prompt)
    argv[argv.index("--max-tokens") + 1] = "64"
    code, first, stderr = closed_after_one_line(argv)
    assert json.loads(first)["index"] == 0
    assert code in (0, 141), stderr
    assert_no_traceback(stderr)


def test_generate_verbose_names_instance_blocks_ttft_and_session(cluster: Cluster) -> None:
    prompt = prompt_of(PROMPT_BLOCKS, seed=9, tail=3)
    cluster.store_at_holder(prompt)
    ran = subprocess.run(
        generate_argv(cluster, prompt, "--verbose"), capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr
    tokens = [json.loads(line) for line in ran.stdout.splitlines()]
    assert [t["index"] for t in tokens] == [0, 1, 2, 3]  # stdout stays NDJSON
    report = dict(
        line.removeprefix("kvsp: ").split(": ", 1)
        for line in ran.stderr.splitlines()
        if line.startswith("kvsp: ")
    )
    assert report["instance"] == cluster.url("a"), ran.stderr
    assert report["matched blocks"] == str(PROMPT_BLOCKS), ran.stderr
    assert re.fullmatch(r"\d+ loaded, \d+ computed", report["blocks"]), ran.stderr
    assert re.fullmatch(r"\d+(\.\d+)? ms", report["TTFT"]), ran.stderr
    session = report["session"]
    answer = cluster.http.get(f"{cluster.control}sessions/{session}", headers=ADMIN)
    assert answer.status_code == 200 and answer.json()["instance"] == cluster.url("a")
    assert report["failovers"] == "0", ran.stderr
    assert "directive" in report, ran.stderr


# --- the lists behind the tables, the same over both stores --------------------------------------


def census_record(i: int, holder: str, scope: bytes, size: int) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"census %d/%d" % (i, n)).digest() for n in range(2))
    return ReplicaRecord(
        block_key=BlockKey(hashlib.sha256(b"census key %d" % i).digest()),
        compat_id=CompatId(b"\x3c" * 32),
        scope_id=ScopeId(scope),
        holder=holder,
        codec=1,
        size=size,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=None,
        ttl_ms=60_000,
    )


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_holders_and_recent_sessions_list_the_same_over_memory_and_redis(
    kind: str, request: pytest.FixtureRequest
) -> None:
    h1, h2 = "https://census-a.example/kvsp/", "https://census-b.example/kvsp/"
    puts = [  # (record, expiry): two scopes, and one record already expired at 1000
        (census_record(1, h1, b"\x01" * 16, 100), 5_000),
        (census_record(2, h1, b"\x02" * 16, 50), 5_000),
        (census_record(3, h2, b"\x01" * 16, 7), 5_000),
        (census_record(4, h2, b"\x01" * 16, 9), 900),
    ]
    sessions = [uuid.uuid4() for _ in range(4)]

    async def check() -> None:
        replicas: Any
        listing: Any
        if kind == "redis":
            pytest.importorskip("redis")
            from kvsp.stores.redis import RedisStore
            from kvsp.stores.redis_sessions import RedisSessionStore

            url = request.getfixturevalue("redis_url")
            replicas, listing = RedisStore.from_url(url), RedisSessionStore.from_url(url)
        else:
            replicas, listing = MemoryStore(), MemorySessionStore()
        try:
            for record, expires in puts:
                await replicas.put(record, expires)
            # the IS offers GET replicas over a store that is a ReplicaCensus
            assert isinstance(replicas, ReplicaCensus)
            assert await replicas.holders(1000) == [(h1, 2, 150), (h2, 1, 7)]
            for n, session in enumerate(sessions):
                made = new_session(session, ScopeId(b"\x01" * 16), CompatId(b"\x3c" * 32), h1, n)
                await listing.create(made)
            await listing.settle(sessions[0], 1, SessionState.DONE, 10, None)
            assert isinstance(listing, SessionCensus)  # the PC's GET sessions needs it
            recent = await listing.recent(3)
            assert [r.session for r in recent] == [sessions[0], sessions[3], sessions[2]]
            assert recent[0].state is SessionState.DONE
        finally:
            for opened in (replicas, listing):
                close = getattr(opened, "aclose", None)
                if close is not None:
                    await close()

    asyncio.run(check())


def test_get_sessions_is_for_admins_and_bounds_its_limit(cluster: Cluster) -> None:
    url = f"{cluster.control}sessions"
    assert cluster.http.get(url, headers=ADMIN).status_code == 200
    client = {"authorization": f"Bearer {CLIENT_TOKEN}"}
    assert cluster.http.get(url, headers=client).status_code == 403
    for bad in ("0", "1001", "x"):
        answer = cluster.http.get(url, params={"limit": bad}, headers=ADMIN)
        assert answer.status_code == 400, answer.text
        assert answer.headers["content-type"].startswith("application/problem+json")
