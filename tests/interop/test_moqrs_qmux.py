"""moq-rs 0.5.1 (Rust moq-tokio with the ``qmux`` 0.5.2 crate) against OUR MOQT over QMux:
draft-ietf-quic-qmux-01 §3.2 (records), §4.2 (QX_TRANSPORT_PARAMETERS), §4.3 (QX_PING), §5.2
(max_record_size), §6 (flow control); MOQT draft-16 §3 and §9.3 (setup).

What moq-rs 0.5.1 can do over QMux decides the shape (observed on the wire, see
interop/README.md "moq-rs over QMux"):

* it dials QMux over plain TCP (``tcp://host:port/``) and over a Unix socket
  (``unix:///abs/path``) and agrees MOQT draft-16 when the server's QX_TRANSPORT_PARAMETERS
  carries the application_protocols parameter (0x3d4f9c2a8b1e6075) naming ``moqt-16``;
* it has no QMux-over-TLS client (``tls://``-like schemes are refused; ``wss://`` is QMux inside
  WebSocket, a carrier we do not serve), so our TLS carrier is not tested against it;
* it cannot listen on QMux (``moq.Server`` binds UDP only), so it is always the client here.

The checks:

* our ``serve_qmux`` with our MOQT session: a moq-rs client completes the setup on each carrier
  and reports draft 16 (``connected version=moq-transport-16``);
* KV-shaped objects (one group, four 2 MiB objects, one per layer) from a moq-rs publisher through
  our relay (``relay.app --open`` with ``--qmux-tcp-listen`` and ``--qmux-unix``) to a moq-rs
  subscriber, compared by SHA-256 per object, over every carrier pair that matters: QMux TCP to
  QMux TCP, Unix to Unix, TCP to Unix, and QMux to raw QUIC both ways (one cache for all).
  moq-rs accepts records of at most 16,382 octets and opens with 1 MiB of connection and
  256 KiB of stream credit, so the subscriber side exercises our record splitting and our
  respect of its flow control.

Each skips with its reason when moq-rs cannot be installed, when ``moqt.qmux_asyncio`` does not
exist yet, or when our relay does not start with the QMux carriers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from interop import peers
from tests.support.polling import eventually, until

pytestmark = pytest.mark.slow  # peer processes: about ten seconds in all
LAYERS = 4
SIZE = 2 << 20  # a 2 MiB object per layer, ~128 QMux records each at moq-rs's 16,382 limit
COMPAT, SCOPE = "c2" * 32, "5e" * 16
TRACK = "ab" * 32
ANSI = re.compile(r"\x1b\[[0-9;]*m")
AGREED_D16 = re.compile(r"connected version=moq-transport-16\b")


def namespace(case: str) -> str:
    """A KV-shaped namespace of its own per case (the relay caches by track)."""
    block = hashlib.sha256(case.encode()).hexdigest()
    return f"kvsp/1/{COMPAT}/{SCOPE}/{block}"


def expected_objects() -> dict[int, tuple[int, str]]:
    return {
        layer: (SIZE, hashlib.sha256(peers.kv_payload(layer, SIZE)).hexdigest())
        for layer in range(LAYERS)
    }


@pytest.fixture(scope="module")
def moqrs() -> str:
    try:
        return peers.moqrs_python()
    except peers.PeerUnavailable as exc:
        pytest.skip(f"moq-rs unavailable: {exc}")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path for Unix sockets (107 octets at most)."""
    with tempfile.TemporaryDirectory(prefix="kq-") as folder:
        yield Path(folder)


# --- our QMux server + our MOQT session, moq-rs as the client ---------------------------------


