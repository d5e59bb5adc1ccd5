"""Real KVSP processes to SIGKILL, for the crash tests: ``kvsp serve control``, ``kvsp serve
holder``, ``kvsp serve instance --engine toy`` and ``python -m relay.app``, on 127.0.0.1, all
sharing one principals file; blocks with their digests computed here; a layer sink that kills a
process when a chosen layer of a transfer begins (so the kill lands mid-transfer, not before or
after it); bounded polls.

Imported by the crash tests and by ``bench/bench_crash.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import (
    Container,
    Geometry,
    decode_container,
    encode_container,
    replica_digest,
)
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.keys import block_keys, scope_id
from kvsp.records import ReplicaRecord
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from tests.support.polling import eventually

ADMIN_TOKEN = "reliability-admin-token-0123456789abcdef"
CLIENT_TOKEN = "reliability-client-token-0123456789abcde"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
CLIENT = {"authorization": f"Bearer {CLIENT_TOKEN}"}
SCOPE_KEY = bytes(range(60, 92))
SCOPE: ScopeId = scope_id(SCOPE_KEY)
PROBLEM = "urn:ietf:params:kvsp:problem:"


def _descriptor(name: str, **geometry: Any) -> CompatibilityDescriptor:
    return CompatibilityDescriptor(
        model=name,
        model_digest=hashlib.sha256(name.encode() + b" weights").digest(),
        tokenizer_digest=hashlib.sha256(name.encode() + b" tokenizer").digest(),
        positional="none",
        **geometry,
    )


BIG = _descriptor(
    "reliability-big", layers=8, kv_heads=8, head_dim=128, kv_dtype="fp16", block_tokens=1024
)
"""32 MiB blocks (4 MiB a layer): more than loopback TCP buffers hold, so a holder killed
when the first layer begins to arrive cannot have sent the rest already."""
SMALL = _descriptor(
    "reliability-small", layers=4, kv_heads=2, head_dim=64, kv_dtype="fp16", block_tokens=64
)
"""128 KiB blocks for the tests about records, leases and the disk tier."""
TOY = toy_descriptor(layers=2, kv_heads=4, head_dim=128, kv_dtype="int8", block_tokens=32)
"""What the toy-engine instances compute: 64 KiB blocks of 32 tokens."""
DESCRIPTORS = {"big": BIG, "small": SMALL, "toy": TOY}


# --- blocks --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Block:
    """A block of one descriptor: its key, container octets and layer digests."""

    descriptor: CompatibilityDescriptor
    key: BlockKey
    data: bytes
    digests: tuple[bytes, ...]

    @property
    def compat(self) -> CompatId:
        return compat_id(self.descriptor)

    @property
    def geometry(self) -> Geometry:
        return Geometry.from_descriptor(self.descriptor)

    def path(self) -> str:
        """``blocks/{compat}/{scope}/{key}`` (§6.7)."""
        return f"blocks/{self.compat.hex()}/{SCOPE.hex()}/{self.key.hex()}"

    def record(self, holder: str) -> ReplicaRecord:
        """The Replica Record a holder at ``holder`` would publish (every layer in host)."""
        return ReplicaRecord.from_json(
            {
                "block_key": self.key.hex(),
                "compat_id": self.compat.hex(),
                "scope_id": SCOPE.hex(),
                "holder": holder,
                "codec": 1,
                "size": len(self.data),
                "digest": "sha-256:" + replica_digest(self.digests).hex(),
                "layer_digests": [d.hex() for d in self.digests],
                "ttl_ms": 60_000,
            }
        )


def make_block(descriptor: CompatibilityDescriptor, seed: int) -> Block:
    """A block whose every layer differs, deterministic in ``seed``."""
    geometry = Geometry.from_descriptor(descriptor)
    section = geometry.section_length(descriptor.block_tokens)
    layers = []
    for i in range(descriptor.layers):
        pattern = hashlib.sha256(b"%s/%d/%d" % (descriptor.model.encode(), seed, i)).digest()
        layers.append((pattern * (section // 32), pattern[::-1] * (section // 32)))
    data = encode_container(
        layers, first_layer=0, token_count=descriptor.block_tokens, geometry=geometry
    )
    digests = tuple(hashlib.sha256(k + v).digest() for k, v in layers)
    key = BlockKey(hashlib.sha256(b"reliability-key/%d/" % seed + data[:64]).digest())
    return Block(descriptor, key, data, digests)


def block_of(descriptor: CompatibilityDescriptor, key: BlockKey, data: bytes) -> Block:
    """A block from its container octets (layer digests computed here)."""
    digests = tuple(bytes(d) for d in decode_container(data).layer_digests())
    return Block(descriptor, key, data, digests)


def check_layers(container: Container, digests: Sequence[bytes]) -> None:
    """Every layer handed out hashes to its digest, computed independently here.

    Raises:
        AssertionError: a layer differs (a wrong byte was delivered).
    """
    for layer in container.layers:
        got = hashlib.sha256(bytes(layer.k) + bytes(layer.v)).digest()
        assert got == digests[layer.index], f"layer {layer.index} delivered wrong octets"


class KillingSink:
    """A :class:`~kvsp.container_reader.LayerSink` that runs ``action`` (once) when layer
    ``at`` begins to arrive, then hands out fresh memory for every layer."""

    def __init__(self, at: int, action: Callable[[], None]) -> None:
        self.at = at
        self.action = action
        self.fired = False

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        if index == self.at and not self.fired:
            self.fired = True
            self.action()
        return memoryview(bytearray(k_len)), memoryview(bytearray(v_len))


def reference(prompt: Sequence[int]) -> list[bytes]:
    """The block containers a toy engine computes for ``prompt`` (what every instance and
    holder must deliver for its keys)."""

    async def compute() -> list[bytes]:
        engine = ToyEngine(TOY)
        try:
            seq = await engine.prefill(list(prompt), [])
            containers = [bytes(block.container) for block in seq.computed]
            await seq.release()
        finally:
            await engine.aclose()
        return containers

    return asyncio.run(compute())


def prompt_keys(prompt: Sequence[int]) -> list[BlockKey]:
    """The §4.2 Block Keys of ``prompt`` under the toy descriptor, in the test scope."""
    return block_keys(SCOPE_KEY, compat_id(TOY), prompt, TOY.block_tokens)


# --- processes -----------------------------------------------------------------------------------


@dataclass
class Processes:
    """Named service processes in one folder; restart keeps a service's address and state."""

    folder: Path
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=15))
    services: dict[str, RunningService] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        write_principals(
            self.folder / "principals.toml",
            [
                principal_entry("admin", ADMIN_TOKEN, ["admin"], None),
                principal_entry("client", CLIENT_TOKEN, ["client", "instance"], [SCOPE]),
            ],
        )
        self.token_file.write_text(ADMIN_TOKEN + "\n")
        (self.folder / "scope.key").write_text(SCOPE_KEY.hex())
        for name, descriptor in DESCRIPTORS.items():
            (self.folder / f"{name}.json").write_text(json.dumps(descriptor.to_json()))

    @property
    def token_file(self) -> Path:
        return self.folder / "admin.token"

    def descriptor_args(self, *names: str) -> list[str]:
        """``--descriptor FILE`` for each named descriptor (default: all)."""
        out: list[str] = []
        for name in names or tuple(DESCRIPTORS):
            out += ["--descriptor", str(self.folder / f"{name}.json")]
        return out

    def url(self, name: str) -> str:
        return self.services[name].base_url

    def start(self, name: str, argv: Sequence[str], listen: str = "127.0.0.1:0") -> str:
        """Start ``argv`` (``{listen}`` and ``{state}`` filled in) as ``name``; its URL."""
        work = self.folder / name
        work.mkdir(exist_ok=True)
        log = work / "output.log"
        if log.exists():  # a restart: keep the earlier run's output
            log.rename(work / f"output-{time.monotonic_ns()}.log")
        (work / "ready").unlink(missing_ok=True)
        self.argv[name] = list(argv)
        filled = [a.format(listen=listen, state=work / "state") for a in argv]
        self.services[name] = start_process(filled, workdir=work, ready_timeout=60)
        return self.url(name)

    def serve(self, name: str, service: str, *argv: str) -> str:
        """``kvsp serve SERVICE`` as ``name`` with the shared principals; its base URL."""
        command = [
            *(sys.executable, "-m", "kvsp", "serve", service, "--listen", "{listen}"),
            *("--state", "{state}", "--principals", str(self.folder / "principals.toml")),
            *argv,
        ]
        return self.start(name, command)

    def control(self, name: str = "control", *argv: str) -> str:
        """``kvsp serve control`` (IS + PC)."""
        token = ("--directive-token-file", str(self.token_file))
        return self.serve(name, "control", *self.descriptor_args(), *token, *argv)

    def holder(self, name: str, *argv: str, control: str = "control") -> str:
        """``kvsp serve holder`` publishing at the control plane's IS."""
        index = ("--index", self.url(control), "--index-token-file", str(self.token_file))
        return self.serve(name, "holder", *index, *self.descriptor_args(), *argv)

    def instance(self, name: str, *argv: str, control: str = "control") -> str:
        """``kvsp serve instance --engine toy`` reporting to the control plane."""
        return self.serve(
            name,
            "instance",
            *("--pc", self.url(control), "--token-file", str(self.token_file)),
            *("--engine", "toy", *self.descriptor_args("toy")),
            *("--scope-key-file", str(self.folder / "scope.key"), "--status-ttl-ms", "900"),
            *argv,
        )

    def relay(self, name: str, cert: Path, key: Path, *argv: str) -> str:
        """``python -m relay.app --open`` with the given certificate; its ``moqt://`` URL."""
        command = [
            *(sys.executable, "-m", "relay.app", "--open", "--listen", "{listen}"),
            *("--state", "{state}", "--cert", str(cert), "--key", str(key), *argv),
        ]
        self.start(name, command)
        ready: dict[str, str] = json.loads(self.url(name))
        return ready["moqt"]

    def together(self, *starts: Callable[[], object]) -> None:
        """Run several ``start`` calls at once (each waits for its process to be ready).

        Raises:
            ServiceStartError: the first start that failed (the others still finish).
        """
        failures: list[BaseException] = []

        def guarded(start: Callable[[], object]) -> None:
            try:
                start()
            except BaseException as exc:  # re-raised on the calling thread
                failures.append(exc)

        threads = [threading.Thread(target=guarded, args=(start,)) for start in starts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]

    def restart(self, name: str) -> str:
        """Start ``name`` again at its old address with its old options and state folder."""
        old = self.services[name]
        old.stop()
        return self.start(name, self.argv[name], listen=_listen_of(old.base_url))

    def alive(self, name: str) -> bool:
        return self.services[name].proc.poll() is None

    def kill(self, name: str) -> None:
        """SIGKILL ``name``: no withdrawal, no last word."""
        proc = self.services[name].proc
        proc.kill()
        proc.wait()

    def freeze(self, name: str) -> None:
        """SIGSTOP ``name``: its sockets accept connections, it answers nothing."""
        self.services[name].proc.send_signal(signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        """SIGCONT ``name`` after :meth:`freeze`."""
        self.services[name].proc.send_signal(signal.SIGCONT)

    def stop_all(self) -> None:
        for service in reversed(list(self.services.values())):
            if service.proc.poll() is None:
                service.proc.send_signal(signal.SIGCONT)
            service.stop(grace_s=3)
        self.http.close()

    # -- HTTP calls ----------------------------------------------------------------------------

    def put(self, holder: str, block: Block) -> httpx.Response:
        """PUT a block at a holder (§6.7, ``If-None-Match: *``) as the client."""
        headers = CLIENT | {"if-none-match": "*", "content-type": "application/kvsp-block"}
        return self.http.put(
            f"{self.url(holder)}{block.path()}", content=block.data, headers=headers
        )

    def replicas(self, block: Block, control: str = "control") -> list[ReplicaRecord]:
        """The IS's records of one block (none when it has no unexpired one)."""
        body = {
            "scope_id": SCOPE.hex(),
            "compat_id": block.compat.hex(),
            "block_keys": [block.key.hex()],
        }
        answer = self.http.post(f"{self.url(control)}lookup", json=body, headers=CLIENT)
        assert answer.status_code == 200, answer.text
        found = answer.json().get("replicas") or [[]]
        return [ReplicaRecord.from_json(r) for r in found[0]]

    def prefetch(self, instance: str, blocks: Sequence[tuple[BlockKey, str]]) -> str:
        """POST a directive to ``instance`` as the PC would (blocks: key and source name);
        returns its id."""
        directive = str(uuid.uuid4())
        body = {
            "directive": directive,
            "scope_id": SCOPE.hex(),
            "compat_id": compat_id(TOY).hex(),
            "blocks": [{"block_key": k.hex(), "sources": [self.url(s)]} for k, s in blocks],
            "layer_order": "ascending",
            "deadline_ms": 30_000,
            "lease_ms": 10_000,
        }
        answer = self.http.post(f"{self.url(instance)}prefetch", json=body, headers=ADMIN)
        assert answer.status_code == 202, answer.text
        return directive

    def directive(self, instance: str, directive: str) -> dict[str, Any]:
        """GET prefetch/{directive} at ``instance``: its status (§6.5)."""
        answer = self.http.get(f"{self.url(instance)}prefetch/{directive}", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body

    def outcome(self, instance: str, directive: str, timeout: float = 15.0) -> dict[str, Any]:
        """The directive's status once it is no longer ``pending``."""

        def final() -> dict[str, Any] | None:
            status = self.directive(instance, directive)
            return status if status["state"] != "pending" else None

        return eventually(final, timeout, f"directive {directive} at {instance} to stop")

    def wait_row(self, instance: str, state: str, timeout: float = 15.0) -> dict[str, Any]:
        """The PC's row for ``instance`` once it shows ``state``."""

        def shown() -> dict[str, Any] | None:
            row = self.pc_row(instance)
            return row if row is not None and row["state"] == state else None

        return eventually(shown, timeout, f"the PC to show {instance} {state}")

    def pc_row(self, instance: str, control: str = "control") -> dict[str, Any] | None:
        """The PC's row for ``instance`` (GET instances), ``None`` when it has none."""
        answer = self.http.get(f"{self.url(control)}instances", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        rows = {row["instance"]: row for row in answer.json()["instances"]}
        row: dict[str, Any] | None = rows.get(self.url(instance))
        return row

    def place(self, prompt: Sequence[int], control: str = "control") -> httpx.Response:
        """POST place for ``prompt`` as the client."""
        body = {
            "scope_id": SCOPE.hex(),
            "compat_id": compat_id(TOY).hex(),
            "block_keys": [k.hex() for k in prompt_keys(prompt)],
            "prompt_tokens": len(prompt),
        }
        return self.http.post(f"{self.url(control)}place", json=body, headers=CLIENT)

    def generate(self, instance: str, prompt: Sequence[int]) -> httpx.Response:
        """POST generate (one token) at ``instance``: it computes and publishes the blocks."""
        body = {"prompt": list(prompt), "max_tokens": 1}
        return self.http.post(f"{self.url(instance)}generate", json=body, headers=CLIENT)

    def holders_of(self, block: Block) -> set[str]:
        return {r.holder for r in self.replicas(block)}

    def listed(self, block: Block, holders: set[str], timeout: float = 15.0) -> None:
        """Wait until the IS names exactly ``holders`` for ``block``."""

        def check() -> bool | None:
            return True if self.holders_of(block) == holders else None

        eventually(check, timeout, f"the IS to list {sorted(holders)} for {block.key.hex()[:8]}")


def _listen_of(base_url: str) -> str:
    """``HOST:PORT`` of a service's ready-file URL (a relay's is JSON: its MOQT address)."""
    if base_url.startswith("{"):
        base_url = json.loads(base_url)["moqt"]
    return base_url.split("://", 1)[-1].split("/", 1)[0]
