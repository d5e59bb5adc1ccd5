"""A Linux network namespace joined to the test's own namespace by one veth pair, for tests
that need a second site: processes inside it reach the outer side only through the pair's
addresses, never the outer side's ``127.0.0.1`` services (DESIGN.md §1 deployment, a central
site and an edge site).

:func:`network_namespace` makes the namespace, the veth pair with addresses from a private
``/30`` (``10.231.X.Y``, a block no interface of this host uses yet, so parallel runs do not
collide) and the namespace's loopback, and removes all of it at the end, after a failure as
well: first the processes still running inside (started by the test), then the veth pair and
the namespace. Namespaces are named ``PREFIX-PID-TAG``: what a run killed before its cleanup
left (a timeout, SIGKILL) is removed by the next run of the same prefix, once ``PID`` is gone.

:meth:`Namespace.command` wraps an argv in ``ip netns exec``, which executes the command in the
same process, so a signal sent to a started process reaches the command itself.

Needs root and ``ip`` (iproute2); :func:`unavailable` says why where they are missing, for a
``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

PRIVATE_NET = ipaddress.IPv4Network("10.231.0.0/16")
"""Where the /30 of a pair comes from."""
IP_TIMEOUT_S = 20.0


class NamespaceError(RuntimeError):
    """An ``ip`` command failed while making the namespace (its output is in the message)."""


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["ip", *argv], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise NamespaceError(f"ip {' '.join(argv)}: {(done.stderr or done.stdout).strip()}")
    return done


def unavailable() -> str | None:
    """Why this host cannot make network namespaces (no root, no ``ip``), or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "ip (iproute2) is not installed"
    done = _ip("netns", "list", check=False)
    if done.returncode != 0:
        return f"ip netns does not work here: {done.stderr.strip()}"
    return None


@dataclass(frozen=True, slots=True)
class Namespace:
    """A namespace and the two ends of its veth pair."""

    name: str
    outer_if: str
    """The veth end in the test's own namespace."""
    inner_if: str
    """The veth end inside the namespace."""
    outer_addr: str
    """The outer end's address: how processes inside reach the outer side."""
    inner_addr: str
    """The inner end's address: how the outer side reaches processes inside."""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec``, which keeps the environment
        and runs the command in the same process)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the namespace to its end (``subprocess.run`` keywords; text
        output captured unless told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        kwargs.setdefault("check", False)
        done: subprocess.CompletedProcess[str] = subprocess.run(self.command(argv), **kwargs)
        return done

    def pids(self) -> list[int]:
        """The processes running inside the namespace now."""
        done = _ip("netns", "pids", self.name, check=False)
        return [int(word) for word in done.stdout.split() if word.isdigit()]


def _used_networks() -> list[ipaddress.IPv4Network]:
    done = _ip("-o", "-4", "addr", "show", check=False)
    nets = []
    for line in done.stdout.splitlines():
        words = line.split()
        if "inet" in words:
            with contextlib.suppress(ValueError, IndexError):
                nets.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]).network)
    return nets


def _free_block() -> ipaddress.IPv4Network:
    """A /30 of :data:`PRIVATE_NET` that overlaps no address of this host."""
    used = _used_networks()
    for _ in range(64):
        offset = secrets.randbelow(PRIVATE_NET.num_addresses // 4) * 4
        block = ipaddress.IPv4Network(f"{PRIVATE_NET.network_address + offset}/30")
        if not any(block.overlaps(net) for net in used):
            return block
    raise NamespaceError(f"no free /30 in {PRIVATE_NET}")


def _stop_inside(ns: Namespace, grace_s: float = 5.0) -> None:
    """SIGTERM the processes left inside ``ns`` (the test started them), SIGKILL after
    ``grace_s``."""
    pids = ns.pids()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = ns.pids()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _remove(name: str, outer_if: str) -> list[str]:
    """Delete the veth pair and the namespace; returns what could not be removed."""
    problems = []
    if _ip("link", "show", outer_if, check=False).returncode == 0:
        done = _ip("link", "del", outer_if, check=False)
        if done.returncode != 0 and "Cannot find" not in done.stderr:
            problems.append(f"veth {outer_if}: {done.stderr.strip()}")
    if name in _ip("netns", "list", check=False).stdout.split():
        done = _ip("netns", "del", name, check=False)
        if done.returncode != 0:
            problems.append(f"namespace {name}: {done.stderr.strip()}")
    deadline = time.monotonic() + IP_TIMEOUT_S  # the kernel drops the pair asynchronously
    while _ip("link", "show", outer_if, check=False).returncode == 0:
        if time.monotonic() > deadline:
            problems.append(f"veth {outer_if} still exists")
            break
        time.sleep(0.05)
    return problems


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(prefix: str) -> None:
    """Remove what an earlier run killed before its cleanup (a timeout, SIGKILL) left: the
    namespaces named ``PREFIX-PID-TAG`` whose creating process ``PID`` is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split(" ", 1)[0]
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != prefix or not parts[1].isdigit():
            continue
        if _alive(int(parts[1])):
            continue
        stale = Namespace(name, f"kv{parts[2]}o", f"kv{parts[2]}i", "", "")
        _stop_inside(stale)
        _remove(stale.name, stale.outer_if)


@contextlib.contextmanager
def network_namespace(prefix: str = "kvsp") -> Iterator[Namespace]:
    """A fresh namespace ``PREFIX-PID-TAG`` joined by a veth pair (see the module docstring);
    removed on exit. ``prefix`` must not contain ``-``; namespaces of this prefix that a dead
    process left are removed first.

    Raises:
        NamespaceError: an ``ip`` command failed (whatever was made is removed again).
    """
    _sweep(prefix)
    tag = secrets.token_hex(4)
    block = _free_block()
    outer, inner = (str(block.network_address + 1), str(block.network_address + 2))
    ns = Namespace(
        name=f"{prefix}-{os.getpid()}-{tag}",
        outer_if=f"kv{tag}o",  # interface names: at most 15 characters
        inner_if=f"kv{tag}i",
        outer_addr=outer,
        inner_addr=inner,
    )
    failed = False
    try:
        _ip("netns", "add", ns.name)
        _ip("link", "add", ns.outer_if, "type", "veth", "peer", "name", ns.inner_if)
        _ip("link", "set", ns.inner_if, "netns", ns.name)
        _ip("addr", "add", f"{outer}/30", "dev", ns.outer_if)
        _ip("link", "set", ns.outer_if, "up")
        inside = ("-n", ns.name)
        _ip(*inside, "addr", "add", f"{inner}/30", "dev", ns.inner_if)
        _ip(*inside, "link", "set", ns.inner_if, "up")
        _ip(*inside, "link", "set", "lo", "up")
        yield ns
    except BaseException:
        failed = True
        raise
    finally:
        if ns.name in _ip("netns", "list", check=False).stdout.split():
            _stop_inside(ns)
        problems = _remove(ns.name, ns.outer_if)
        if problems and not failed:  # never hide the test's own failure behind this one
            raise NamespaceError("; ".join(problems))


def exists(ns: Namespace) -> dict[str, bool]:
    """Whether the namespace and the outer veth end exist now (for cleanup checks)."""
    return {
        "namespace": ns.name in _ip("netns", "list").stdout.split(),
        "veth": _ip("link", "show", ns.outer_if, check=False).returncode == 0,
    }
