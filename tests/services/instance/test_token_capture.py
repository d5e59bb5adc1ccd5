"""A holder must not capture an instance's credentials (DESIGN.md §3, spec §4.4 and §6.5-6.7;
:mod:`kvsp.audience`).

Real processes on 127.0.0.1: ``kvsp serve control`` (IS + PC), ``kvsp serve holder`` and
``kvsp serve instance`` with a principal of role instance. Two small HTTP servers in the test
stand for what an attacker controls: a *capture* server that records every request it gets,
and an IS stand-in that answers the instance's lookups with records the real IS would refuse
(a record forced in past the IS).

* The IS refuses a record whose ``lease_base`` is not on its holder's origin (400
  ``kvsp-bad-request`` at ``$.lease_base``).
* Given such a record anyway, the instance sends the capture server nothing.
* What a holder does receive from the instance (its lease POST) is an audience credential for
  that holder: it opens nothing at the PC, the IS or another holder.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.audience import audience_credential
from kvsp.compat import compat_id
from kvsp.container import decode_container
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.ids import uri_id
from kvsp.keys import block_keys, scope_id
from kvsp.services.index.client import replica_path
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from tests.support.polling import eventually

pytestmark = pytest.mark.slow  # control plane, holder and instance, each a process
DESCRIPTOR = toy_descriptor(layers=2, kv_heads=2, head_dim=8, kv_dtype="fp16", block_tokens=4)
COMPAT = compat_id(DESCRIPTOR)
SCOPE_KEY = bytes(range(40, 72))
SCOPE = scope_id(SCOPE_KEY)
ADMIN = "capture-test-admin-token-0123456789abcdef"
INSTANCE = "capture-test-instance-token-0123456789abcd"
EVIL = "capture-test-evil-holder-token-0123456789ab"
PROBLEM = "urn:ietf:params:kvsp:problem:"


@dataclass
class Seen:
    """One request a test server received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Recorder:
    """An HTTP server on 127.0.0.1 that records every request and answers with ``answer``."""

    def __init__(self, answer: Callable[[Seen], tuple[int, Any]]) -> None:
        self.seen: list[Seen] = []
        lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                seen = Seen(
                    self.command,
                    self.path,
                    {k.lower(): v for k, v in self.headers.items()},
                    self.rfile.read(length),
                )
                with lock:
                    recorder.seen.append(seen)
                status, body = answer(seen)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/kvsp+json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def containers(prompt: list[int]) -> list[bytes]:
    """The block containers a toy engine computes for ``prompt``."""

    async def compute() -> list[bytes]:
        engine = ToyEngine(DESCRIPTOR)
        seq = await engine.prefill(prompt, [])
        out = [block.container for block in seq.computed]
        await seq.release()
        await engine.aclose()
        return out

    return asyncio.run(compute())


def record(key: bytes, data: bytes, holder: str, lease_base: str | None) -> dict[str, Any]:
    """A Replica Record of ``data`` at ``holder`` (JSON)."""
    container = decode_container(data)
    obj: dict[str, Any] = {
        "block_key": key.hex(),
        "compat_id": COMPAT.hex(),
        "scope_id": SCOPE.hex(),
        "holder": holder,
        "codec": 1,
        "size": len(data),
        "digest": "sha-256:" + container.digest().hex(),
        "layer_digests": [d.hex() for d in container.layer_digests()],
        "ttl_ms": 60_000,
    }
    if lease_base is not None:
        obj["lease_base"] = lease_base
    return obj


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class World:
    folder: Path
    control: RunningService
    holder: RunningService
    instance: RunningService
    capture: Recorder
    index: Recorder
    lookups: dict[str, dict[str, Any]]
    """block key (hex) → the record the IS stand-in answers for it."""
    http: httpx.Client


