"""The local backend: clusters as process trees on this host, confined per job.

`backend` (the calls), `cluster` (one cluster's processes), `supervisor` (the process
that owns them), `users` (run-as users), `fencing` and `logs`.
"""
