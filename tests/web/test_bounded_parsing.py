"""Bounded JSON parsing (DESIGN.md §3 "Encodings"): what a body may make the parser build, and
the amplification payloads against real processes (RSS growth and event-loop stall).

The process test starts ``kvsp serve control`` (IS + PC), a holder and one toy-engine instance
(:mod:`tests.support.cluster`), sends ``{"x":[{},{},…]}`` bodies to the IS's ``/lookup`` and
``/replicas`` and to the instance's ``/generate`` (with a Content-Length, streamed without one,
and under the route's octet limit), and checks each service's peak RSS growth
(``/proc/PID/status`` VmHWM after resetting it) and the longest gap between answers to
``/healthz`` polled from another connection during the upload: both well below what parsing
such a body costs (hundreds of MiB, seconds), and the PC still counts the instance active
afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.errors import BadRequest, PayloadTooLarge
from kvsp.web.http import JsonLimits, json_prescan, parse_json
from tests.support import cluster as cluster_kit

# --- the limits, in-process --------------------------------------------------------------------

SMALL = JsonLimits(max_octets=10_000, max_items=100, max_containers=10, max_string=20, max_number=8)


def test_limits_bound_what_the_parser_would_build() -> None:
    assert parse_json(b'{"a":[1,2,3],"b":"short","c":{"d":null}}', limits=SMALL) is not None
    cases = {
        b"[" + b"{}," * 20 + b"{}]": "arrays and objects",
        b"[" + b"1," * 200 + b"1]": "items",
        b'{"s":"' + b"x" * 21 + b'"}': "string is longer than 20",
        b"[123456789]": "number is longer than 8",
        b'["' + b'a","' * 120 + b'a"]': "items",
    }
    for body, what in cases.items():
        with pytest.raises(PayloadTooLarge, match=what):
            parse_json(body, limits=SMALL)
    with pytest.raises(PayloadTooLarge, match="octets"):
        parse_json(b" " * 10_001 + b"1", limits=SMALL)


def test_structure_inside_strings_is_not_counted() -> None:
    body = b'{"s":"[{,:]}[{,:]}","t":"\\"[[{{,,","u":"\\\\"}'
    assert parse_json(body, limits=SMALL) == {"s": "[{,:]}[{,:]}", "t": '"[[{{,,', "u": "\\"}
    limits = JsonLimits(max_octets=1000, max_items=10, max_containers=2, max_strings=6)
    assert parse_json(body, limits=limits)["u"] == "\\"
    with pytest.raises(PayloadTooLarge, match="strings"):
        json_prescan(
            body, JsonLimits(max_octets=1000, max_items=10, max_containers=2, max_strings=5)
        )


def test_strings_are_measured_in_octets_as_sent() -> None:
    exactly = b'["' + b"\\\\" * 10 + b'"]'  # 20 octets, 10 characters
    assert parse_json(exactly, limits=SMALL) == ["\\" * 10]
    with pytest.raises(PayloadTooLarge, match="string"):
        parse_json(b'["' + b"\\\\" * 10 + b'x"]', limits=SMALL)


def test_numbers_that_overflow_to_infinity_are_refused() -> None:
    with pytest.raises(BadRequest, match="not finite"):
        parse_json(b"[1e999]")
    with pytest.raises(BadRequest, match="not finite"):
        parse_json(b"[-1e999]", limits=SMALL)


def test_for_array_fits_its_array_and_not_much_more() -> None:
    keys = JsonLimits.for_array(65_536, 80, 32 << 20, strings=True)
    body = json.dumps({"scope_id": "0" * 32, "block_keys": ["ab" * 32] * 65_536}).encode()
    json_prescan(body, keys)
    assert keys.max_octets < 6 << 20
    prompt = JsonLimits.for_array(1 << 20, 12, 64 << 20, strings=False)
    json_prescan(json.dumps({"prompt": [4_294_967_295] * (1 << 20)}).encode(), prompt)
    with pytest.raises(PayloadTooLarge, match="strings"):
        json_prescan(json.dumps({"prompt": ["ab"] * 2000}).encode(), prompt)
    with pytest.raises(PayloadTooLarge, match="arrays and objects"):
        json_prescan(b'{"prompt":[' + b"{}," * 100 + b"{}]}", prompt)


_VALUES = st.recursive(
    st.none()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet='[]{},:"\\ab\u00e9\n'),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=3),
)


def _measure(value: object) -> tuple[int, int, int, int]:
    """(items, containers, strings, depth) of a JSON value, by walking it (an empty array or
    object is two items, as :class:`JsonLimits` counts it)."""
    if isinstance(value, dict):
        inner = [_measure(v) for v in value.values()]
        counts = (len(value) + 1 + (not value), 1, len(value), 1)
    elif isinstance(value, list):
        inner = [_measure(v) for v in value]
        counts = (1 + (not value), 1, 0, 1)
    else:
        return 1, 0, int(isinstance(value, str)), 0
    return (
        counts[0] + sum(i[0] for i in inner),
        counts[1] + sum(i[1] for i in inner),
        counts[2] + sum(i[2] for i in inner),
        counts[3] + max((i[3] for i in inner), default=0),
    )


def _scalars(value: object) -> Iterator[object]:
    """Every key and scalar of a JSON value."""
    if isinstance(value, dict):
        yield from value
        value = list(value.values())
    if isinstance(value, list):
        for inner in value:
            yield from _scalars(inner)
    elif value is not None:
        yield value


def _sent(scalar: object, ascii_only: bool) -> int:
    """Octets of a string between its quotes, or characters of a number, as json.dumps sends
    them."""
    text = json.dumps(scalar, ensure_ascii=ascii_only).encode()
    return len(text) - 2 if isinstance(scalar, str) else len(text)


@given(_VALUES, st.booleans(), st.booleans())
def test_prescan_counts_are_exact(value: object, ascii_only: bool, large: bool) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    if large:  # the path for bodies of a MiB and more, which never copies the body
        body = body + b" " * (1 << 20)
    items, containers, strings, depth = _measure(value)
    scalars = list(_scalars(value))
    texts = [_sent(t, ascii_only) for t in scalars if isinstance(t, str)]
    numbers = [_sent(n, ascii_only) for n in scalars if type(n) in (int, float)]
    exact = JsonLimits(
        max_octets=len(body),
        max_items=items,
        max_containers=containers,
        max_strings=strings,
        max_depth=depth,
        max_string=max(texts, default=0),
        max_number=max(numbers, default=1),
    )
    json_prescan(body, exact)
    for tighter in (
        {"max_items": items - 1},
        {"max_containers": containers - 1},
        {"max_strings": strings - 1},
        {"max_string": exact.max_string - 1},
        {"max_number": exact.max_number - 1 if numbers else -1},
    ):
        if min(tighter.values()) >= 0:
            with pytest.raises(PayloadTooLarge):
                json_prescan(body, dataclasses.replace(exact, **tighter))
    if depth > 0:
        with pytest.raises(BadRequest, match="deeper"):
            json_prescan(body, dataclasses.replace(exact, max_depth=depth - 1))


# --- the amplification payloads against real processes ------------------------------------------


def amplifier(octets: int) -> bytes:
    """``{"x":[{},{},…]}`` of about ``octets`` octets (the issue's payload)."""
    return b'{"x":[' + b"{}," * (octets // 3) + b"{}]}"


def post_raw(url: str, path: str, token: str, body: bytes, *, chunked: bool = False) -> int:
    """POST ``body`` over a fresh socket and return the status of the answer; the upload runs
    in a thread so that a server that answers early (and stops reading) is seen answering."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    framing = "transfer-encoding: chunked" if chunked else f"content-length: {len(body)}"
    head = (
        f"POST /{path} HTTP/1.1\r\nhost: {parts.netloc}\r\nauthorization: Bearer {token}\r\n"
        f"content-type: application/kvsp+json\r\n{framing}\r\nconnection: close\r\n\r\n"
    ).encode()

    def upload() -> None:
        try:
            sock.sendall(head)
            if not chunked:
                sock.sendall(body)
                return
            step = 1 << 20
            for start in range(0, len(body), step):
                piece = body[start : start + step]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed before taking it all

    sender = threading.Thread(target=upload, daemon=True)
    sender.start()
    answer = b""
    try:
        while b"\r\n" not in answer:
            more = sock.recv(4096)
            if not more:
                break
            answer += more
    finally:
        sender.join(timeout=60)
        sock.close()
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


class HealthPoller:
    """Polls ``healthz`` of one service on its own connection; the longest gap between two
    answers is the longest the service's loop was unavailable (plus one request's time)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.longest = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        request = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
        with socket.create_connection(self.address, timeout=30) as sock:
            last = time.monotonic()
            while not self._stop.is_set():
                sock.sendall(request)
                answer = b""
                while not answer.endswith(b"}"):
                    answer += sock.recv(4096)
                now = time.monotonic()
                self.longest = max(self.longest, now - last)
                self.answers += 1
                last = now
                time.sleep(0.005)


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster_kit.Cluster]:
    cluster = cluster_kit.start_cluster(tmp_path_factory.mktemp("bounded"), {"a": []}, [])
    try:
        yield cluster
    finally:
        cluster.stop()
        cluster.http.close()


