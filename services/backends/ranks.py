"""What each node rank of a task gets, whatever the backend: its environment and how
its log lines are told apart from the other ranks'.

A task runs once per node rank. Every rank sees the task's own `envs` plus the
variables below, which win over `envs` of the same name; backends add only what
depends on where the rank runs (its cluster folder, its notice file).

Multi-node logs prefix each line with `(rank=<r>) `; followers pass on whole lines
only, so that two ranks' lines never run into each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# A line this long is passed on in pieces rather than held back.
MAX_HELD_LINE = 1 << 20


def rank_env(
    *,
    job_id: int,
    task_id: int,
    cluster_name: str,
    envs: Mapping[str, object],
    rank: int,
    num_nodes: int,
    node_ips: Sequence[str],
) -> dict[str, str]:
    """The environment of one node rank: the task's `envs`, then the MJ_* and SKYPILOT_*
    variables naming the rank, the node count, the job, the task and the nodes' IPs."""
    env = {str(k): str(v) for k, v in envs.items()}
    env.update(
        {
            "MJ_NODE_RANK": str(rank),
            "MJ_NUM_NODES": str(num_nodes),
            "MJ_JOB_ID": str(job_id),
            "MJ_TASK_ID": str(task_id),
            "MJ_CLUSTER_NAME": cluster_name,
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NUM_NODES": str(num_nodes),
            "SKYPILOT_TASK_ID": f"mj-{job_id}-task-{task_id}",
            "SKYPILOT_NODE_IPS": "\n".join(node_ips),
        }
    )
    return env


def prefix_lines(data: bytes, rank: int) -> bytes:
    """Prefixes each line with its rank; an unterminated last line gets a newline so
    that it cannot run into another rank's output."""
    prefix = f"(rank={rank}) ".encode()
    out = b"".join(prefix + line for line in data.splitlines(keepends=True))
    return out if not out or out.endswith((b"\n", b"\r")) else out + b"\n"


class RankLogJoiner:
    """Joins the ranks' log bytes as they arrive into one stream of whole, prefixed lines.

    With one node the bytes pass through untouched (no prefix, nothing held back).
    """

    def __init__(self, num_nodes: int) -> None:
        self.num_nodes = num_nodes
        self._partial: dict[int, bytes] = {}

    def add(self, rank: int, data: bytes) -> bytes:
        """The complete lines `data` finishes for `rank`, prefixed; keeps the rest."""
        if self.num_nodes == 1:
            return data
        head, newline, rest = (self._partial.get(rank, b"") + data).rpartition(b"\n")
        out = prefix_lines(head + newline, rank) if newline else b""
        if len(rest) >= MAX_HELD_LINE:
            out += prefix_lines(rest, rank)
            rest = b""
        self._partial[rank] = rest
        return out

    def flush(self) -> bytes:
        """Every rank's unfinished last line, prefixed (once the logs stopped growing)."""
        rest = b"".join(prefix_lines(data, rank) for rank, data in sorted(self._partial.items()))
        self._partial.clear()
        return rest
