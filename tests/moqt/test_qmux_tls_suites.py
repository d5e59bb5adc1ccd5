"""moqt.qmux_tls: which side protects the records after the handshake, and with which suite.

An inline connection between our client and our server hands its records to
moqt._tlsrecords.Records on both sides and agrees on AES-128-GCM; the thread engine leaves them
with OpenSSL; the order of preference never enables a suite the context does not.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from moqt import qmux_tls
from moqt.qmux_tls import TLSWorkerTransport
from tests.moqt.test_qmux_tls import Peer, certs, run

__all__ = ["certs"]  # the module's certificate fixture, shared


class Context:
    """What _preferred_suites reads of an ssl.SSLContext."""

    def __init__(self, *names: str) -> None:
        self.ciphers = [{"name": n, "protocol": "TLSv1.3"} for n in names]
        self.ciphers.append({"name": "ECDHE-RSA-AES128-GCM-SHA256", "protocol": "TLSv1.2"})

    def get_ciphers(self) -> list[dict[str, Any]]:
        return self.ciphers


@pytest.mark.parametrize(
    ("enabled", "expected"),
    [
        (
            ("TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256", "TLS_AES_128_GCM_SHA256"),
            "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256",
        ),
        (  # a policy without AES-128-GCM keeps it out
            ("TLS_CHACHA20_POLY1305_SHA256", "TLS_AES_256_GCM_SHA384"),
            "TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256",
        ),
        (  # one we do not rank stays enabled, after ours
            ("TLS_AES_128_CCM_SHA256", "TLS_AES_128_GCM_SHA256"),
            "TLS_AES_128_GCM_SHA256:TLS_AES_128_CCM_SHA256",
        ),
    ],
)
def test_the_preference_reorders_what_the_context_enables_and_adds_nothing(
    enabled: tuple[str, ...], expected: str
) -> None:
    context = Context(*enabled)
    assert qmux_tls._preferred_suites(context) == expected  # type: ignore[arg-type]
    context.ciphers.clear()  # kept per context: asked once
    assert qmux_tls._preferred_suites(context) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "thread"])
def test_who_protects_the_records_after_the_handshake(
    certs: tuple[str, str], threaded: bool
) -> None:
    if not threaded:
        pytest.importorskip("moqt._tlsrecords", reason="moqt._tlsrecords is not built")
    data = bytes(range(256)) * 4096  # 1 MiB, echoed

    async def body(tls: TLSWorkerTransport, client: Peer, served: list[Peer]) -> None:
        tls.write(data)
        while len(client.received) < len(data):
            await asyncio.sleep(0.01)
        server = served[0].transport
        assert server is not None
        for side in (tls, server):
            assert (side._worker._sealed is not None) is not threaded
            if not threaded:
                assert side.get_extra_info("cipher")[0] == "TLS_AES_128_GCM_SHA256"
        tls.close()
        assert await client.lost is None

    run(certs, body, threaded, echo=True)
