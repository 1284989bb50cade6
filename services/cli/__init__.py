"""`mj`, the command-line client of the managed-jobs control plane (contract §12).

A thin, synchronous gRPC client: `main` parses the command line and maps every
failure to an exit code, `client` talks to the scheduler and the logs service,
`commands` implements the subcommands, `specs` reads job files (making relative
workdirs absolute), `tables` turns messages into rows without any I/O (so the
output can be tested exactly) and `output` prints them. The entry point is
`services.cli.main:main`.
"""
