"""An instance among real processes: ``kvsp serve control`` (IS + PC), ``kvsp serve holder``
and ``kvsp serve instance`` on 127.0.0.1. The instance registers at the PC with measured
rates (§6.3), streams generated tokens as NDJSON, publishes the blocks it computed (§6.1), and
executes a prefetch directive against the real IS and holder (§6.5)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.ids import uri_id
from kvsp.keys import block_keys, scope_id
from kvsp.services.auth import principal_entry, write_principals
from kvsp.services.testing import RunningService, start_process
from kvsp.services.toy_engine import ToyEngine, toy_descriptor

T = TypeVar("T")
DESCRIPTOR = toy_descriptor(layers=2, kv_heads=2, head_dim=8, kv_dtype="fp16", block_tokens=4)
COMPAT = compat_id(DESCRIPTOR)
SCOPE_KEY = bytes(range(7, 39))
SCOPE = scope_id(SCOPE_KEY)
TOKEN = "process-test-admin-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@dataclass
class Cluster:
    control: RunningService
    holder: RunningService
    instance: RunningService
    http: httpx.Client

    def lookup(self, keys: list[bytes], targets: list[str] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "block_keys": [k.hex() for k in keys],
        }
        if targets is not None:
            body["targets"] = targets
        answer = self.http.post(f"{self.control.base_url}lookup", json=body, headers=AUTH)
        assert answer.status_code == 200, answer.text
        result: dict[str, Any] = answer.json()
        return result


def eventually(check: Callable[[], T | None], timeout: float = 15.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def reference(prompt: list[int], count: int) -> tuple[list[int], list[bytes]]:
    """Tokens and block containers of a toy engine computing ``prompt`` from scratch."""

    async def compute() -> tuple[list[int], list[bytes]]:
        engine = ToyEngine(DESCRIPTOR)
        seq = await engine.prefill(prompt, [])
        tokens = [t async for t in seq.tokens(count)]
        containers = [block.container for block in seq.computed]
        await seq.release()
        await engine.aclose()
        return tokens, containers

    return asyncio.run(compute())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("cluster")
    principals = folder / "principals.toml"
    write_principals(principals, [principal_entry("admin", TOKEN, ["admin"], None)])
    token = folder / "token"
    token.write_text(TOKEN + "\n")
    descriptor = folder / "descriptor.json"
    descriptor.write_text(json.dumps(DESCRIPTOR.to_json()))
    scope_key = folder / "scope.key"
    scope_key.write_text(SCOPE_KEY.hex())
    kvsp = [sys.executable, "-m", "kvsp", "serve"]
    started: list[RunningService] = []

    def start(name: str, *argv: str) -> RunningService:
        work = folder / name
        work.mkdir()
        common = ["--listen", "127.0.0.1:0", "--principals", str(principals)]
        service = start_process(
            [*kvsp, name, *common, "--state", str(work / "state"), *argv], workdir=work
        )
        started.append(service)
        return service

    try:
        control = start("control", "--directive-token-file", str(token))
        holder = start(
            "holder",
            "--index",
            control.base_url,
            "--index-token-file",
            str(token),
            "--descriptor",
            str(descriptor),
        )
        instance = start(
            "instance",
            "--control",
            control.base_url,
            "--token-file",
            str(token),
            "--descriptor",
            str(descriptor),
            "--scope-key-file",
            str(scope_key),
            "--status-ttl-ms",
            "1500",
        )
        with httpx.Client(timeout=30) as http:
            yield Cluster(control, holder, instance, http)
    finally:
        for service in reversed(started):
            service.stop()


def test_instance_registers_active_with_measured_rates(cluster: Cluster) -> None:
    def registered() -> dict[str, Any] | None:
        answer = cluster.http.get(f"{cluster.control.base_url}instances", headers=AUTH)
        assert answer.status_code == 200, answer.text
        for row in answer.json()["instances"]:
            if row["instance"] == cluster.instance.base_url:
                return dict(row)
        return None

    row = eventually(registered)
    assert row["state"] == "active" and row["reported_state"] == "active"
    assert row["ttl_ms"] == 1500 and row["epoch"] > 1_600_000_000_000  # start time in ms
    status = cluster.http.get(f"{cluster.instance.base_url}status", headers=AUTH).json()
    assert status["prefill_tokens_per_s"] > 0 and status["decode_tokens_per_s"] > 0
    first_age = row["age_ms"]
    time.sleep(0.6)  # reports come at least every ttl/3 = 500 ms
    assert registered() is not None and eventually(registered)["age_ms"] < 1500
    assert first_age < 1500


def test_generate_streams_ndjson_and_publishes_its_blocks(cluster: Cluster) -> None:
    prompt = list(range(300, 313))  # three blocks of 4 and a tail of 1
    expected, _ = reference(prompt, 8)
    url = f"{cluster.instance.base_url}generate"
    lines = []
    with cluster.http.stream(
        "POST", url, json={"prompt": prompt, "max_tokens": 8}, headers=AUTH
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        assert answer.headers["kvsp-computed-blocks"] == "3"
        for line in answer.iter_lines():
            lines.append(json.loads(line))
    assert lines == [{"index": i, "epoch": 1, "token": t} for i, t in enumerate(expected)]

    keys = block_keys(SCOPE_KEY, COMPAT, prompt, 4)
    target = cluster.instance.base_url
    found = eventually(lambda: (r := cluster.lookup(keys, [target]))["matched"] == 3 and r or None)
    holders = {record["holder"] for records in found["replicas"] for record in records}
    assert holders == {cluster.instance.base_url}
    estimate = found["estimates"][target]
    assert 0 < estimate["recompute_us"] < 1e12  # from the measured prefill rate it reported


def test_prefetch_through_the_real_index_and_holder(cluster: Cluster) -> None:
    prompt = list(range(700, 716))  # four blocks
    expected, containers = reference(prompt, 5)
    keys = block_keys(SCOPE_KEY, COMPAT, prompt, 4)
    for key, data in zip(keys, containers, strict=True):
        url = f"{cluster.holder.base_url}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key.hex()}"
        headers = AUTH | {"if-none-match": "*", "content-type": "application/kvsp-block"}
        assert cluster.http.put(url, content=data, headers=headers).status_code == 201
    eventually(lambda: cluster.lookup(keys)["matched"] == 4 or None)

    directive = {
        "directive": str(uuid.uuid4()),
        "scope_id": SCOPE.hex(),
        "compat_id": COMPAT.hex(),
        "blocks": [{"block_key": k.hex(), "sources": [cluster.holder.base_url]} for k in keys],
        "layer_order": "ascending",
        "deadline_ms": 10_000,
        "lease_ms": 5_000,
    }
    answer = cluster.http.post(f"{cluster.instance.base_url}prefetch", json=directive, headers=AUTH)
    assert answer.status_code == 202, answer.text
    location = answer.headers["location"]

    def finished() -> dict[str, Any] | None:
        status: dict[str, Any] = cluster.http.get(location, headers=AUTH).json()
        return status if status["state"] != "pending" else None

    status = eventually(finished)
    assert status["state"] == "complete", status
    assert status["loaded"] == [k.hex() for k in keys]

    generated = cluster.http.post(
        f"{cluster.instance.base_url}generate",
        json={"prompt": prompt, "max_tokens": 5},
        headers=AUTH,
    )
    assert generated.headers["kvsp-loaded-blocks"] == "4"
    assert [json.loads(line)["token"] for line in generated.text.splitlines()] == expected
    records = cluster.lookup(keys)["replicas"]
    assert all(
        {cluster.holder.base_url, cluster.instance.base_url} <= {r["holder"] for r in rs}
        for rs in records
    )
    links = cluster.http.get(f"{cluster.instance.base_url}status", headers=AUTH).json()["links"]
    assert [link["holder"] for link in links] == [cluster.holder.base_url]


def test_a_drain_from_the_pc_ends_in_sleeping_and_a_wake_up(cluster: Cluster) -> None:
    state_url = f"{cluster.control.base_url}instances/{uri_id(cluster.instance.base_url)}/state"
    drained = cluster.http.put(state_url, json={"state": "draining"}, headers=AUTH)
    assert drained.status_code == 200, drained.text

    def reported(state: str) -> bool | None:
        answer = cluster.http.get(f"{cluster.control.base_url}instances", headers=AUTH)
        rows = [r for r in answer.json()["instances"] if r["instance"] == cluster.instance.base_url]
        return True if rows and rows[0]["reported_state"] == state else None

    eventually(lambda: reported("sleeping"))  # idle, so it went on to sleeping and said so
    refused = cluster.http.post(
        f"{cluster.instance.base_url}generate", json={"prompt": [1], "max_tokens": 1}, headers=AUTH
    )
    assert refused.status_code == 503
    assert refused.json()["type"] == "urn:ietf:params:kvsp:problem:kvsp-not-active"
    woken = cluster.http.put(state_url, json={"state": "active"}, headers=AUTH)
    assert woken.status_code == 200, woken.text
    eventually(lambda: reported("active"))


def test_stop_withdraws_the_instances_records(cluster: Cluster) -> None:
    prompt = list(range(300, 313))
    keys = block_keys(SCOPE_KEY, COMPAT, prompt, 4)
    assert cluster.lookup(keys)["matched"] == 3
    assert cluster.instance.stop() == 0
    assert cluster.lookup(keys)["matched"] == 0