def serve(folder: Path, name: str, *argv: str, listen: str = "127.0.0.1:0") -> RunningService:
    workdir = folder / name
    workdir.mkdir()
    return start_process(
        [sys.executable, "-m", "kvsp", "serve", name, "--listen", listen,
         "--principals", str(folder / "principals.toml"), "--state", str(workdir / "state"),
         *argv],
        workdir=workdir,
    )  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    folder = tmp_path_factory.mktemp("capture")
    capture = Recorder(lambda seen: (503, {"detail": "captured"}))
    lookups: dict[str, dict[str, Any]] = {}

    def index_answer(seen: Seen) -> tuple[int, Any]:
        if seen.path.endswith("/lookup"):
            wanted = json.loads(seen.body)["block_keys"]
            found = [[lookups[k]] for k in wanted if k in lookups]
            return 200, {"matched": len(found), "replicas": found}
        return 404, {"detail": "not here"}

    index = Recorder(index_answer)
    instance_url = f"http://127.0.0.1:{free_port()}/"
    evil_holder = "http://127.0.0.1:9/"  # the evil principal's own holder URI
    write_principals(
        folder / "principals.toml",
        [
            principal_entry("admin", ADMIN, ["admin"], None),
            principal_entry("ii", INSTANCE, ["instance"], [SCOPE], [instance_url]),
            principal_entry("evil", EVIL, ["holder"], [SCOPE], [evil_holder, capture.url]),
        ],
    )
    for name, token in (("admin.token", ADMIN), ("instance.token", INSTANCE)):
        (folder / name).write_text(token + "\n")
    (folder / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
    (folder / "scope.key").write_text(SCOPE_KEY.hex())
    admin, descriptor = str(folder / "admin.token"), str(folder / "descriptor.json")
    started: list[RunningService] = []
    try:
        started.append(control := serve(folder, "control", "--directive-token-file", admin))
        started.append(
            holder := serve(
                folder, "holder", "--index", control.base_url, "--index-token-file", admin
            )
        )
        started.append(
            instance := serve(
                folder,
                "instance",
                *("--pc", control.base_url, "--index", index.url),
                *("--token-file", str(folder / "instance.token"), "--descriptor", descriptor),
                *("--scope-key-file", str(folder / "scope.key"), "--engine", "toy"),
                listen=instance_url.removeprefix("http://").rstrip("/"),
            )
        )
        assert instance.base_url == instance_url
        with httpx.Client(timeout=30) as http:
            yield World(folder, control, holder, instance, capture, index, lookups, http)
    finally:
        for service in reversed(started):
            service.stop()
        capture.close()
        index.close()


def auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def prefetch(world: World, keys: list[bytes], source: str) -> dict[str, Any]:
    """POST a directive to the instance as the PC would, and wait until it is settled."""
    directive = str(uuid.uuid4())
    body = {
        "directive": directive,
        "scope_id": SCOPE.hex(),
        "compat_id": COMPAT.hex(),
        "blocks": [{"block_key": k.hex(), "sources": [source]} for k in keys],
        "layer_order": "ascending",
        "deadline_ms": 10_000,
        "lease_ms": 5_000,
    }
    url = world.instance.base_url
    answer = world.http.post(f"{url}prefetch", json=body, headers=auth(ADMIN))
    assert answer.status_code == 202, answer.text

    def settled() -> dict[str, Any] | None:
        got = world.http.get(f"{url}prefetch/{directive}", headers=auth(ADMIN))
        assert got.status_code == 200, got.text
        result: dict[str, Any] = got.json()
        return result if result["state"] != "pending" else None

    return eventually(settled, 30, "the directive to settle")


def test_the_index_refuses_a_lease_base_off_the_holder_origin(world: World) -> None:
    prompt = list(range(500, 504))
    [key] = block_keys(SCOPE_KEY, COMPAT, prompt, 4)
    [data] = containers(prompt)
    holder = "http://127.0.0.1:9/"
    url = world.control.base_url + replica_path(COMPAT, SCOPE, key, holder)
    evil = world.http.put(
        url, json=record(key, data, holder, world.capture.url), headers=auth(EVIL)
    )
    assert evil.status_code == 400, evil.text
    problem = evil.json()
    assert problem["type"] == PROBLEM + "kvsp-bad-request"
    assert problem["path"] == "$.lease_base"
    # the same record with its lease_base on the holder's own origin is taken
    fine = world.http.put(url, json=record(key, data, holder, holder + "l/"), headers=auth(EVIL))
    assert fine.status_code == 200, fine.text


def test_the_instance_sends_nothing_where_the_index_did_not_vouch(world: World) -> None:
    """A record forced in past the IS (here: answered by an IS stand-in) sends the instance's
    lease to the capture server; the instance refuses it and sends nothing there."""
    prompt = list(range(600, 604))
    [key] = block_keys(SCOPE_KEY, COMPAT, prompt, 4)
    [data] = containers(prompt)
    source = world.holder.base_url  # a genuine holder, named in the record as its holder
    world.lookups[key.hex()] = record(key, data, source, world.capture.url)
    before = len(world.capture.seen)
    outcome = prefetch(world, [key], source)
    assert outcome["state"] != "completed"
    assert world.index.seen, "the instance asked the IS stand-in"
    assert world.capture.seen[before:] == []


def test_what_a_holder_receives_opens_nothing_elsewhere(world: World) -> None:
    prompt = list(range(700, 704))
    [key] = block_keys(SCOPE_KEY, COMPAT, prompt, 4)
    [data] = containers(prompt)
    world.lookups[key.hex()] = record(key, data, world.capture.url, None)
    before = len(world.capture.seen)
    prefetch(world, [key], world.capture.url)
    got = eventually(lambda: world.capture.seen[before:] or None, 10, "a request at the holder")
    captured = got[0].headers["authorization"]

    control = world.control.base_url
    lookup = {"scope_id": SCOPE.hex(), "compat_id": COMPAT.hex(), "block_keys": [key.hex()]}
    assert world.http.post(f"{control}lookup", json=lookup, headers=auth(INSTANCE)).is_success
    replay = {"authorization": captured}
    answer = world.http.post(f"{control}lookup", json=lookup, headers=replay)
    assert answer.status_code == 401, answer.text

    status = world.http.get(f"{world.instance.base_url}status", headers=auth(ADMIN)).json()
    path = f"{control}instances/{uri_id(world.instance.base_url)}/status"
    answer = world.http.put(path, json=status, headers=replay)
    assert answer.status_code == 401, answer.text

    block = f"{world.holder.base_url}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key.hex()}"
    assert world.http.get(block, headers=replay).status_code == 401  # another holder
    assert INSTANCE not in captured
    # the credential the instance would show that holder works there (as kvsp token-audience
    # prints it for curl users): a miss, not a refusal
    minted = subprocess.run(
        [sys.executable, "-m", "kvsp", "token-audience", "--token-file",
         str(world.folder / "instance.token"), world.holder.base_url],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert world.http.get(block, headers=auth(minted)).status_code == 404
    # the control plane takes tokens only: not even a credential bound to its own origin
    own = audience_credential(INSTANCE, control)
    assert world.http.post(f"{control}lookup", json=lookup, headers=auth(own)).status_code == 401
