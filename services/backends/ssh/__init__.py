"""The `ssh` backend: machines a team already has, as regions (contract §17).

The node pools file (`config`, SkyPilot's `ssh_node_pools.yaml` form) names
pools of hosts; a pool is a region. A cluster is `num_nodes` free hosts of one
pool that fit the task (`placement`), one node rank per host. Everything is done
over SSH (asyncssh, host keys checked against the pool's known_hosts, one pooled
connection per host: `hosts`) by a shell script shipped with every command
(`node.sh`), so hosts need only bash and the usual Linux tools.

Shared truth lives on the hosts, not in any replica's memory, so any number of
backend instances (controller replicas on different machines, the logs service)
work on the same pools:

- A host's reservation is a directory in its user's ~/.mj, moved into place with
  one rename under the host's lock: two launches can never take the same host.
  It names the cluster, the job, the epoch and the launch (and, once the ranks
  are placed, every host of the cluster in rank order), so a cluster is found
  again from its name alone (a lazy `handle_for` handle is resolved by asking
  every host once) and a restarted replica picks up where it was.
- Epochs fence launches and terminates: each host remembers the highest epoch
  reserved there per job and the newest launch per cluster name; a launch or
  terminate below what any answering host holds is a `StaleEpochError`.
- A rank is `runner.sh` started with setsid in a session of its own, so it
  outlives the SSH session; it runs setup then run in the cluster folder's
  workdir and leaves its phase, exit codes and end time in files that stay
  readable after its processes died, until terminate removes the folder.
- One look at a cluster is one command per host (`observe_many` batches every
  cluster on a host into it), judged by `state.judge`. A host that does not
  answer makes the look a `BackendUnreachableError` carrying the pool's
  `unreachable_timeout`, never DOWN; a host that answers with the rank's runner
  gone and no end time is a preemption: DOWN.
- Terminate signals the rank's process group (SIGTERM, SIGKILL after the
  grace) and every process carrying the cluster's environment tags, removes the
  folder and releases the host. Reservations whose cluster is gone (replaced by a
  newer launch of its name, a launch that died half-way, the rest of the cluster
  released) are released by the reaper every instance runs (`reaper`), which is
  how a cluster given up while its host was unreachable dies when the host
  answers again.
"""
