"""One trust setting for every outbound TLS connection of a process (DESIGN.md §3 TLS).

A process reads ``--cafile PEM`` and ``--insecure`` once (:func:`~kvsp.web.cliargs.trust_from_args`)
into a :class:`Trust` and hands that one value to every client it makes: the control-plane
HTTP clients (:class:`~kvsp.web.client.BaseClient`), the bulk block client
(:class:`~kvsp.transfer.bulk.BulkClient`, which also takes leases), and the MOQT clients over
QUIC and QMux/TLS. So a peer whose certificate a private CA signed is trusted on its HTTPS face
and its MOQT face alike, as the operator said once.

``cafile`` replaces the system trust store (as ``curl --cacert`` does); a PEM file may hold
several CA certificates, or a peer's self-signed certificate to pin it. ``verify=False``
(``--insecure``) checks nothing and is for tests only.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Trust:
    """Which TLS server certificates the process's clients accept."""

    cafile: str | None = None
    """PEM file of the CA certificates (or pinned certificates) trusted; None: the system's."""
    verify: bool = True
    """False: accept any certificate for any name (``--insecure``, tests only)."""

    def ssl_context(self) -> ssl.SSLContext:
        """A new client context that trusts what this setting says.

        Raises:
            OSError: ``cafile`` cannot be read. ssl.SSLError: it holds no certificate.
        """
        if not self.verify:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            return context
        return ssl.create_default_context(cafile=self.cafile)

    def describe(self) -> str:
        """One line for the start-up log: where trust comes from."""
        if not self.verify:
            return "outbound TLS: certificates NOT verified (--insecure)"
        if self.cafile is None:
            return "outbound TLS: the system trust store"
        return f"outbound TLS: trusting only {self.cafile}"


SYSTEM_TRUST = Trust()
"""The default: the system trust store, certificates verified."""

__all__ = ["SYSTEM_TRUST", "Trust"]
