"""Generates Python code and mypy stubs for protos/ into gen/ (one command: `make protos`).

`--check` regenerates into a temporary folder and exits 1 when gen/ differs, so a
stale checkout fails its tests instead of running old messages.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GEN = ROOT / "gen"


def generate(out: Path) -> None:
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    bindir = Path(sys.executable).parent
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTOS}",
            f"-I{include}",
            f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            *files,
        ],
        check=True,
    )
    for folder in [p for p in out.rglob("*") if p.is_dir()]:
        (folder / "__init__.py").touch()
        (folder / "py.typed").touch()


def differs(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [str(Path(a, n)) for n in cmp.left_only + cmp.right_only + cmp.diff_files]
    for sub in cmp.common_dirs:
        out += differs(a / sub, b / sub)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when gen/ is stale")
    args = parser.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            stale = differs(GEN, Path(tmp)) if GEN.exists() else ["gen/ is missing"]
        if stale:
            print("generated code is stale; run `make protos`:", *stale, sep="\n  ")
            return 1
        return 0
    if GEN.exists():
        shutil.rmtree(GEN)
    generate(GEN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
