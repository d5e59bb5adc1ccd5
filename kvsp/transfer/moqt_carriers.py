"""Which byte pipe carries a MOQT session to a holder, and how it is opened (DESIGN.md §4
Carriers; spec §4.4; draft-ietf-quic-qmux-01; draft-nandakumar-moq-qmux-moqt-00).

The MOQT session is the same on every carrier; only the pipe under it changes:

=============================================  ==================================================
``moqt://host:port/path``                      QUIC (aioquic or qh3), ALPN ``moqt-16``
``moqt+tls://host:port/path``                  QMux over TLS 1.3 over TCP, ALPN
                                               ``qmux-01.moqt-16``
``moqt+tcp://host:port/path``                  QMux over plain TCP: loopback, or a network the
                                               operator marks trusted
``moqt+unix://localhost/abs/path.sock``        QMux over a Unix domain socket on the holder's host
=============================================  ==================================================

A holder's Replica Record names its QUIC URI as ``holder`` and lists its QMux endpoints, fastest
first, in the ``moqt_carriers`` extension member. :func:`carrier_candidates` keeps the ones a
client may use: a TLS or TCP endpoint only on the holder's own host (the same-origin rule of
``lease_base``: a record cannot send a client's credentials to a server the holder URI does not
name), plain TCP only to a loopback host unless the client is on a trusted network, and a Unix
socket only when the holder's host is this machine (a loopback name) and the socket exists here.
The client tries them in order and the QUIC URI last, so a carrier that fails costs one refused
connection, never the transfer.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsp.errors import UnsupportedHolder
from kvsp.transfer.moqt_transfer import MoqtAddress, parse_moqt_uri
from moqt.asyncio import MOQTConnection, connect
from moqt.backend import TransportConfig, default_backend, get_backend
from moqt.qmux_asyncio import is_loopback


@dataclass(frozen=True, slots=True, kw_only=True)
class CarrierPolicy:
    """What a client may use: QMux at all (``qmux``), plain TCP beyond loopback
    (``trusted_network``)."""

    qmux: bool = True
    trusted_network: bool = False


def usable(carrier: MoqtAddress, holder: MoqtAddress, policy: CarrierPolicy) -> bool:
    """Whether a client under ``policy`` may reach ``holder`` through ``carrier``."""
    if carrier.carrier == "quic":
        return carrier == holder
    if not policy.qmux:
        return False
    if carrier.carrier == "unix":
        return is_loopback(holder.host) and _is_socket(carrier.socket_path)
    if carrier.host.lower() != holder.host.lower():
        return False  # same origin: only the holder's own host
    return carrier.carrier == "tls" or policy.trusted_network or is_loopback(carrier.host)


def check_allowed(address: MoqtAddress, policy: CarrierPolicy) -> MoqtAddress:
    """``address`` when ``policy`` lets a client dial it directly (``--relay``), else raise.

    Raises:
        UnsupportedHolder: QMux turned off, or plain TCP to a non-loopback host without a
            trusted network.
    """
    if address.carrier != "quic" and not policy.qmux:
        raise UnsupportedHolder(f"{address}: QMux carriers are turned off")
    if address.carrier == "tcp" and not (policy.trusted_network or is_loopback(address.host)):
        raise UnsupportedHolder(
            f"{address}: plain TCP beyond loopback needs a trusted network (--trusted-network)"
        )
    return address


def _is_socket(path: str | None) -> bool:
    try:
        return path is not None and stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def carrier_candidates(
    holder: str, carriers: Sequence[str] | None, policy: CarrierPolicy | None = None
) -> tuple[MoqtAddress, ...]:
    """Where to reach ``holder`` (a ``moqt`` URI), in the order to try: the usable entries of
    ``carriers`` (a record's ``moqt_carriers``) as listed, then the holder's QUIC address.

    Raises:
        UnsupportedHolder: ``holder`` is not a MOQT URI.
    """
    home = parse_moqt_uri(holder)
    if home.carrier != "quic" or not carriers:
        return (home,)
    policy = policy or CarrierPolicy()
    out: list[MoqtAddress] = []
    for uri in carriers:
        try:
            address = parse_moqt_uri(uri)
        except UnsupportedHolder:
            continue  # a carrier this client cannot read is one it does not use
        if address not in out and usable(address, home, policy):
            out.append(address)
    out.append(home)
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionOptions:
    """How a client opens MOQT sessions, on any carrier.

    ``cafile`` is what the peer's certificate must chain to, or the certificate itself to pin
    (QUIC and QMux over TLS alike: the process's ``--cafile``); ``verify`` False turns the check
    off (``--insecure``, tests). ``backend``/``transport`` are the QUIC ones (None: the measured
    default); ``token`` travels as the AUTHORIZATION TOKEN setup parameter.
    """

    cafile: str | None = None
    verify: bool = True
    server_name: str | None = None
    backend: str | None = None
    transport: TransportConfig | None = None
    token: bytes | None = None
    timeout: float = 10.0
    policy: CarrierPolicy = field(default_factory=CarrierPolicy)


async def open_session(
    stack: contextlib.AsyncExitStack, address: MoqtAddress, options: SessionOptions
) -> MOQTConnection:
    """Open a MOQT session (setup complete) to ``address`` on its carrier; ``stack`` closes it.

    Raises:
        OSError, ConnectionError, TimeoutError, SessionClosedError: no session.
        ValueError: plain TCP to a non-loopback host without a trusted network.
    """
    if address.carrier == "quic":
        backend = options.backend or default_backend()
        transport = options.transport or TransportConfig()
        configuration = get_backend(backend).configuration(
            is_client=True,
            transport=transport,
            cafile=options.cafile,
            verify=options.verify,
            server_name=options.server_name or address.host,
        )
        return await stack.enter_async_context(
            connect(
                address.host,
                address.port,
                configuration=configuration,
                backend=backend,
                path=address.path,
                auth_token=options.token,
                transport=transport,
                setup_timeout=options.timeout,
            )
        )
    from moqt.qmux_asyncio import QMuxEndpoint, client_ssl_context, connect_qmux

    if address.carrier == "unix":
        endpoint = QMuxEndpoint(carrier="unix", path=address.socket_path)
    elif address.carrier == "tcp":
        endpoint = QMuxEndpoint(carrier="tcp", host=address.host, port=address.port)
    else:
        endpoint = QMuxEndpoint(carrier="tls", host=address.host, port=address.port)
    ssl_context = None
    if address.carrier == "tls":
        ssl_context = client_ssl_context(cafile=options.cafile, verify=options.verify)
    return await stack.enter_async_context(
        connect_qmux(
            endpoint,
            ssl_context=ssl_context,
            server_hostname=options.server_name or address.host,
            path=address.path,
            auth_token=options.token,
            setup_timeout=options.timeout,
            trusted_network=options.policy.trusted_network,
        )
    )


__all__ = [
    "CarrierPolicy",
    "SessionOptions",
    "carrier_candidates",
    "check_allowed",
    "is_loopback",
    "open_session",
    "usable",
]
