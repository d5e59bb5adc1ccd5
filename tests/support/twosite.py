"""Two sites of real KVSP processes for the acceptance test of the issue "two sites, several
control planes" (DESIGN.md §1, §3, §4; spec §6.3, §6.4, §6.5, §6.8):

* central, in the test's own network namespace: Redis, two control planes (``kvsp serve
  control --store redis://…``, each IS + PC, listening on the veth address so that the edge
  reaches them), a holder with a disk tier and a toy-engine instance. The holder and the
  instance listen on ``127.0.0.1``: the edge cannot reach them, as in the operator's report
  where the PC named ``http://127.0.0.1:…`` sources an edge instance could not use.
* edge, in a network namespace of its own (:mod:`tests.support.netns`) reachable only through
  the veth pair: a relay (``kvsp serve relay``, MOQT over QUIC and its HTTPS face, with a
  certificate of a private CA naming the veth address) and a toy-engine instance that uses it
  as its edge relay (``--relay``).

The central instance also publishes to the edge relay (``--relay``), so blocks it computes
reach the relay, which publishes its own Replica Records (a ``moqt://`` holder). Every party
has its own principal, limited to the scope and, for holders, to its own URI (as
:mod:`kvsp.demo.cluster` wires them); clients of the control plane are given both control
planes' URLs (one comma-separated value), instances and relay carry ``--site``/``--zone``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvsp.compat import compat_id
from kvsp.demo.procs import reserve_port
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.ids import BlockKey
from kvsp.keys import block_keys, scope_id
from kvsp.web.auth import mint_token, principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from tests.support.netns import Namespace
from tests.support.private_ca import make_private_ca

DESCRIPTOR = toy_descriptor(layers=4, kv_heads=2, head_dim=64, kv_dtype="int8", block_tokens=16)
COMPAT = compat_id(DESCRIPTOR)
B = DESCRIPTOR.block_tokens
SCOPE_KEY = bytes(range(140, 172))
SCOPE = scope_id(SCOPE_KEY)
STATUS_TTL_MS = 1500
"""Instances' status TTL: a PC notices a silent instance within seconds (§6.3)."""
EDGE_PORTS = {"relay": 4443, "relay-http": 4444, "instance": 8470}
"""Ports inside the fresh edge namespace, where nothing else listens."""
PARTIES = ("admin", "client", "control", "holder", "relay", "central", "edge")


def keys_of(prompt: Sequence[int]) -> list[BlockKey]:
    """The §4.2 Block Keys of ``prompt`` in the test scope."""
    return block_keys(SCOPE_KEY, COMPAT, prompt, B)


def prompt_of(blocks: int, seed: int, tail: int = 0) -> list[int]:
    """A prompt of ``blocks`` whole blocks and ``tail`` more tokens, distinct per ``seed``."""
    return [(seed * 7_919 + i * 31) % 30_011 for i in range(blocks * B + tail)]


def reference_tokens(prompt: Sequence[int], count: int) -> list[int]:
    """The tokens a toy engine computing ``prompt`` from scratch generates (greedy)."""

    async def compute() -> list[int]:
        engine = ToyEngine(DESCRIPTOR)
        try:
            seq = await engine.prefill(list(prompt), [])
            tokens = [t async for t in seq.tokens(count)]
            await seq.release()
        finally:
            await engine.aclose()
        return tokens

    return asyncio.run(compute())


