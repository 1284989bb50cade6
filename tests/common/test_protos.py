"""Generated code in gen/ matches protos/: a stale checkout fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_service_of_the_contract_is_declared() -> None:
    from managedjobs.v1 import (
        controller_service_pb2,
        job_service_pb2,
        log_service_pb2,
        scheduler_service_pb2,
    )

    methods = {
        "JobService": (
            job_service_pb2,
            {"SubmitJob", "GetJob", "ListJobs", "CancelJobs", "WatchJobs"},
        ),
        "SchedulerService": (scheduler_service_pb2, {"ConnectController", "GetSchedulerState"}),
        "ControllerService": (controller_service_pb2, {"GetControllerState"}),
        "LogService": (log_service_pb2, {"ReadLogs"}),
    }
    for service, (module, wanted) in methods.items():
        declared = {m.name for m in module.DESCRIPTOR.services_by_name[service].methods}
        assert wanted <= declared, service
