"""Resharding with real processes (spec §6.9): the PC's shard-map face and four instances, each a
uvicorn server on 127.0.0.1 (``tests/support/reshard_peers.py``), talking HTTP with their own
tokens.

A 64k-token context goes 3 → 2 → 4 → 3 instances. After every committed version the shards,
read back over HTTP from their instances, give the original cache bit for bit; each instance's
counters show that nothing of a retained range was fetched and that it fetched exactly the
tokens that changed owner; instances hold only their ranges. Then one member is paused with
SIGSTOP: the change aborts at the deadline, version v keeps serving, fetched ranges are
discarded, and after SIGCONT the same change commits. Last, the same routes as mounted in
``kvsp serve control`` and ``kvsp serve instance`` move a range between two real instances.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvsp.container import decode_container
from kvsp.engine.shards import TokenPages, container_parts, gather_kv, seeded_kv, token_bytes
from kvsp.engine.toy import toy_descriptor
from kvsp.errors import Conflict, NotFound, TransportError
from kvsp.services.instance.reshard import HttpRangeFetcher
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.http import parse_repr_digest
from kvsp.web.testing import RunningService, start_process
from tests.support import SUPPORT
from tests.support import reshard_peers as rt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # real processes: about a minute
HELPER = SUPPORT / "reshard_peers.py"
GEOMETRY = rt.GEOMETRY
CONTEXT = rt.CONTEXT
TOKEN = token_bytes(GEOMETRY)
MAP = "long-context"
NAMES = "abcd"


class Cluster:
    """The PC and the instances as processes, and a client for each role."""

    def __init__(self, folder: Path) -> None:
        principals = folder / "principals.toml"
        write_principals(principals, rt.principal_entries())
        roles = ["pc", *(["instance"] * len(NAMES))]
        argvs = [
            [sys.executable, str(HELPER), role, "--principals", str(principals)]
            + (["--deadline-ms", "10000", "--message-timeout-s", "1"] if role == "pc" else [])
            for role in roles
        ]
        workdirs = [folder / name for name in ["pc", *NAMES]]
        for workdir in workdirs:
            workdir.mkdir()
        with ThreadPoolExecutor(len(argvs)) as pool:
            started = pool.map(lambda pair: _start(*pair), zip(argvs, workdirs, strict=True))
            self.services: list[RunningService] = list(started)
        self.pc = self.services[0]
        self.instances = dict(zip(NAMES, self.services[1:], strict=True))
        self.http = httpx.Client(timeout=60)

    def url(self, name: str) -> str:
        return self.instances[name].base_url

    def request(self, method: str, url: str, role: str = "pc", **kwargs: Any) -> httpx.Response:
        return self.http.request(method, url, headers=rt.auth(role), **kwargs)

    def shards(self, *parts: tuple[str, int, int]) -> list[dict[str, Any]]:
        return [{"tokens": [a, b], "instance": self.url(n)} for n, a, b in parts]

    def stats(self, name: str) -> dict[str, Any]:
        answer = self.request("GET", self.url(name) + "shards", "instance")
        assert answer.status_code == 200, answer.text
        stats: dict[str, Any] = answer.json()
        return stats

    def gather(self) -> np.ndarray:
        """Read every shard of the map's current version from its instance over HTTP."""
        current = self.request("GET", self.pc.base_url + f"shardmaps/{MAP}").json()
        parts = []
        for shard in current["shards"]:
            a, b = shard["tokens"]
            url = shard["instance"] + f"shards/{MAP}/{a}-{b}?version={current['version']}"
            answer = self.request("GET", url, "instance")
            assert answer.status_code == 200, answer.text
            digest = parse_repr_digest(answer.headers["repr-digest"])
            assert digest == hashlib.sha256(answer.content).digest()
            pages = TokenPages.allocate(a, b, GEOMETRY)
            pages.write_container(a, decode_container(answer.content, GEOMETRY))
            parts.append((a, pages.read(a, b)))
        start, whole = gather_kv(parts)
        assert start == 0
        return whole

    def close(self) -> None:
        self.http.close()
        for service in self.services:
            service.proc.send_signal(signal.SIGCONT)
            service.stop()


def _start(argv: list[str], workdir: Path) -> RunningService:
    return start_process(argv, workdir=workdir, ready_timeout=60)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path)
    try:
        yield running
    finally:
        running.close()


def _owners(parts: list[tuple[str, int, int]]) -> np.ndarray:
    owner = np.full(CONTEXT, "", dtype=object)
    for name, a, b in parts:
        owner[a:b] = name
    return owner


STEPS = [
    [("a", 0, 32_768), ("b", 32_768, CONTEXT)],
    [("a", 0, 16_384), ("d", 16_384, 32_768), ("b", 32_768, 49_152), ("c", 49_152, CONTEXT)],
    [("a", 0, 20_000), ("d", 20_000, 45_000), ("c", 45_000, CONTEXT)],
]


