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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.ids import uri_id
from kvsp.keys import block_keys, scope_id
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from tests.support.polling import eventually

pytestmark = pytest.mark.slow  # control plane, holder and instance, each a process
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
    folder: Path

    def start_instance(self, name: str) -> RunningService:
        """Another ``kvsp serve instance`` on this control plane (the caller stops it)."""
        return serve(self.folder, "instance", *instance_argv(self.folder, self.control), work=name)

    def lookup(self, keys: Sequence[bytes], targets: list[str] | None = None) -> dict[str, Any]:
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


def serve(folder: Path, name: str, *argv: str, work: str | None = None) -> RunningService:
    """``kvsp serve NAME`` on 127.0.0.1 with the principals in ``folder``, its state under
    ``folder/WORK`` (default: ``NAME``)."""
    workdir = folder / (work or name)
    workdir.mkdir()
    common = ["--listen", "127.0.0.1:0", "--principals", str(folder / "principals.toml")]
    return start_process(
        [sys.executable, "-m", "kvsp", "serve", name, *common, "--state", str(workdir / "state"),
         *argv],
        workdir=workdir,
    )  # fmt: skip


def instance_argv(folder: Path, control: RunningService) -> list[str]:
    """The options of an instance of the toy descriptor, in the scope, on ``control``."""
    return [
        "--pc", control.base_url, "--token-file", str(folder / "token"),
        "--descriptor", str(folder / "descriptor.json"),
        "--scope-key-file", str(folder / "scope.key"), "--status-ttl-ms", "1500",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("cluster")
    write_principals(folder / "principals.toml", [principal_entry("admin", TOKEN, ["admin"], None)])
    token = folder / "token"
    token.write_text(TOKEN + "\n")
    descriptor = folder / "descriptor.json"
    descriptor.write_text(json.dumps(DESCRIPTOR.to_json()))
    (folder / "scope.key").write_text(SCOPE_KEY.hex())
    started: list[RunningService] = []
    try:
        control = serve(folder, "control", "--directive-token-file", str(token))
        started.append(control)
        holder_argv = [
            "--index", control.base_url, "--index-token-file", str(token),
            "--descriptor", str(descriptor),
        ]  # fmt: skip
        started.append(holder := serve(folder, "holder", *holder_argv))
        started.append(instance := serve(folder, "instance", *instance_argv(folder, control)))
        with httpx.Client(timeout=30) as http:
            yield Cluster(control, holder, instance, http, folder)
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
    seen = time.monotonic()

    def refreshed() -> dict[str, Any] | None:
        """The row once a report that arrived after ``seen`` is the PC's record."""
        asked = time.monotonic()  # the PC measures the age after this
        now = registered()
        return now if now is not None and now["age_ms"] < (asked - seen) * 1000 else None

    # reports come at least every ttl/3 = 500 ms: a newer one arrives within the ttl
    again = eventually(refreshed, 1.5, "a status report newer than the first row")
    assert again["state"] == "active" and again["age_ms"] < 1500
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
    # an instance of its own: stopping the module's one would leave the other tests none
    with cluster.start_instance("instance-stopped") as instance:
        prompt = list(range(900, 913))  # blocks no other test makes
        answer = cluster.http.post(
            f"{instance.base_url}generate", json={"prompt": prompt, "max_tokens": 1}, headers=AUTH
        )
        assert answer.status_code == 200, answer.text
        keys = block_keys(SCOPE_KEY, COMPAT, prompt, 4)
        eventually(lambda: cluster.lookup(keys)["matched"] == 3 or None)
        assert instance.stop() == 0
        assert cluster.lookup(keys)["matched"] == 0
