"""TLS on the wire: server and client credentials, the peer's certificate identity,
and the rule that a server off loopback speaks TLS.

A server given a certificate and key serves TLS; given a client CA as well, it
requires and verifies a client certificate (mTLS). A client given a CA verifies
the server against it; given its own certificate and key, it presents them.
Files are read once, at start.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping
from pathlib import Path

import grpc


class TlsConfigError(Exception):
    """A TLS setting is incomplete or names a file that cannot be read."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{what} {path}: {exc.strerror or exc}") from None


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key, and the CA its clients must be signed by."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: str, key: str, client_ca: str = "") -> ServerTls | None:
        """The TLS of `--tls-cert/--tls-key/--tls-client-ca`; None when none is given.

        Raises:
            TlsConfigError: only one of cert and key, a client CA without them, or an
                unreadable file.
        """
        if not cert and not key:
            if client_ca:
                raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not cert or not key:
            raise TlsConfigError("--tls-cert and --tls-key go together")
        return cls(
            _read(cert, "--tls-cert"),
            _read(key, "--tls-key"),
            _read(client_ca, "--tls-client-ca") if client_ca else None,
        )

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """The CA a client verifies servers with, and its own certificate for mTLS."""

    ca: bytes
    cert_chain: bytes | None = None
    private_key: bytes | None = None

    @classmethod
    def from_files(cls, ca: str, cert: str = "", key: str = "") -> ClientTls | None:
        """The TLS of `--tls-ca/--tls-client-cert/--tls-client-key`; None without a CA.

        Raises:
            TlsConfigError: a client certificate without a CA, one of cert and key
                without the other, or an unreadable file.
        """
        if bool(cert) != bool(key):
            raise TlsConfigError("--tls-client-cert and --tls-client-key go together")
        if not ca:
            if cert:
                raise TlsConfigError("--tls-client-cert needs --tls-ca")
            return None
        return cls(
            _read(ca, "--tls-ca"),
            _read(cert, "--tls-client-cert") if cert else None,
            _read(key, "--tls-client-key") if key else None,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.private_key, self.cert_chain)


def peer_names(auth_context: Mapping[str, Iterable[bytes]]) -> frozenset[str]:
    """The names in the peer's verified client certificate: common name and SANs.

    Empty when the peer presented no certificate (plaintext, or TLS without mTLS).
    """
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth_context.get(key, ()):
            names.add(value.decode("utf-8", "replace"))
    return frozenset(names)


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps the port on this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name (or "" for every address): assume it is reachable