@dataclass
class TwoSites:
    """The processes of both sites, their URLs and tokens (see the module docstring)."""

    folder: Path
    ns: Namespace
    redis: str
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30))
    services: dict[str, RunningService] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)

    # -- addresses ------------------------------------------------------------------------------

    @property
    def controls(self) -> list[str]:
        """The two control planes' base URLs, first the one clients try first."""
        return [self.urls["control-a"], self.urls["control-b"]]

    @property
    def control_list(self) -> str:
        """Both control planes as one flag value (contract: several URLs, comma-separated)."""
        return ",".join(self.controls)

    @property
    def relay_moqt(self) -> str:
        """The edge relay's ``moqt://`` URI (its holder URI in Replica Records)."""
        return self.urls["relay"]

    def headers(self, party: str = "admin") -> dict[str, str]:
        """The bearer token header of ``party`` (one of :data:`PARTIES`)."""
        return {"authorization": f"Bearer {self.tokens[party]}"}

    def token_file(self, party: str) -> Path:
        """The file holding ``party``'s token, as the processes are given it."""
        return self.folder / "tokens" / f"{party}.token"

    # -- processes ------------------------------------------------------------------------------

    def _start(
        self, name: str, argv: Sequence[str], *, inside: bool = False, ready_s: float = 60
    ) -> RunningService:
        work = self.folder / name
        work.mkdir(exist_ok=True)
        command = [
            *(sys.executable, "-m", "kvsp", "serve", *argv),
            *("--state", str(work / "state"), "--principals", str(self.folder / "principals")),
            *("--log-level", "info"),
        ]
        if inside:
            command = self.ns.command(command)
        service = start_process(command, workdir=work, ready_timeout=ready_s)
        self.services[name] = service
        return service

    def start_controls(self) -> None:
        """Both control planes, on one Redis, listening on the outer veth address."""
        for name in ("control-a", "control-b"):
            self._start(
                name,
                [
                    *("control", "--listen", self.urls[name].removeprefix("http://")[:-1]),
                    *("--store", f"{self.redis}"),
                    *("--descriptor", str(self.folder / "descriptor.json")),
                    *("--directive-token-file", str(self.token_file("control"))),
                    *("--status-sweep-ms", "100"),
                ],
            )

    def start_holder(self) -> None:
        """The central holder with a disk tier, publishing at both control planes."""
        self._start(
            "holder",
            [
                *("holder", "--listen", self.urls["holder"].removeprefix("http://")[:-1]),
                *(
                    "--index",
                    self.control_list,
                    "--index-token-file",
                    str(self.token_file("holder")),
                ),
                *("--tier", "disk=64MiB", "--descriptor", str(self.folder / "descriptor.json")),
                *("--site", "central", "--zone", "central-1"),
            ],
        )

    def start_relay(self) -> None:
        """The edge relay inside the namespace (QUIC and HTTPS with the CA's certificate)."""
        inner = self.ns.inner_addr
        self._start(
            "relay",
            [
                *("relay", "--listen", f"{inner}:{EDGE_PORTS['relay']}"),
                *("--http-listen", f"{inner}:{EDGE_PORTS['relay-http']}"),
                *("--cert", str(self.folder / "ca" / "server.pem")),
                *("--key", str(self.folder / "ca" / "server-key.pem")),
                *("--index", self.control_list, "--token-file", str(self.token_file("relay"))),
                *("--cafile", str(self.folder / "ca" / "ca.pem")),
                *("--site", "edge", "--zone", "edge-1"),
            ],
            inside=True,
        )

    def instance_argv(self, name: str, site: str) -> list[str]:
        """``kvsp serve instance`` options of instance ``name`` (``central`` or ``edge``)."""
        return [
            *("instance", "--listen", self.urls[name].removeprefix("http://")[:-1]),
            *("--control", self.control_list, "--token-file", str(self.token_file(name))),
            *("--engine", "toy", "--descriptor", str(self.folder / "descriptor.json")),
            *("--scope-key-file", str(self.folder / "scope.key")),
            *("--status-ttl-ms", str(STATUS_TTL_MS), "--toy-decode-ms", "40"),
            *("--relay", self.relay_moqt, "--cafile", str(self.folder / "ca" / "ca.pem")),
            *("--site", site, "--zone", f"{site}-1"),
        ]

    def start_instance(self, name: str) -> RunningService:
        """Start instance ``name``: ``central`` on the outer loopback, ``edge`` inside."""
        site = "edge" if name == "edge" else "central"
        return self._start(name, self.instance_argv(name, site), inside=name == "edge")

    def stop(self) -> None:
        """Stop every process, the last started first."""
        for service in reversed(list(self.services.values())):
            service.stop()
        self.http.close()

    def logs(self) -> str:
        """Every process's output, for a failure message."""
        parts = []
        for name, service in self.services.items():
            parts.append(f"===== {name}\n{service.output()[-3000:]}")
        return "\n".join(parts)

    # -- requests -------------------------------------------------------------------------------

    def instances(self, control: str) -> dict[str, dict[str, Any]]:
        """GET instances at ``control``, by instance URI."""
        answer = self.http.get(f"{control}instances", headers=self.headers())
        assert answer.status_code == 200, answer.text
        return {row["instance"]: row for row in answer.json()["instances"]}

    def lookup(self, control: str, keys: Sequence[bytes]) -> list[list[dict[str, Any]]]:
        """POST lookup at the IS of ``control``: the records of each matched key."""
        body = {
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "block_keys": [k.hex() for k in keys],
        }
        answer = self.http.post(f"{control}lookup", json=body, headers=self.headers("client"))
        assert answer.status_code == 200, answer.text
        replicas: list[list[dict[str, Any]]] = answer.json()["replicas"]
        return replicas

    def holders_of(self, control: str, keys: Sequence[bytes]) -> list[set[str]]:
        """The holders the IS names for each matched key, in prefix order."""
        return [{r["holder"] for r in records} for records in self.lookup(control, keys)]

    def generate_at(self, name: str, prompt: Sequence[int], max_tokens: int) -> httpx.Response:
        """POST generate straight at instance ``name`` as the client."""
        body = {"prompt": list(prompt), "max_tokens": max_tokens}
        url = f"{self.urls[name]}generate"
        return self.http.post(url, json=body, headers=self.headers("client"))

    def put_state(self, control: str, name: str, state: str) -> httpx.Response:
        """PUT instances/{id}/state at ``control`` (forwarded to the instance, §6.3)."""
        from kvsp.ids import uri_id

        path = f"{control}instances/{uri_id(self.urls[name])}/state"
        return self.http.put(path, json={"state": state}, headers=self.headers())

    def metrics(self, name: str) -> str:
        """GET metrics at instance ``name``, or at the relay's HTTPS face (``relay-http``)."""
        url = f"{self.urls[name]}metrics"
        if url.startswith("https:"):
            trust = ssl.create_default_context(cafile=self.folder / "ca" / "ca.pem")
            with httpx.Client(verify=trust, timeout=30) as client:
                answer = client.get(url, headers=self.headers())
        else:
            answer = self.http.get(url, headers=self.headers())
        assert answer.status_code == 200, answer.text
        return answer.text

    def kvsp_generate(
        self, prompt: Sequence[int], max_tokens: int, pc: str | None = None
    ) -> subprocess.Popen[str]:
        """``kvsp generate --verbose`` through the control planes (``pc``: default both), as
        the client, in a process of its own (NDJSON tokens on stdout, the report on stderr)."""
        argv = [
            *(sys.executable, "-m", "kvsp", "generate", "--pc", pc or self.control_list),
            *("--token-file", str(self.token_file("client"))),
            *("--descriptor", str(self.folder / "descriptor.json")),
            *("--scope-key-file", str(self.folder / "scope.key")),
            *("--tokens", ",".join(map(str, prompt)), "--max-tokens", str(max_tokens)),
            "--verbose",
        ]
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=self.folder
        )


