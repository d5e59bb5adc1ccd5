"""Independent MOQT peers for interop checks: install them, start them, stop them.

The peers come from the package index, pinned, into virtual environments under a cache folder
(``.interop-venvs/`` at the repository root, or ``$KVSP_INTEROP_CACHE``); nothing else is
fetched. Everything they start listens on 127.0.0.1 (aiomoqt's relay binds all interfaces
whatever it is told; only loopback traffic is sent to it) on ephemeral ports, runs under a
bounded timeout and is stopped by its own PID.

* **aiomoqt 0.13.3** (picoquic): needs Python 3.12 (an unpinned install on 3.11 silently gets
  0.5.3, so the pin is strict). Its relay (``moq-interop-relay``), its TAP conformance client
  (``moq-interop-client``) and small publisher/subscriber scripts of ours on its API.
* **moq-rs 0.5.1** (moq-ffi 0.4.18, Rust moq-net on quinn): Python 3.11 works. A relay (a
  ``moq.Server`` with one shared origin), and publisher/subscriber scripts.

Each helper raises :class:`PeerUnavailable` with the reason when a peer cannot be installed or
started, so tests can skip with it.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AIOMOQT = "aiomoqt==0.13.3"
MOQ_RS = "moq-rs==0.5.1"
INSTALL_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 20.0
RELAY_BIG_OBJECTS = ("--stream-ring-cap", str(16 << 20), "--max-inflight-bytes", str(8 << 20))
"""aiomoqt's relay silently drops objects above its 1 MiB default stream ring."""


class PeerUnavailable(RuntimeError):
    """A peer cannot be installed or started here; the message says why."""


def cache_dir() -> Path:
    """Where the peers' virtual environments live."""
    return Path(os.environ.get("KVSP_INTEROP_CACHE", REPO / ".interop-venvs"))


def find_python312() -> str | None:
    """A Python 3.12 interpreter: pyenv's 3.12.x (the shim does not work) or ``python3.12``."""
    candidates: list[str] = []
    for root in (os.environ.get("PYENV_ROOT"), str(Path.home() / ".pyenv")):
        if root:
            candidates += sorted(glob.glob(f"{root}/versions/3.12.*/bin/python3.12"), reverse=True)
    with_pyenv = shutil.which("pyenv")
    if with_pyenv:
        try:
            root = subprocess.run(
                [with_pyenv, "root"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            root = ""
        if root:
            candidates += sorted(glob.glob(f"{root}/versions/3.12.*/bin/python3.12"), reverse=True)
    on_path = shutil.which("python3.12")
    if on_path:
        candidates.append(on_path)
    for candidate in candidates:
        if _is_python(candidate, (3, 12)):
            return candidate
    return None


def _is_python(executable: str, version: tuple[int, int]) -> bool:
    code = "import sys; print('%d.%d' % sys.version_info[:2])"
    try:
        out = subprocess.run(
            [executable, "-c", code], capture_output=True, text=True, timeout=20, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return out.stdout.strip() == f"{version[0]}.{version[1]}"


def ensure_venv(name: str, python: str, requirement: str) -> Path:
    """A virtual environment ``cache_dir()/name`` with ``requirement`` installed (once).

    Raises:
        PeerUnavailable: the venv or the install failed or timed out.
    """
    venv = cache_dir() / name
    marker = venv / "kvsp-installed.txt"
    if marker.is_file() and marker.read_text().strip() == requirement:
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [python, "-m", "venv", "--clear", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", requirement],
    ]
    for step in steps:
        try:
            result = subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PeerUnavailable(f"{requirement}: {' '.join(step[:3])} failed: {exc}") from exc
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise PeerUnavailable(f"{requirement}: install failed: {' | '.join(tail)}")
    marker.write_text(requirement + "\n")
    return venv


def aiomoqt_python() -> str:
    """The Python of the aiomoqt 0.13.3 venv (Python 3.12), installed on first use.

    Raises:
        PeerUnavailable: no Python 3.12 here, or the install failed.
    """
    python = find_python312()
    if python is None:
        raise PeerUnavailable("aiomoqt 0.13.3 needs Python 3.12 and none was found")
    return str(ensure_venv("aiomoqt-0.13.3", python, AIOMOQT) / "bin" / "python")


def moqrs_python() -> str:
    """The Python of the moq-rs 0.5.1 venv (this interpreter's version), installed once.

    Raises:
        PeerUnavailable: the install failed.
    """
    base = getattr(sys, "_base_executable", sys.executable)
    return str(ensure_venv("moq-rs-0.5.1", base, MOQ_RS) / "bin" / "python")


def url_port(url: str) -> int:
    """The port of a ``moqt://host:port[/path]`` URL."""
    from urllib.parse import urlsplit

    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"no port in {url!r}")
    return port


def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PeerProcess:
    """A started peer: its process, its log file, and the URL it serves (if a server)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    keep: list[object] = field(default_factory=list)
    carriers: list[str] = field(default_factory=list)
    """Our relay's QMux carrier URIs (``moqt+tls://``, ``moqt+tcp://``, ``moqt+unix://``)."""

    def output(self) -> str:
        """Everything it has written so far."""
        return self.log.read_text(encoding="utf-8", errors="replace")

    def wait(self, timeout: float) -> int:
        """Its exit status, killing it when it outlives ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM its process group, SIGKILL after ``grace_s``."""
        if self.proc.poll() is not None:
            return
        with _suppressed():
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with _suppressed():
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=grace_s)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _suppressed:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, ProcessLookupError | PermissionError)