def test_reshard_processes_three_two_four_three_and_a_paused_member(cluster: Cluster) -> None:
    original = seeded_kv(GEOMETRY, 0, CONTEXT, rt.SEED)
    parts = [("a", 0, 21_846), ("b", 21_846, 43_691), ("c", 43_691, CONTEXT)]
    for name, a, b in parts:  # version 1: each instance holds its third
        body = b"".join(bytes(p) for p in container_parts(original[:, :, a:b], GEOMETRY))
        url = cluster.url(name) + f"shards/{MAP}/{a}-{b}?version=1"
        assert cluster.request("PUT", url, "pc", content=body).status_code == 204
    created = cluster.request(
        "POST",
        cluster.pc.base_url + "shardmaps",
        json={"map": MAP, "shards": cluster.shards(*parts)},
    )
    assert created.status_code == 201, created.text
    assert np.array_equal(cluster.gather(), original)
    for version, step in enumerate(STEPS, start=1):
        _change(cluster, version, parts, step)
        assert np.array_equal(cluster.gather(), original)  # bit-exact after every commit
        parts = step
    _paused_member(cluster, original)
    _fetch_errors(cluster)


def _fetch_errors(cluster: Cluster) -> None:
    """The bulk-client fetch path maps a source's problems to the same errors."""
    fetcher = HttpRangeFetcher(rt.TOKENS["instance"], GEOMETRY)

    async def fetch(version: int, a: int, b: int) -> int:
        into = TokenPages.allocate(a, b, GEOMETRY)
        return await fetcher.fetch(cluster.url("a"), MAP, version, (a, b), into)

    assert asyncio.run(fetch(5, 100, 300)) == 200 * TOKEN  # version 5: a holds [0, 25000)
    with pytest.raises(Conflict, match="holds version 5"):
        asyncio.run(fetch(4, 100, 300))
    with pytest.raises(NotFound, match="not all held"):
        asyncio.run(fetch(5, 24_000, 26_000))
    gone = HttpRangeFetcher(rt.TOKENS["instance"], GEOMETRY, timeout=2)
    with pytest.raises(TransportError):
        one = TokenPages.allocate(0, 1, GEOMETRY)
        asyncio.run(gone.fetch("http://127.0.0.1:9/", MAP, 5, (0, 1), one))


