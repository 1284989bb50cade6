"""docker-compose.yml only uses commands, flags and environment variables the services
accept, and runs them with tokens, TLS and mTLS on (contract §14)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml

from services.common import settings as common
from services.common.security.certs import SETTINGS as CERTS
from services.common.security.tokens import SETTINGS as TOKENS
from services.common.settings import Setting
from services.controller.main import SETTINGS as CONTROLLER
from services.logs.main import SETTINGS as LOGS
from services.scheduler.main import SETTINGS as SCHEDULER
from services.simcloud.main import SETTINGS as SIMCLOUD

ROOT = Path(__file__).resolve().parents[2]
ACCEPTED: dict[str, tuple[Setting, ...]] = {
    "mj-simcloud": SIMCLOUD,
    "mj-scheduler": SCHEDULER,
    "mj-controller": CONTROLLER,
    "mj-logs": LOGS,
    "mj-certs": CERTS,
    "mj-tokens": TOKENS,
}
SERVERS = {"mj-scheduler", "mj-controller", "mj-logs", "mj-simcloud"}
CLIENTS = {"mj-controller", "mj-logs"}


def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())[
        "services"
    ]
    return services


def by_command(name: str) -> dict[str, dict[str, Any]]:
    return {k: s for k, s in compose_services().items() if s.get("command", [""])[0] == name}


def test_compose_runs_the_topology() -> None:
    services = compose_services()
    commands = [s["command"][0] for s in services.values() if "command" in s]
    assert sorted(commands) == sorted(
        ["mj-certs", "mj-tokens", "mj-scheduler", "mj-controller", "mj-controller",
         "mj-controller", "mj-logs", "mj-simcloud"]
    )  # fmt: skip
    assert "postgres" in services
    scheduler_env = services["scheduler"]["environment"]
    assert str(scheduler_env["MJ_DATABASE_URL"]).startswith("postgresql://")


def test_every_command_flag_and_variable_is_accepted() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, service in compose_services().items():
        if "command" not in service:
            continue
        command: list[str] = service["command"]
        assert command[0] in scripts, name
        accepted = ACCEPTED[command[0]]
        flags = {s.flag for s in accepted}
        for word in command[1:]:
            if word.startswith("--"):
                assert word.split("=")[0] in flags, f"{name}: {word}"
        envs = {s.env for s in accepted}
        for key in service.get("environment", {}):
            assert key in envs, f"{name}: {key} is not a setting of {command[0]}"


def test_every_server_and_client_has_the_security_settings() -> None:
    for settings in (SCHEDULER, CONTROLLER, LOGS, SIMCLOUD):
        assert set(common.SERVER_SECURITY) <= set(settings)
    for settings in (CONTROLLER, LOGS):
        assert set(common.CLIENT_SECURITY) <= set(settings)


def test_every_server_runs_tokens_tls_and_mtls() -> None:
    for command in SERVERS:
        for name, service in by_command(command).items():
            env = service["environment"]
            assert env.get("MJ_AUTH", "tokens") == "tokens", name
            assert "MJ_INSECURE" not in env, name
            assert env["MJ_TOKENS_FILE"] == "/secrets/tokens.yaml", name
            assert env["MJ_TLS_CERT"].startswith("/tls/"), name
            assert env["MJ_TLS_KEY"].startswith("/tls/"), name
            assert env["MJ_TLS_CLIENT_CA"] == "/tls/ca.pem", name
            depends = service["depends_on"]
            for step in ("certs", "tokens"):
                assert depends[step]["condition"] == "service_completed_successfully", name


def test_every_client_speaks_tls_with_its_own_certificate_and_token() -> None:
    for command in CLIENTS:
        for name, service in by_command(command).items():
            env = service["environment"]
            assert env["MJ_TLS_CA"] == "/tls/ca.pem", name
            assert env["MJ_TLS_CLIENT_CERT"].startswith("/tls/"), name
            assert env["MJ_TOKEN_FILE"].startswith("/secrets/"), name


def test_each_replica_has_the_certificate_and_token_of_its_controller_id() -> None:
    certs = next(iter(by_command("mj-certs").values()))["environment"]
    tokens = next(iter(by_command("mj-tokens").values()))["environment"]
    ids = []
    for name, service in by_command("mj-controller").items():
        env = service["environment"]
        controller_id = env["MJ_CONTROLLER_ID"]
        ids.append(controller_id)
        assert env["MJ_TLS_CERT"] == env["MJ_TLS_CLIENT_CERT"] == f"/tls/{controller_id}.pem"
        assert env["MJ_TOKEN_FILE"] == f"/secrets/controllers/{controller_id}.token", name
    assert sorted(certs["MJ_CERTS_CONTROLLERS"].split(",")) == sorted(ids)
    assert sorted(tokens["MJ_TOKENS_CONTROLLERS"].split(",")) == sorted(ids)
    assert {"scheduler", "logs"} <= set(certs["MJ_CERTS_HOSTS"].split(","))
    # The CA's key is in a volume of its own, which no service mounts.
    ca_volume = certs["MJ_CERTS_CA_KEY"].split("/")[1]
    for name, service in compose_services().items():
        if name != "certs":
            assert not any(v.endswith(f":/{ca_volume}") for v in service.get("volumes", [])), name
    assert tokens["MJ_TOKENS_SERVICES"] == "logs"


def test_dockerfile_installs_the_package_with_its_generated_code() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY gen" in dockerfile and "COPY services" in dockerfile
    assert "pip install" in dockerfile


# Backends whose clusters every process reaches over the network; `local` clusters are
# processes of one host, which separate containers cannot see.
SHARED_BACKENDS = {"sim", "ssh"}


def test_every_replica_and_the_logs_service_see_the_same_clusters() -> None:
    """A job moved to another replica must find its cluster alive, not DOWN: every
    process that reads clusters uses one backend they all reach, the same one."""
    readers = {**by_command("mj-controller"), **by_command("mj-logs")}
    backends = {name: s["environment"].get("MJ_BACKEND", "local") for name, s in readers.items()}
    assert set(backends.values()) <= SHARED_BACKENDS, backends
    assert len(set(backends.values())) == 1, backends
    if set(backends.values()) == {"sim"}:
        [(cloud_name, cloud)] = by_command("mj-simcloud").items()
        port = cloud["environment"]["MJ_SIMCLOUD_PORT"]
        for name, service in readers.items():
            assert service["environment"]["MJ_SIMCLOUD_ADDRESS"] == f"{cloud_name}:{port}", name
            assert cloud_name in service["depends_on"], name
        certs = next(iter(by_command("mj-certs").values()))["environment"]
        assert cloud_name in certs["MJ_CERTS_HOSTS"].split(",")
    # No process keeps clusters in a volume another container mounts as its own.
    for name, service in readers.items():
        assert not any(v.split(":")[0] == "clusters" for v in service.get("volumes", [])), name


def test_the_sim_cloud_config_is_in_the_image() -> None:
    [cloud] = by_command("mj-simcloud").values()
    config = cloud["environment"]["MJ_SIMCLOUD_CONFIG"]
    assert config.startswith("/app/") and (ROOT / config.removeprefix("/app/")).is_file()
    assert "COPY examples" in (ROOT / "Dockerfile").read_text()
