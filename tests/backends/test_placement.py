"""Where processes run belongs to the deployment: no service pins its own threads.

Every service, and `make up` (`python -m services.launcher`), runs where the OS puts it; a
deployment that wants placement gives it from outside (`taskset`, a container's
`cpuset`). So none takes a flag for it: a service asked for one refuses it as an
unknown argument, in one line, with the parser its `main` builds.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.common import settings
from services.common.settings import Setting
from services.controller import main as controller
from services.launcher import main as launcher
from services.logs import main as logs
from services.scheduler import main as scheduler
from services.simcloud import main as simcloud


@pytest.mark.parametrize(
    ("prog", "service_settings"),
    [
        ("mj-scheduler", scheduler.SETTINGS),
        ("mj-controller", controller.SETTINGS),
        ("mj-logs", logs.SETTINGS),
        ("mj-simcloud", simcloud.SETTINGS),
    ],
)
def test_a_service_refuses_to_be_told_its_cpus(
    prog: str, service_settings: Sequence[Setting], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        settings.parse(prog, "", service_settings, ["--cpus", "0"], environ={"MJ_CPUS": "0"})
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"{prog}: error: unrecognized arguments: --cpus 0\n"


def test_make_up_lays_out_no_cpus(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        launcher.main(["--help"])
    assert exited.value.code == 0
    usage = capsys.readouterr().out
    assert "--data-dir" in usage and "cpu" not in usage.lower()
