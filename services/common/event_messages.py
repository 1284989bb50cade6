"""The event log's vocabulary: the messages whose words are read back, by code.

Most event messages are for people (`mj watch`, `mj status`). These are read back:
the history checker (`harness/history.py`) judges a run from the event log by them
(who held a job from when, when a cancel was accepted, which rule of the
scheduler changed a status), and the soak's figures read the releases. Each is
defined once, here, and imported where it is written and where it is read, so a
message renamed here is renamed for every reader.

The events they name (contract §4, §5, §8, §9):

- an assignment (`ADMITTED_ON`, `RESUMED_ON` + the controller id) carries the
  new assignment epoch;
- a release (`RELEASE_PREFIXES`: the lease ran out, the replica handed the job
  back or no longer runs it) carries the epoch released;
- `CANCEL_REQUESTED` is the scheduler's record of an accepted cancel of a job a
  replica may hold; `CANCELLED_BEFORE_START` ends a job no replica took;
- `MAX_PENDING_EXCEEDED` begins the reason of a job no replica took in time;
- `CLEANUP_FAILED` begins the reason of a task whose cluster could not be torn
  down (the one FAILED_CONTROLLER contract §4 allows).
"""

from __future__ import annotations

SUBMITTED = "submitted"
ADMITTED_ON = "admitted on "
RESUMED_ON = "resumed on "
ASSIGNMENT_PREFIXES = (ADMITTED_ON, RESUMED_ON)

CANCEL_REQUESTED = "cancel requested"
CANCELLED_BEFORE_START = "cancelled before start"
MAX_PENDING_EXCEEDED = "max_pending exceeded"
CLEANUP_FAILED = "cleanup failed"

LEASE_EXPIRED_PREFIX = "lease of "
HANDED_BACK_PREFIX = "handed back by "
NO_LONGER_RUNS_IT = "the replica no longer runs it"
RELEASED = "released"
RELEASE_PREFIXES = (LEASE_EXPIRED_PREFIX, HANDED_BACK_PREFIX, NO_LONGER_RUNS_IT, RELEASED)


def lease_expired(controller_id: str) -> str:
    """The release of a replica's jobs when its lease ran out."""
    return f"{LEASE_EXPIRED_PREFIX}{controller_id} expired"


def handed_back(controller_id: str) -> str:
    """The release of jobs a replica gave back (a drain, a lost lease)."""
    return f"{HANDED_BACK_PREFIX}{controller_id}"
