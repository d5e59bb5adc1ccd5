"""A private certificate authority for tests: a CA certificate and a server certificate it
signs (SANs ``localhost`` and ``127.0.0.1``), as an operator's own CA would issue them.

:mod:`moqt.certs` makes self-signed certificates that clients pin; a CA-signed one is what the
trust setting (``--cafile CA.pem``, :mod:`kvsp.web.trust`) must accept without pinning.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=2)
SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True, slots=True)
class IssuedCertificates:
    """The files :func:`make_private_ca` wrote."""

    ca: Path
    """The CA certificate (what ``--cafile`` names)."""
    cert: Path
    """The server certificate, signed by the CA."""
    key: Path
    """The server's private key (mode 0600)."""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def make_private_ca(
    folder: Path, server_name: str = "localhost", addresses: Sequence[str] = ()
) -> IssuedCertificates:
    """Write ``ca.pem``, ``server.pem`` and ``server-key.pem`` into ``folder``; the server
    certificate also names the IP ``addresses`` (e.g. a veth address of another site)."""
    folder.mkdir(parents=True, exist_ok=True)
    start = datetime.datetime.now(datetime.UTC) - SKEW
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("kvsp test CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    if server_name != "localhost":
        names.append(x509.DNSName(server_name))
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(server_name))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    issued = IssuedCertificates(
        ca=folder / "ca.pem", cert=folder / "server.pem", key=folder / "server-key.pem"
    )
    issued.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _pem_key(key, issued.key)
    return issued
