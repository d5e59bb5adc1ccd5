"""A whole KVSP cluster on loopback, as real processes (DESIGN.md §1, §3 authentication):
``kvsp serve control`` (IS + PC), one ``kvsp serve relay`` (MOQT edge relay, a holder at the
IS; MOQT over QUIC, QMux over TLS and QMux over a Unix socket, DESIGN.md §4 Carriers) and
reference-engine instances (``kvsp serve instance --engine reference``), which publish to the
relay over its Unix socket and fetch over the fastest carrier its records offer.

The state folder (``~/.kvsp/demo`` unless ``--state DIR``) keeps:

=====================  ===================================================================
``model/``             the seeded checkpoint, made on the first run and reused after
``descriptor.json``    its Compatibility Descriptor (§4.1) at the cluster's block size
``scope.key``          the scope key of the demo scope (§4.2), kept across runs
``principals.toml``    one principal per party, made again on every start (mode 0600)
``admin.token``        the operator's token (admin), kept across runs; the only path shown
``tokens/NAME.token``  the other parties' tokens: client, control (pc), relay, instance-*
``services/NAME/``     each service's state folder, output log and ready file
``cluster.json``       the endpoints, while the cluster runs (read by ``kvsp status``)
=====================  ===================================================================

Least privilege: an instance may publish only for its own URI, the relay only for its own
``moqt://`` URI, the control plane calls instances with role ``pc``, the front end is a
``client``; all are limited to the demo scope. Their URIs go into the principals file before
they start, so instances and the relay listen on ports reserved just before
(:func:`~kvsp.demo.procs.reserve_port`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.demo.console import Console
from kvsp.demo.procs import ProcessGroup, ServiceProcess, reserve_port
from kvsp.demo.state import Endpoints, StateFolder, default_state, write_private
from kvsp.errors import ClusterError, KVSPError
from kvsp.ids import CompatId, ScopeId
from kvsp.keys import scope_id
from kvsp.web.auth import mint_token, principal_entry, write_principals

INSTANCE_NAMES = ("a", "b", "c", "d", "e", "f")
DEMO_SITE = "local"
"""The site label of every demo process (one host: one site); each instance is a zone of its
own (``zone-a`` ...), as racks of one site would be, so ``kvsp status`` shows where each is."""
RELAY_TLS = "relay-tls"
MAX_SOCKET_PATH = 100  # sun_path holds 108 octets on Linux, with its terminating NUL
RELAY_CERT_MARGIN = datetime.timedelta(days=3)
"""The relay renews its certificate two days before expiry; ours must outlive that."""
KVSP = (sys.executable, "-m", "kvsp")


def instances_support_relay() -> bool:
    """Whether ``kvsp serve instance`` has ``--relay``: a MOQT session to its edge relay that
    mirrors its blocks there, and a client for ``moqt://`` replicas (DESIGN.md §4)."""
    from kvsp.services.instance.app import configure_parser

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return "--relay" in parser._option_string_actions


