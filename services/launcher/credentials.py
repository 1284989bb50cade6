"""The tokens and TLS material a stack makes for its services, and what each is given.

Security is on as in production (contract §14). On first start a stack writes the
tokens file (`DATA_DIR/tokens.yaml`) with an admin token for the local user, one
token per controller replica bound to its id and a service token for the logs
service, keeping the plain tokens in `DATA_DIR/secrets/` (mode 0600): each service
reads its own through `MJ_TOKEN_FILE`, and `mj` finds the admin token there by
itself. Later starts reuse them. With TLS it also makes a CA and certificates under
`DATA_DIR/tls/` (`mj-certs`) and every server runs with TLS and mTLS: each replica's
certificate names its controller id, and clients present `admin.pem`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from services.common.channels import ClientSecurity, TokenSource
from services.common.security.auth import Secrets, local_user
from services.common.security.certs import make_certificates
from services.common.security.tls import ClientTls
from services.common.security.tokens import bootstrap, tokens_path

# Names on the stack's certificates: every process listens on 127.0.0.1.
TLS_HOSTS = ("scheduler", "logs", "simcloud")
LOOPBACK_NAMES = ("localhost", "127.0.0.1")
LOGS_SERVICE = "logs"


@dataclasses.dataclass(frozen=True)
class Credentials:
    """A stack's tokens (and certificates), and each service's security settings."""

    tokens_file: Path
    admin_token_file: Path
    # The certificates folder; None without TLS.
    tls_dir: Path | None
    # The admin's token and TLS, for tests and `mj`.
    client_security: ClientSecurity
    # TLS only, for health checks.
    probe_security: ClientSecurity
    # Each service's own token and certificate settings (MJ_*), by service name.
    service_env: dict[str, dict[str, str]]

    @property
    def admin_token(self) -> str:
        """The admin token the stack made for the local user."""
        return self.admin_token_file.read_text().strip()

    def client_env(self) -> dict[str, str]:
        """Variables that give `mj` the admin's TLS; it finds the admin token by itself."""
        # Every variable is set: none from the caller's shell must leak in.
        env = {"MJ_TOKEN": "", "MJ_TOKEN_FILE": ""}
        tls = self.tls_dir
        env["MJ_TLS_CA"] = str(tls / "ca.pem") if tls else ""
        env["MJ_TLS_CLIENT_CERT"] = str(tls / "admin.pem") if tls else ""
        env["MJ_TLS_CLIENT_KEY"] = str(tls / "admin.key") if tls else ""
        return env


def make_credentials(
    data_dir: Path, controller_ids: Sequence[str], auth: bool, tls: bool
) -> Credentials:
    """Makes the tokens (and with `tls` the certificates) under `data_dir`, or reuses them."""
    names = ["scheduler", LOGS_SERVICE, "simcloud", *controller_ids]
    secrets = Secrets.in_data_dir(data_dir)
    tokens_file = tokens_path(data_dir)
    bootstrap(
        tokens_file,
        secrets,
        admin=local_user(),
        controllers=list(controller_ids),
        services=[LOGS_SERVICE],
    )
    own: dict[str, dict[str, str]] = {}
    for name in names:
        # Every setting is explicit: a variable from the caller's shell must not leak in.
        own[name] = {
            "MJ_AUTH": "tokens" if auth else "none",
            "MJ_TOKENS_FILE": str(tokens_file),
            "MJ_TOKEN": "",
            "MJ_TOKEN_FILE": "",
            "MJ_TLS_CERT": "",
            "MJ_TLS_KEY": "",
            "MJ_TLS_CLIENT_CA": "",
            "MJ_TLS_CA": "",
            "MJ_TLS_CLIENT_CERT": "",
            "MJ_TLS_CLIENT_KEY": "",
        }
    own[LOGS_SERVICE]["MJ_TOKEN_FILE"] = str(secrets.service(LOGS_SERVICE))
    for controller_id in controller_ids:
        own[controller_id]["MJ_TOKEN_FILE"] = str(secrets.controller(controller_id))
    tls_dir: Path | None = None
    client_tls: ClientTls | None = None
    if tls:
        tls_dir = data_dir / "tls"
        ca = make_certificates(
            tls_dir,
            hosts=TLS_HOSTS,
            controllers=list(controller_ids),
            clients=["admin"],
            extra_names=LOOPBACK_NAMES,
        )
        for name in names:
            own[name].update(
                {
                    "MJ_TLS_CERT": str(tls_dir / f"{name}.pem"),
                    "MJ_TLS_KEY": str(tls_dir / f"{name}.key"),
                    "MJ_TLS_CLIENT_CA": str(ca),
                    "MJ_TLS_CA": str(ca),
                    "MJ_TLS_CLIENT_CERT": str(tls_dir / f"{name}.pem"),
                    "MJ_TLS_CLIENT_KEY": str(tls_dir / f"{name}.key"),
                }
            )
        client_tls = ClientTls.from_files(
            str(ca), str(tls_dir / "admin.pem"), str(tls_dir / "admin.key")
        )
    admin_token_file = secrets.admin()
    return Credentials(
        tokens_file=tokens_file,
        admin_token_file=admin_token_file,
        tls_dir=tls_dir,
        client_security=ClientSecurity(TokenSource(path=admin_token_file), client_tls),
        probe_security=ClientSecurity(None, client_tls),
        service_env=own,
    )
