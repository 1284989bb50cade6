"""`mj-certs`: a one-shot maker of the certificates TLS and mTLS between services need.

Into one folder it writes a CA (`ca.pem`, `ca.key`) and, signed by it:

- for each `--hosts` name (scheduler, logs, simcloud...): `NAME.pem`/`NAME.key`, a
  certificate for serving under that DNS name that is also good as a client
  certificate (the logs service calls the scheduler with it);
- for each `--controllers` id: the same, with the controller id as its common name
  and DNS name: a replica serves ControllerService with it and presents it to the
  scheduler, which checks that it names the replica of the hello;
- for each `--clients` name (e.g. `admin` for `mj`): a client-only certificate.

`--extra-names localhost,127.0.0.1` adds those names (and IP addresses) to every
serving certificate, for a whole system on one host. Keys are EC P-256, written
with mode 0600; a rerun keeps the CA and every certificate already there and makes
only the missing ones, so it is safe as a step that runs on every start. The CA's
key goes to `--ca-key` when given: keep it out of the folder the services mount,
or any of them could issue itself a certificate. All the cryptography is the
`cryptography` package's.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common import settings
from services.common.settings import Setting

CA_NAME = "managed-jobs CA"
SETTINGS = (
    Setting("out", "MJ_CERTS_OUT", "tls", "folder the CA and certificates are written to"),
    Setting(
        "hosts",
        "MJ_CERTS_HOSTS",
        "scheduler,logs,simcloud",
        "comma-separated host names to make serving certificates for",
    ),
    Setting(
        "controllers",
        "MJ_CERTS_CONTROLLERS",
        "",
        "comma-separated controller ids to make certificates for (common name = the id)",
    ),
    Setting(
        "clients", "MJ_CERTS_CLIENTS", "admin", "comma-separated names of client-only certificates"
    ),
    Setting(
        "extra_names",
        "MJ_CERTS_EXTRA_NAMES",
        "",
        "names and IP addresses added to every serving certificate (e.g. localhost,127.0.0.1)",
    ),
    Setting("days", "MJ_CERTS_DAYS", 825, "days the certificates are valid", int),
    Setting(
        "ca_key",
        "MJ_CERTS_CA_KEY",
        "",
        "where the CA's private key is kept (default: ca.key in --out)",
    ),
)


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _write(path: Path, data: bytes, private: bool) -> None:
    """Writes atomically; a private file is created 0600 and never exists with wider bits."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


class CertificateMaker:
    """Issues certificates from the CA in `out`, creating the CA on first use."""

    def __init__(self, out: Path, days: int = 825, ca_key: Path | None = None) -> None:
        self.out = out
        self.days = days
        out.mkdir(parents=True, exist_ok=True)
        ca_cert, ca_key = out / "ca.pem", ca_key or out / "ca.key"
        ca_key.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if ca_cert.exists() and ca_key.exists():
            self.ca_cert = x509.load_pem_x509_certificate(ca_cert.read_bytes())
            loaded = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
            if not isinstance(loaded, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{ca_key}: not an EC private key")
            self.ca_key = loaded
            return
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        now = dt.datetime.now(dt.UTC)
        self.ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.ca_key.public_key()), critical=False
            )
            .sign(self.ca_key, hashes.SHA256())
        )
        _write(ca_key, _key_pem(self.ca_key), private=True)
        _write(ca_cert, self.ca_cert.public_bytes(serialization.Encoding.PEM), private=False)

    def issue(
        self, name: str, alt_names: Sequence[str] = (), *, server: bool = True
    ) -> tuple[Path, Path]:
        """Writes `name.pem`/`name.key` unless both exist; returns their paths.

        Args:
            name: The common name (a host name or a controller id) and first DNS name.
            alt_names: More DNS names or IP addresses the certificate is valid for.
            server: Good for serving as well as for client authentication.
        """
        cert_path, key_path = self.out / f"{name}.pem", self.out / f"{name}.key"
        if cert_path.exists() and key_path.exists():
            return cert_path, key_path
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        sans = list(dict.fromkeys([name, *alt_names]))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in sans]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()),
                critical=False,
            )
            .sign(self.ca_key, hashes.SHA256())
        )
        _write(key_path, _key_pem(key), private=True)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
        return cert_path, key_path


def make_certificates(
    out: Path,
    *,
    hosts: Sequence[str] = (),
    controllers: Sequence[str] = (),
    clients: Sequence[str] = (),
    extra_names: Sequence[str] = (),
    days: int = 825,
    ca_key: Path | None = None,
) -> Path:
    """Makes (or completes) the CA and certificates in `out`; returns the CA's path."""
    maker = CertificateMaker(out, days, ca_key)
    for name in [*hosts, *controllers]:
        maker.issue(name, extra_names)
    for name in clients:
        maker.issue(name, server=False)
    return out / "ca.pem"


def main(argv: Sequence[str] | None = None) -> None:
    """The `mj-certs` console script."""
    args = settings.parse("mj-certs", __doc__ or "", SETTINGS, argv)
    out = Path(args.out)
    make_certificates(
        out,
        hosts=_names(args.hosts),
        controllers=_names(args.controllers),
        clients=_names(args.clients),
        extra_names=_names(args.extra_names),
        days=args.days,
        ca_key=Path(args.ca_key) if args.ca_key else None,
    )
    print(f"certificates in {out} (CA: {out / 'ca.pem'})")


if __name__ == "__main__":
    main()
