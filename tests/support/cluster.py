"""A KVSP cluster of real processes on 127.0.0.1 for acceptance tests (DESIGN.md §1): ``kvsp
serve control`` (IS + PC), one standalone ``kvsp serve holder`` and toy-engine instances
(``kvsp serve instance --engine toy``), all sharing one principals file.

:class:`Cluster` starts, kills, freezes and restarts the processes and wraps the HTTP calls the
tests make; every wait is a bounded poll (:func:`tests.support.polling.eventually`).
:func:`expected_choice` recomputes a placement with :func:`kvsp.placement.choose_instance` from
the inputs the PC had: the instances' status records, the PC's view of their load and service
times, and the IS's replica records.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvsp.compat import compat_id
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.ids import BlockKey, uri_id
from kvsp.keys import block_keys, scope_id
from kvsp.placement import (
    AssumedLink,
    PlacementDecision,
    ServiceTimeEstimator,
    choose_instance,
)
from kvsp.records import InstanceStatusRecord, ReplicaRecord
from kvsp.registries import InstanceState
from kvsp.services.pc.service import PCConfig
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from tests.support.polling import eventually

PC_DEFAULTS = PCConfig()  # the control plane runs with the default assumed link


# Wide states make a block dear to recompute (3 * width^2 multiply-adds per token and layer)
# next to its octets (2 * width per token and layer), so that on this toy engine, as on a real
# model, loading a cached prefix is plainly cheaper than recomputing it under §6.4.
DESCRIPTOR = toy_descriptor(layers=2, kv_heads=4, head_dim=128, kv_dtype="int8", block_tokens=32)
COMPAT = compat_id(DESCRIPTOR)
B = DESCRIPTOR.block_tokens
SCOPE_KEY = bytes(range(101, 133))
SCOPE = scope_id(SCOPE_KEY)
ADMIN_TOKEN = "cluster-test-admin-token-0123456789abcdef"
CLIENT_TOKEN = "cluster-test-client-token-0123456789abcde"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
CLIENT = {"authorization": f"Bearer {CLIENT_TOKEN}"}
STATUS_TTL_MS = 900
SERVICE_PRIOR_US = 10_000_000.0
"""The PC's assumed mean service time (``--service-prior-us``): a queued request at an
instance adds 10 s to its §6.4 ``wait_us``."""
PROBLEM = "urn:ietf:params:kvsp:problem:"
INSTANCE_STATES = ("active", "draining", "sleeping", "failed")


def keys_of(prompt: Sequence[int]) -> list[BlockKey]:
    """The §4.2 Block Keys of ``prompt`` in the cluster's scope."""
    return block_keys(SCOPE_KEY, COMPAT, prompt, B)


