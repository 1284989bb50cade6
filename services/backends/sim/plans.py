"""A launch plan as the sim cloud's Launch call.

The plan's resources and regions go as they are. How the task behaves comes from
the plan's "sim" options, the spec's `sim` key, which only this backend reads:
runtime_seconds, setup_seconds, exit_code, exit_code_runs, setup_exit_code,
log_lines, preempt_after_seconds, sigterm_exit_seconds (a number, or "never": the
task ignores SIGTERM); defaults in services/simcloud/clusters.py. `run` and `setup`
are never executed: a setup that is not blank only has the task set up first.
"""

from __future__ import annotations

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from services.backends.base import LaunchPlan, PrecheckError
from services.scheduler.spec.fields import NEVER

# The backend's name, which also keys its options in a launch plan.
BACKEND_NAME = "sim"


def launch_request(plan: LaunchPlan) -> pb.LaunchRequest:
    """The Launch call for a launch plan; the task behaves as its "sim" options say.

    Raises:
        PrecheckError: the "sim" options cannot be read.
    """
    sim = plan.extension(BACKEND_NAME)
    behavior = pb.TaskBehavior(has_setup=bool(plan.setup.strip()))
    try:
        if "runtime_seconds" in sim:
            behavior.runtime_seconds = float(sim["runtime_seconds"])
        if "preempt_after_seconds" in sim:
            behavior.preempt_after_seconds = float(sim["preempt_after_seconds"])
        behavior.setup_seconds = float(sim.get("setup_seconds", 0.0))
        behavior.exit_code = int(sim.get("exit_code", 0))
        behavior.setup_exit_code = int(sim.get("setup_exit_code", 0))
        behavior.exit_code_runs = int(sim.get("exit_code_runs", 0))
        if "log_lines" in sim:
            behavior.log_lines.lines.extend(str(line) for line in sim["log_lines"])
        sigterm_exit = sim.get("sigterm_exit_seconds")
        if sigterm_exit == NEVER:
            behavior.sigterm_ignored = True
        elif sigterm_exit is not None:
            behavior.sigterm_exit_seconds = float(sigterm_exit)
    except (TypeError, ValueError) as exc:
        raise PrecheckError(f"sim: {exc}") from exc
    return pb.LaunchRequest(
        cluster_name=plan.cluster_name,
        job_id=plan.job_id,
        task_id=plan.task_id,
        epoch=plan.epoch,
        resources=pb.Resources(
            cloud=plan.cloud,
            region=plan.region,
            zone=plan.zone,
            cpus=plan.cpus,
            memory=plan.memory,
            accelerators=plan.accelerators,
            use_spot=plan.use_spot,
            num_nodes=plan.num_nodes,
        ),
        candidate_regions=list(plan.candidate_regions),
        blocked_regions=list(plan.blocked_regions),
        behavior=behavior,
    )
