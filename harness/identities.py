"""Callers for the security tests: a tokens file with one token per role, and certificates.

Callers are named as in the auth matrix: "none" (no token), "unknown" (a token
not in the file), "user" (alice), "other user" (bob), "admin", "controller"
(bound to controller-1) and "service" (the logs service). Under TLS each caller
presents its own client certificate, signed by the stack's CA: alice's, bob's,
the admin's, controller-1's, the logs service's, and for the two without a token
one that names nobody.

`MTLS_CALLERS` are callers only TLS has, each a way mTLS must refuse: the admin's
token with no client certificate, with a certificate from another CA, and the
controller-1 token with controller-2's certificate.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from services.common.channels import ClientSecurity
from services.common.security.auth import Role, TokensFile, add_token, new_token
from services.common.security.certs import make_certificates
from services.common.security.edge import ServerSecurity
from services.common.security.tls import ClientTls, ServerTls

CALLERS = ("none", "unknown", "user", "other user", "admin", "controller", "service")
NO_CERT, FOREIGN_CERT, OTHER_REPLICA_CERT = "no cert", "foreign cert", "other replica's cert"
MTLS_CALLERS = (NO_CERT, FOREIGN_CERT, OTHER_REPLICA_CERT)
HOSTS = ("scheduler", "logs", "simcloud")
CONTROLLERS = ("controller-1", "controller-2")
# The user, role and bound controller of each caller that has a token in the file.
REGISTERED = {
    "user": ("alice", Role.USER, ""),
    "other user": ("bob", Role.USER, ""),
    "admin": ("root", Role.ADMIN, ""),
    "controller": ("controller-1", Role.CONTROLLER, "controller-1"),
    "service": ("logs", Role.SERVICE, ""),
}
# Each caller's client certificate (its files' stem, under the identities folder), and
# for the callers only TLS has, whose token it goes with.
CLIENT_CERT = {
    "none": "tls/nobody",
    "unknown": "tls/nobody",
    "user": "tls/alice",
    "other user": "tls/bob",
    "admin": "tls/admin",
    "controller": "tls/controller-1",
    "service": "tls/logs",
    FOREIGN_CERT: "foreign-tls/admin",
    OTHER_REPLICA_CERT: "tls/controller-2",
}
TOKEN_OF = {NO_CERT: "admin", FOREIGN_CERT: "admin", OTHER_REPLICA_CERT: "controller"}
CLIENTS = ("nobody", "alice", "bob", "admin")


@dataclasses.dataclass
class Identities:
    """The tokens file, each caller's token and the certificates folder."""

    tokens_file: Path
    tokens: dict[str, str]
    tls_dir: Path

    def client(self, caller: str, tls: bool) -> ClientSecurity:
        """What `caller` calls with: its token, and with `tls` the CA and its certificate."""
        token = self.tokens[TOKEN_OF.get(caller, caller)]
        if not tls:
            return ClientSecurity.of(token, None)
        ca = str(self.tls_dir / "ca.pem")
        cert = CLIENT_CERT.get(caller)
        if cert is None:
            return ClientSecurity.of(token, ClientTls.from_files(ca))
        pem, key = self.tls_dir.parent / f"{cert}.pem", self.tls_dir.parent / f"{cert}.key"
        return ClientSecurity.of(token, ClientTls.from_files(ca, str(pem), str(key)))

    def server(self, name: str, tls: bool, mtls: bool = True) -> ServerSecurity:
        """A server authenticating against the tokens file, with `name`'s certificate."""
        server_tls = None
        if tls:
            server_tls = ServerTls.from_files(
                str(self.tls_dir / f"{name}.pem"),
                str(self.tls_dir / f"{name}.key"),
                str(self.tls_dir / "ca.pem") if mtls else "",
            )
        return ServerSecurity(TokensFile(self.tokens_file), server_tls)


def make_identities(folder: Path) -> Identities:
    """A tokens file with every registered caller, a CA with the stack's and the callers'
    certificates, and in `foreign-tls` another CA with a certificate of its own."""
    tokens_file = folder / "tokens.yaml"
    tokens = {"none": "", "unknown": new_token()}
    for caller, (user, role, controller_id) in REGISTERED.items():
        tokens[caller] = add_token(tokens_file, user, role, controller_id)
    tls_dir = folder / "tls"
    make_certificates(
        tls_dir,
        hosts=HOSTS,
        controllers=CONTROLLERS,
        clients=CLIENTS,
        extra_names=["localhost", "127.0.0.1"],
    )
    make_certificates(folder / "foreign-tls", clients=["admin"])
    return Identities(tokens_file, tokens, tls_dir)
