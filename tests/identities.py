"""Callers for the security tests: a tokens file with one token per role, and certificates.

Callers are named as in the auth matrix: "none" (no token), "unknown" (a token
not in the file), "user" (alice), "other user" (bob), "admin", "controller"
(bound to controller-1) and "service" (the logs service). Under TLS each caller
presents a client certificate: a controller its replica's, the service the logs
service's, everyone else `admin.pem`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from services.common.auth import Role, TokensFile, add_token, new_token
from services.common.certs import make_certificates
from services.common.channels import ClientSecurity
from services.common.edge import ServerSecurity
from services.common.tls import ClientTls, ServerTls

CALLERS = ("none", "unknown", "user", "other user", "admin", "controller", "service")
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
CLIENT_CERT = {"controller": "controller-1", "service": "logs"}


@dataclasses.dataclass
class Identities:
    """The tokens file, each caller's token and the certificates folder."""

    tokens_file: Path
    tokens: dict[str, str]
    tls_dir: Path

    def client(self, caller: str, tls: bool) -> ClientSecurity:
        """What `caller` calls with: its token, and with `tls` the CA and its certificate."""
        client_tls = None
        if tls:
            cert = CLIENT_CERT.get(caller, "admin")
            client_tls = ClientTls.from_files(
                str(self.tls_dir / "ca.pem"),
                str(self.tls_dir / f"{cert}.pem"),
                str(self.tls_dir / f"{cert}.key"),
            )
        return ClientSecurity.of(self.tokens[caller], client_tls)

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
    """A tokens file with every registered caller, and a CA with the stack's certificates."""
    tokens_file = folder / "tokens.yaml"
    tokens = {"none": "", "unknown": new_token()}
    for caller, (user, role, controller_id) in REGISTERED.items():
        tokens[caller] = add_token(tokens_file, user, role, controller_id)
    tls_dir = folder / "tls"
    make_certificates(
        tls_dir,
        hosts=HOSTS,
        controllers=CONTROLLERS,
        clients=["admin"],
        extra_names=["localhost", "127.0.0.1"],
    )
    return Identities(tokens_file, tokens, tls_dir)
