"""The measured QUIC default: the fastest installed backend at 1,452-byte datagrams, path-MTU
probing where the backend does it, aioquic still selectable, and the start-up banner."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moqt.asyncio import MOQTConnection, connect, serve
from moqt.backend import (
    DEFAULT_DATAGRAM_SIZE,
    TransportConfig,
    available_backends,
    backend_of,
    default_backend,
    describe_transport,
    get_backend,
    transport_banner,
)
from moqt.certs import make_self_signed
from tests.support.backends import BACKENDS, HAS_QH3
from tests.support.polling import until


def test_the_default_is_qh3_when_installed_else_aioquic() -> None:
    assert default_backend() == ("qh3" if HAS_QH3 else "aioquic")
    assert available_backends()[0] == default_backend()
    assert "aioquic" in available_backends()
    assert get_backend(None) is get_backend(default_backend())


@pytest.mark.parametrize("backend", BACKENDS)
def test_configurations_use_internet_mtu_datagrams(backend: str) -> None:
    quic = get_backend(backend)
    assert DEFAULT_DATAGRAM_SIZE == 1452
    config = quic.configuration(is_client=True)
    assert config.max_datagram_size == DEFAULT_DATAGRAM_SIZE
    if backend == "qh3":
        assert config.probe_datagram_size is True
        off = quic.configuration(is_client=True, transport=TransportConfig(probe_path_mtu=False))
        assert off.probe_datagram_size is False
    assert backend_of(config) == backend  # connect/serve run on the configuration's library
    library = quic.configuration(is_client=True, transport=TransportConfig(max_datagram_size=None))
    assert library.max_datagram_size == quic.QuicConfiguration(is_client=True).max_datagram_size


def test_the_banner_names_backend_version_and_datagram_size() -> None:
    aioquic = get_backend("aioquic")
    assert transport_banner("aioquic") == f"aioquic {aioquic.version}, 1452-byte datagrams"
    assert describe_transport(TransportConfig(max_datagram_size=None), "aioquic") == (
        "library-default datagrams"
    )
    if HAS_QH3:
        qh3 = get_backend("qh3")
        assert transport_banner("qh3") == (
            f"qh3 {qh3.version}, 1452-byte datagrams, path-MTU probing"
        )
    assert transport_banner().startswith(default_backend() + " ")


def test_connect_and_serve_default_to_the_same_backend(tmp_path: Path) -> None:
    cert, key = make_self_signed("localhost", tmp_path)

    async def scenario() -> tuple[str, str]:
        seen: list[str] = []

        async def handler(connection: MOQTConnection) -> None:
            seen.append(type(connection._protocol).__name__)
            await connection.wait_closed()

        server_config = get_backend().configuration(
            is_client=False, certificate=str(cert), private_key=str(key)
        )
        server = await serve("127.0.0.1", 0, configuration=server_config, handler=handler)
        try:
            client_config = get_backend().configuration(is_client=True, cafile=str(cert))
            client_config.server_name = "localhost"
            async with connect(
                "127.0.0.1", server.address[1], configuration=client_config
            ) as connection:
                client_protocol = type(connection._protocol).__name__
                await until(lambda: seen, 10, "the server's handler")
        finally:
            server.close()
        return client_protocol, seen[0]

    client_protocol, server_protocol = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert client_protocol == server_protocol == f"MOQTProtocol_{default_backend()}"