ATTACKS = [
    ("control", "lookup", 31 << 20, False),
    ("control", "lookup", 31 << 20, True),
    ("control", "lookup", 4 << 20, False),  # under the lookup's octet limit
    ("control", "replicas", 31 << 20, False),  # a batch may be 32 MiB of records
    ("a", "generate", 63 << 20, False),
    ("a", "generate", 63 << 20, True),
    ("a", "generate", 11 << 20, False),  # under the prompt's octet limit
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("service", "path", "octets", "chunked"), ATTACKS)
def test_amplification_payloads_are_refused_cheaply(
    small_cluster: cluster_kit.Cluster, service: str, path: str, octets: int, chunked: bool
) -> None:
    proc = small_cluster.services[service].proc
    url = small_cluster.url(service)
    token = cluster_kit.CLIENT_TOKEN if path == "generate" else cluster_kit.ADMIN_TOKEN
    body = amplifier(octets)
    Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = rss_kib(proc.pid, "VmRSS")
    with HealthPoller(url) as poller:
        status = post_raw(url, path, token, body, chunked=chunked)
        time.sleep(0.05)  # one more poll after the answer
    grown_mib = (rss_kib(proc.pid, "VmHWM") - before) / 1024
    assert status == 413
    # At most the octets of the body (a batch may be 32 MiB of records) plus the scan's own.
    assert grown_mib < 48, f"{service} /{path}: peak RSS grew {grown_mib:.0f} MiB"
    half_ttl_s = cluster_kit.STATUS_TTL_MS / 2000
    assert poller.answers > 0
    assert poller.longest < half_ttl_s, f"{service} loop stalled {poller.longest:.3f} s"
    row = small_cluster.row("a")
    assert row["state"] == "active", row  # no remote-triggered failover