def _valid_for(cert: Path, margin: datetime.timedelta) -> bool:
    """Whether the PEM certificate ``cert`` exists and stays valid for ``margin`` more."""
    from cryptography import x509

    try:
        loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    except (OSError, ValueError):
        return False
    return loaded.not_valid_after_utc - margin > datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The seeded checkpoint ``kvsp model init`` writes (a small Llama, DESIGN.md §6)."""

    seed: int = 1
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    max_positions: int = 4096

    def init_args(self) -> list[str]:
        """The ``kvsp model init`` options."""
        return [
            *("--seed", str(self.seed), "--layers", str(self.layers)),
            *("--hidden", str(self.hidden), "--heads", str(self.heads)),
            *("--kv-heads", str(self.kv_heads), "--max-positions", str(self.max_positions)),
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """What to start and where to keep it."""

    state: Path = field(default_factory=default_state)
    instances: int = 3
    block_tokens: int = 32
    status_ttl_ms: int = 1500
    """Short, so that the PC notices a killed instance within seconds (§6.3)."""
    status_sweep_ms: int = 100
    ready_timeout_s: float = 180.0
    model: ModelSpec = field(default_factory=ModelSpec)


@dataclass(slots=True)
class _Plan:
    """The ports and URIs chosen before the services start."""

    relay_port: int
    instance_ports: dict[str, int]

    @property
    def relay_uri(self) -> str:
        return f"moqt://127.0.0.1:{self.relay_port}/"

    def instance_uri(self, name: str) -> str:
        return f"http://127.0.0.1:{self.instance_ports[name]}/"


class Cluster:
    """The control plane, the relay and the instances of one state folder (context manager:
    leaving it stops every process)."""

    def __init__(self, config: ClusterConfig, console: Console | None = None) -> None:
        if not 1 <= config.instances <= len(INSTANCE_NAMES):
            raise ClusterError(f"instances: 1 to {len(INSTANCE_NAMES)}, not {config.instances}")
        self.config = config
        self.console = console or Console()
        self.files = StateFolder(config.state)
        self.group = ProcessGroup()
        self.names = list(INSTANCE_NAMES[: config.instances])
        self.endpoints: Endpoints | None = None
        self.descriptor: CompatibilityDescriptor | None = None
        self.scope_key = b""
        self.relay_link = instances_support_relay()
        """Whether instances take ``--relay`` (publish to it, load ``moqt://`` replicas)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the parts ------------------------------------------------------------------------------

    @property
    def compat(self) -> CompatId:
        """The Compatibility ID of the instances' model (§4.1)."""
        if self.descriptor is None:
            raise ClusterError("the cluster has not started")
        return compat_id(self.descriptor)

    @property
    def scope(self) -> ScopeId:
        """The demo scope's Scope ID (§4.2)."""
        return scope_id(self.scope_key)

    def running(self) -> Endpoints:
        """The endpoints of the started cluster.

        Raises:
            ClusterError: it has not started.
        """
        if self.endpoints is None:
            raise ClusterError("the cluster has not started")
        return self.endpoints

    def service(self, name: str) -> ServiceProcess:
        """The process of service ``name`` (``control``, ``relay``, ``instance-a``...)."""
        return self.group.services[name]

    def instance_name(self, url: str) -> str:
        """The short name (``a``, ``b``...) of an instance URL (the URL when unknown)."""
        found = [n for n, u in self.running().instances.items() if u == url]
        return found[0] if found else url

    # -- start and stop -------------------------------------------------------------------------

    def start(self) -> Endpoints:
        """Make what the state folder lacks, start every service, wait until the PC lists
        every instance as active, and write ``cluster.json``.

        Raises:
            ClusterError: a cluster already runs from this state folder, a service did not
                start (its log is quoted), or a file is unusable.
        """
        self._refuse_if_running()
        self.prepare()
        plan = _Plan(
            relay_port=reserve_port(socket.SOCK_DGRAM),
            instance_ports={name: reserve_port() for name in self.names},
        )
        self._write_principals(plan)
        with self.console.progress("starting services", 2 + len(self.names)) as bar:
            control = self._start_control()
            bar.advance(note="control plane (IS + PC)")
            self._spawn_relay(plan, control)
            for name in self.names:
                self._spawn_instance(name, plan, control)
            waiting = ["relay", *(f"instance-{n}" for n in self.names)]
            self.group.wait_ready(
                waiting,
                self.config.ready_timeout_s,
                on_ready=lambda s: bar.advance(note=s.name),
            )
        relay = json.loads(self.service("relay").ready_text or "{}")
        instances = {n: plan.instance_uri(n) for n in self.names}
        for name, url in instances.items():
            served = (self.service(f"instance-{name}").ready_text or "").strip()
            if served != url:
                raise ClusterError(f"instance {name} serves at {served}, expected {url}")
        self.endpoints = Endpoints(
            control=control,
            relay_moqt=relay.get("moqt"),
            relay_http=relay.get("http"),
            instances=instances,
            pids={name: s.pid for name, s in self.group.services.items()},
        )
        self._await_registration()
        write_private(self.files.cluster_file, json.dumps(self.endpoints.to_json(), indent=2))
        return self.endpoints

    def _refuse_if_running(self) -> None:
        """Another cluster of this state folder still answering keeps it (its principals and
        tokens would be replaced under it); a ``cluster.json`` left by a crash does not."""
        try:
            endpoints = Endpoints.from_json(json.loads(self.files.cluster_file.read_text()))
        except (OSError, ValueError, ClusterError):
            return
        try:
            answer = httpx.get(f"{endpoints.control}healthz", timeout=2)
        except httpx.HTTPError:
            return
        if answer.status_code == 200:
            raise ClusterError(
                f"a cluster already runs from {self.files.root} (control plane "
                f"{endpoints.control}); stop it, or give another --state"
            )

    def prepare(self) -> None:
        """Make what the state folder lacks: the seeded model and its descriptor (first run
        only), the scope key.

        Raises:
            ClusterError: ``kvsp model init`` or ``kvsp model descriptor`` failed.
        """
        self.files.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._ensure_model()
        self._ensure_scope_key()

    def stop(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL) and remove ``cluster.json``."""
        self.group.stop()
        if self.endpoints is not None:
            self.files.cluster_file.unlink(missing_ok=True)

    def kill(self, name: str) -> None:
        """SIGKILL instance ``name``: no withdrawal, no last status (a crash)."""
        self.group.kill(f"instance-{name}")

    # -- the state folder -----------------------------------------------------------------------

    def _ensure_model(self) -> None:
        model, spec = self.files.model, self.config.model
        if not (model / "config.json").exists():
            shutil.rmtree(model, ignore_errors=True)
            partial = model.with_name(f".model.{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)
            with self.console.progress("making the seeded model (first run only)", 2) as bar:
                self._run([*KVSP, "model", "init", str(partial), *spec.init_args()])
                bar.advance(note="weights written")
                os.replace(partial, model)
                self.files.descriptor.unlink(missing_ok=True)
                self._describe_model()
                bar.advance(note="descriptor computed")
        elif not self._load_descriptor():
            self._describe_model()
        if not self._load_descriptor():
            raise ClusterError(f"{self.files.descriptor}: not the descriptor of {model}")

    def _describe_model(self) -> None:
        argv = [*KVSP, "model", "descriptor", str(self.files.model)]
        argv += ["--block-tokens", str(self.config.block_tokens)]
        self.files.descriptor.write_text(self._run(argv), encoding="utf-8")

    def _load_descriptor(self) -> bool:
        try:
            obj = json.loads(self.files.descriptor.read_text(encoding="utf-8"))
            descriptor = CompatibilityDescriptor.from_json(obj)
        except (OSError, ValueError, KVSPError):
            return False
        if descriptor.block_tokens != self.config.block_tokens:
            return False
        self.descriptor = descriptor
        return True

    @staticmethod
    def _run(argv: list[str]) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ClusterError(f"{' '.join(argv[2:5])} failed:\n{done.stderr[-2000:]}")
        return done.stdout

    def _ensure_scope_key(self) -> None:
        path = self.files.scope_key
        text = path.read_text(encoding="ascii").strip() if path.exists() else ""
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) < 32:
            key = secrets.token_bytes(32)
            write_private(path, key.hex() + "\n")
        self.scope_key = key

    def _write_principals(self, plan: _Plan) -> None:
        admin = self._admin_token()
        scope = [self.scope]
        names = self.names
        parties: list[tuple[str, list[str], list[str]]] = [
            ("client", ["client"], []),
            ("control", ["pc"], []),
            ("relay", ["holder"], [plan.relay_uri]),
            *((f"instance-{n}", ["instance", "holder"], [plan.instance_uri(n)]) for n in names),
        ]
        entries = [principal_entry("admin", admin, ["admin"], None)]
        for name, roles, holders in parties:
            token = mint_token()
            write_private(self.files.token_file(name), token + "\n")
            entries.append(principal_entry(name, token, roles, scope, holders))
        write_principals(self.files.principals, entries)

    def _admin_token(self) -> str:
        path = self.files.admin_token
        token = path.read_text(encoding="ascii").strip() if path.exists() else ""
        if not token:
            token = mint_token()
            write_private(path, token + "\n")
        return token

    # -- the services ---------------------------------------------------------------------------

    def _serve(self, name: str, service: str, *argv: str) -> ServiceProcess:
        work = self.files.services / name
        command = [
            *KVSP,
            *("serve", service, "--state", str(work / "state")),
            *("--principals", str(self.files.principals)),
            *argv,
        ]
        return self.group.spawn(name, command, work)

    def _start_control(self) -> str:
        self._serve(
            "control",
            "control",
            *("--listen", "127.0.0.1:0", "--status-sweep-ms", str(self.config.status_sweep_ms)),
            *("--directive-token-file", str(self.files.token_file("control"))),
        )
        self.group.wait_ready(["control"], self.config.ready_timeout_s)
        return self.service("control").ready_text or ""

    def _relay_socket(self) -> Path | None:
        """The Unix socket of the relay's QMux carrier (instances on this host publish and
        fetch over it), or None where the state path is too long for a socket address."""
        path = (self.files.services / "relay" / "relay.sock").resolve()
        return path if len(str(path).encode()) <= MAX_SOCKET_PATH else None

    def _spawn_relay(self, plan: _Plan, control: str) -> None:
        socket_path = self._relay_socket()
        unix = [] if socket_path is None else ["--qmux-unix", str(socket_path)]
        self._serve(
            "relay",
            "relay",
            *("--listen", f"127.0.0.1:{plan.relay_port}", "--public-url", plan.relay_uri),
            *("--index", control, "--index-token-file", str(self.files.token_file("relay"))),
            *("--site", DEMO_SITE),
            *unix,
        )

    def _relay_certificate(self) -> Path:
        """The relay's self-signed certificate, made before it starts (it keeps one that is
        valid for days yet) so that instances can pin it from their first connection."""
        folder = self.files.services / "relay" / "state" / RELAY_TLS
        cert = folder / "cert.pem"
        if not _valid_for(cert, RELAY_CERT_MARGIN) or not (folder / "key.pem").exists():
            from moqt.certs import make_self_signed

            make_self_signed("localhost", folder)
        return cert

    def _spawn_instance(self, name: str, plan: _Plan, control: str) -> None:
        relay: list[str] = []
        if self.relay_link:
            socket_path = self._relay_socket()  # the fastest carrier on one host
            uri = plan.relay_uri if socket_path is None else f"moqt+unix://localhost{socket_path}"
            relay = ["--relay", uri, "--cafile", str(self._relay_certificate())]
        self._serve(
            f"instance-{name}",
            "instance",
            *("--listen", f"127.0.0.1:{plan.instance_ports[name]}", "--pc", control),
            *("--token-file", str(self.files.token_file(f"instance-{name}"))),
            *("--engine", "reference", "--model", str(self.files.model)),
            *("--block-tokens", str(self.config.block_tokens)),
            *("--scope-key-file", str(self.files.scope_key)),
            *("--status-ttl-ms", str(self.config.status_ttl_ms)),
            *("--site", DEMO_SITE, "--zone", f"zone-{name}"),
            *relay,
        )

    def _await_registration(self) -> None:
        """Wait until the PC lists every instance as active and knows their descriptor."""
        endpoints = self.running()
        headers = {"authorization": f"Bearer {self.files.read_token('admin')}"}
        wanted = set(endpoints.instances.values())
        deadline = time.monotonic() + self.config.ready_timeout_s
        with httpx.Client(base_url=endpoints.control, headers=headers, timeout=10) as http:
            while True:
                rows = http.get("instances").json().get("instances", [])
                active = {r["instance"] for r in rows if r["state"] == "active"}
                if wanted <= active:
                    break
                if time.monotonic() > deadline:
                    raise ClusterError(f"instances not active at the PC: {sorted(wanted - active)}")
                time.sleep(0.1)
            known = http.get(f"descriptors/{self.compat.hex()}")
            if known.status_code != 200:
                raise ClusterError("the instances registered another descriptor than the model's")
