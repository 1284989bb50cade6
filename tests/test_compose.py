"""docker-compose.yml only uses commands, flags and environment variables the services accept."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from services.common.settings import Setting
from services.controller.main import SETTINGS as CONTROLLER
from services.logs.main import SETTINGS as LOGS
from services.scheduler.main import SETTINGS as SCHEDULER

ROOT = Path(__file__).resolve().parent.parent
ACCEPTED: dict[str, tuple[Setting, ...]] = {
    "mj-scheduler": SCHEDULER,
    "mj-controller": CONTROLLER,
    "mj-logs": LOGS,
}


def compose_services() -> dict[str, dict[str, object]]:
    services: dict[str, dict[str, object]] = yaml.safe_load(
        (ROOT / "docker-compose.yml").read_text()
    )["services"]
    return services


def test_compose_runs_the_topology() -> None:
    services = compose_services()
    commands = [s["command"][0] for s in services.values() if "command" in s]  # type: ignore[index]
    assert sorted(commands) == sorted(
        ["mj-scheduler", "mj-controller", "mj-controller", "mj-controller", "mj-logs"]
    )
    assert "postgres" in services
    scheduler_env = services["scheduler"]["environment"]
    assert str(scheduler_env["MJ_DATABASE_URL"]).startswith("postgresql://")  # type: ignore[index]


def test_every_command_flag_and_variable_is_accepted() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, service in compose_services().items():
        if "command" not in service:
            continue
        command: list[str] = service["command"]  # type: ignore[assignment]
        assert command[0] in scripts, name
        accepted = ACCEPTED[command[0]]
        flags = {s.flag for s in accepted}
        for word in command[1:]:
            if word.startswith("--"):
                assert word.split("=")[0] in flags, f"{name}: {word}"
        envs = {s.env for s in accepted}
        for key in service.get("environment", {}):  # type: ignore[attr-defined]
            assert key in envs, f"{name}: {key} is not a setting of {command[0]}"


def test_dockerfile_installs_the_package_with_its_generated_code() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY gen" in dockerfile and "COPY services" in dockerfile
    assert "pip install" in dockerfile