@pytest.mark.parametrize("carrier", ["tcp", "unix"])
def test_moqrs_client_agrees_draft16_with_our_qmux_server(
    carrier: str, moqrs: str, tmp_path: Path, short_dir: Path
) -> None:
    if importlib.util.find_spec("moqt.qmux_asyncio") is None:
        pytest.skip("moqt.qmux_asyncio does not exist yet (QMux is being written)")
    from moqt.qmux_asyncio import QMuxEndpoint, serve_qmux

    setups: list[Any] = []
    closes: list[Any] = []

    async def handler(connection: Any) -> None:
        setups.append(await connection.wait_setup())
        closes.append(await connection.wait_closed())

    async def test() -> str:
        if carrier == "tcp":
            endpoint = QMuxEndpoint(carrier="tcp", host="127.0.0.1", port=0, path=None)
        else:
            socket_path = str(short_dir / "q.sock")
            endpoint = QMuxEndpoint(carrier="unix", host=None, port=None, path=socket_path)
        server = await serve_qmux(endpoint, handler=handler)
        try:
            if carrier == "tcp":
                url = f"tcp://127.0.0.1:{server.address[1]}/"
            else:
                url = f"unix://{socket_path}"
            client = peers.run_script(
                "moqrs-connect", moqrs, peers.MOQRS_CONNECT, [url, "1"], tmp_path
            )
            with client:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, _wait_exit, client, 30.0)
                output = ANSI.sub("", client.output())
            if setups:
                await until(lambda: closes, 10.0, "our session sees moq-rs leave")
            return output
        finally:
            server.close()
            await server.wait_closed()

    output = asyncio.run(asyncio.wait_for(test(), 60))
    assert "CLIENT connected" in output, output[-3000:]
    assert AGREED_D16.search(output), output[-3000:]
    assert len(setups) == 1, output[-3000:]
    # moq-rs leaving ends our session from its side: with CONNECTION_CLOSE (code 0) when its
    # process lives long enough to send it, else with the carrier's end (FIN or a reset)
    assert [c.by_peer for c in closes] == [True], (closes, output[-3000:])


def _wait_exit(peer: peers.PeerProcess, timeout: float) -> None:
    try:
        peer.wait(timeout)
    except Exception:  # noqa: BLE001 - a hung peer fails the assertions on its output
        peer.stop()


# --- through our relay -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def qmux_relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[peers.PeerProcess]:
    workdir = tmp_path_factory.mktemp("kvsp-relay-qmux")
    with tempfile.TemporaryDirectory(prefix="kq-") as folder:
        try:
            relay = peers.start_our_relay(
                workdir, qmux_tcp=True, qmux_unix=Path(folder) / "relay.sock"
            )
        except peers.PeerUnavailable as exc:
            pytest.skip(str(exc))
        with relay:
            yield relay


PAIRS = [
    ("moqt+tcp", "moqt+tcp"),
    ("moqt+unix", "moqt+unix"),
    ("moqt+tcp", "moqt+unix"),
    ("moqt+unix", "moqt"),
    ("moqt", "moqt+tcp"),
]


@pytest.mark.parametrize(("pub_scheme", "sub_scheme"), PAIRS)
def test_moqrs_publisher_to_moqrs_subscriber_through_our_relay_over_qmux(
    pub_scheme: str, sub_scheme: str, qmux_relay: peers.PeerProcess, moqrs: str, tmp_path: Path
) -> None:
    pub_url = peers.moqrs_url(peers.carrier(qmux_relay, pub_scheme))
    sub_url = peers.moqrs_url(peers.carrier(qmux_relay, sub_scheme))
    path = namespace(f"{pub_scheme}->{sub_scheme}")
    pub_args = [pub_url, path, TRACK, str(LAYERS), str(SIZE), "30"]
    publisher = peers.run_script("moqrs-pub", moqrs, peers.MOQRS_KV_PUB, pub_args, tmp_path)
    with publisher:
        _wait_for_line(publisher, "PUB announced")
        # the subscriber waits for the announcement itself (announced_broadcast)
        sub_args = [sub_url, path, TRACK, str(LAYERS), "20"]
        subscriber = peers.run_script("moqrs-sub", moqrs, peers.MOQRS_KV_SUB, sub_args, tmp_path)
        with subscriber:
            _wait_exit(subscriber, 60.0)
            output = subscriber.output()
        output += "\n--- publisher ---\n" + publisher.output()[-1500:]
    output += "\n--- relay ---\n" + qmux_relay.output()[-1500:]
    assert peers.object_lines(output, "SUB") == expected_objects(), ANSI.sub("", output)[-4000:]


def _wait_for_line(peer: peers.PeerProcess, line: str, timeout: float = 15.0) -> None:
    with contextlib.suppress(AssertionError):  # reported below, with the peer's output
        eventually(
            lambda: line in peer.output() or peer.proc.poll() is not None,
            timeout,
            f"{peer.name} prints {line!r}",
        )
    if line not in peer.output():
        peer.stop()
        pytest.fail(f"{peer.name} did not print {line!r}: {peer.output()[-1500:]}")