def _change(
    cluster: Cluster, version: int, old: list[tuple[str, int, int]], new: list[tuple[str, int, int]]
) -> None:
    seen = {n: len(cluster.stats(n)["fetched"]) for n in NAMES}
    answer = cluster.request(
        "POST",
        cluster.pc.base_url + f"shardmaps/{MAP}/versions",
        json={"from": version, "shards": cluster.shards(*new)},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["version"] == version + 1 and "unconfirmed" not in answer.json()
    before, after = _owners(old), _owners(new)
    for name in NAMES:
        stats = cluster.stats(name)
        fetched = stats["fetched"][seen[name] :]
        retained = (before == name) & (after == name)
        incoming = (after == name) & (before != name)
        for entry in fetched:  # counted per range: no octet of a retained range moved
            a, b = entry["tokens"]
            assert entry["version"] == version + 1
            assert not retained[a:b].any()
            assert entry["bytes"] == (b - a) * TOKEN
            assert set(before[a:b]) == {entry_owner(cluster, entry["from"])}
        assert sum(e["bytes"] for e in fetched) == int(incoming.sum()) * TOKEN
        mine = int((after == name).sum())
        held = stats["maps"][0]["ranges"] if stats["maps"] else []
        assert sum(b - a for a, b in held) == mine
        assert stats["held_bytes"] <= mine * TOKEN + 2 * len(held) * 256 * TOKEN
        if mine == 0:
            assert stats["held_bytes"] == 0  # released everything it held


def entry_owner(cluster: Cluster, url: str) -> str:
    return next(n for n in NAMES if cluster.url(n) == url)


def _paused_member(cluster: Cluster, original: np.ndarray) -> None:
    """Version 4 is a [0, 20000), d [20000, 45000), c [45000, 65536); c is paused."""
    before = {n: cluster.stats(n) for n in NAMES}
    proposal = cluster.shards(("a", 0, 25_000), ("d", 25_000, 45_000), ("c", 45_000, CONTEXT))
    versions = cluster.pc.base_url + f"shardmaps/{MAP}/versions"
    paused = cluster.instances["c"].proc
    paused.send_signal(signal.SIGSTOP)
    try:
        answer = cluster.request(
            "POST", versions, json={"from": 4, "shards": proposal, "deadline_ms": 2000}
        )
        assert answer.status_code == 504, answer.text
        body = answer.json()
        assert body["type"] == "urn:ietf:params:kvsp:problem:kvsp-reshard-aborted"
        assert [f["instance"] for f in body["failed"]] == [cluster.url("c")]
        assert body["version"] == 4
        current = cluster.request("GET", cluster.pc.base_url + f"shardmaps/{MAP}").json()
        assert current["version"] == 4 and "pending" not in current
        a_now = cluster.stats("a")
        new_fetches = a_now["fetched"][len(before["a"]["fetched"]) :]
        assert [e["tokens"] for e in new_fetches] == [[20_000, 25_000]]  # fetched ...
        assert a_now["held_bytes"] == before["a"]["held_bytes"]  # ... and discarded
        assert a_now["maps"][0]["pending"] is None
        assert a_now["aborted"] == before["a"]["aborted"] + 1
        assert cluster.stats("d")["held_bytes"] == before["d"]["held_bytes"]
    finally:
        paused.send_signal(signal.SIGCONT)
    assert np.array_equal(cluster.gather(), original)  # version 4 kept serving
    retry = cluster.request("POST", versions, json={"from": 4, "shards": proposal})
    assert retry.status_code == 200, retry.text
    assert retry.json()["version"] == 5
    assert np.array_equal(cluster.gather(), original)


# --- through the real commands -----------------------------------------------------------------

ADMIN_TOKEN = "reshard-e2e-admin-token-0123456789abcdef"


def _serve(folder: Path, name: str, service: str, *argv: str) -> RunningService:
    work = folder / name
    work.mkdir()
    command = [
        *(sys.executable, "-m", "kvsp", "serve", service, "--listen", "127.0.0.1:0"),
        *("--state", str(work / "state"), "--principals", str(folder / "principals")),
        *argv,
    ]
    return start_process(command, workdir=work, ready_timeout=90)


def test_reshard_through_kvsp_serve_control_and_instances(tmp_path: Path) -> None:
    """The routes as mounted in ``kvsp serve control`` and ``kvsp serve instance``: the PC calls
    the instances with its directive token, the instances fetch from each other with theirs."""
    write_principals(
        tmp_path / "principals", [principal_entry("admin", ADMIN_TOKEN, ["admin"], None)]
    )
    token = tmp_path / "admin.token"
    token.write_text(ADMIN_TOKEN + "\n")
    descriptor = toy_descriptor(layers=2, kv_heads=2, head_dim=16, kv_dtype="fp16")
    (tmp_path / "descriptor.json").write_text(json.dumps(descriptor.to_json()))
    described = ("--descriptor", str(tmp_path / "descriptor.json"))
    started: list[RunningService] = []
    http = httpx.Client(timeout=60, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    try:
        control = _serve(
            tmp_path, "control", "control", *described, "--directive-token-file", str(token)
        )
        started.append(control)
        instance = ("--pc", control.base_url, "--token-file", str(token), "--engine", "toy")
        with ThreadPoolExecutor(2) as pool:
            started += pool.map(
                lambda n: _serve(tmp_path, n, "instance", *instance, *described), "ab"
            )
        a, b = (s.base_url for s in started[1:])
        original = seeded_kv(GEOMETRY, 0, 5000, 77)
        for base, (lo, hi) in ((a, (0, 3000)), (b, (3000, 5000))):
            body = b"".join(bytes(p) for p in container_parts(original[:, :, lo:hi], GEOMETRY))
            put = http.put(base + f"shards/e2e/{lo}-{hi}?version=1", content=body)
            assert put.status_code == 204, put.text
        layout = [{"tokens": [0, 3000], "instance": a}, {"tokens": [3000, 5000], "instance": b}]
        created = http.post(control.base_url + "shardmaps", json={"map": "e2e", "shards": layout})
        assert created.status_code == 201, created.text
        moved = [{"tokens": [0, 1000], "instance": a}, {"tokens": [1000, 5000], "instance": b}]
        answer = http.post(
            control.base_url + "shardmaps/e2e/versions", json={"from": 1, "shards": moved}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["version"] == 2
        parts = []
        for base, (lo, hi) in ((b, (1000, 5000)), (a, (0, 1000))):
            got = http.get(base + f"shards/e2e/{lo}-{hi}?version=2")
            assert got.status_code == 200, got.text
            pages = TokenPages.allocate(lo, hi, GEOMETRY)
            pages.write_container(lo, decode_container(got.content, GEOMETRY))
            parts.append((lo, pages.read(lo, hi)))
        assert np.array_equal(gather_kv(parts)[1], original)
        fetched = http.get(b + "shards").json()["fetched"]
        assert fetched == [
            {"map": "e2e", "version": 2, "tokens": [1000, 3000], "bytes": 2000 * TOKEN, "from": a}
        ]
        assert http.get(a + "shards").json()["maps"][0]["ranges"] == [[0, 1000]]
    finally:
        http.close()
        for service in reversed(started):
            service.stop()
