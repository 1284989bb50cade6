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
- a release (`RELEASE_PREFIXES`: the lease ran out or the stream closed, the
  replica handed the job back or no longer runs it) carries the epoch released;
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

# Releases, each `.format(controller_id)` where it names the replica. Every lease's end
# begins with LEASE_EXPIRED_PREFIX.
LEASE_EXPIRED_PREFIX = "lease of "
# A replica silent for its lease's TTL.
LEASE_EXPIRED = LEASE_EXPIRED_PREFIX + "{} expired"
# A replica whose stream closed: its jobs move at once.
STREAM_CLOSED = LEASE_EXPIRED_PREFIX + "{} ended: its stream closed"
# Jobs a commit gave a replica whose lease had already ended.
LEASE_ENDED = LEASE_EXPIRED_PREFIX + "{} had ended"
HANDED_BACK_PREFIX = "handed back by "
# A drain, or a replica that lost its lease.
HANDED_BACK = HANDED_BACK_PREFIX + "{}"
# A replica that said hello without the job.
NO_LONGER_RUNS_IT = "the replica no longer runs it"
RELEASED = "released"
RELEASE_PREFIXES = (LEASE_EXPIRED_PREFIX, HANDED_BACK_PREFIX, NO_LONGER_RUNS_IT, RELEASED)