def hexes(keys: Sequence[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def prompt_of(blocks: int, seed: int, tail: int = 0) -> list[int]:
    """A prompt of ``blocks`` whole blocks and ``tail`` more tokens, distinct per ``seed``."""
    return [(seed * 7_919 + i * 31) % 30_011 for i in range(blocks * B + tail)]


def reference(prompt: Sequence[int], count: int) -> tuple[list[int], list[bytes]]:
    """Tokens and block containers of a toy engine computing ``prompt`` from scratch."""

    async def compute() -> tuple[list[int], list[bytes]]:
        engine = ToyEngine(DESCRIPTOR)
        try:
            seq = await engine.prefill(list(prompt), [])
            tokens = [t async for t in seq.tokens(count)]
            containers = [block.container for block in seq.computed]
            await seq.release()
        finally:
            await engine.aclose()
        return tokens, containers

    return asyncio.run(compute())


@dataclass
class Generation:
    """A finished POST generate: status, the prompt-block headers and the NDJSON lines."""

    status: int
    loaded_blocks: int
    computed_blocks: int
    lines: list[dict[str, Any]]
    body: str

    @property
    def tokens(self) -> list[int]:
        return [line["token"] for line in self.lines]


class PCServiceTimes(ServiceTimeEstimator):
    """The PC's service times as ``GET instances`` shows them: an instance's measured mean,
    else the mean of those measured, else the prior (as ``ObservedServiceTimes`` does)."""

    def __init__(self, rows: Mapping[str, Mapping[str, Any]], prior_us: float) -> None:
        super().__init__(prior_us=prior_us)
        self.measured = {
            uri: float(row["mean_service_us"])
            for uri, row in rows.items()
            if row["mean_service_us"] is not None
        }
        values = list(self.measured.values())
        self.fleet = sum(values) / len(values) if values else prior_us

    def mean_us(self, instance: str) -> float:
        return self.measured.get(instance, self.fleet)


@dataclass
class Cluster:
    """The processes of one cluster and an HTTP client to talk to them."""

    folder: Path
    http: httpx.Client
    services: dict[str, RunningService] = field(default_factory=dict)
    instance_args: dict[str, list[str]] = field(default_factory=dict)
    probes: dict[str, list[int]] = field(default_factory=dict)

    # -- processes ------------------------------------------------------------------------------

    @property
    def control(self) -> str:
        return self.services["control"].base_url

    @property
    def holder(self) -> str:
        return self.services["holder"].base_url

    def url(self, name: str) -> str:
        """The base URL of service ``name``."""
        return self.services[name].base_url

    def name_of(self, url: str) -> str:
        """The service name of a base URL."""
        return next(n for n, s in self.services.items() if s.base_url == url)

    @property
    def instance_names(self) -> list[str]:
        return sorted(self.instance_args)

    def _serve(self, name: str, service: str, *argv: str, listen: str = "127.0.0.1:0") -> None:
        work = self.folder / name
        work.mkdir(exist_ok=True)
        log = work / "output.log"
        if log.exists():  # a restart: keep the earlier run's output
            log.rename(work / f"output-{time.monotonic_ns()}.log")
        (work / "ready").unlink(missing_ok=True)
        command = [
            *(sys.executable, "-m", "kvsp", "serve", service, "--listen", listen),
            *("--state", str(work / "state"), "--principals", str(self.folder / "principals")),
            *argv,
        ]
        self.services[name] = start_process(command, workdir=work, ready_timeout=90)

    def start_instance(self, name: str, *extra: str, listen: str = "127.0.0.1:0") -> None:
        """Start instance ``name`` (again at ``listen`` with its old options on a restart)."""
        self.instance_args.setdefault(name, list(extra))
        self._serve(
            name,
            "instance",
            *("--pc", self.control, "--token-file", str(self.folder / "admin.token")),
            *("--engine", "toy", "--descriptor", str(self.folder / "descriptor.json")),
            *("--scope-key-file", str(self.folder / "scope.key")),
            *("--status-ttl-ms", str(STATUS_TTL_MS)),
            *self.instance_args[name],
            listen=listen,
        )

    def restart_instance(self, name: str) -> None:
        """Stop instance ``name`` (if running) and start it at its old address with its old
        state folder, so that it comes back as the same instance with a new epoch."""
        old = self.services[name]
        old.stop()
        self.start_instance(name, listen=old.base_url.removeprefix("http://").rstrip("/"))

    def alive(self, name: str) -> bool:
        return self.services[name].proc.poll() is None

    def kill(self, name: str) -> None:
        """SIGKILL service ``name``: no withdrawal, no last status."""
        proc = self.services[name].proc
        proc.kill()
        proc.wait()

    def freeze(self, name: str) -> None:
        """SIGSTOP service ``name``: it keeps accepting connections but answers nothing."""
        self.services[name].proc.send_signal(signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        """SIGCONT service ``name``."""
        if self.alive(name):
            self.services[name].proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for name in reversed(list(self.services)):
            self.thaw(name)
            self.services[name].stop()

    # -- the PC and the IS ----------------------------------------------------------------------

    def instances(self) -> dict[str, dict[str, Any]]:
        """GET instances at the PC, by instance URI."""
        answer = self.http.get(f"{self.control}instances", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        return {row["instance"]: row for row in answer.json()["instances"]}

    def row(self, name: str) -> dict[str, Any]:
        """The PC's row for instance ``name``."""
        return self.instances()[self.url(name)]

    def row_if_any(self, name: str) -> dict[str, Any] | None:
        """The PC's row for instance ``name``, None while it has none (an instance that left
        ends its epoch, and its next incarnation has not registered yet)."""
        return self.instances().get(self.url(name))

    def set_state(self, name: str, state: str) -> httpx.Response:
        """PUT instances/{id}/state at the PC (which forwards it to the instance)."""
        path = f"{self.control}instances/{uri_id(self.url(name))}/state"
        return self.http.put(path, json={"state": state}, headers=ADMIN)

    def place(self, prompt: Sequence[int], **extra: Any) -> httpx.Response:
        """POST place for ``prompt`` as the client (``extra``: deadline_ms, lease_ms, ...)."""
        body = {
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "block_keys": hexes(keys_of(prompt)),
            "prompt_tokens": len(prompt),
            **extra,
        }
        return self.http.post(f"{self.control}place", json=body, headers=CLIENT)

    def put_status(self, record: Mapping[str, Any]) -> httpx.Response:
        """PUT an Instance Status Record at the PC (as an admin may for any instance)."""
        path = f"{self.control}instances/{uri_id(record['instance'])}/status"
        return self.http.put(path, json=dict(record), headers=ADMIN)

    def lookup(self, keys: Sequence[bytes]) -> dict[str, Any]:
        """POST lookup at the IS."""
        body = {"scope_id": SCOPE.hex(), "compat_id": COMPAT.hex(), "block_keys": hexes(keys)}
        answer = self.http.post(f"{self.control}lookup", json=body, headers=CLIENT)
        assert answer.status_code == 200, answer.text
        result: dict[str, Any] = answer.json()
        return result

    def holders_of(self, keys: Sequence[bytes]) -> list[set[str]]:
        """The holders the IS names for each matched key, in prefix order."""
        return [{r["holder"] for r in records} for records in self.lookup(keys)["replicas"]]

    def published(self, keys: Sequence[bytes], holder: str, timeout: float = 20) -> None:
        """Wait until the IS names ``holder`` for every key."""

        def done() -> bool | None:
            found = self.holders_of(keys)
            return True if len(found) == len(keys) and all(holder in h for h in found) else None

        eventually(done, timeout, f"{len(keys)} replicas of {holder} at the IS")

    # -- instances and the holder ----------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        """GET status at instance ``name``: the record it would send now."""
        answer = self.http.get(f"{self.url(name)}status", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        result: dict[str, Any] = answer.json()
        return result

    def directive(self, name: str, directive: str) -> httpx.Response:
        """GET prefetch/{directive} at instance ``name``."""
        return self.http.get(f"{self.url(name)}prefetch/{directive}", headers=ADMIN)

    def directive_outcome(self, name: str, directive: str, timeout: float = 30) -> dict[str, Any]:
        """The directive's status at ``name`` once it is no longer pending."""

        def final() -> dict[str, Any] | None:
            answer = self.directive(name, directive)
            assert answer.status_code == 200, answer.text
            body: dict[str, Any] = answer.json()
            return body if body["state"] != "pending" else None

        return eventually(final, timeout, f"directive {directive} at {name} to stop")

    def prefetch(self, name: str, keys: Sequence[bytes], source: str) -> str:
        """POST a directive straight to instance ``name``, as a PC would; returns its id."""
        directive = str(uuid.uuid4())
        body = {
            "directive": directive,
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "blocks": [{"block_key": k.hex(), "sources": [source]} for k in keys],
            "layer_order": "ascending",
            "deadline_ms": 30_000,
            "lease_ms": 10_000,
        }
        answer = self.http.post(f"{self.url(name)}prefetch", json=body, headers=ADMIN)
        assert answer.status_code == 202, answer.text
        return directive

    def generate(self, name: str, prompt: Sequence[int], max_tokens: int) -> Generation:
        """POST generate at instance ``name`` and read the whole NDJSON answer."""
        body = {"prompt": list(prompt), "max_tokens": max_tokens}
        answer = self.http.post(f"{self.url(name)}generate", json=body, headers=CLIENT)
        ndjson = answer.headers.get("content-type", "").startswith("application/x-ndjson")
        return Generation(
            status=answer.status_code,
            loaded_blocks=int(answer.headers.get("kvsp-loaded-blocks", -1)),
            computed_blocks=int(answer.headers.get("kvsp-computed-blocks", -1)),
            lines=[json.loads(line) for line in answer.text.splitlines()] if ndjson else [],
            body=answer.text,
        )

    def hold_generation(self, name: str, prompt: Sequence[int]) -> socket.socket:
        """Open a long generation at ``name`` whose answer nobody reads; closing the returned
        socket ends it."""
        host, port = self.url(name).removeprefix("http://").rstrip("/").rsplit(":", 1)
        body = json.dumps({"prompt": list(prompt), "max_tokens": 4096}).encode()
        head = (
            f"POST /generate HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {CLIENT_TOKEN}\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        sock = socket.create_connection((host, int(port)), timeout=10)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(head.encode() + body)
        except BaseException:
            sock.close()
            raise
        return sock

    def store_at_holder(self, prompt: Sequence[int], first: int = 0) -> list[BlockKey]:
        """PUT blocks ``first``.. of ``prompt`` (computed here) at the standalone holder, which
        publishes them; returns the keys of all of the prompt's blocks once the IS names the
        holder for the stored ones."""
        keys = keys_of(prompt)
        _, containers = reference(prompt, 0)
        headers = ADMIN | {"if-none-match": "*", "content-type": "application/kvsp-block"}
        for key, data in list(zip(keys, containers, strict=True))[first:]:
            url = f"{self.holder}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key.hex()}"
            answer = self.http.put(url, content=data, headers=headers)
            assert answer.status_code == 201, answer.text

        def stored() -> bool | None:
            records = self.lookup(keys[first:])["replicas"]
            ok = len(records) == len(keys) - first and all(
                self.holder in {r["holder"] for r in rs} for rs in records
            )
            return True if ok else None

        eventually(stored, what="the holder's replicas at the IS")
        return keys

    def teach_link(self, name: str, source: str) -> None:
        """Make instance ``name`` measure a link to holder ``source`` (an instance name or
        ``"holder"``) by loading one probe block from it (§4.4 ``links`` are measured)."""
        if source not in self.probes:
            probe = prompt_of(1, 90_000 + len(self.probes))
            if source == "holder":
                self.store_at_holder(probe)
            else:
                made = self.generate(source, probe, 1)
                assert made.status == 200, made.body
                self.published(keys_of(probe), self.url(source))
            self.probes[source] = probe
        directive = self.prefetch(name, keys_of(self.probes[source]), self.url(source))
        outcome = self.directive_outcome(name, directive)
        assert outcome["state"] == "complete", outcome
        links = eventually(
            lambda: (
                [x for x in self.status(name)["links"] if x["holder"] == self.url(source)] or None
            ),
            what=f"{name} to report a link to {source}",
        )
        assert links[0]["mbit_per_s"] > 0

    # -- readiness -------------------------------------------------------------------------------

    def fresh(self, names: Sequence[str], since: float) -> bool | None:
        """Whether the PC shows ``names`` active with records that arrived after ``since``
        (``time.monotonic()``)."""
        rows = self.instances()
        now = time.monotonic()
        for name in names:
            row = rows.get(self.url(name))
            if row is None or row["state"] != "active" or row["reported_state"] != "active":
                return None
            if row["age_ms"] / 1000 >= now - since:
                return None
        return True

    def settle(self, names: Sequence[str] | None = None, timeout: float = 20) -> None:
        """Wait until every instance of ``names`` (default all) reported itself active after
        this call began, so that the PC's records are what their ``GET status`` shows now."""
        since = time.monotonic()
        chosen = self.instance_names if names is None else names
        eventually(lambda: self.fresh(chosen, since), timeout, f"fresh records of {chosen}")

    def heal(self) -> None:
        """Bring the cluster back to all instances active: thaw the holder, restart dead
        instances, wake drained or sleeping ones."""
        self.thaw("holder")
        for name in self.instance_names:
            if not self.alive(name):
                self.restart_instance(name)
        for name in self.instance_names:
            row = self.instances().get(self.url(name))
            if row is not None and row["state"] in ("draining", "sleeping"):
                answer = self.set_state(name, "active")
                assert answer.status_code == 200, answer.text
        self.settle(timeout=30)

    # -- §6.4 from the same inputs -----------------------------------------------------------------

    def expected_choice(
        self, prompt: Sequence[int], rows: Mapping[str, Mapping[str, Any]]
    ) -> PlacementDecision | None:
        """What :func:`choose_instance` picks for ``prompt`` from the IS's replica records, the
        instances' status records, and the PC's state, load and service times in ``rows``."""
        found = self.lookup(keys_of(prompt))
        replicas = [[ReplicaRecord.from_json(r) for r in rs] for rs in found["replicas"]]
        candidates = []
        for name in self.instance_names:
            row = rows.get(self.url(name))
            if row is None or row["state"] != "active" or not self.alive(name):
                continue
            record = InstanceStatusRecord.from_json(self.status(name))
            candidates.append(
                dataclasses.replace(
                    record,
                    state=InstanceState.ACTIVE,
                    running=row["running"],
                    queued=row["queued"],
                )
            )
        return choose_instance(
            candidates,
            replicas,
            block_tokens=B,
            prompt_tokens=len(prompt),
            service_times=PCServiceTimes(rows, SERVICE_PRIOR_US),
            layers=DESCRIPTOR.layers,
            # The PC assumes a link rate to same-site holders an instance has not measured.
            assumed=AssumedLink(
                mbit_per_s=PC_DEFAULTS.assumed_link_mbit_per_s,
                rtt_us=PC_DEFAULTS.assumed_link_rtt_us,
            ),
        )

    def place_as_formula(
        self, prompt: Sequence[int], **extra: Any
    ) -> tuple[dict[str, Any], PlacementDecision]:
        """POST place and check the answer against :meth:`expected_choice`, computed from the
        inputs just before the call. Call it on a quiet cluster: no directive loading, and
        records settled (:meth:`settle`) since rates or links changed.

        The first answer that matches the formula is taken: a place that sends a directive
        changes the inputs itself (the target loads blocks, measures its link), so the view
        after the call need not give the same choice again. An answer that does not match
        is a failure unless the PC's view of the instances (state, load, rates, links,
        residency) moved during the call; then the call is tried again, at most twice.
        """
        for _ in range(3):
            before = self.instances()
            expected = self.expected_choice(prompt, before)
            answer = self.place(prompt, **extra)
            assert answer.status_code == 200, answer.text
            assert expected is not None, answer.text
            body: dict[str, Any] = answer.json()
            if body["instance"] == expected.instance and math.isclose(
                body["cost"], expected.estimate.cost_us, rel_tol=1e-6
            ):
                return body, expected
            after = self.instances()
            again = self.expected_choice(prompt, after)
            moved = _load(after) != _load(before) or (
                again is None
                or (again.instance, again.estimate.cost_us)
                != (expected.instance, expected.estimate.cost_us)
            )
            assert moved, (body, expected)  # same inputs throughout, yet another answer
        raise AssertionError("the PC's view of the instances kept moving during place")


def _load(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[Any, ...]]:
    keep = ("state", "epoch", "running", "queued", "mean_service_us")
    return {uri: tuple(row[k] for k in keep) for uri, row in rows.items()}


def start_cluster(
    folder: Path, instances: Mapping[str, Sequence[str]], control: Sequence[str]
) -> Cluster:
    """Start control (with ``control`` options), the holder and ``instances`` (name → extra
    options) in ``folder``; every process is stopped again if any fails to start."""
    write_principals(
        folder / "principals",
        [
            principal_entry("admin", ADMIN_TOKEN, ["admin"], None),
            principal_entry("client", CLIENT_TOKEN, ["client"], [SCOPE]),
        ],
    )
    (folder / "admin.token").write_text(ADMIN_TOKEN + "\n")
    (folder / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
    (folder / "scope.key").write_text(SCOPE_KEY.hex())
    cluster = Cluster(folder, httpx.Client(timeout=60))
    failures: list[BaseException] = []

    def guarded(start: Callable[..., None], *args: str) -> None:
        try:
            start(*args)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    try:
        token = str(folder / "admin.token")
        descriptor = ("--descriptor", str(folder / "descriptor.json"))
        cluster._serve("control", "control", *descriptor, "--directive-token-file", token, *control)
        holder = ("holder", "holder", "--index", cluster.control, "--index-token-file", token)
        threads = [threading.Thread(target=guarded, args=(cluster._serve, *holder, *descriptor))]
        threads += [
            threading.Thread(target=guarded, args=(cluster.start_instance, name, *extra))
            for name, extra in instances.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        cluster.settle(timeout=60)
    except BaseException:
        cluster.stop()
        cluster.http.close()
        raise
    return cluster
