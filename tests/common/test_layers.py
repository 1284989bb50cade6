"""The import arrows between the packages of services/ point one way."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"


def imported(package: str) -> dict[str, set[str]]:
    """What each module of services/<package> imports of services/, wherever the import
    stands (a function's own import counts too), by module path."""
    out: dict[str, set[str]] = {}
    for path in sorted((SERVICES / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        out[str(path.relative_to(SERVICES))] = {n for n in names if n.startswith("services.")}
    return out


def reaching(package: str, into: tuple[str, ...]) -> dict[str, set[str]]:
    """The modules of `package` that import any of the packages `into`, and what of them."""
    found = {
        module: {name for name in names if any(name.split(".")[:2] == p.split(".") for p in into)}
        for module, names in imported(package).items()
    }
    return {module: names for module, names in found.items() if names}


def test_the_common_package_imports_no_service_nor_backend() -> None:
    services = tuple(
        f"services.{path.name}"
        for path in SERVICES.iterdir()
        if path.is_dir() and path.name not in ("common", "__pycache__")
    )
    assert "services.backends" in services
    assert reaching("common", services) == {}


def test_backends_do_not_reach_into_the_sim_cloud_server() -> None:
    assert reaching("backends", ("services.simcloud",)) == {}
