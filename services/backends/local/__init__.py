"""The local backend: clusters as process trees on this host, confined per job.

`backend` (the calls), `processes` (starting and stopping a cluster's supervisor),
`cluster` (one cluster's files and processes), `supervisor` (the process that owns
them), `users` (run-as users), `fencing` and `logs`.
"""
