"""The services under the authorization matrix, in-process: one fresh environment per request,
seeded by a ``root`` principal with blocks, records, leases and directives in two scopes.

Every principal of the matrix has exactly one scope, ``A`` (its own); ``B`` is another's. The
holder principal may publish for ``H_URI``, the instance principal for ``II_URI``; ``pc``,
``client`` and ``admin`` name no holder (admin may publish for any, DESIGN.md §3).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvsp.compat import compat_id
from kvsp.container import Geometry, encode_container, replica_digest
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.ids import uri_id
from kvsp.index import IndexService
from kvsp.keys import scope_id
from kvsp.lifecycle import InstanceRegistry, SleepPolicy
from kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    ReplicaRecord,
    StateAnswer,
)
from kvsp.registries import InstanceState
from kvsp.services.control import LocalIndex, create_control_app
from kvsp.services.holder.app import create_holder_app
from kvsp.services.holder.service import Holder, HolderConfig
from kvsp.services.index.app import IndexConfig, create_index_app
from kvsp.services.instance.app import create_instance_app
from kvsp.services.instance.service import InstanceAgent, InstanceConfig
from kvsp.services.pc.app import create_pc_app
from kvsp.services.pc.service import PCConfig, PlacementController
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.memory import MemoryStore
from kvsp.transfer.block_client import BlockClient
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import ManualClock
from relay.holder import HolderConfig as RelayHolderConfig
from relay.holder import RelayHolder
from relay.kv import BlockTrack, KVReplica
from relay.web import create_app as create_relay_web_app

NOW = 1_000_000
ROLES = ("holder", "instance", "pc", "client", "admin")
DESCRIPTOR = toy_descriptor(layers=2, kv_heads=2, head_dim=8, kv_dtype="fp16", block_tokens=4)
OTHER_DESCRIPTOR = toy_descriptor(layers=3, kv_heads=2, head_dim=8, kv_dtype="fp16", block_tokens=4)
COMPAT = compat_id(DESCRIPTOR)
GEOMETRY = Geometry.from_descriptor(DESCRIPTOR)
KEY_A = bytes(range(1, 33))
KEY_B = bytes(range(50, 82))
SCOPES = {"own": scope_id(KEY_A), "other": scope_id(KEY_B)}
STORED = b"\x11" * 32
"""The block key every environment holds (or indexes) in both scopes."""
FRESH = b"\x22" * 32
"""A block key no environment holds yet."""
H_URI = "http://holder.test/"
II_URI = "http://ii.test/"
II_OTHER = "http://ii-other.test/"
URIS = {"own": II_URI, "other": II_OTHER}
DIRECTIVES = {
    "own": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10",
    "other": "b3c8d0f1-2a4e-4d2b-9a6c-7e3f0b8d4c21",
}


def token(name: str) -> str:
    """The bearer token of principal ``name``."""
    return f"authz-{name}-token-0123456789abcdef"


def bearer(name: str) -> dict[str, str]:
    """The Authorization header of principal ``name``."""
    return {"authorization": f"Bearer {token(name)}"}


def principals() -> Principals:
    """One principal per role (scope A only), ``root`` (admin, every scope), ``expired``."""
    holders = {"holder": [H_URI], "instance": [II_URI]}
    entries = [
        principal_entry(r, token(r), [r], [SCOPES["own"]], holders.get(r, [])) for r in ROLES
    ]
    entries.append(principal_entry("root", token("root"), ["admin"], None))
    entries.append(principal_entry("expired", token("expired"), ["admin"], None, expires_ms=NOW))
    return Principals.from_entries(entries)


def container(seed: int) -> bytes:
    """A block of DESCRIPTOR's geometry (2 layers, 4 tokens)."""
    section = GEOMETRY.section_length(4)
    layers = [
        (bytes([seed, i]) * (section // 2), bytes([i, seed]) * (section // 2)) for i in (0, 1)
    ]
    return encode_container(layers, first_layer=0, token_count=4, geometry=GEOMETRY)


def layer_digests(data: bytes) -> list[bytes]:
    """The layer digests of a :func:`container`."""
    section = GEOMETRY.section_length(4)
    start = len(data) - 4 * section
    return [
        hashlib.sha256(data[start + i * 2 * section : start + (i + 1) * 2 * section]).digest()
        for i in (0, 1)
    ]


def record_json(side: str, key: bytes = STORED, holder: str = H_URI) -> dict[str, Any]:
    """A Replica Record of ``key`` in the scope of ``side``, held by ``holder``."""
    data = container(1)
    digests = layer_digests(data)
    return {
        "block_key": key.hex(),
        "compat_id": COMPAT.hex(),
        "scope_id": SCOPES[side].hex(),
        "holder": holder,
        "codec": 1,
        "size": len(data),
        "digest": "sha-256:" + replica_digest(digests).hex(),
        "layer_digests": [d.hex() for d in digests],
        "ttl_ms": 60_000,
    }


def replica_path(side: str, key: bytes = STORED, holder: str = H_URI) -> str:
    """The IS resource of a record (DESIGN.md §3)."""
    return f"replicas/{COMPAT.hex()}/{SCOPES[side].hex()}/{key.hex()}/{uri_id(holder)}"


def block_path(side: str, key: bytes = STORED) -> str:
    """The holder resource of a block (§6.7)."""
    return f"blocks/{COMPAT.hex()}/{SCOPES[side].hex()}/{key.hex()}"


def status_json(instance: str = II_URI) -> dict[str, Any]:
    """An active Instance Status Record of ``instance`` with a link to ``H_URI``."""
    return {
        "instance": instance,
        "epoch": 1,
        "state": "active",
        "running": 0,
        "queued": 0,
        "batch_size": 8,
        "kv_utilization": 0.1,
        "prefill_tokens_per_s": 10000,
        "decode_tokens_per_s": 1000,
        "links": [{"holder": H_URI, "mbit_per_s": 1000, "rtt_us": 10}],
        "ttl_ms": 60_000,
    }


def directive_json(side: str) -> dict[str, Any]:
    """A prefetch directive for the scope of ``side`` from an unreachable source."""
    return {
        "directive": DIRECTIVES[side],
        "request_ref": "ref",
        "scope_id": SCOPES[side].hex(),
        "compat_id": COMPAT.hex(),
        "blocks": [{"block_key": FRESH.hex(), "sources": ["http://127.0.0.1:9/"]}],
        "layer_order": "ascending",
        "deadline_ms": 5000,
        "lease_ms": 2000,
    }


def lease_json(side: str) -> dict[str, Any]:
    """A lease request for ``STORED`` in the scope of ``side`` (§6.6)."""
    return {
        "compat_id": COMPAT.hex(),
        "scope_id": SCOPES[side].hex(),
        "block_keys": [STORED.hex()],
        "ttl_ms": 2000,
    }


class Peers:
    """The PC's instances: they take every directive and state change."""

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        return None

    async def put_state(self, instance: str, state: InstanceState) -> None:
        return None


class NoIndex:
    """The IS as an instance sees it, answering locally (no replicas anywhere)."""

    async def put_status(self, record: InstanceStatusRecord, /) -> StateAnswer:
        return StateAnswer(state=record.state)

    async def lookup(self, request: LookupRequest, /) -> LookupResponse:
        return LookupResponse(matched=0, replicas=())

    async def publish(self, record: ReplicaRecord, /) -> int:
        return record.ttl_ms

    async def publish_batch(self, records: Any, /) -> list[Any]:
        return [r.ttl_ms for r in records]

    async def withdraw(self, compat: bytes, scope: bytes, key: bytes, holder: str, /) -> bool:
        return True


@dataclass
class Env:
    """One service app with an HTTP client into it and the root principal's helpers."""

    http: httpx.AsyncClient
    notes: dict[str, Any] = field(default_factory=dict)

    async def root(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """A request as ``root``; it must succeed."""
        headers = {**kwargs.pop("headers", {}), **bearer("root")}
        answer = await self.http.request(method, url, headers=headers, **kwargs)
        if answer.status_code >= 300:
            raise AssertionError(f"seeding {method} {url}: {answer.status_code} {answer.text}")
        return answer


def _client(app: Any, base: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url=base)


def _registry() -> DescriptorRegistry:
    registry = DescriptorRegistry()
    registry.add(DESCRIPTOR, persist=False)
    return registry


async def _seed_index(env: Env) -> None:
    for side in SCOPES:
        await env.root("PUT", replica_path(side), json=record_json(side))


@asynccontextmanager
async def index_env(tmp_path: Path) -> AsyncIterator[Env]:
    """The Index Service alone (``kvsp serve index``)."""
    app = create_index_app(
        IndexConfig(gc_freeze_interval_s=None),
        store=MemoryStore(),
        principals=principals(),
        clock=ManualClock(NOW),
        descriptors=_registry(),
    )
    async with _client(app, "http://is.test/") as http:
        env = Env(http)
        await _seed_index(env)
        yield env


@asynccontextmanager
async def control_env(tmp_path: Path) -> AsyncIterator[Env]:
    """IS and PC in one process (``kvsp serve control``), with one active instance."""
    app = create_control_app(
        IndexConfig(gc_freeze_interval_s=None),
        store=MemoryStore(),
        principals=principals(),
        clock=ManualClock(NOW),
        descriptors=_registry(),
        peers=Peers(),
        pc_config=PCConfig(),
    )
    async with _client(app, "http://control.test/") as http:
        env = Env(http)
        await _seed_index(env)
        await env.root("PUT", f"instances/{uri_id(II_URI)}/status", json=status_json())
        yield env


@asynccontextmanager
async def pc_env(tmp_path: Path) -> AsyncIterator[Env]:
    """The PC alone (``kvsp serve pc``) over an in-process index, with one active instance."""
    clock = ManualClock(NOW)
    registry = _registry()
    index = IndexService(MemoryStore(), max_ttl_ms=600_000, descriptors=registry)
    pc = PlacementController(
        InstanceRegistry(SleepPolicy(threshold_load=0.0, min_low_ms=10**9)),
        LocalIndex(index, registry),
        Peers(),
        clock,
        PCConfig(),
    )
    app = create_pc_app(pc, principals=principals(), clock=clock)
    async with _client(app, "http://pc.test/") as http:
        env = Env(http)
        await env.root("PUT", f"instances/{uri_id(II_URI)}/status", json=status_json())
        yield env


async def _seed_blocks(env: Env) -> None:
    headers = {"if-none-match": "*", "content-type": "application/kvsp-block"}
    for side in SCOPES:
        await env.root("PUT", block_path(side), content=container(1), headers=headers)
    other = await env.root("POST", "leases", json=lease_json("other"))
    env.notes["root_lease"] = other.json()["lease"]
    own = await env.root("POST", "leases", json=lease_json("own"))
    env.notes["root_lease_own"] = own.json()["lease"]


@asynccontextmanager
async def holder_env(tmp_path: Path) -> AsyncIterator[Env]:
    """A standalone holder (``kvsp serve holder``) holding ``STORED`` in both scopes."""
    clock = ManualClock(NOW)
    registry = _registry()
    config = HolderConfig(public_url=H_URI)
    holder = Holder(config, index=None, descriptors=registry, clock=clock)
    app = create_holder_app(holder, principals(), clock, config)
    async with _client(app, H_URI) as http:
        env = Env(http)
        await _seed_blocks(env)
        yield env


@asynccontextmanager
async def instance_env(tmp_path: Path) -> AsyncIterator[Env]:
    """An inference instance (toy engine) with keys for both scopes, holding ``STORED`` in both
    and running a directive in each."""
    clock = ManualClock(NOW)
    control = NoIndex()
    engine = ToyEngine(DESCRIPTOR)
    registry = _registry()
    holder = Holder(HolderConfig(), index=control, descriptors=registry, clock=clock)
    blocks = BlockClient(token("root"))
    config = InstanceConfig(
        public_url=II_URI,
        status_loop=False,
        state_dir=tmp_path / "state",
        scope_keys={SCOPES["own"]: KEY_A, SCOPES["other"]: KEY_B},
        warmup_tokens=8,
        max_tokens=100,
    )
    agent = InstanceAgent(engine, holder, control, blocks, control, clock, config)
    app = create_instance_app(agent, principals(), clock, descriptors=registry)
    async with AsyncExitStack() as stack:
        await agent.start()
        stack.push_async_callback(engine.aclose)
        stack.push_async_callback(blocks.aclose)
        stack.push_async_callback(agent.close)
        http = await stack.enter_async_context(_client(app, II_URI))
        env = Env(http)
        await _seed_blocks(env)
        for side in SCOPES:
            await env.root("POST", "prefetch", json=directive_json(side))
        yield env


@asynccontextmanager
async def relay_env(tmp_path: Path) -> AsyncIterator[Env]:
    """The relay's HTTP holder face, the relay holding ``STORED`` in both scopes."""
    clock = ManualClock(NOW)
    holder = RelayHolder(RelayHolderConfig(), clock, holder_url="moqt://relay.test:4443")
    digests = tuple(layer_digests(container(1)))
    digest = replica_digest(digests)
    for side in SCOPES:
        namespace = (b"kvsp", b"1", COMPAT.hex().encode(), SCOPES[side].hex().encode())
        track = (namespace + (STORED.hex().encode(),), digest.hex().encode())
        block = BlockTrack(COMPAT, SCOPES[side], STORED, digest)  # type: ignore[arg-type]
        holder.add(KVReplica(block, track, digests, len(container(1)), None))
    app = create_relay_web_app(holder, principals(), clock)
    async with _client(app, "http://relay-face.test/") as http:
        env = Env(http)
        other = await env.root("POST", "leases", json=lease_json("other"))
        env.notes["root_lease"] = other.json()["lease"]
        own = await env.root("POST", "leases", json=lease_json("own"))
        env.notes["root_lease_own"] = own.json()["lease"]
        yield env


EnvFactory = Callable[[Path], Any]
ENVIRONMENTS: dict[str, EnvFactory] = {
    "index": index_env,
    "control": control_env,
    "pc": pc_env,
    "holder": holder_env,
    "instance": instance_env,
    "relay-face": relay_env,
}
"""Each HTTP service by name: IS, IS+PC, PC, holder, instance, the relay's web face."""
