"""Every KVSP service app, built with in-memory neighbours, in-process or served by a real
uvicorn process on 127.0.0.1 (for the metrics, logs and OpenAPI tests).

Run as ``python tests/support/operations.py SERVICE --ready-file F`` it serves that app with
:func:`kvsp.web.runner.serve` (JSON logs at ``--log-level``) until SIGTERM.

Outbound calls never leave the process: the PC's directives go to :class:`RefusingPeers`, and
the instance's control plane and index are :class:`MemoryControl`, which knows no replicas, so
a directive never makes the instance fetch from the holders it names.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette

from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.errors import KVSPError
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
from kvsp.web.clock import Clock, SystemClock
from kvsp.web.logs import configure_logging
from kvsp.web.runner import ServeConfig, serve
from relay.holder import HolderConfig as RelayHolderConfig
from relay.holder import RelayHolder
from relay.web import create_app as create_relay_app

SERVICES = ("index", "control", "pc", "holder", "instance", "relay")
ADMIN_TOKEN = "ops-admin-token-0123456789abcdefghijklmn"
METRICS_TOKEN = "ops-metrics-token-0123456789abcdefghijkl"
CLIENT_TOKEN = "ops-client-token-0123456789abcdefghijklm"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
METRICS = {"authorization": f"Bearer {METRICS_TOKEN}"}
CLIENT = {"authorization": f"Bearer {CLIENT_TOKEN}"}
DESCRIPTOR = toy_descriptor(layers=2, kv_heads=2, head_dim=8, kv_dtype="fp16", block_tokens=4)
SCOPE_KEY = bytes(range(1, 33))
SCOPE = scope_id(SCOPE_KEY)


def principals() -> Principals:
    """An admin (every scope), a scrape-only ``metrics`` principal and a client of ``SCOPE``."""
    return Principals.from_entries(
        [
            principal_entry("admin", ADMIN_TOKEN, ["admin"], None),
            principal_entry("prometheus", METRICS_TOKEN, ["metrics"], []),
            principal_entry("client", CLIENT_TOKEN, ["client"], [SCOPE]),
        ]
    )


class RefusingPeers:
    """The PC's instances, none reachable: every directive and state change fails at once."""

    def __init__(self) -> None:
        self.directives: list[tuple[str, PrefetchDirective]] = []

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        self.directives.append((instance, directive))
        raise KVSPError(f"{instance} is not reachable from the test")

    async def put_state(self, instance: str, state: InstanceState) -> None:
        raise KVSPError(f"{instance} is not reachable from the test")


class MemoryControl:
    """An instance's PC and IS in memory: statuses answered with the reported state, records
    kept, no replicas found."""

    def __init__(self) -> None:
        self.published: list[ReplicaRecord] = []

    async def put_status(self, record: InstanceStatusRecord, /) -> StateAnswer:
        return StateAnswer(state=record.state)

    async def lookup(self, request: LookupRequest, /) -> LookupResponse:
        return LookupResponse(matched=0, replicas=())

    async def publish(self, record: ReplicaRecord, /) -> int:
        self.published.append(record)
        return record.ttl_ms

    async def publish_batch(self, records: Sequence[ReplicaRecord], /) -> list[Any]:
        return [await self.publish(r) for r in records]

    async def withdraw(self, compat: bytes, scope: bytes, key: bytes, holder: str, /) -> bool:
        return True


def _registry() -> DescriptorRegistry:
    registry = DescriptorRegistry()
    registry.add(DESCRIPTOR, persist=False)
    return registry


def build_app(service: str, tmp_path: Path, clock: Clock | None = None) -> Starlette:
    """The app of ``service`` (one of :data:`SERVICES`) with in-memory neighbours."""
    clock = clock or SystemClock()
    if service == "index":
        return create_index_app(
            IndexConfig(gc_freeze_interval_s=None),  # no gc.collect() in the test process
            store=MemoryStore(),
            principals=principals(),
            clock=clock,
            descriptors=_registry(),
        )
    if service == "control":
        return create_control_app(
            IndexConfig(gc_freeze_interval_s=None),  # no gc.collect() in the test process
            store=MemoryStore(),
            principals=principals(),
            clock=clock,
            descriptors=_registry(),
            peers=RefusingPeers(),
        )
    if service == "pc":
        registry = _registry()
        index = IndexService(MemoryStore(), max_ttl_ms=600_000, descriptors=registry)
        pc = PlacementController(
            InstanceRegistry(SleepPolicy(threshold_load=0.0, min_low_ms=60_000)),
            LocalIndex(index, registry),
            RefusingPeers(),
            clock,
            PCConfig(),
        )
        return create_pc_app(pc, principals=principals(), clock=clock)
    if service == "holder":
        holder = Holder(
            HolderConfig(public_url="http://127.0.0.1:9/"),
            index=None,
            descriptors=_registry(),
            clock=clock,
        )
        return create_holder_app(holder, principals(), clock, HolderConfig())
    if service == "instance":
        return _instance_app(tmp_path, clock)
    if service == "relay":
        holder = RelayHolder(RelayHolderConfig(), clock, None)
        return create_relay_app(holder, principals(), clock)
    raise ValueError(service)


def _instance_app(tmp_path: Path, clock: Clock) -> Starlette:
    control = MemoryControl()
    registry = _registry()
    holder = Holder(HolderConfig(), index=control, descriptors=registry, clock=clock)
    config = InstanceConfig(
        public_url="http://127.0.0.1:9/",
        status_loop=False,
        state_dir=tmp_path / "instance-state",
        scope_keys={SCOPE: SCOPE_KEY},
        warmup_tokens=8,
        max_tokens=64,
    )
    engine = ToyEngine(DESCRIPTOR)
    agent = InstanceAgent(engine, holder, control, BlockClient(ADMIN_TOKEN), control, clock, config)
    return create_instance_app(agent, principals(), clock, descriptors=registry)


def main(argv: list[str]) -> int:
    """Serve one service's test app until SIGTERM (see the module docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("service", choices=SERVICES)
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    configure_logging("json", args.log_level)
    app = build_app(args.service, Path(tempfile.mkdtemp(prefix="kvsp-ops-")))
    return serve(app, ServeConfig(ready_file=args.ready_file, log_level=args.log_level))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
