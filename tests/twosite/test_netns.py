"""The network namespace of the two-site tests (tests/support/netns.py): a process inside
reaches the outer side only through the veth pair, not the outer side's loopback services, and
everything made is gone at the end, after a failure as well, processes left inside included."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.support.netns import Namespace, exists, network_namespace, unavailable

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=WHY or "")]

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


class Listener:
    """A TCP server on ``host`` of the outer namespace that accepts and closes connections."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.port: int = self.sock.getsockname()[1]
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def ns() -> Iterator[Namespace]:
    with network_namespace("kvspt") as made:
        yield made


def connect_from_inside(ns: Namespace, host: str, port: int) -> str:
    done = ns.run([sys.executable, "-c", CONNECT, host, str(port)])
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_inside_reaches_the_outer_address_and_not_the_outer_loopback(ns: Namespace) -> None:
    outer = Listener(ns.outer_addr)
    loopback = Listener("127.0.0.1")
    try:
        assert connect_from_inside(ns, ns.outer_addr, outer.port) == "connected"
        assert outer.accepted == 1
        # 127.0.0.1 inside is the namespace's own loopback: nothing listens there
        assert connect_from_inside(ns, "127.0.0.1", loopback.port) == "ConnectionRefusedError"
        assert loopback.accepted == 0
    finally:
        outer.close()
        loopback.close()


def test_the_outer_side_reaches_a_server_inside(ns: Namespace) -> None:
    server = subprocess.Popen(
        ns.command([sys.executable, "-u", "-m", "http.server", "--bind", ns.inner_addr, "0"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # "Serving HTTP on ADDR port PORT ..."
        port = int(line.split(" port ")[1].split()[0])
        with socket.create_connection((ns.inner_addr, port), timeout=5):
            pass
        assert ns.pids() == [server.pid]  # ip netns exec runs the command in its own process
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()


def test_everything_is_removed_after_a_failure_processes_included() -> None:
    made: list[Namespace] = []
    with pytest.raises(RuntimeError, match="the test failed"), network_namespace("kvspt") as ns:
        made.append(ns)
        sleeper = subprocess.Popen(ns.command(["sleep", "300"]))
        assert exists(ns) == {"namespace": True, "veth": True}
        raise RuntimeError("the test failed")
    assert exists(made[0]) == {"namespace": False, "veth": False}
    assert sleeper.wait(timeout=10) != 0  # stopped at teardown, not left running


def test_two_namespaces_get_distinct_addresses() -> None:
    with network_namespace("kvspt") as one, network_namespace("kvspt") as two:
        assert {one.outer_addr, one.inner_addr}.isdisjoint({two.outer_addr, two.inner_addr})
        assert one.name != two.name and one.outer_if != two.outer_if


def test_what_a_dead_run_left_is_removed_by_the_next() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    tag = secrets.token_hex(4)
    left = Namespace(f"kvspt-{dead.pid}-{tag}", f"kv{tag}o", f"kv{tag}i", "", "")
    subprocess.run(["ip", "netns", "add", left.name], check=True)
    subprocess.run(
        ["ip", "link", "add", left.outer_if, "type", "veth", "peer", "name", left.inner_if],
        check=True,
    )
    subprocess.run(["ip", "link", "set", left.inner_if, "netns", left.name], check=True)
    orphan = subprocess.Popen(left.command(["sleep", "300"]))
    try:
        assert exists(left) == {"namespace": True, "veth": True}
        with network_namespace("kvspt") as ns:
            assert exists(left) == {"namespace": False, "veth": False}
            assert exists(ns) == {"namespace": True, "veth": True}
        assert orphan.wait(timeout=10) != 0
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        subprocess.run(["ip", "link", "del", left.outer_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", left.name], capture_output=True, check=False)
