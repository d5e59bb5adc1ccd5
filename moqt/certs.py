"""Self-signed TLS certificates for QUIC on loopback (tests, and the embedded default).

EC P-256, SAN ``localhost`` and ``127.0.0.1``, short validity. Clients pin the certificate
(``cafile=cert_path``) rather than trusting a CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

DEFAULT_VALIDITY = datetime.timedelta(days=30)
CLOCK_SKEW = datetime.timedelta(minutes=5)


def make_self_signed(
    common_name: str,
    path_dir: str | os.PathLike[str],
    *,
    validity: datetime.timedelta = DEFAULT_VALIDITY,
    now: datetime.datetime | None = None,
) -> tuple[Path, Path]:
    """Write ``cert.pem`` and ``key.pem`` (PKCS#8, unencrypted, mode 0600) into ``path_dir``.

    The certificate names ``common_name`` and carries SANs ``localhost``, ``127.0.0.1`` and
    ``common_name`` (as a DNS name or IP address). Returns ``(cert_path, key_path)``.

    Raises:
        OSError: the folder cannot be created or written.
    """
    folder = Path(path_dir)
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start = (now or datetime.datetime.now(datetime.UTC)) - CLOCK_SKEW
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + CLOCK_SKEW + validity)
        .add_extension(x509.SubjectAlternativeName(_alt_names(common_name)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key_pem)
    return cert_path, key_path


def _alt_names(common_name: str) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    try:
        address = ipaddress.ip_address(common_name)
    except ValueError:
        if common_name != "localhost":
            names.append(x509.DNSName(common_name))
    else:
        if str(address) != "127.0.0.1":
            names.append(x509.IPAddress(address))
    return names