def start(
    name: str, argv: Sequence[str], workdir: Path, *, env: dict[str, str] | None = None
) -> PeerProcess:
    """Start ``argv`` in its own process group, output to ``workdir/<name>.log``."""
    log = workdir / f"{name}.log"
    handle = log.open("wb")
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    environment.pop("PYTHONPATH", None)  # the peers' own venvs must not see this checkout
    environment.update(env or {})
    proc = subprocess.Popen(
        list(argv),
        stdout=handle,
        stderr=subprocess.STDOUT,
        cwd=workdir,
        env=environment,
        start_new_session=True,
    )
    handle.close()
    return PeerProcess(name, proc, log)


def wait_moqt_ready(
    peer: PeerProcess, host: str, port: int, timeout: float = READY_TIMEOUT_S
) -> None:
    """Until a MOQT d16 setup with ``host:port`` completes (UDP cannot be probed otherwise).

    Raises:
        PeerUnavailable: the process exited, or no setup within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if peer.proc.poll() is not None:
            raise PeerUnavailable(f"{peer.name} exited: {peer.output()[-800:]}")
        if asyncio.run(_setup_once(host, port)):
            return
        time.sleep(0.2)
    peer.stop()
    raise PeerUnavailable(f"{peer.name} not ready in {timeout} s: {peer.output()[-800:]}")


async def _setup_once(host: str, port: int) -> bool:
    from moqt.asyncio import connect
    from moqt.backend import get_backend

    configuration = get_backend().configuration(is_client=True, verify=False)
    try:
        async with asyncio.timeout(2.0), connect(host, port, configuration=configuration) as c:
            c.close()
        return True
    except Exception:  # noqa: BLE001 - not up yet, whatever the reason
        return False


def self_signed(workdir: Path) -> tuple[Path, Path]:
    """A loopback certificate and key for a peer server."""
    from moqt.certs import make_self_signed

    return make_self_signed("localhost", workdir / "certs")


# --- aiomoqt ------------------------------------------------------------------------------------


def start_aiomoqt_relay(workdir: Path, *, draft: int = 16) -> PeerProcess:
    """aiomoqt's test relay on raw QUIC, one draft, with a stream ring big enough for 2 MiB
    objects; ``url`` is ``moqt://127.0.0.1:PORT``.

    Raises:
        PeerUnavailable: aiomoqt cannot be installed, or the relay did not come up.
    """
    python = aiomoqt_python()
    cert, key = self_signed(workdir)
    port = free_udp_port()
    argv = [
        python,
        "-m",
        "aiomoqt.tools.moq_interop_relay",
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--cert",
        str(cert),
        "--key",
        str(key),
        "--quic",
        "--draft",
        str(draft),
        *RELAY_BIG_OBJECTS,
    ]
    peer = start("aiomoqt-relay", argv, workdir)
    wait_moqt_ready(peer, "127.0.0.1", port)
    peer.url = f"moqt://127.0.0.1:{port}"
    return peer


def run_aiomoqt_conformance(
    relay_url: str, workdir: Path, *, cases: Sequence[str] = (), timeout: float = 120.0
) -> tuple[int, str]:
    """aiomoqt's TAP conformance client against ``relay_url`` at draft 16: (exit status,
    TAP output). With ``cases`` each runs as its own ``-t`` (how ``fetch`` and ``join``,
    which the default run leaves out, are asked for); the outputs are joined.

    Raises:
        PeerUnavailable: aiomoqt cannot be installed.
        subprocess.TimeoutExpired: a run outlived ``timeout``.
    """
    python = aiomoqt_python()
    base = [python, "-m", "aiomoqt.tools.moq_interop_client", "-r", relay_url]
    base += ["--tls-disable-verify", "--draft", "16"]
    runs = [[*base, "-t", case] for case in cases] or [base]
    status, outputs = 0, []
    for argv in runs:
        peer = start("aiomoqt-conformance", argv, workdir)
        code = peer.wait(timeout)
        outputs.append(peer.output())
        status = status or code
    return status, "\n".join(outputs)


AIOMOQT_KV_PUB = r"""
import asyncio, hashlib, sys
from aiomoqt.client import MOQTClient
from aiomoqt.track import PublishedTrack
HOST, NS, TRACK = sys.argv[1], sys.argv[3], sys.argv[4]
PORT, LAYERS, SIZE = int(sys.argv[2]), int(sys.argv[5]), int(sys.argv[6])
HOLD = float(sys.argv[7])
def payload(l): return hashlib.sha256(b"layer%d" % l).digest() * (SIZE // 32)
class KV(PublishedTrack):
    async def produce(self, out):
        for l in range(LAYERS):
            await out.write(0, l, payload(l), group_start=(l == 0))
        print("PUB sent", LAYERS, flush=True)
async def main():
    c = MOQTClient(HOST, PORT, path="", use_quic=True, verify_tls=False, supported_drafts=16)
    async with c.connect() as s:
        await s.client_session_init()
        t = KV(s, namespace=NS, trackname=TRACK)
        t.attach()
        await s.publish_namespace(namespace=NS, wait_response=True)
        print("PUB announced", flush=True)
        await asyncio.sleep(HOLD)
asyncio.run(main())
"""

AIOMOQT_KV_SUB = r"""
import asyncio, hashlib, sys
from aiomoqt.client import MOQTClient
HOST, NS, TRACK = sys.argv[1], sys.argv[3], sys.argv[4]
PORT, LAYERS, WAIT = int(sys.argv[2]), int(sys.argv[5]), float(sys.argv[6])
got = {}
done = asyncio.Event()
def on_object(msg, size, recv_time_us, group_id=None, subgroup_id=None):
    p = bytes(msg.payload or b"")
    if p:
        got[msg.object_id] = hashlib.sha256(p).hexdigest()
        print("SUB", msg.object_id, len(p), got[msg.object_id], flush=True)
    if len(got) >= LAYERS:
        done.set()
async def main():
    c = MOQTClient(HOST, PORT, path="", use_quic=True, verify_tls=False, supported_drafts=16)
    async with c.connect() as s:
        await s.client_session_init()
        s.on_object_received = on_object
        await s.subscribe(NS, TRACK, wait_response=True)
        print("SUB subscribed", flush=True)
        await asyncio.wait_for(done.wait(), WAIT)
    print("SUB total", len(got), flush=True)
asyncio.run(main())
"""

AIOMOQT_KV_FETCH = r"""
import asyncio, hashlib, sys
from aiomoqt.client import MOQTClient
HOST, NS, TRACK = sys.argv[1], sys.argv[3], sys.argv[4]
PORT, FIRST, LAST = int(sys.argv[2]), int(sys.argv[5]), int(sys.argv[6])
got = []
def on_object(msg, *_):
    p = bytes(msg.payload or b"")
    got.append(msg.object_id)
    print("FETCH", msg.object_id, len(p), hashlib.sha256(p).hexdigest(), flush=True)
async def main():
    c = MOQTClient(HOST, PORT, path="", use_quic=True, verify_tls=False, supported_drafts=16)
    async with c.connect() as s:
        await s.client_session_init()
        s.on_fetch_object = on_object
        ok = await s.fetch(namespace=NS, track_name=TRACK, start_group=0, start_object=FIRST,
                           end_group=0, end_object=LAST + 1, wait_response=True)
        await s.await_fetch_done(ok.request_id, timeout=10)
    print("FETCH total", len(got), flush=True)
asyncio.run(asyncio.wait_for(main(), 20))
"""

MOQRS_RELAY = r"""
import asyncio, sys, moq
async def main():
    origin = moq.OriginProducer()
    server = moq.Server(
        sys.argv[1], tls_generate=["localhost"], publish=origin, subscribe=origin
    )
    async with server:
        print("RELAY listening", sys.argv[1], flush=True)
        sessions = []
        async for request in server:
            sessions.append(await request.accept())
asyncio.run(main())
"""

MOQRS_KV_SUB = r"""
import asyncio, hashlib, sys, moq
URL, PATH, TRACK = sys.argv[1:4]
LAYERS, WAIT = int(sys.argv[4]), float(sys.argv[5])
async def main():
    got = 0
    async with moq.Client(URL, tls_verify=False, reconnect=False) as client:
        broadcast = await asyncio.wait_for(client.announced_broadcast(PATH).available(), WAIT)
        track = await broadcast.subscribe_track(TRACK)
        print("SUB subscribed", flush=True)
        async for group in track:
            async for frame in group:
                p = bytes(getattr(frame, "payload", frame))
                print("SUB", got, len(p), hashlib.sha256(p).hexdigest(), flush=True)
                got += 1
                if got >= LAYERS:
                    print("SUB total", got, flush=True)
                    return
asyncio.run(asyncio.wait_for(main(), float(sys.argv[5]) + 10))
"""

MOQRS_KV_PUB = r"""
import asyncio, hashlib, sys, moq
URL, PATH, TRACK = sys.argv[1:4]
LAYERS, SIZE, HOLD = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
def payload(l): return hashlib.sha256(b"layer%d" % l).digest() * (SIZE // 32)
async def main():
    async with moq.Client(URL, tls_verify=False, reconnect=False) as client:
        broadcast = client.create_broadcast(PATH)
        track = broadcast.publish_track(TRACK)
        broadcast.announce()
        print("PUB announced", flush=True)
        await asyncio.wait_for(track.used(), HOLD)
        group = track.create_group(0)
        for l in range(LAYERS):
            group.write_frame(payload(l))
        group.finish()
        print("PUB sent", LAYERS, flush=True)
        await asyncio.sleep(HOLD)
asyncio.run(main())
"""


MOQRS_CONNECT = r"""
import asyncio, sys, moq
moq.log_level("info")  # its "connected version=…" line names the MOQT version agreed
URL, HOLD = sys.argv[1], float(sys.argv[2])
async def main():
    async with moq.Client(URL, tls_verify=False, reconnect=False):
        print("CLIENT connected", flush=True)
        await asyncio.sleep(HOLD)
asyncio.run(asyncio.wait_for(main(), HOLD + 10))
"""


def object_lines(output: str, tag: str) -> dict[int, tuple[int, str]]:
    """``{object id: (length, sha256 hex)}`` from the ``TAG id length sha256`` lines a peer
    script printed."""
    found: dict[int, tuple[int, str]] = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == tag and parts[1].isdigit():
            found[int(parts[1])] = (int(parts[2]), parts[3])
    return found


def kv_payload(layer: int, size: int) -> bytes:
    """The layer payload the peer scripts send (``sha256("layer<l>")`` repeated)."""
    import hashlib

    return hashlib.sha256(b"layer%d" % layer).digest() * (size // 32)


def run_script(
    name: str, python: str, source: str, args: Sequence[str], workdir: Path
) -> PeerProcess:
    """Start one of the scripts above with ``python``."""
    script = workdir / f"{name}.py"
    script.write_text(source)
    return start(name, [python, str(script), *args], workdir)


def start_moqrs_relay(workdir: Path) -> PeerProcess:
    """moq-rs's origin server as a relay on 127.0.0.1; ``url`` is ``moqt://127.0.0.1:PORT``.

    Raises:
        PeerUnavailable: moq-rs cannot be installed, or the server did not come up.
    """
    python = moqrs_python()
    port = free_udp_port()
    peer = run_script("moqrs-relay", python, MOQRS_RELAY, [f"127.0.0.1:{port}"], workdir)
    wait_moqt_ready(peer, "127.0.0.1", port)
    peer.url = f"moqt://127.0.0.1:{port}"
    return peer


def start_our_relay(
    workdir: Path,
    *extra: str,
    qmux_tcp: bool = False,
    qmux_unix: Path | None = None,
    preamble: str | None = None,
) -> PeerProcess:
    """This project's relay (``python -m relay.app``) in its open plain-relay mode on
    ephemeral loopback ports; ``url`` is its MOQT URI (from the ready file's ``"moqt"``),
    ``carriers`` its QMux carrier URIs (the ready file's ``"carriers"``).

    Started as ``python -m relay.app --open --listen 127.0.0.1:0 --state DIR --ready-file
    FILE`` plus ``extra``, plus ``--qmux-tcp-listen 127.0.0.1:0`` with ``qmux_tcp`` and
    ``--qmux-unix PATH`` with ``qmux_unix`` (keep that path short: a Unix socket path has at
    most 107 octets); its ready file is JSON ``{"moqt": …, "http": …, "carriers": […]}``.
    ``preamble``, Python run in the relay's process before ``relay.app``, lets a benchmark
    set a module variable there (``python -c``, then ``relay.app`` as ``__main__``).

    Raises:
        PeerUnavailable: ``relay.app`` (or, for a QMux carrier, ``moqt.qmux_asyncio``) does not
            exist yet, the relay did not start in open mode, or it lacks an asked-for carrier.
    """
    import importlib.util
    import json

    try:
        found = importlib.util.find_spec("relay.app") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise PeerUnavailable("relay.app does not exist yet (the relay is being written)")
    if (qmux_tcp or qmux_unix is not None) and importlib.util.find_spec(
        "moqt.qmux_asyncio"
    ) is None:
        raise PeerUnavailable("moqt.qmux_asyncio does not exist yet (QMux is being written)")
    ready = workdir / "relay-ready.json"
    argv = [sys.executable, "-m", "relay.app", "--open", "--listen", "127.0.0.1:0"]
    if preamble is not None:
        run_app = "import runpy; runpy.run_module('relay.app', run_name='__main__', alter_sys=True)"
        argv[1:3] = ["-c", f"{preamble}\n{run_app}"]
    argv += ["--state", str(workdir / "relay-state"), "--ready-file", str(ready), *extra]
    if qmux_tcp:
        argv += ["--qmux-tcp-listen", "127.0.0.1:0"]
    if qmux_unix is not None:
        argv += ["--qmux-unix", str(qmux_unix)]
    peer = start("kvsp-relay", argv, workdir, env={"PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if peer.proc.poll() is not None:
            raise PeerUnavailable(f"relay.app --open exited: {peer.output()[-800:]}")
        try:
            info = json.loads(ready.read_text())
        except (OSError, ValueError):
            time.sleep(0.1)
            continue
        url = str(info.get("moqt", ""))
        peer.url = url if url.startswith("moqt://") else f"moqt://{url}"
        peer.carriers = [str(uri) for uri in info.get("carriers", [])]
        schemes = {uri.split("://", 1)[0] for uri in peer.carriers}
        wanted = {"moqt+tcp"} if qmux_tcp else set()
        wanted |= {"moqt+unix"} if qmux_unix is not None else set()
        if not wanted <= schemes:
            peer.stop()
            raise PeerUnavailable(f"relay.app lists no {sorted(wanted - schemes)} carrier: {info}")
        return peer
    peer.stop()
    raise PeerUnavailable(f"relay.app --open wrote no ready file: {peer.output()[-800:]}")


def moqrs_url(carrier: str) -> str:
    """The moq-rs 0.5.1 client URL for one of our carrier URIs.

    moq-rs dials MOQT over QMux on plain TCP as ``tcp://host:port/path`` and on a Unix socket
    as ``unix:///abs/path``; raw QUIC keeps ``moqt://``. It has no QMux-over-TLS client
    (``tls://``-like schemes are refused; ``wss://`` is QMux inside WebSocket), so
    ``moqt+tls://`` has no moq-rs form.

    Raises:
        ValueError: ``moqt+tls://`` or an unknown scheme.
    """
    from urllib.parse import urlsplit

    parts = urlsplit(carrier)
    if parts.scheme == "moqt":
        return carrier
    if parts.scheme == "moqt+tcp":
        return f"tcp://{parts.netloc}{parts.path or '/'}"
    if parts.scheme == "moqt+unix":
        return f"unix://{parts.path}"
    raise ValueError(f"moq-rs 0.5.1 cannot dial {carrier!r}")


def carrier(peer: PeerProcess, scheme: str) -> str:
    """``peer``'s carrier URI with this scheme (``moqt`` gives its QUIC URL).

    Raises:
        PeerUnavailable: it lists no such carrier.
    """
    if scheme == "moqt":
        return peer.url
    for uri in peer.carriers:
        if uri.startswith(scheme + "://"):
            return uri
    raise PeerUnavailable(f"{peer.name} lists no {scheme}:// carrier: {peer.carriers}")


def scratch(prefix: str = "kvsp-interop-") -> Path:
    """A fresh scratch folder for peer logs and certificates."""
    return Path(tempfile.mkdtemp(prefix=prefix))
