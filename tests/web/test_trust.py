"""The process's one TLS trust setting (DESIGN.md §3 TLS; :mod:`kvsp.web.trust`): ``--cafile``
and ``--insecure`` as read from the command line (with the deprecated per-connection aliases),
and what the HTTPS clients built with it accept from a real TLS server on 127.0.0.1 whose
certificate a private CA signed."""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kvsp.errors import BadRequest, TransportError
from kvsp.transfer.block_client import BlockClient
from kvsp.web.cliargs import add_common_arguments, trust_from_args
from kvsp.web.client import BaseClient
from kvsp.web.trust import Trust
from relay.app import configure_parser as relay_parser
from relay.app import relay_config
from tests.support.private_ca import IssuedCertificates, make_private_ca

BODY = b'{"ok":true}'


@pytest.fixture(scope="module")
def issued(tmp_path_factory: pytest.TempPathFactory) -> IssuedCertificates:
    return make_private_ca(tmp_path_factory.mktemp("ca"))


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsp serve x")
    add_common_arguments(parser, 9999)
    parser.add_argument("--relay-cafile", type=Path)
    return parser


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.readuntil(b"\r\n\r\n")
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/kvsp+json\r\n"
        writer.write(head + b"content-length: %d\r\n\r\n" % len(BODY) + BODY)
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
        pass  # a client that refused our certificate hangs up during the handshake
    finally:
        writer.close()


@asynccontextmanager
async def https_server(issued: IssuedCertificates) -> AsyncIterator[str]:
    """A one-answer HTTPS server on 127.0.0.1 with the CA-signed certificate; its base URL."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(issued.cert, issued.key)
    server = await asyncio.start_server(_answer, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"https://127.0.0.1:{port}/"


async def base_client_get(issued: IssuedCertificates, trust: Trust | None) -> object:
    async with https_server(issued) as url, BaseClient(url, None, trust=trust) as client:
        return await client._request_json("GET", "healthz")


async def bulk_get(issued: IssuedCertificates, trust: Trust | None) -> int:
    async with (
        https_server(issued) as url,
        BlockClient(None, trust=trust, hashing="inline") as blocks,
    ):
        return (await blocks.bulk.request("GET", url + "healthz")).status


@pytest.mark.parametrize("get", [base_client_get, bulk_get], ids=["httpx", "bulk"])
def test_an_https_client_trusts_the_ca_it_is_given_and_only_that(
    issued: IssuedCertificates, get: Callable[[IssuedCertificates, Trust | None], Awaitable[object]]
) -> None:
    run = get
    with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(run(issued, None))  # the system store knows no test CA
    assert asyncio.run(run(issued, Trust(cafile=str(issued.ca)))) in ({"ok": True}, 200)
    assert asyncio.run(run(issued, Trust(verify=False))) in ({"ok": True}, 200)
    # a CA file that is not the signer's: refused as well
    other = make_private_ca(issued.ca.parent / "other")
    with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(run(issued, Trust(cafile=str(other.ca))))


def test_cafile_and_insecure_make_one_trust(
    issued: IssuedCertificates, caplog: pytest.LogCaptureFixture
) -> None:
    parse = serve_parser().parse_args
    assert trust_from_args(parse([])) == Trust()
    assert trust_from_args(parse(["--cafile", str(issued.ca)])) == Trust(cafile=str(issued.ca))
    with caplog.at_level(logging.WARNING):
        assert trust_from_args(parse(["--insecure"])) == Trust(verify=False)
    assert "NOT verified" in caplog.text


def test_the_old_relay_cafile_means_cafile_with_a_warning(
    issued: IssuedCertificates, caplog: pytest.LogCaptureFixture
) -> None:
    parse = serve_parser().parse_args
    with caplog.at_level(logging.WARNING):
        trust = trust_from_args(parse(["--relay-cafile", str(issued.ca)]))
    assert trust == Trust(cafile=str(issued.ca))
    assert "--relay-cafile is deprecated" in caplog.text
    same = ["--relay-cafile", str(issued.ca), "--cafile", str(issued.ca)]
    assert trust_from_args(parse(same)) == trust


@pytest.mark.parametrize(
    "argv",
    [
        ["--cafile", "{ca}", "--relay-cafile", "{cert}"],
        ["--cafile", "{ca}", "--insecure"],
        ["--cafile", "{missing}"],
        ["--cafile", "{key}"],
    ],
    ids=["alias-differs", "insecure-with-cafile", "missing-file", "not-a-certificate"],
)
def test_contradictory_or_unusable_trust_is_a_bad_request(
    issued: IssuedCertificates, argv: list[str]
) -> None:
    names = {
        "ca": issued.ca,
        "cert": issued.cert,
        "key": issued.key,
        "missing": issued.ca.parent / "nope.pem",
    }
    args = serve_parser().parse_args([a.format(**names) for a in argv])
    with pytest.raises(BadRequest):
        trust_from_args(args)


@pytest.mark.parametrize(
    "argv", [["--cafile", "{ca}"], ["--upstream-cafile", "{ca}"]], ids=["cafile", "alias"]
)
def test_the_relays_upstream_uses_the_process_trust(
    issued: IssuedCertificates, tmp_path: Path, argv: list[str]
) -> None:
    parser = argparse.ArgumentParser(prog="kvsp serve relay")
    add_common_arguments(parser, 4443)
    relay_parser(parser)
    base = ["--state", str(tmp_path), "--upstream", "moqt://127.0.0.1:4443/", "--open"]
    args = parser.parse_args(base + [a.format(ca=issued.ca) for a in argv])
    upstream = relay_config(args).upstream
    assert upstream is not None
    assert (upstream.cafile, upstream.verify) == (issued.ca, True)
    insecure = relay_config(parser.parse_args([*base, "--upstream-insecure"])).upstream
    assert insecure is not None and insecure.verify is False