def _write_files(sites: TwoSites) -> None:
    folder = sites.folder
    (folder / "tokens").mkdir()
    for party in PARTIES:
        sites.tokens[party] = mint_token()
        sites.token_file(party).write_text(sites.tokens[party] + "\n")
    scope = [SCOPE]
    holders = {p: [sites.urls[p]] for p in ("holder", "relay", "central", "edge")}
    entries = [
        principal_entry("admin", sites.tokens["admin"], ["admin"], None),
        principal_entry("client", sites.tokens["client"], ["client"], scope),
        principal_entry("control", sites.tokens["control"], ["pc"], scope),
        principal_entry("holder", sites.tokens["holder"], ["holder"], scope, holders["holder"]),
        principal_entry("relay", sites.tokens["relay"], ["holder"], scope, holders["relay"]),
        *(
            principal_entry(p, sites.tokens[p], ["instance", "holder"], scope, holders[p])
            for p in ("central", "edge")
        ),
    ]
    write_principals(folder / "principals", entries)
    (folder / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
    (folder / "scope.key").write_text(SCOPE_KEY.hex())
    make_private_ca(folder / "ca", addresses=[sites.ns.inner_addr])


def start_two_sites(folder: Path, ns: Namespace, redis: str) -> TwoSites:
    """Start both sites (control planes first, then holder and relay, then the instances);
    every process is stopped again if one fails to start."""
    outer, inner = ns.outer_addr, ns.inner_addr
    sites = TwoSites(folder=folder, ns=ns, redis=redis)
    sites.urls = {
        "control-a": f"http://{outer}:{reserve_port(host=outer)}/",
        "control-b": f"http://{outer}:{reserve_port(host=outer)}/",
        "holder": f"http://127.0.0.1:{reserve_port()}/",
        "central": f"http://127.0.0.1:{reserve_port()}/",
        "relay": f"moqt://{inner}:{EDGE_PORTS['relay']}/",
        "relay-http": f"https://{inner}:{EDGE_PORTS['relay-http']}/",
        "edge": f"http://{inner}:{EDGE_PORTS['instance']}/",
    }
    _write_files(sites)
    try:
        sites.start_controls()
        sites.start_holder()
        sites.start_relay()
        sites.start_instance("central")
        sites.start_instance("edge")
    except BaseException:
        sites.stop()
        raise
    return sites


def reachable(ns: Namespace, url: str) -> bool:
    """Whether a process inside ``ns`` can open a TCP connection to ``url``'s host and port."""
    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    code = (
        "import socket,sys\n"
        "try:\n"
        f"    socket.create_connection(({host!r}, {int(port)}), timeout=3).close()\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    return ns.run([sys.executable, "-c", code]).returncode == 0
